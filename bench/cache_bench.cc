// The registration cache against UCX's ucs_rcache, in process, on one trace:
// the same memfd buffer sizes (4 KiB, 64 KiB, 2 MiB, 64 MiB), each run three
// ways:
//
//   miss        a cold registration and its deregistration
//   hit         a registration of a range another reference holds, and its
//               deregistration (no pinning)
//   reregister  registering a range again right after its last release
//
// mrd side: the core in process on the software device (flag decoding,
// session and buffer lookup, range checks, limits, cache, key issue and
// revoke, page-refcounted mlock), exactly as RegisterMr/DeregisterMr run in
// the server minus gRPC. "miss" runs with warm pins off; "reregister" with
// warm pins on: the released registration's key dies at DeregisterMr, its
// pages stay locked, and the next RegisterMr gets a new key without locking
// anything.
//
// UCX side: ucs_rcache (libucs 1.13.1) with mem_reg/mem_dereg callbacks that
// mlock/munlock the region, the same floor work the software device does,
// with UCM's unmap events on as UCX runs it. "miss" is ucs_rcache_get +
// ucs_rcache_region_invalidate + ucs_rcache_region_put (the region is
// deregistered when the put drops the last reference); "hit" is get + put
// while another get holds the region; "reregister" is get + put with nothing
// else holding it — which rcache serves as a hit, because rcache keeps a
// released region registered, its key still valid, until eviction. That is
// the behaviour mrd refuses; the ratio compares unequal guarantees.
//
// Also, for the data structures alone: mrd's RegistrationCache with the same
// mlock/munlock create/release as the UCX callbacks ("cache_miss",
// "cache_hit").
//
// The floor is mlock + munlock of the same pages. Benchmarks run in the
// order registered: the floor, mrd, then UCX, so UCM's memory hooks are
// installed only after mrd's cases have run. After the runs a table of
// ratios (mrd/UCX, each to the floor) is printed; docs/PERFORMANCE.md gives
// it with the command (the table uses CPU time, see RatioReporter):
//
//   build/bench/cache_bench --benchmark_repetitions=5
//       --benchmark_report_aggregates_only=true

#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

extern "C" {
#include <ucm/api/ucm.h>
#include <ucs/memory/rcache.h>
}

#include "absl/synchronization/mutex.h"
#include "mrd/unique_fd.h"
#include "server/cache/registration_cache.h"
#include "server/common/clock.h"
#include "server/common/log.h"
#include "server/core/core.h"
#include "server/device/software/software_device.h"

namespace mrd {
namespace {

constexpr int64_t kSizes[] = {int64_t{4} << 10, int64_t{64} << 10,
                              int64_t{2} << 20, int64_t{64} << 20};

int SealedMemfd(uint64_t size) {
  int fd = memfd_create("cache-bench", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    return -1;
  }
  return fd;
}

// A memfd of `size` bytes mapped shared, as mrd maps an imported buffer.
struct Mapping {
  int fd = -1;
  void* address = MAP_FAILED;
  uint64_t size = 0;

  bool Init(uint64_t bytes) {
    size = bytes;
    fd = SealedMemfd(size);
    if (fd < 0) return false;
    address = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    return address != MAP_FAILED;
  }
  ~Mapping() {
    if (address != MAP_FAILED) munmap(address, size);
    if (fd >= 0) close(fd);
  }
};

// --- the floor
// ----------------------------------------------------------------

void BM_Floor(benchmark::State& state) {
  Mapping m;
  if (!m.Init(static_cast<uint64_t>(state.range(0)))) {
    state.SkipWithError("memfd/mmap failed");
    return;
  }
  for (auto _ : state) {
    if (mlock(m.address, m.size) != 0 || munlock(m.address, m.size) != 0) {
      state.SkipWithError("mlock failed (needs CAP_IPC_LOCK or ulimit -l)");
      return;
    }
  }
}

// --- mrd: the core on the software device
// -------------------------------------

struct Mrd {
  std::unique_ptr<device::SoftwareDevice> device;
  std::unique_ptr<core::Core> core;
  std::string session;
  uint64_t buffer = 0;
  uint64_t size = 0;

