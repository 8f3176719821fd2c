// Registration cost through mrd on a real verbs device, against the floor of
// doing the same registration directly: ibv_reg_mr + ibv_dereg_mr of the same
// memfd pages in this process, on the same device. Both run in the same
// process and the same run, so docs/PERFORMANCE.md reports ratios.
//
// Runs inside the Soft-RoCE VM (scripts/vm-bench.sh):
//   MRD_TEST_DEVICE=verbs build/bench/verbs_bench
//   --benchmark_counters_tabular=true
// Outside the VM (no verbs device) it can still run against the software
// device for the mrd side (MRD_TEST_DEVICE unset), but then the floor is
// missing and the run fails: the figures are meant for the verbs device.
//
// Cases (argument: buffer size in bytes; 4 KiB, 2 MiB, 64 MiB, 1 GiB):
//   BM_Floor_IbvRegDereg    ibv_reg_mr + ibv_dereg_mr, in process
//   BM_Mrd_RegisterDeregister
//                           RegisterMr + DeregisterMr through the real mrd
//                           (client library, gRPC over its Unix socket,
//                           memfd passed with SCM_RIGHTS once at set-up);
//                           every iteration a cold registration (mrd keeps
//                           no warm pins on a device that pins per
//                           registration, as verbs does), after one untimed
//                           registration that filled mrd's page tables
// and, at 1 GiB only,
//   BM_Core_RegisterDeregister
//                           the same through mrd's core in this process on
//                           the verbs device (no gRPC, no second process)
// and the first registration of a mapping:
//   BM_Floor_FreshMapping   ibv_reg_mr + ibv_dereg_mr of a new mapping of
//                           the written memfd (its page tables empty)
//   BM_Mrd_FirstRegistration
//                           RegisterMr + DeregisterMr of a buffer just
//                           imported (mrd's new mapping of the same memfd)

#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "client/lib/mrd_client.h"
#include "mrd/unique_fd.h"
#include "server/common/clock.h"
#include "server/core/core.h"
#include "server/device/verbs/verbs_device.h"
#include "tests/integration/mrd_process.h"

namespace mrd {
namespace {

constexpr uint64_t kMaxSize = uint64_t{1} << 30;

// The verbs device named by MRD_VERBS_DEVICE (or the first), with a PD.
struct Verbs {
  ibv_context* context = nullptr;
  ibv_pd* pd = nullptr;

  static Verbs& Get() {
    static Verbs* verbs = [] {
      auto* v = new Verbs();
      int n = 0;
      ibv_device** list = ibv_get_device_list(&n);
      const char* want = std::getenv("MRD_VERBS_DEVICE");
      for (int i = 0; list != nullptr && i < n; ++i) {
        if (want == nullptr || *want == '\0' ||
            std::strcmp(ibv_get_device_name(list[i]), want) == 0) {
          v->context = ibv_open_device(list[i]);
          break;
        }
      }
      if (list != nullptr) ibv_free_device_list(list);
      if (v->context != nullptr) v->pd = ibv_alloc_pd(v->context);
      return v;
    }();
    return *verbs;
  }
};

// A memfd of `size` bytes, mapped and touched so every page exists.
struct Memory {
  int fd = -1;
  void* address = MAP_FAILED;
  uint64_t size = 0;

