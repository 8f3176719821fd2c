// Registration cost through mrd's core on the software device, against the
// floor that any pinning registration must pay: mlock + munlock of the same
// pages. Both run in the same process, in the same run, on the same memfd, so
// docs/PERFORMANCE.md reports ratios, not absolute times.
//
//   build/bench/register_bench --benchmark_counters_tabular=true
//
// Cases (the argument is the buffer size in bytes):
//   BM_Floor_MlockMunlock     mlock + munlock of the buffer
//   BM_RegisterDeregister     RegisterMr + DeregisterMr (a cache miss each
//   time) BM_RegisterCacheHit       RegisterMr of an already-registered range +
//   its
//                             DeregisterMr (W5: a reference, no pinning)

#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "mrd/unique_fd.h"
#include "server/common/clock.h"
#include "server/core/core.h"
#include "server/device/software/software_device.h"

namespace mrd {
namespace {

int SealedMemfd(uint64_t size) {
  int fd = memfd_create("bench", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    return -1;
  }
  return fd;
}

// A core on a software device with one fd-style session holding one buffer.
struct Fixture {
  std::unique_ptr<device::SoftwareDevice> device;
  std::unique_ptr<core::Core> core;
  std::string session;
  uint64_t buffer = 0;

  bool Init(uint64_t size) {
    device::SoftwareDeviceOptions options;
    auto d = device::SoftwareDevice::Create(options);
    if (!d.ok() || !(*d)->Start().ok()) return false;
    device = std::move(*d);
    core::CoreOptions core_options;
    core_options.max_session_pinned_bytes = uint64_t{1} << 40;
    core_options.max_total_pinned_bytes = uint64_t{1} << 40;
    core = std::make_unique<core::Core>(device.get(), RealClock::Get(),
                                        core_options);
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

  v1::RegisterMrRequest Request(uint64_t size) const {
    v1::RegisterMrRequest req;
    req.set_session(session);
    req.set_buffer(buffer);
    req.set_length(size);
    req.set_flags(0x2 | 0x5);
    return req;
  }

  ~Fixture() {
    if (core) core->Shutdown();
    if (device) device->Shutdown();
  }
};

void BM_Floor_MlockMunlock(benchmark::State& state) {
  const uint64_t size = static_cast<uint64_t>(state.range(0));
  int fd = SealedMemfd(size);
  void* addr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (fd < 0 || addr == MAP_FAILED) {
    state.SkipWithError("memfd/mmap failed");
    return;
  }
  for (auto _ : state) {
    if (mlock(addr, size) != 0 || munlock(addr, size) != 0) {
      state.SkipWithError("mlock failed (needs CAP_IPC_LOCK or ulimit -l)");
      break;
    }
  }
  munmap(addr, size);
  close(fd);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * size));
}

void BM_RegisterDeregister(benchmark::State& state) {
  const uint64_t size = static_cast<uint64_t>(state.range(0));
  Fixture f;
  if (!f.Init(size)) {
    state.SkipWithError("fixture failed");
    return;
  }
  v1::RegisterMrRequest req = f.Request(size);
  for (auto _ : state) {
    v1::RegisterMrResponse resp;
    if (!f.core->RegisterMr(req, &resp).ok()) {
      state.SkipWithError("RegisterMr failed");
      break;
    }
    v1::DeregisterMrRequest dereg;
    dereg.set_session(f.session);
    dereg.set_registration(resp.registration());
    v1::DeregisterMrResponse left;
    if (!f.core->DeregisterMr(dereg, &left).ok()) {
      state.SkipWithError("DeregisterMr failed");
      break;
    }
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * size));
}

void BM_RegisterCacheHit(benchmark::State& state) {
  const uint64_t size = static_cast<uint64_t>(state.range(0));
  Fixture f;
  if (!f.Init(size)) {
    state.SkipWithError("fixture failed");
    return;
  }
  v1::RegisterMrRequest req = f.Request(size);
  v1::RegisterMrResponse held;
  if (!f.core->RegisterMr(req, &held).ok()) {
    state.SkipWithError("RegisterMr failed");
    return;
  }
  for (auto _ : state) {
    v1::RegisterMrResponse resp;
    if (!f.core->RegisterMr(req, &resp).ok() || !resp.cache_hit()) {
      state.SkipWithError("expected a cache hit");
      break;
    }
    v1::DeregisterMrRequest dereg;
    dereg.set_session(f.session);
    dereg.set_registration(resp.registration());
    v1::DeregisterMrResponse left;
    (void)f.core->DeregisterMr(dereg, &left);
  }
}

constexpr int64_t k4K = 4 << 10;
constexpr int64_t k2M = 2 << 20;
constexpr int64_t k64M = 64 << 20;

BENCHMARK(BM_Floor_MlockMunlock)->Arg(k4K)->Arg(k2M)->Arg(k64M);
BENCHMARK(BM_RegisterDeregister)->Arg(k4K)->Arg(k2M)->Arg(k64M);
BENCHMARK(BM_RegisterCacheHit)->Arg(k4K)->Arg(k2M)->Arg(k64M);

}  // namespace
}  // namespace mrd

int main(int argc, char** argv) {
  // As mrd's main does in release builds (see there): no lock-graph walk on
  // every mutex operation, so that the core costs here what it costs in mrd.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