  bool Init(uint64_t bytes, bool warm) {
    size = bytes;
    SetMinLogLevel(LogLevel::kWarning);
    auto d = device::SoftwareDevice::Create(device::SoftwareDeviceOptions{});
    if (!d.ok() || !(*d)->Start().ok()) return false;
    device = std::move(*d);
    core::CoreOptions options;
    options.max_session_pinned_bytes = uint64_t{1} << 40;
    options.max_total_pinned_bytes = uint64_t{1} << 40;
    options.warm_pin_bytes_per_session = warm ? uint64_t{1} << 30 : 0;
    options.warm_pin_bytes_total = warm ? uint64_t{1} << 30 : 0;
    core =
        std::make_unique<core::Core>(device.get(), RealClock::Get(), options);
    auto token =
        core->OnConnect({getpid(), getuid(), getgid(), std::nullopt, ""});
    if (!token.ok()) return false;
    session = *token;
    v1::ImportMemfd import;
    import.set_writable(true);
    auto info = core->OnImport(session, UniqueFd(SealedMemfd(size)), import);
    if (!info.ok()) return false;
    buffer = info->buffer();
    return true;
  }

  // RegisterMr of the whole buffer, local write + remote read + remote write.
  bool Register(v1::RegisterMrResponse* out) {
    v1::RegisterMrRequest req;
    req.set_session(session);
    req.set_buffer(buffer);
    req.set_length(size);
    req.set_flags(0x1 | 0x2 | 0x4);
    return core->RegisterMr(req, out).ok();
  }
  bool Deregister(uint64_t registration) {
    v1::DeregisterMrRequest req;
    req.set_session(session);
    req.set_registration(registration);
    v1::DeregisterMrResponse out;
    return core->DeregisterMr(req, &out).ok();
  }