  bool Init(uint64_t bytes) {
    size = bytes;
    fd = memfd_create("verbs-bench", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) return false;
    address = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (address == MAP_FAILED) return false;
    for (uint64_t i = 0; i < size; i += 4096) {
      static_cast<char*>(address)[i] = 1;
    }
    return true;
  }
  ~Memory() {
    if (address != MAP_FAILED) munmap(address, size);
    if (fd >= 0) close(fd);
  }
};

// ibv_reg_mr + ibv_dereg_mr of a written memfd in this process: through the
// mapping the writes went through (BM_Floor_IbvRegDereg), or through a new
// mapping of it each time (BM_Floor_FreshMapping): the memfd's pages exist,
// but that mapping's page tables are empty, so ibv_reg_mr faults every page
// in. The second is what mrd meets on the first registration of an imported
// buffer: it maps the file itself, and the client's writes filled only the
// client's page tables.
void FloorRegDereg(benchmark::State& state, bool fresh_mapping) {
  const uint64_t size = static_cast<uint64_t>(state.range(0));
  Verbs& verbs = Verbs::Get();
  if (verbs.pd == nullptr) {
    state.SkipWithError("no verbs device (run inside the Soft-RoCE VM)");
    return;
  }
  Memory memory;
  if (!memory.Init(size)) {
    state.SkipWithError("memfd");
    return;
  }
  const int access =
      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
  for (auto _ : state) {
    void* view = memory.address;
    if (fresh_mapping) {
      state.PauseTiming();
      view =
          mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, memory.fd, 0);
      state.ResumeTiming();
      if (view == MAP_FAILED) {
        state.SkipWithError("mmap");
        return;
      }
    }
    ibv_mr* mr = ibv_reg_mr(verbs.pd, view, size, access);
    if (mr == nullptr) {
      state.SkipWithError("ibv_reg_mr failed");
      return;
    }
    ibv_dereg_mr(mr);
    if (fresh_mapping) {
      state.PauseTiming();
      munmap(view, size);
      state.ResumeTiming();
    }
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(size));
}
void BM_Floor_IbvRegDereg(benchmark::State& state) {
  FloorRegDereg(state, false);
}
void BM_Floor_FreshMapping(benchmark::State& state) {
  FloorRegDereg(state, true);
}

// A real mrd, a client session and one buffer of `size` bytes.
struct MrdFixture {
  std::unique_ptr<testing::MrdProcess> mrd;
  std::unique_ptr<client::Client> client;
  std::unique_ptr<client::Session> session;
  std::unique_ptr<client::Buffer> buffer;