  ~Mrd() {
    if (core) core->Shutdown();
    if (device) device->Shutdown();
  }
};

void BM_Mrd_Miss(benchmark::State& state) {
  Mrd mrd;
  if (!mrd.Init(static_cast<uint64_t>(state.range(0)), /*warm=*/false)) {
    state.SkipWithError("mrd fixture failed");
    return;
  }
  uint32_t last_rkey = 0;
  for (auto _ : state) {
    v1::RegisterMrResponse r;
    if (!mrd.Register(&r) || r.cache_hit() || r.rkey() == last_rkey ||
        !mrd.Deregister(r.registration())) {
      state.SkipWithError("expected a cold registration with a new key");
      return;
    }
    last_rkey = r.rkey();
  }
}

void BM_Mrd_Hit(benchmark::State& state) {
  Mrd mrd;
  v1::RegisterMrResponse held;
  if (!mrd.Init(static_cast<uint64_t>(state.range(0)), /*warm=*/false) ||
      !mrd.Register(&held)) {
    state.SkipWithError("mrd fixture failed");
    return;
  }
  for (auto _ : state) {
    v1::RegisterMrResponse r;
    if (!mrd.Register(&r) || !r.cache_hit() || r.rkey() != held.rkey() ||
        !mrd.Deregister(r.registration())) {
      state.SkipWithError("expected a W5 cache hit");
      return;
    }
  }
}

void BM_Mrd_ReRegister(benchmark::State& state) {
  Mrd mrd;
  v1::RegisterMrResponse first;
  if (!mrd.Init(static_cast<uint64_t>(state.range(0)), /*warm=*/true) ||
      !mrd.Register(&first) || !mrd.Deregister(first.registration())) {
    state.SkipWithError("mrd fixture failed");
    return;
  }
  uint32_t last_rkey = first.rkey();
  for (auto _ : state) {
    v1::RegisterMrResponse r;
    if (!mrd.Register(&r) || r.rkey() == last_rkey ||
        !mrd.Deregister(r.registration())) {
      state.SkipWithError("expected a registration with a new key");
      return;
    }
    last_rkey = r.rkey();
  }
  const cache::WarmPinStats warm = mrd.core->Stats().warm;
  if (warm.hits != static_cast<uint64_t>(state.iterations())) {
    state.SkipWithError("not every re-registration was a warm hit");
  }
}

// --- mrd's cache alone, with UCX's callbacks' work
// ------------------------------

cache::CacheKey WholeBuffer(uint64_t size) {
  cache::CacheKey key;
  key.session = 1;
  key.buffer = 1;
  key.length = size;
  key.access = 7;
  key.base_address = uint64_t{1} << 32;
  return key;
}

void BM_Cache_Miss(benchmark::State& state) {
  Mapping m;
  if (!m.Init(static_cast<uint64_t>(state.range(0)))) {
    state.SkipWithError("memfd/mmap failed");
    return;
  }
  cache::RegistrationCache cache;
  const cache::CacheKey key = WholeBuffer(m.size);
  for (auto _ : state) {
    absl::StatusOr<cache::AcquireResult> r =
        cache.Acquire(key, [&]() -> absl::StatusOr<cache::CachedRegistration> {
          if (mlock(m.address, m.size) != 0) {
            return absl::ResourceExhaustedError("mlock");
          }
          return cache::CachedRegistration{1, 2, 3, 1, m.size, nullptr};
        });
    if (!r.ok() || r->hit) {
      state.SkipWithError("expected a miss");
      return;
    }
    absl::StatusOr<cache::ReleaseResult> left = cache.Release(r->entry);
    if (!left.ok() || !left->released.has_value()) {
      state.SkipWithError("expected the last release");
      return;
    }
    munlock(m.address, m.size);
  }
}

void BM_Cache_Hit(benchmark::State& state) {
  Mapping m;
  if (!m.Init(static_cast<uint64_t>(state.range(0))) ||
      mlock(m.address, m.size) != 0) {
    state.SkipWithError("memfd/mmap/mlock failed");
    return;
  }
  cache::RegistrationCache cache;
  const cache::CacheKey key = WholeBuffer(m.size);
  auto create = [&]() -> absl::StatusOr<cache::CachedRegistration> {
    return cache::CachedRegistration{1, 2, 3, 1, m.size, nullptr};
  };
  absl::StatusOr<cache::AcquireResult> held = cache.Acquire(key, create);
  for (auto _ : state) {
    absl::StatusOr<cache::AcquireResult> r = cache.Acquire(key, create);
    if (!r.ok() || !r->hit || !cache.Release(r->entry).ok()) {
      state.SkipWithError("expected a hit");
      return;
    }
  }
  munlock(m.address, m.size);
}

// --- UCX: ucs_rcache
// ------------------------------------------------------------

struct UcxCounts {
  uint64_t registrations = 0;
  uint64_t deregistrations = 0;
};

ucs_status_t UcxRegister(void* context, ucs_rcache_t*, void*,
                         ucs_rcache_region_t* region, uint16_t) {
  auto* counts = static_cast<UcxCounts*>(context);
  const uint64_t start = region->super.start;
  if (mlock(reinterpret_cast<void*>(start), region->super.end - start) != 0) {
    return UCS_ERR_NO_MEMORY;
  }
  ++counts->registrations;
  return UCS_OK;
}

void UcxDeregister(void* context, ucs_rcache_t*, ucs_rcache_region_t* region) {
  auto* counts = static_cast<UcxCounts*>(context);
  const uint64_t start = region->super.start;
  munlock(reinterpret_cast<void*>(start), region->super.end - start);
  ++counts->deregistrations;
}

void UcxDump(void*, ucs_rcache_t*, ucs_rcache_region_t*, char* buf,
             size_t max) {
  if (max > 0) buf[0] = '\0';
}

void UcxInvalidated(void*) {}

const ucs_rcache_ops_t kUcxOps = {UcxRegister, UcxDeregister, UcxDump};

struct Ucx {
  Mapping memory;
  UcxCounts counts;
  ucs_rcache_t* rcache = nullptr;

  bool Init(uint64_t size) {
    if (!memory.Init(size)) return false;
    ucs_rcache_params_t params{};
    params.region_struct_size = sizeof(ucs_rcache_region_t);
    params.alignment = UCS_PGT_ADDR_ALIGN;
    params.max_alignment = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    // As UCX runs it: regions are invalidated when their memory is unmapped
    // (UCM hooks munmap/mremap/... in this process).
    params.ucm_events = UCM_EVENT_VM_UNMAPPED;
    params.ucm_event_priority = 1000;
    params.ops = &kUcxOps;
    params.context = &counts;
    params.flags = UCS_RCACHE_FLAG_NO_PFN_CHECK;
    params.max_regions = std::numeric_limits<unsigned long>::max();
    params.max_size = std::numeric_limits<size_t>::max();
    params.max_unreleased = std::numeric_limits<size_t>::max();
    return ucs_rcache_create(&params, "cache-bench", nullptr, &rcache) ==
           UCS_OK;
  }
  ucs_rcache_region_t* Get() {
    ucs_rcache_region_t* region = nullptr;
    if (ucs_rcache_get(rcache, memory.address, memory.size,
                       PROT_READ | PROT_WRITE, nullptr, &region) != UCS_OK) {
      return nullptr;
    }
    return region;
  }
  ~Ucx() {
    if (rcache != nullptr) ucs_rcache_destroy(rcache);
  }
};

void BM_Ucx_Miss(benchmark::State& state) {
  Ucx ucx;
  if (!ucx.Init(static_cast<uint64_t>(state.range(0)))) {
    state.SkipWithError("ucs_rcache_create failed");
    return;
  }
  for (auto _ : state) {
    const uint64_t before = ucx.counts.registrations;
    ucs_rcache_region_t* region = ucx.Get();
    if (region == nullptr || ucx.counts.registrations != before + 1) {
      state.SkipWithError("expected a cold registration");
      return;
    }
    ucs_rcache_region_invalidate(ucx.rcache, region, UcxInvalidated, nullptr);
    ucs_rcache_region_put(ucx.rcache, region);
  }
  if (ucx.counts.deregistrations != ucx.counts.registrations) {
    state.SkipWithError("a region stayed registered");
  }
}

void BM_Ucx_Hit(benchmark::State& state) {
  Ucx ucx;
  ucs_rcache_region_t* held = nullptr;
  if (!ucx.Init(static_cast<uint64_t>(state.range(0))) ||
      (held = ucx.Get()) == nullptr) {
    state.SkipWithError("ucs_rcache failed");
    return;
  }
  for (auto _ : state) {
    ucs_rcache_region_t* region = ucx.Get();
    if (region != held) {
      state.SkipWithError("expected a hit");
      return;
    }
    ucs_rcache_region_put(ucx.rcache, region);
  }
  ucs_rcache_region_put(ucx.rcache, held);
  if (ucx.counts.registrations != 1) state.SkipWithError("registered again");
}

void BM_Ucx_ReRegister(benchmark::State& state) {
  Ucx ucx;
  if (!ucx.Init(static_cast<uint64_t>(state.range(0)))) {
    state.SkipWithError("ucs_rcache_create failed");
    return;
  }
  for (auto _ : state) {
    ucs_rcache_region_t* region = ucx.Get();
    if (region == nullptr) {
      state.SkipWithError("ucs_rcache_get failed");
      return;
    }
    ucs_rcache_region_put(ucx.rcache, region);
  }
  // The released region was never deregistered: its key stayed valid.
  if (ucx.counts.registrations != 1 || ucx.counts.deregistrations != 0) {
    state.SkipWithError("rcache deregistered a released region");
  }
}

void Sizes(benchmark::internal::Benchmark* b) {
  for (int64_t size : kSizes) b->Arg(size);
  b->Unit(benchmark::kMicrosecond);
}

BENCHMARK(BM_Floor)->Apply(Sizes);
BENCHMARK(BM_Mrd_Miss)->Apply(Sizes);
BENCHMARK(BM_Mrd_Hit)->Apply(Sizes);
BENCHMARK(BM_Mrd_ReRegister)->Apply(Sizes);
BENCHMARK(BM_Cache_Miss)->Apply(Sizes);
BENCHMARK(BM_Cache_Hit)->Apply(Sizes);
BENCHMARK(BM_Ucx_Miss)->Apply(Sizes);
BENCHMARK(BM_Ucx_Hit)->Apply(Sizes);
BENCHMARK(BM_Ucx_ReRegister)->Apply(Sizes);

// --- the ratio table ---------------------------------------------------------

// Prints what the console reporter prints, and keeps each case's time per
// iteration (the median when repetitions are asked for) for the table.
class RatioReporter final : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& reports) override {
    for (const Run& run : reports) {
      if (run.error_occurred) continue;
      const std::string name =
          run.run_name.function_name + "/" + run.run_name.args;
      // CPU time of the benchmark thread (user + system: mlock is system
      // time): on a shared 2-core machine it is far steadier than wall time,
      // and every case here runs on that thread alone.
      const double seconds = run.GetAdjustedCPUTime() /
                             benchmark::GetTimeUnitMultiplier(run.time_unit);
      if (run.run_type == Run::RT_Aggregate) {
        if (run.aggregate_name == "median") {
          times_[name] = seconds;
          medians_[name] = true;
        }
      } else if (!medians_[name]) {
        times_[name] = seconds;
      }
    }
    ConsoleReporter::ReportRuns(reports);
  }