  bool Init(uint64_t size) {
    testing::MrdProcessOptions options;
    options.extra_flags = {
        "--max_session_pinned_bytes=" + std::to_string(4 * kMaxSize),
        "--max_total_pinned_bytes=" + std::to_string(4 * kMaxSize),
    };
    auto p = testing::MrdProcess::Start(options);
    if (!p.ok()) {
      std::fprintf(stderr, "mrd: %s\n", p.status().ToString().c_str());
      return false;
    }
    mrd = std::move(*p);
    client::ClientOptions client_options;
    client_options.socket_path = mrd->grpc_socket();
    client_options.fd_socket_path = mrd->fd_socket();
    auto c = client::Client::Connect(client_options);
    if (!c.ok()) return false;
    client = std::make_unique<client::Client>(std::move(*c));
    auto s = client::Session::OpenFd(*client);
    if (!s.ok()) return false;
    session = std::make_unique<client::Session>(std::move(*s));
    auto b = client::Buffer::Create(*session, size);
    if (!b.ok()) return false;
    buffer = std::make_unique<client::Buffer>(std::move(*b));
    for (uint64_t i = 0; i < size; i += 4096) {
      static_cast<char*>(buffer->data())[i] = 1;
    }
    return true;
  }
};

// RegisterMr + DeregisterMr of all of `buffer` (local write, remote read and
// write) through mrd; false, with the benchmark skipped, on a failure.
bool MrdRegDereg(benchmark::State& state, const client::Session& session,
                 uint64_t buffer, uint64_t size) {
  client::RegisterOptions o;
  o.buffer = buffer;
  o.length = size;
  o.flags = 0x1 | 0x2 | 0x5;
  auto r = client::Registration::Register(session, o);
  if (!r.ok()) {
    state.SkipWithError(r.status().ToString().c_str());
    return false;
  }
  auto left = r->Deregister();
  if (!left.ok() || *left != 0) {
    state.SkipWithError("DeregisterMr failed");
    return false;
  }
  return true;
}

void BM_Mrd_RegisterDeregister(benchmark::State& state) {
  const uint64_t size = static_cast<uint64_t>(state.range(0));
  MrdFixture f;
  if (!f.Init(size)) {
    state.SkipWithError("could not start mrd or open a session");
    return;
  }
  auto info = f.client->GetDeviceInfo();
  if (info.ok()) state.SetLabel(info->kind() + ":" + info->name());
  // One registration before timing: it fills the page tables of mrd's
  // mapping of the buffer, as the floor's own writes filled its mapping's
  // (the first registration of a buffer is BM_Mrd_FirstRegistration's).
  if (!MrdRegDereg(state, *f.session, f.buffer->id(), size)) return;
  for (auto _ : state) {
    if (!MrdRegDereg(state, *f.session, f.buffer->id(), size)) return;
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(size));
}

// mrd's core in this process on the verbs device (no gRPC, no second
// process): RegisterMr + DeregisterMr of an imported buffer, after one
// untimed registration, as BM_Mrd_RegisterDeregister. Splits the service
// path from the core and the device.
void BM_Core_RegisterDeregister(benchmark::State& state) {
  const uint64_t size = static_cast<uint64_t>(state.range(0));
  const char* name = std::getenv("MRD_VERBS_DEVICE");
  const char* address = std::getenv("MRD_VERBS_ADDRESS");
  if (address == nullptr) {
    state.SkipWithError("MRD_VERBS_ADDRESS unset (run inside the VM)");
    return;
  }
  device::VerbsDeviceOptions options;
  options.device_name = name == nullptr ? "" : name;
  options.peer_address = std::string(address) + ":0";
  auto device = device::VerbsDevice::Create(options);
  if (!device.ok() || !(*device)->Start().ok()) {
    state.SkipWithError("verbs device");
    return;
  }
  core::CoreOptions core_options;
  core_options.max_session_pinned_bytes = 4 * kMaxSize;
  core_options.max_total_pinned_bytes = 4 * kMaxSize;
  core::Core core(device->get(), RealClock::Get(), core_options);
  Memory memory;  // written through this mapping; the core maps its own
  auto token = core.OnConnect({getpid(), getuid(), getgid(), std::nullopt, ""});
  if (!memory.Init(size) || !token.ok() ||
      fcntl(memory.fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    state.SkipWithError("session or memfd");
    return;
  }
  v1::ImportMemfd import;
  import.set_writable(true);
  auto info = core.OnImport(*token, UniqueFd(dup(memory.fd)), import);
  if (!info.ok()) {
    state.SkipWithError(info.status().ToString().c_str());
    return;
  }
  v1::RegisterMrRequest req;
  req.set_session(*token);
  req.set_buffer(info->buffer());
  req.set_length(size);
  req.set_flags(0x1 | 0x2 | 0x5);  // local write, remote read, remote write
  auto once = [&]() {
    v1::RegisterMrResponse resp;
    if (!core.RegisterMr(req, &resp).ok()) return false;
    v1::DeregisterMrRequest dereg;
    dereg.set_session(*token);
    dereg.set_registration(resp.registration());
    v1::DeregisterMrResponse left;
    return core.DeregisterMr(dereg, &left).ok();
  };
  if (!once()) {
    state.SkipWithError("first registration failed");
    return;
  }
  for (auto _ : state) {
    if (!once()) {
      state.SkipWithError("RegisterMr or DeregisterMr failed");
      break;
    }
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(size));
  core.Shutdown();
  (*device)->Shutdown();
}

// The same through mrd: every iteration imports the (written) memfd anew,
// so mrd's mapping of it is fresh, and times the first RegisterMr +
// DeregisterMr of the new buffer.
void BM_Mrd_FirstRegistration(benchmark::State& state) {
  const uint64_t size = static_cast<uint64_t>(state.range(0));
  MrdFixture f;
  if (!f.Init(size)) {
    state.SkipWithError("could not start mrd or open a session");
    return;
  }
  for (auto _ : state) {
    state.PauseTiming();
    auto buffer = f.session->ImportMemfd(f.buffer->fd(), true, size);
    state.ResumeTiming();
    if (!buffer.ok()) {
      state.SkipWithError(buffer.status().ToString().c_str());
      return;
    }
    if (!MrdRegDereg(state, *f.session, buffer->id(), size)) return;
    state.PauseTiming();
    (void)buffer->Release();
    state.ResumeTiming();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(size));
}

void Sizes(benchmark::internal::Benchmark* b) {
  b->Arg(4096)->Arg(2 << 20)->Arg(64 << 20);
  b->Unit(benchmark::kMicrosecond);
}
void HugeSize(benchmark::internal::Benchmark* b) {
  // 1 GiB: few iterations (each pins 262144 pages).
  b->Arg(int64_t{1} << 30)->Iterations(5)->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_Floor_IbvRegDereg)->Apply(Sizes);
BENCHMARK(BM_Mrd_RegisterDeregister)->Apply(Sizes);
BENCHMARK(BM_Floor_IbvRegDereg)->Apply(HugeSize);
BENCHMARK(BM_Mrd_RegisterDeregister)->Apply(HugeSize);
BENCHMARK(BM_Core_RegisterDeregister)->Apply(HugeSize);
BENCHMARK(BM_Floor_FreshMapping)->Apply(HugeSize);
BENCHMARK(BM_Mrd_FirstRegistration)->Apply(HugeSize);

}  // namespace
}  // namespace mrd

BENCHMARK_MAIN();