  void PrintRatios() const {
    std::printf(
        "\nratios of CPU time per register+deregister (median of the "
        "repetitions if any; < 1 means faster)\n"
        "%-10s %8s %10s %10s %10s %8s %9s %9s\n",
        "case", "size", "floor us", "mrd us", "ucx us", "mrd/ucx", "mrd/floor",
        "ucx/floor");
    const std::pair<const char*, const char*> kCases[] = {
        {"miss", "Miss"}, {"hit", "Hit"}, {"reregister", "ReRegister"}};
    for (const auto& [label, suffix] : kCases) {
      for (int64_t size : kSizes) {
        Row(label, std::string("BM_Mrd_") + suffix,
            std::string("BM_Ucx_") + suffix, size);
      }
    }
    for (const auto& [label, suffix] :
         {std::pair<const char*, const char*>{"cache_miss", "Miss"},
          std::pair<const char*, const char*>{"cache_hit", "Hit"}}) {
      for (int64_t size : kSizes) {
        Row(label, std::string("BM_Cache_") + suffix,
            std::string("BM_Ucx_") + suffix, size);
      }
    }
  }

 private:
  double Time(const std::string& function, int64_t size) const {
    auto it = times_.find(function + "/" + std::to_string(size));
    return it == times_.end() ? -1 : it->second;
  }
  void Row(const char* label, const std::string& mrd, const std::string& ucx,
           int64_t size) const {
    const double floor = Time("BM_Floor", size);
    const double m = Time(mrd, size);
    const double u = Time(ucx, size);
    if (floor <= 0 || m <= 0 || u <= 0) return;
    std::printf("%-10s %8s %10.3f %10.3f %10.3f %8.2f %9.3f %9.4f\n", label,
                SizeName(size).c_str(), floor * 1e6, m * 1e6, u * 1e6, m / u,
                m / floor, u / floor);
  }
  static std::string SizeName(int64_t size) {
    if (size >= (int64_t{1} << 20)) {
      return std::to_string(size >> 20) + " MiB";
    }
    return std::to_string(size >> 10) + " KiB";
  }

  std::map<std::string, double> times_;
  std::map<std::string, bool> medians_;
};

}  // namespace
}  // namespace mrd

int main(int argc, char** argv) {
  // As mrd's main does in release builds (see there): no lock-graph walk on
  // every mutex operation.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  mrd::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.PrintRatios();
  benchmark::Shutdown();
  return 0;
}
