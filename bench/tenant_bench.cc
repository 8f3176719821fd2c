// Noisy neighbours (issue 24): what one tenant's flood of work does to
// another tenant's small registration, through the real mrd (software
// device, warm pins off), with the fair scheduler and with
// `--fair_scheduling=false` (one first-come-first-served queue, the old
// behaviour). Both mrds run side by side for the whole run and take turns,
// so that both see the same machine.
//
// The two tenants. The bystander is an fd session of this process (root:
// tenant "uid:0"). The flooder runs in child processes: this binary
// re-executed as uid 65534 (nobody) with `--child=<flood>`, so its fd
// sessions are tenant "uid:65534"; mrd runs with --allowed_uids=0,65534 and
// --socket_mode=0666 for it. Both use memfds over the fd socket, the path
// containers use. With `--pods=1` the bench makes three pods
// (tests/support/pod_cgroup.h: kubelet's cgroupfs layout, in every cgroup
// hierarchy) and runs the bystander (this process), every flooder child and
// both mrds each in a pod of their own, as a node would: the tenants are
// then pod:<UID>, and each pod is a CPU cgroup of its own, which the
// kernel's scheduler shares fairly between pods before it shares a pod's
// time between its threads. Without it, every process is in the cgroup the
// bench was started in. The bench reads both sessions' tenants back with
// GetSession and stops, saying so, unless they are the two it expects.
//
// The bystander: RegisterMr + DeregisterMr of a fresh 4 KiB page (a page of
// a written memfd not registered before: a cache miss that pins, every
// time), one pair after the other on one client; p50 and p99 of `--samples`
// pairs, idle (the two mrds taking turns) and while the flooder floods with
//   a. big:   `--clients` clients, each looping RegisterMr + DeregisterMr of
//             a whole 256 MiB memfd (`--big_mib`), imported afresh for every
//             registration (a new buffer and a new mapping in mrd: a miss
//             whose every page mrd maps and pins anew) and released after
//             it; each memfd was written once by the flooder, so its pages
//             exist;
//   b. batch: `--clients` clients, each looping RegisterMrBatch +
//             DeregisterMrBatch of `--batch_items` (4,096) 4 KiB pages of a
//             written memfd of its own (every item a new registration);
//   c. hits:  `--hits` (1,000) cache hits in flight: asynchronous RegisterMr
//             calls of one range the flooder holds registered, each followed
//             by the DeregisterMr of the reference it took, a new RegisterMr
//             as soon as that returns (gRPC's callback API; each of the
//             `--hits` chains has one call in flight at every moment).
// Under a flood the bystander samples for at most `--phase_seconds` (fewer
// samples then: the table says how many), after `--warmup_ms` of flood.
// Before each pair it times a gRPC health check (gRPC's own service, no
// lock of mrd's: what the flood leaves of the CPU to any call) and a
// GetDeviceInfo (answered on the gRPC thread, but it reads the software
// device's pinned bytes under the pin tracker's lock, which each pin step
// and each unpin holds). It also reports the CPU mrd and the whole machine
// used meanwhile (/proc), and with the fair scheduler, per request of the
// bystander's that went to a worker, its mean wait for one and its mean
// time on one (mrd_tenant_queue_wait_seconds and
// mrd_tenant_service_seconds_total of its tenant): what of its latency is
// queueing and what is work.
//
// The flooder alone: each flood without the bystander for `--seconds`, the
// two mrds taking turns `--rounds` times (fair, FIFO, FIFO, fair, ...), in
// operations completed per second over all its turns. Every turn, and every
// bystander phase, gets a fresh flooder child, so that none inherits
// another's processes or memory (with the children of both mrds alive at
// once, the one started first was measurably slower in either mode).
//
// Goals: the bystander's p99 under each flood ≤ 3× its idle p99 with the
// fair scheduler; the flooder alone with the fair scheduler ≥ 0.90× its
// throughput with FIFO for a. and b. The bench prints whether each was met;
// no goal makes it fail.
//
//   build/bench/tenant_bench [--samples=300] [--seconds=4] [--rounds=2]
//       [--phase_seconds=15] [--warmup_ms=1000] [--clients=8] [--hits=1000]
//       [--big_mib=256] [--batch_items=4096] [--floods=big,batch,hits]
//       [--pods=0] [--mrd_flags=A,B] [--out=bench-out]
//
// Needs root (the flooder's uid, and the right to pin) and about 2.5 GiB of
// free memory. Prints markdown tables, writes <out>/tenant_bench.csv and
// each mrd's log (<out>/tenant_bench-mrd-{fair,fifo}.log); exits non-zero
// if anything failed (a refused call, a tenant mix-up, an mrd that did not
// stop clean). About 2 to 3 minutes with the defaults on 2 cores.

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/bench_util.h"
#include "client/lib/mrd_client.h"
#include "grpcpp/grpcpp.h"
#include "mrd/v1/mrd.grpc.pb.h"
#include "tests/integration/mrd_process.h"
#include "tests/support/pod_cgroup.h"

namespace mrd::bench {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint32_t kRemoteRead = 0x2;
constexpr uid_t kFlooderUid = 65534;
constexpr int kLoggedErrors = 5;  // per child process
constexpr absl::Duration kRpcTimeout = absl::Minutes(2);

enum class FloodKind { kBig, kBatch, kHits };
constexpr FloodKind kFloods[] = {FloodKind::kBig, FloodKind::kBatch,
                                 FloodKind::kHits};

const char* KindName(FloodKind kind) {
  switch (kind) {
    case FloodKind::kBig:
      return "big";
    case FloodKind::kBatch:
      return "batch";
    case FloodKind::kHits:
      return "hits";
  }
  return "?";
}

bool KindFromName(absl::string_view name, FloodKind* kind) {
  for (FloodKind k : kFloods) {
    if (name == KindName(k)) {
      *kind = k;
      return true;
    }
  }
  return false;
}

struct Settings {
  uint64_t samples = 300;
  uint64_t seconds = 4;
  uint64_t rounds = 2;
  uint64_t phase_seconds = 15;
  uint64_t warmup_ms = 1000;
  uint64_t clients = 8;
  uint64_t hits = 1000;
  uint64_t big_mib = 256;
  uint64_t batch_items = 4096;
  std::string out = "bench-out";
  std::string floods = "big,batch,hits";  // which to run
  // --pods: the bystander (this process), the flooder's children and the
  // two mrds each in a pod of their own (tests/support/pod_cgroup.h), as
  // on a node: a CPU cgroup each, and tenants named by pod.
  bool pods = false;
  // --mrd_flags=A,B: more flags for both mrds (e.g. --bulk_nice=19).
  std::string mrd_flags;
  std::shared_ptr<testing::PodCgroup> mrd_pod;
  std::shared_ptr<testing::PodCgroup> bystander_pod;
  std::shared_ptr<testing::PodCgroup> flooder_pod;
};

Settings ReadSettings(int argc, char** argv) {
  Settings s;
  s.samples = Flag(argc, argv, "--samples", s.samples, 5);
  s.seconds = Flag(argc, argv, "--seconds", s.seconds, 1);
  s.rounds = Flag(argc, argv, "--rounds", s.rounds, 1);
  s.phase_seconds = Flag(argc, argv, "--phase_seconds", s.phase_seconds, 1);
  s.warmup_ms = Flag(argc, argv, "--warmup_ms", s.warmup_ms);
  s.clients = Flag(argc, argv, "--clients", s.clients, 1);
  s.hits = Flag(argc, argv, "--hits", s.hits, 1);
  s.big_mib = Flag(argc, argv, "--big_mib", s.big_mib, 1);
  s.batch_items = Flag(argc, argv, "--batch_items", s.batch_items, 1);
  s.out = StringFlag(argc, argv, "--out", s.out);
  s.floods = StringFlag(argc, argv, "--floods", s.floods);
  s.pods = Flag(argc, argv, "--pods", 0) != 0;
  s.mrd_flags = StringFlag(argc, argv, "--mrd_flags", "");
  return s;
}

bool Wanted(const Settings& s, FloodKind kind) {
  for (absl::string_view name : absl::StrSplit(s.floods, ',')) {
    if (name == KindName(kind)) return true;
  }
  return false;
}

absl::StatusOr<client::Client> Connect(const std::string& grpc_socket,
                                       const std::string& fd_socket) {
  client::ClientOptions options;
  options.socket_path = grpc_socket;
  options.fd_socket_path = fd_socket;
  options.rpc_timeout = kRpcTimeout;
  return client::Client::Connect(options);
}

// ---------------------------------------------------------------------------
// The flooder, in a child process.

// What a child does between "run" and "stop".
class Flood {
 public:
  virtual ~Flood() = default;
  // The flooder's sessions, whose tenant the parent checks.
  virtual std::vector<std::string> Tokens() const = 0;
  // Starts flooding; returns at once.
  virtual void Begin() = 0;
  // Stops and waits for the operations in flight: the operations completed
  // since Begin (those still in flight when End was called not counted) and
  // the calls that failed.
  virtual void End(uint64_t* ops, uint64_t* errors) = 0;
};

// The clients of a looping flood: the state op(i) works on.
class Clients {
 public:
  virtual ~Clients() = default;
  virtual size_t size() const = 0;
  virtual std::vector<std::string> Tokens() const = 0;
  // One operation of client i; called on client i's thread only.
  virtual absl::Status Op(size_t i) = 0;
};

// One thread per client, thread i repeating clients->Op(i) while running.
class LoopFlood final : public Flood {
 public:
  explicit LoopFlood(std::unique_ptr<Clients> clients)
      : clients_(std::move(clients)) {
    for (size_t i = 0; i < clients_->size(); ++i) {
      threads_.emplace_back([this, i] { Loop(i); });
    }
  }

  // The threads go before the clients they use.
  ~LoopFlood() override {
    {
      absl::MutexLock lock(&mu_);
      quit_ = true;
    }
    for (std::thread& t : threads_) t.join();
  }

  std::vector<std::string> Tokens() const override {
    return clients_->Tokens();
  }

  void Begin() override {
    absl::MutexLock lock(&mu_);
    running_ = true;
  }

  void End(uint64_t* ops, uint64_t* errors) override {
    absl::MutexLock lock(&mu_);
    running_ = false;
    mu_.Await(absl::Condition(this, &LoopFlood::Idle));
    *ops = ops_;
    *errors = errors_;
    ops_ = 0;
    errors_ = 0;
  }

 private:
  bool Ready() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return running_ || quit_;
  }
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return busy_ == 0; }

  void Loop(size_t i) {
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &LoopFlood::Ready));
        if (quit_) return;
        ++busy_;
      }
      const absl::Status status = clients_->Op(i);
      absl::MutexLock lock(&mu_);
      --busy_;
      if (!status.ok()) {
        if (++errors_ <= kLoggedErrors) {
          std::fprintf(stderr, "tenant_bench flooder, client %zu: %s\n", i,
                       status.ToString().c_str());
        }
        // Not a busy loop on a lasting failure.
        mu_.AwaitWithTimeout(absl::Condition(&quit_), absl::Milliseconds(10));
      } else if (running_) {
        ++ops_;
      }
    }
  }

  const std::unique_ptr<Clients> clients_;
  std::vector<std::thread> threads_;
  absl::Mutex mu_;
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  bool quit_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t busy_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t ops_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t errors_ ABSL_GUARDED_BY(mu_) = 0;
};

// Fd sessions of one client connection, one per flooding client.
class FdClients : public Clients {
 public:
  size_t size() const override { return sessions_.size(); }
  std::vector<std::string> Tokens() const override {
    std::vector<std::string> tokens;
    for (const auto& s : sessions_) tokens.push_back(s->token());
    return tokens;
  }

 protected:
  absl::Status OpenSessions(const client::Client& client, size_t count) {
    for (size_t i = 0; i < count; ++i) {
      absl::StatusOr<client::Session> s = client::Session::OpenFd(client);
      if (!s.ok()) return s.status();
      sessions_.push_back(std::make_unique<client::Session>(*std::move(s)));
    }
    return absl::OkStatus();
  }

  std::vector<std::unique_ptr<client::Session>> sessions_;
};

// a. Each client: a written memfd, imported afresh, registered whole,
// deregistered and released, over and over.
class BigClients final : public FdClients {
 public:
  static absl::StatusOr<std::unique_ptr<Clients>> Create(
      const client::Client& client, size_t clients, uint64_t bytes) {
    auto c = std::unique_ptr<BigClients>(new BigClients());
    if (absl::Status s = c->OpenSessions(client, clients); !s.ok()) return s;
    for (size_t i = 0; i < clients; ++i) {
      absl::StatusOr<client::MappedMemfd> m =
          client::MappedMemfd::Create(bytes, "tenant-bench-big");
      if (!m.ok()) return m.status();
      for (uint64_t at = 0; at < bytes; at += kPage) {
        static_cast<char*>(m->data())[at] = 1;
      }
      c->memfds_.push_back(
          std::make_unique<client::MappedMemfd>(*std::move(m)));
    }
    return c;
  }

  absl::Status Op(size_t i) override {
    const client::Session& session = *sessions_[i];
    const client::MappedMemfd& memfd = *memfds_[i];
    absl::StatusOr<client::Buffer> buffer =
        session.ImportMemfd(memfd.fd(), true, memfd.size());
    if (!buffer.ok()) return buffer.status();
    client::RegisterOptions o;
    o.buffer = buffer->id();
    o.length = memfd.size();
    o.flags = kRemoteRead;
    absl::StatusOr<client::Registration> r =
        client::Registration::Register(session, o);
    if (!r.ok()) return r.status();
    if (r->cache_hit()) return absl::InternalError("a big registration hit");
    absl::StatusOr<uint32_t> left = r->Deregister();
    if (!left.ok()) return left.status();
    if (*left != 0) return absl::InternalError("references left");
    return buffer->Release().status();
  }

 private:
  BigClients() = default;

  std::vector<std::unique_ptr<client::MappedMemfd>> memfds_;
};

// b. Each client: a written memfd of `items` pages, every page registered
// in one RegisterMrBatch and deregistered in one DeregisterMrBatch, over and
// over.
class BatchClients final : public FdClients {
 public:
  static absl::StatusOr<std::unique_ptr<Clients>> Create(
      const client::Client& client, size_t clients, uint64_t items) {
    auto c = std::unique_ptr<BatchClients>(new BatchClients());
    if (absl::Status s = c->OpenSessions(client, clients); !s.ok()) return s;
    for (size_t i = 0; i < clients; ++i) {
      absl::StatusOr<client::Buffer> b = client::Buffer::Create(
          *c->sessions_[i], items * kPage, "tenant-bench-batch");
      if (!b.ok()) return b.status();
      TouchPages(*b);
      std::vector<client::RegisterOptions> options;
      for (uint64_t page = 0; page < items; ++page) {
        options.push_back(PageOf(b->id(), page));
      }
      c->options_.push_back(std::move(options));
      c->buffers_.push_back(std::make_unique<client::Buffer>(*std::move(b)));
    }
    return c;
  }

  absl::Status Op(size_t i) override {
    auto results =
        client::Registration::RegisterBatch(*sessions_[i], options_[i]);
    if (!results.ok()) return results.status();
    std::vector<client::Registration> regs;
    absl::Status status;
    for (absl::StatusOr<client::Registration>& r : *results) {
      if (!r.ok()) {
        status.Update(r.status());
      } else if (r->cache_hit()) {
        status.Update(absl::InternalError("a batch item hit the cache"));
      } else {
        regs.push_back(*std::move(r));
      }
    }
    auto left = client::Registration::DeregisterBatch(regs);
    if (!left.ok()) return left.status();
    for (const absl::StatusOr<uint32_t>& l : *left) {
      if (!l.ok()) {
        status.Update(l.status());
      } else if (*l != 0) {
        status.Update(absl::InternalError("references left"));
      }
    }
    return status;
  }

 private:
  BatchClients() = default;

  std::vector<std::vector<client::RegisterOptions>> options_;
  std::vector<std::unique_ptr<client::Buffer>> buffers_;
};

// c. `chains` chains of asynchronous calls on one channel: RegisterMr of a
// range the flooder holds (a hit), then DeregisterMr of the reference it
// took, then the next RegisterMr; every chain has one call in flight.
class HitFlood final : public Flood {
 public:
  static absl::StatusOr<std::unique_ptr<Flood>> Create(
      const client::Client& client, const std::string& grpc_socket,
      size_t chains) {
    auto f = std::unique_ptr<HitFlood>(new HitFlood());
    absl::StatusOr<client::Session> s = client::Session::OpenFd(client);
    if (!s.ok()) return s.status();
    f->session_ = std::make_unique<client::Session>(*std::move(s));
    absl::StatusOr<client::Buffer> b =
        client::Buffer::Create(*f->session_, kPage, "tenant-bench-hits");
    if (!b.ok()) return b.status();
    TouchPages(*b);
    f->buffer_ = std::make_unique<client::Buffer>(*std::move(b));
    const client::RegisterOptions range = PageOf(f->buffer_->id(), 0);
    absl::StatusOr<client::Registration> held =
        client::Registration::Register(*f->session_, range);
    if (!held.ok()) return held.status();
    f->held_ = std::make_unique<client::Registration>(*std::move(held));
    f->channel_ = grpc::CreateChannel("unix:" + grpc_socket,
                                      grpc::InsecureChannelCredentials());
    f->stub_ = v1::MemoryRegistration::NewStub(f->channel_);
    f->chains_.resize(chains);
    for (Chain& c : f->chains_) {
      c.register_request = client::ToRequest(f->session_->token(), range);
      c.deregister_request.set_session(f->session_->token());
    }
    return f;
  }

  // End() came first: no call is in flight.
  ~HitFlood() override = default;

  std::vector<std::string> Tokens() const override {
    return {session_->token()};
  }

  void Begin() override {
    {
      absl::MutexLock lock(&mu_);
      running_ = true;
      in_flight_ = chains_.size();
    }
    for (Chain& c : chains_) Register(&c);
  }

  void End(uint64_t* ops, uint64_t* errors) override {
    absl::MutexLock lock(&mu_);
    running_ = false;
    mu_.Await(absl::Condition(this, &HitFlood::Drained));
    *ops = ops_;
    *errors = errors_;
    ops_ = 0;
    errors_ = 0;
  }

 private:
  struct Chain {
    v1::RegisterMrRequest register_request;
    v1::RegisterMrResponse register_reply;
    v1::DeregisterMrRequest deregister_request;
    v1::DeregisterMrResponse deregister_reply;
    std::unique_ptr<grpc::ClientContext> context;
  };

  HitFlood() = default;

  bool Drained() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return in_flight_ == 0;
  }

  void Prepare(Chain* c) {
    c->context = std::make_unique<grpc::ClientContext>();
    c->context->set_deadline(std::chrono::system_clock::now() +
                             absl::ToChronoSeconds(kRpcTimeout));
  }

  void Register(Chain* c) {
    Prepare(c);
    c->register_reply.Clear();
    stub_->async()->RegisterMr(
        c->context.get(), &c->register_request, &c->register_reply,
        [this, c](grpc::Status done) { Registered(c, done); });
  }

  void Registered(Chain* c, const grpc::Status& status) {
    if (!status.ok()) {
      Failed(absl::StrCat("RegisterMr: ", status.error_message()));
      Stop();
      return;
    }
    // A reference was taken, hit or not: give it back either way.
    if (!c->register_reply.cache_hit()) Failed("RegisterMr missed the cache");
    Prepare(c);
    c->deregister_request.set_registration(c->register_reply.registration());
    c->deregister_reply.Clear();
    stub_->async()->DeregisterMr(
        c->context.get(), &c->deregister_request, &c->deregister_reply,
        [this, c](grpc::Status done) { Deregistered(c, done); });
  }

  void Deregistered(Chain* c, const grpc::Status& status) {
    if (!status.ok()) {
      Failed(absl::StrCat("DeregisterMr: ", status.error_message()));
      Stop();
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      if (!running_) {
        --in_flight_;
        return;
      }
      ++ops_;
    }
    Register(c);
  }

  void Failed(absl::string_view what) {
    absl::MutexLock lock(&mu_);
    if (++errors_ <= kLoggedErrors) {
      std::fprintf(stderr, "tenant_bench flooder: %s\n",
                   std::string(what).c_str());
    }
  }

  // A chain that failed ends (no loop of failures).
  void Stop() {
    absl::MutexLock lock(&mu_);
    --in_flight_;
  }

  std::unique_ptr<client::Session> session_;
  std::unique_ptr<client::Buffer> buffer_;
  std::unique_ptr<client::Registration> held_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::MemoryRegistration::Stub> stub_;
  std::vector<Chain> chains_;
  absl::Mutex mu_;
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // chains not ended
  uint64_t ops_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t errors_ ABSL_GUARDED_BY(mu_) = 0;
};

// The child: sets its flood up, says "ready <tokens>", then obeys "run",
// "stop" (answered "done <ops> <seconds> <errors>") and "quit" on stdin.
int ChildMain(int argc, char** argv) {
  const Settings settings = ReadSettings(argc, argv);
  FloodKind kind;
  if (!KindFromName(StringFlag(argc, argv, "--child", ""), &kind)) {
    std::fprintf(stderr, "tenant_bench: unknown --child\n");
    return 2;
  }
  const std::string grpc_socket = StringFlag(argc, argv, "--grpc_socket", "");
  absl::StatusOr<client::Client> client =
      Connect(grpc_socket, StringFlag(argc, argv, "--fd_socket", ""));
  if (!client.ok()) {
    std::fprintf(stderr, "tenant_bench flooder: connect: %s\n",
                 client.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<std::unique_ptr<Flood>> flood;
  switch (kind) {
    case FloodKind::kBig: {
      auto clients = BigClients::Create(*client, settings.clients,
                                        settings.big_mib * kMiB);
      if (clients.ok()) {
        flood = std::make_unique<LoopFlood>(*std::move(clients));
      } else {
        flood = clients.status();
      }
      break;
    }
    case FloodKind::kBatch: {
      auto clients =
          BatchClients::Create(*client, settings.clients, settings.batch_items);
      if (clients.ok()) {
        flood = std::make_unique<LoopFlood>(*std::move(clients));
      } else {
        flood = clients.status();
      }
      break;
    }
    case FloodKind::kHits:
      flood = HitFlood::Create(*client, grpc_socket, settings.hits);
      break;
  }
  if (!flood.ok()) {
    std::fprintf(stderr, "tenant_bench flooder (%s): %s\n", KindName(kind),
                 flood.status().ToString().c_str());
    return 1;
  }
  std::string ready = "ready";
  for (const std::string& token : (*flood)->Tokens()) {
    absl::StrAppend(&ready, " ", token);
  }
  std::printf("%s\n", ready.c_str());
  std::fflush(stdout);
  Clock::time_point start = Clock::now();
  char line[64];
  while (std::fgets(line, sizeof(line), stdin) != nullptr) {
    const absl::string_view command = absl::StripAsciiWhitespace(line);
    if (command == "run") {
      start = Clock::now();
      (*flood)->Begin();
    } else if (command == "stop") {
      const double seconds = Seconds(start);
      uint64_t ops = 0;
      uint64_t errors = 0;
      (*flood)->End(&ops, &errors);
      std::printf("done %" PRIu64 " %.6f %" PRIu64 "\n", ops, seconds, errors);
      std::fflush(stdout);
    } else if (command == "quit") {
      break;
    }
  }
  flood->reset();
  return 0;
}

// ---------------------------------------------------------------------------
// The parent's side of a flooder child.

class FlooderProcess {
 public:
  // Runs `exe` with `args` as uid kFlooderUid, its stdin and stdout pipes
  // of this object; its stderr is ours. With `join`, the cgroup.procs files
  // of a pod (PodCgroup::ProcsFiles), the child joins it before it runs.
  static absl::StatusOr<std::unique_ptr<FlooderProcess>> Spawn(
      const std::string& exe, std::vector<std::string> args,
      const std::vector<std::string>& join) {
    int to_child[2];
    int from_child[2];
    if (::pipe2(to_child, O_CLOEXEC) != 0) {
      return absl::ErrnoToStatus(errno, "pipe2");
    }
    if (::pipe2(from_child, O_CLOEXEC) != 0) {
      const int error = errno;
      ::close(to_child[0]);
      ::close(to_child[1]);
      return absl::ErrnoToStatus(error, "pipe2");
    }
    args.insert(args.begin(), exe);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {
      // Only async-signal-safe calls between fork and exec.
      if (!testing::PodCgroup::JoinSelf(join)) ::_exit(124);
      if (::dup2(to_child[0], 0) < 0 || ::dup2(from_child[1], 1) < 0 ||
          ::setgroups(0, nullptr) != 0 || ::setgid(kFlooderUid) != 0 ||
          ::setuid(kFlooderUid) != 0) {
        ::_exit(125);
      }
      ::execv(exe.c_str(), argv.data());
      ::_exit(127);
    }
    const int error = errno;
    ::close(to_child[0]);
    ::close(from_child[1]);
    if (pid < 0) {
      ::close(to_child[1]);
      ::close(from_child[0]);
      return absl::ErrnoToStatus(error, "fork");
    }
    auto p = std::unique_ptr<FlooderProcess>(new FlooderProcess());
    p->pid_ = pid;
    p->in_ = to_child[1];
    p->out_ = from_child[0];
    return p;
  }

  ~FlooderProcess() {
    if (in_ >= 0) ::close(in_);
    if (out_ >= 0) ::close(out_);
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
    }
  }

  // The next line the child writes, without its newline.
  absl::StatusOr<std::string> ReadLine(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      const size_t newline = pending_.find('\n');
      if (newline != std::string::npos) {
        std::string line = pending_.substr(0, newline);
        pending_.erase(0, newline + 1);
        return line;
      }
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return absl::DeadlineExceededError(absl::StrCat(
            "the flooder said nothing for ", absl::FormatDuration(timeout)));
      }
      pollfd p = {out_, POLLIN, 0};
      const int ready =
          ::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
      if (ready < 0 && errno != EINTR) {
        return absl::ErrnoToStatus(errno, "poll");
      }
      if (ready <= 0) continue;
      char chunk[4096];
      const ssize_t n = ::read(out_, chunk, sizeof(chunk));
      if (n < 0 && errno != EINTR) return absl::ErrnoToStatus(errno, "read");
      if (n == 0) return Exited();
      if (n > 0) pending_.append(chunk, static_cast<size_t>(n));
    }
  }

  absl::Status Send(absl::string_view command) {
    const std::string line = absl::StrCat(command, "\n");
    if (::write(in_, line.data(), line.size()) !=
        static_cast<ssize_t>(line.size())) {
      return absl::ErrnoToStatus(errno, "write to the flooder");
    }
    return absl::OkStatus();
  }

  // The child closed its stdout: how it ended (reaped).
  absl::Status Exited() {
    int status = 0;
    if (pid_ > 0 && ::waitpid(pid_, &status, 0) == pid_) {
      pid_ = -1;
      if (WIFEXITED(status) && WEXITSTATUS(status) == 125) {
        return absl::UnavailableError(
            absl::StrCat("the flooder could not become uid ", kFlooderUid));
      }
      if (WIFEXITED(status) && WEXITSTATUS(status) == 127) {
        return absl::UnavailableError("the flooder could not be executed");
      }
      return absl::UnavailableError(absl::StrCat(
          "the flooder ended (wait status ", status, "; its stderr says why)"));
    }
    return absl::UnavailableError("the flooder closed its stdout");
  }

  // "quit", and its exit status 0 within `timeout`.
  absl::Status Quit(absl::Duration timeout) {
    if (absl::Status s = Send("quit"); !s.ok()) return s;
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      int status = 0;
      const pid_t done = ::waitpid(pid_, &status, WNOHANG);
      if (done == pid_) {
        pid_ = -1;
        if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
          return absl::OkStatus();
        }
        return absl::InternalError(
            absl::StrCat("the flooder ended with status ", status));
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return absl::DeadlineExceededError("the flooder did not quit");
  }

 private:
  FlooderProcess() = default;

  pid_t pid_ = -1;
  int in_ = -1;   // the child's stdin
  int out_ = -1;  // the child's stdout
  std::string pending_;
};

// What a child reported for one "run" ... "stop".
struct FloodRun {
  uint64_t ops = 0;
  double seconds = 0;
  uint64_t errors = 0;
};

absl::StatusOr<FloodRun> ParseDone(absl::string_view line) {
  std::vector<absl::string_view> words = absl::StrSplit(line, ' ');
  FloodRun run;
  if (words.size() != 4 || words[0] != "done" ||
      !absl::SimpleAtoi(words[1], &run.ops) ||
      !absl::SimpleAtod(words[2], &run.seconds) ||
      !absl::SimpleAtoi(words[3], &run.errors)) {
    return absl::InternalError(absl::StrCat("flooder said: ", line));
  }
  return run;
}

// Lets the child flood for `duration` (the caller's `during` runs
// meanwhile, after `warmup`), then stops it.
absl::StatusOr<FloodRun> RunFlood(FlooderProcess& child, absl::Duration warmup,
                                  const std::function<absl::Status()>& during,
                                  absl::Duration duration) {
  if (absl::Status s = child.Send("run"); !s.ok()) return s;
  absl::SleepFor(warmup);
  const absl::Status done = during();
  absl::SleepFor(duration);
  if (absl::Status s = child.Send("stop"); !s.ok()) return s;
  absl::StatusOr<std::string> line = child.ReadLine(absl::Minutes(3));
  if (!line.ok()) return line.status();
  if (!done.ok()) return done;
  return ParseDone(*line);
}

// ---------------------------------------------------------------------------
// The bystander.

// A tenant's queue in front of the workers, from mrd's metrics.
struct QueueFigures {
  double started = 0;  // mrd_tenant_queue_wait_seconds_count
  double wait_seconds = 0;
  double service_seconds = 0;
};

absl::StatusOr<QueueFigures> ScrapeQueue(const testing::MrdProcess& mrd,
                                         const std::string& tenant) {
  absl::StatusOr<std::string> text =
      testing::ScrapeMetrics(mrd.metrics_address());
  if (!text.ok()) return text.status();
  QueueFigures q;
  const std::string label = absl::StrCat("{tenant=\"", tenant, "\"} ");
  const std::pair<std::string, double*> series[] = {
      {"mrd_tenant_queue_wait_seconds_count" + label, &q.started},
      {"mrd_tenant_queue_wait_seconds_sum" + label, &q.wait_seconds},
      {"mrd_tenant_service_seconds_total" + label, &q.service_seconds},
  };
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    for (const auto& [name, value] : series) {
      if (absl::ConsumePrefix(&line, name)) {
        (void)absl::SimpleAtod(line, value);
      }
    }
  }
  return q;
}

// CPU seconds so far: mrd's (utime + stime) and the machine's, busy
// (user, nice, system, irq, softirq) and stolen by the hypervisor.
struct CpuTimes {
  double mrd = 0;
  double busy = 0;
  double steal = 0;

  CpuTimes operator-(const CpuTimes& o) const {
    return {mrd - o.mrd, busy - o.busy, steal - o.steal};
  }
  CpuTimes& operator+=(const CpuTimes& o) {
    mrd += o.mrd;
    busy += o.busy;
    steal += o.steal;
    return *this;
  }
};

CpuTimes ReadCpu(pid_t mrd) {
  CpuTimes t;
  const double tick = static_cast<double>(::sysconf(_SC_CLK_TCK));
  if (FILE* f = std::fopen(absl::StrCat("/proc/", mrd, "/stat").c_str(), "r")) {
    char text[1024] = {};
    const size_t n = std::fread(text, 1, sizeof(text) - 1, f);
    std::fclose(f);
    // utime and stime: fields 14 and 15, counted on from the ")" that ends
    // the command name (field 2).
    const absl::string_view stat(text, n);
    const size_t paren = stat.rfind(')');
    if (paren != absl::string_view::npos && paren + 2 < stat.size()) {
      std::vector<absl::string_view> fields =
          absl::StrSplit(stat.substr(paren + 2), ' ', absl::SkipEmpty());
      double utime = 0;
      double stime = 0;
      if (fields.size() > 12 && absl::SimpleAtod(fields[11], &utime) &&
          absl::SimpleAtod(fields[12], &stime)) {
        t.mrd = (utime + stime) / tick;
      }
    }
  }
  if (FILE* f = std::fopen("/proc/stat", "r")) {
    char line[512] = {};
    const bool read = std::fgets(line, sizeof(line), f) != nullptr;
    std::fclose(f);
    // cpu user nice system idle iowait irq softirq steal ...
    std::vector<absl::string_view> fields = absl::StrSplit(
        absl::StripAsciiWhitespace(line), ' ', absl::SkipEmpty());
    double v[8] = {};
    if (read && fields.size() > 8 && fields[0] == "cpu") {
      for (size_t i = 0; i < 8; ++i) {
        (void)absl::SimpleAtod(fields[i + 1], &v[i]);
      }
      t.busy = (v[0] + v[1] + v[2] + v[5] + v[6]) / tick;
      t.steal = v[7] / tick;
    }
  }
  return t;
}

struct Sampled {
  std::vector<double> us;  // one per pair
  // Before each pair: a health check (gRPC's own service: no lock of
  // mrd's) and a GetDeviceInfo (mrd's cheapest RPC, answered on the gRPC
  // thread; it reads the pinned bytes under the software device's pin
  // lock).
  std::vector<double> health_us;
  std::vector<double> info_us;
  // With the fair scheduler: the bystander's requests that went to a worker
  // meanwhile, their total wait for one and their total time on one.
  bool queue_known = false;
  QueueFigures queue;
  // CPU used while sampling, and the wall time it took.
  CpuTimes cpu;
  double seconds = 0;

  void Add(const Sampled& other) {
    us.insert(us.end(), other.us.begin(), other.us.end());
    health_us.insert(health_us.end(), other.health_us.begin(),
                     other.health_us.end());
    info_us.insert(info_us.end(), other.info_us.begin(), other.info_us.end());
    queue_known = other.queue_known;
    queue.started += other.queue.started;
    queue.wait_seconds += other.queue.wait_seconds;
    queue.service_seconds += other.queue.service_seconds;
    cpu += other.cpu;
    seconds += other.seconds;
  }
  // CPU cores in use meanwhile, on average.
  double MrdCores() const { return seconds > 0 ? cpu.mrd / seconds : 0; }
  double BusyCores() const { return seconds > 0 ? cpu.busy / seconds : 0; }
  double StealCores() const { return seconds > 0 ? cpu.steal / seconds : 0; }
  // Per request that went to a worker, µs; < 0 unknown.
  double MeanWaitUs() const {
    return queue_known && queue.started > 0
               ? queue.wait_seconds / queue.started * 1e6
               : -1;
  }
  double MeanServiceUs() const {
    return queue_known && queue.started > 0
               ? queue.service_seconds / queue.started * 1e6
               : -1;
  }
};

class Bystander {
 public:
  Bystander(const testing::MrdProcess& mrd, client::Session session,
            std::string tenant, bool fair)
      : mrd_(mrd),
        session_(std::move(session)),
        tenant_(std::move(tenant)),
        fair_(fair) {}

  const std::string& tenant() const { return tenant_; }

  // Up to `samples` pairs on fresh pages, for at most `limit` (at least
  // one pair), after `warm` pairs not counted; before each pair, two
  // GetDeviceInfo (mrd's cheapest RPC, answered on the gRPC thread).
  absl::StatusOr<Sampled> Sample(uint64_t samples, absl::Duration limit,
                                 uint64_t warm = 0) {
    absl::StatusOr<client::Buffer> buffer = client::Buffer::Create(
        session_, (warm + samples) * kPage, "tenant-bench-bystander");
    if (!buffer.ok()) return buffer.status();
    TouchPages(*buffer);
    for (uint64_t page = samples; page < samples + warm; ++page) {
      if (absl::Status s = Pair(buffer->id(), page, nullptr); !s.ok()) {
        return s;
      }
    }
    Sampled out;
    absl::StatusOr<QueueFigures> before = QueueFigures();
    if (fair_) before = ScrapeQueue(mrd_, tenant_);
    const CpuTimes cpu_before = ReadCpu(mrd_.pid());
    const Clock::time_point began = Clock::now();
    const absl::Time deadline = absl::Now() + limit;
    for (uint64_t page = 0; page < samples; ++page) {
      if (page > 0 && absl::Now() >= deadline) break;
      Clock::time_point start = Clock::now();
      if (absl::Status s = session_.client().Health().status(); !s.ok()) {
        return s;
      }
      out.health_us.push_back(Seconds(start) * 1e6);
      start = Clock::now();
      if (absl::Status s = session_.client().GetDeviceInfo().status();
          !s.ok()) {
        return s;
      }
      out.info_us.push_back(Seconds(start) * 1e6);
      if (absl::Status s = Pair(buffer->id(), page, &out.us); !s.ok()) {
        return s;
      }
    }
    out.seconds = Seconds(began);
    out.cpu = ReadCpu(mrd_.pid()) - cpu_before;
    if (fair_ && before.ok()) {
      absl::StatusOr<QueueFigures> after = ScrapeQueue(mrd_, tenant_);
      if (after.ok()) {
        out.queue_known = true;
        out.queue.started = after->started - before->started;
        out.queue.wait_seconds = after->wait_seconds - before->wait_seconds;
        out.queue.service_seconds =
            after->service_seconds - before->service_seconds;
      }
    }
    if (absl::Status s = buffer->Release().status(); !s.ok()) return s;
    return out;
  }

 private:
  // RegisterMr + DeregisterMr of page `page`, a new registration; its µs
  // appended to `us` when not null.
  absl::Status Pair(uint64_t buffer, uint64_t page, std::vector<double>* us) {
    const Clock::time_point start = Clock::now();
    absl::StatusOr<client::Registration> r =
        client::Registration::Register(session_, PageOf(buffer, page));
    if (!r.ok()) return r.status();
    if (r->cache_hit()) {
      return absl::InternalError("the bystander's registration hit");
    }
    absl::StatusOr<uint32_t> left = r->Deregister();
    if (!left.ok()) return left.status();
    if (*left != 0) return absl::InternalError("references left");
    if (us != nullptr) us->push_back(Seconds(start) * 1e6);
    return absl::OkStatus();
  }

  const testing::MrdProcess& mrd_;
  client::Session session_;
  const std::string tenant_;
  const bool fair_;
};

// ---------------------------------------------------------------------------
// Both mrds, both schedulers.

struct FloodResult {
  std::string tenant;  // the flooder's
  FloodRun alone;      // summed over the rounds
  Sampled bystander;
  FloodRun during;
};

// One mrd and what was measured on it.
struct Mode {
  bool fair = true;
  std::unique_ptr<testing::MrdProcess> mrd;
  std::unique_ptr<client::Client> client;
  std::unique_ptr<Bystander> bystander;
  std::string tenant;  // the bystander's
  Sampled idle;
  FloodResult floods[std::size(kFloods)];
};

const char* SchedulerName(bool fair) { return fair ? "fair" : "FIFO"; }

// mrd's flags: room for every flood, the flooder's uid let in, and FIFO
// when not `fair`.
std::vector<std::string> MrdFlags(const Settings& s, bool fair) {
  const uint64_t pinned =
      std::max<uint64_t>(4 * s.clients * s.big_mib * kMiB, uint64_t{4} << 30);
  std::vector<std::string> flags =
      GenerousFlags(pinned, 2 * s.batch_items + 1024);
  flags.push_back(absl::StrCat("--max_batch_items=", s.batch_items));
  flags.push_back(absl::StrCat("--allowed_uids=0,", kFlooderUid));
  flags.push_back("--socket_mode=0666");
  if (!fair) flags.push_back("--fair_scheduling=false");
  for (absl::string_view flag :
       absl::StrSplit(s.mrd_flags, ',', absl::SkipEmpty())) {
    flags.emplace_back(flag);
  }
  return flags;
}

absl::Status StartMode(const Settings& s, Mode* m) {
  testing::MrdProcessOptions options;
  options.extra_flags = MrdFlags(s, m->fair);
  options.metrics = true;
  absl::StatusOr<std::unique_ptr<testing::MrdProcess>> mrd =
      testing::MrdProcess::Start(options);
  if (!mrd.ok()) return mrd.status();
  m->mrd = *std::move(mrd);
  if (s.mrd_pod != nullptr && !s.mrd_pod->Join(m->mrd->pid())) {
    return absl::InternalError("mrd could not be moved into its pod's cgroup");
  }
  // The flooder's uid reaches the sockets through the runtime directory.
  if (::chmod(m->mrd->runtime_dir().c_str(), 0755) != 0) {
    return absl::ErrnoToStatus(errno, "chmod runtime_dir");
  }
  absl::StatusOr<client::Client> client =
      Connect(m->mrd->grpc_socket(), m->mrd->fd_socket());
  if (!client.ok()) return client.status();
  m->client = std::make_unique<client::Client>(*std::move(client));
  absl::StatusOr<client::Session> session = client::Session::OpenFd(*m->client);
  if (!session.ok()) return session.status();
  absl::StatusOr<v1::SessionInfo> info = session->Info();
  if (!info.ok()) return info.status();
  m->tenant = info->tenant();
  m->bystander = std::make_unique<Bystander>(*m->mrd, *std::move(session),
                                             info->tenant(), m->fair);
  return absl::OkStatus();
}

absl::Status WriteFile(const std::string& path, const std::string& text) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return absl::ErrnoToStatus(errno, path);
  const bool written =
      std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !written) {
    return absl::ErrnoToStatus(errno, path);
  }
  return absl::OkStatus();
}

// Closes the bystander's session, keeps mrd's log, stops mrd clean.
absl::Status StopMode(const Settings& s, Mode* m) {
  if (m->mrd == nullptr) return absl::OkStatus();
  m->bystander.reset();
  m->client.reset();
  absl::Status status =
      WriteFile(absl::StrCat(s.out, "/tenant_bench-mrd-",
                             m->fair ? "fair" : "fifo", ".log"),
                m->mrd->Log());
  status.Update(m->mrd->Stop());
  m->mrd.reset();
  return status;
}

// A flooder child of `kind` against `m`'s mrd, ready, its sessions checked
// to be of a tenant other than the bystander's.
absl::StatusOr<std::unique_ptr<FlooderProcess>> SpawnFlooder(
    const Settings& s, const std::string& exe, FloodKind kind, Mode& m,
    FloodResult* result) {
  absl::StatusOr<std::unique_ptr<FlooderProcess>> child = FlooderProcess::Spawn(
      exe,
      {absl::StrCat("--child=", KindName(kind)),
       "--grpc_socket=" + m.mrd->grpc_socket(),
       "--fd_socket=" + m.mrd->fd_socket(),
       absl::StrCat("--clients=", s.clients), absl::StrCat("--hits=", s.hits),
       absl::StrCat("--big_mib=", s.big_mib),
       absl::StrCat("--batch_items=", s.batch_items)},
      s.flooder_pod != nullptr ? s.flooder_pod->ProcsFiles()
                               : std::vector<std::string>());
  if (!child.ok()) return child.status();
  const std::string expected = s.flooder_pod != nullptr
                                   ? s.flooder_pod->tenant()
                                   : absl::StrCat("uid:", kFlooderUid);
  absl::StatusOr<std::string> ready = (*child)->ReadLine(absl::Minutes(2));
  if (!ready.ok()) return ready.status();
  std::vector<std::string> words = absl::StrSplit(*ready, ' ');
  if (words.size() < 2 || words[0] != "ready") {
    return absl::InternalError(absl::StrCat("flooder said: ", *ready));
  }
  for (size_t i = 1; i < words.size(); ++i) {
    v1::GetSessionRequest request;
    request.set_session(words[i]);
    absl::StatusOr<v1::SessionInfo> info = m.client->GetSession(request);
    if (!info.ok()) return info.status();
    if (info->tenant() == m.bystander->tenant() || info->tenant() != expected) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the flooder's session is tenant \"", info->tenant(),
          "\" and the bystander's \"", m.bystander->tenant(),
          "\": the bench needs them to be two tenants (the flooder's ",
          expected, ")"));
    }
    result->tenant = info->tenant();
  }
  return child;
}

std::string RateUnit(const Settings& s, FloodKind kind);
double Rate(const Settings& s, FloodKind kind, const FloodRun& run);

// A fresh flooder child of `kind` against `m`'s mrd (each run gets its
// own, so that no run inherits another's processes or memory): it floods
// for `duration`, `during` running meanwhile after `warmup`.
absl::StatusOr<FloodRun> FloodOnce(const Settings& s, const std::string& exe,
                                   FloodKind kind, Mode& m, FloodResult* result,
                                   absl::Duration warmup,
                                   const std::function<absl::Status()>& during,
                                   absl::Duration duration) {
  absl::StatusOr<std::unique_ptr<FlooderProcess>> child =
      SpawnFlooder(s, exe, kind, m, result);
  if (!child.ok()) return child.status();
  absl::StatusOr<FloodRun> run = RunFlood(**child, warmup, during, duration);
  if (!run.ok()) return run.status();
  if (absl::Status q = (*child)->Quit(absl::Minutes(2)); !q.ok()) return q;
  return run;
}

// Flood `kind` on both mrds: the flooder alone (the two mrds taking turns,
// `rounds` each, so that both see the same machine), then the bystander
// under it on each.
absl::Status MeasureFlood(const Settings& s, const std::string& exe,
                          size_t index, Mode (&modes)[2]) {
  const FloodKind kind = kFloods[index];
  for (uint64_t round = 0; round < s.rounds; ++round) {
    for (int turn = 0; turn < 2; ++turn) {
      const int i = round % 2 == 0 ? turn : 1 - turn;
      FloodResult& result = modes[i].floods[index];
      absl::StatusOr<FloodRun> run = FloodOnce(
          s, exe, kind, modes[i], &result, absl::ZeroDuration(),
          [] { return absl::OkStatus(); },
          absl::Seconds(static_cast<double>(s.seconds)));
      if (!run.ok()) return run.status();
      std::fprintf(stderr,
                   "tenant_bench: %s alone, %s, round %" PRIu64 ": %.1f %s\n",
                   KindName(kind), SchedulerName(modes[i].fair), round + 1,
                   Rate(s, kind, *run), RateUnit(s, kind).c_str());
      result.alone.ops += run->ops;
      result.alone.seconds += run->seconds;
      result.alone.errors += run->errors;
    }
  }
  for (Mode& m : modes) {
    FloodResult& result = m.floods[index];
    absl::StatusOr<FloodRun> during = FloodOnce(
        s, exe, kind, m, &result,
        absl::Milliseconds(static_cast<double>(s.warmup_ms)),
        [&]() -> absl::Status {
          absl::StatusOr<Sampled> sampled = m.bystander->Sample(
              s.samples, absl::Seconds(static_cast<double>(s.phase_seconds)));
          if (!sampled.ok()) return sampled.status();
          result.bystander = *std::move(sampled);
          return absl::OkStatus();
        },
        absl::ZeroDuration());
    if (!during.ok()) return during.status();
    result.during = *during;
  }
  return absl::OkStatus();
}

// The idle bystander, the two mrds taking turns in `chunks` chunks.
absl::Status MeasureIdle(const Settings& s, Mode (&modes)[2]) {
  constexpr uint64_t kChunks = 5;
  for (uint64_t chunk = 0; chunk < kChunks; ++chunk) {
    for (Mode& m : modes) {
      absl::StatusOr<Sampled> sampled =
          m.bystander->Sample((s.samples + kChunks - 1) / kChunks,
                              absl::InfiniteDuration(), chunk == 0 ? 20 : 0);
      if (!sampled.ok()) return sampled.status();
      m.idle.Add(*sampled);
    }
  }
  return absl::OkStatus();
}

absl::Status RunAll(const Settings& s, const std::string& exe,
                    Mode (&modes)[2]) {
  for (Mode& m : modes) {
    if (absl::Status status = StartMode(s, &m); !status.ok()) return status;
  }
  std::fprintf(stderr, "tenant_bench: idle bystander\n");
  if (absl::Status status = MeasureIdle(s, modes); !status.ok()) {
    return status;
  }
  for (size_t i = 0; i < std::size(kFloods); ++i) {
    if (!Wanted(s, kFloods[i])) continue;
    std::fprintf(stderr, "tenant_bench: flood %s\n", KindName(kFloods[i]));
    if (absl::Status status = MeasureFlood(s, exe, i, modes); !status.ok()) {
      return absl::Status(
          status.code(),
          absl::StrCat("flood ", KindName(kFloods[i]), ": ", status.message()));
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Output.

std::string FloodTitle(const Settings& s, FloodKind kind) {
  switch (kind) {
    case FloodKind::kBig:
      return absl::StrCat("a. ", s.clients, " clients × fresh ", s.big_mib,
                          " MiB RegisterMr + DeregisterMr");
    case FloodKind::kBatch:
      return absl::StrCat("b. ", s.clients, " clients × RegisterMrBatch + ",
                          "DeregisterMrBatch of ", s.batch_items, " × 4 KiB");
    case FloodKind::kHits:
      return absl::StrCat("c. ", s.hits, " cache-hit RegisterMr + ",
                          "DeregisterMr in flight");
  }
  return "";
}

std::string RateUnit(const Settings& s, FloodKind kind) {
  switch (kind) {
    case FloodKind::kBig:
      return absl::StrCat(s.big_mib, " MiB pairs/s");
    case FloodKind::kBatch:
      return "registrations/s (batch items)";
    case FloodKind::kHits:
      return "hit pairs/s";
  }
  return "";
}

double Rate(const Settings& s, FloodKind kind, const FloodRun& run) {
  if (run.seconds <= 0) return 0;
  const double items =
      kind == FloodKind::kBatch ? static_cast<double>(s.batch_items) : 1.0;
  return static_cast<double>(run.ops) * items / run.seconds;
}

std::string Fixed(double v, int digits) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", digits, v);
  return text;
}

// Milliseconds with about three significant digits.
std::string Ms(double us) {
  const double ms = us / 1000;
  return Fixed(ms, ms >= 100 ? 0 : ms >= 10 ? 1 : 2);
}

std::string RateText(double v) { return Fixed(v, v >= 100 ? 0 : 1); }

double P50(const std::vector<double>& v) { return Percentile(v, 0.5); }
double P99(const std::vector<double>& v) { return Percentile(v, 0.99); }

void PrintBystanderRow(const std::string& flood, const Mode& m,
                       const Sampled& s, const std::string& meanwhile) {
  const double wait = s.MeanWaitUs();
  const double service = s.MeanServiceUs();
  std::printf(
      "| %s | %s | %zu | %s | %s | %s | %s / %s | %s / %s | %s | %s | %s / %s "
      "| %s |\n",
      flood.c_str(), SchedulerName(m.fair), s.us.size(), Ms(P50(s.us)).c_str(),
      Ms(P99(s.us)).c_str(), Fixed(P99(s.us) / P99(m.idle.us), 2).c_str(),
      Ms(P50(s.health_us)).c_str(), Ms(P99(s.health_us)).c_str(),
      Ms(P50(s.info_us)).c_str(), Ms(P99(s.info_us)).c_str(),
      wait >= 0 ? Fixed(wait, 1).c_str() : "–",
      service >= 0 ? Fixed(service, 0).c_str() : "–",
      Fixed(s.MrdCores(), 2).c_str(), Fixed(s.BusyCores(), 2).c_str(),
      meanwhile.c_str());
}

// The flooder's tenant, as GetSession named it.
std::string FlooderTenant(const Mode& m) {
  for (const FloodResult& f : m.floods) {
    if (!f.tenant.empty()) return f.tenant;
  }
  return "?";
}

void PrintTables(const Settings& s, const Mode (&modes)[2]) {
  std::printf(
      "\n### Bystander (%s): cold 4 KiB RegisterMr + DeregisterMr, one "
      "client, while %s floods\n\n",
      modes[0].tenant.c_str(), FlooderTenant(modes[0]).c_str());
  std::printf(
      "| flood | scheduler | samples | p50 ms | p99 ms | p99 ÷ idle p99 | "
      "health check p50 / p99 ms | GetDeviceInfo p50 / p99 ms | "
      "bystander's mean wait for a worker, "
      "µs | bystander's mean time on a worker, µs | CPU cores busy: mrd / "
      "machine | flooder meanwhile |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Mode& m : modes) PrintBystanderRow("idle", m, m.idle, "–");
  for (size_t i = 0; i < std::size(kFloods); ++i) {
    if (!Wanted(s, kFloods[i])) continue;
    for (const Mode& m : modes) {
      const FloodResult& f = m.floods[i];
      PrintBystanderRow(FloodTitle(s, kFloods[i]), m, f.bystander,
                        RateText(Rate(s, kFloods[i], f.during)) + " " +
                            RateUnit(s, kFloods[i]));
    }
  }
  std::printf("\n### Goals\n\n");
  std::printf("| goal | fair | FIFO | met |\n|---|---|---|---|\n");
  for (size_t i = 0; i < std::size(kFloods); ++i) {
    if (!Wanted(s, kFloods[i])) continue;
    const double fair =
        P99(modes[0].floods[i].bystander.us) / P99(modes[0].idle.us);
    const double fifo =
        P99(modes[1].floods[i].bystander.us) / P99(modes[1].idle.us);
    std::printf(
        "| bystander p99 ÷ idle p99 under %s (fair ≤ 3×) | %s× | %s× "
        "| %s |\n",
        FloodTitle(s, kFloods[i]).c_str(), Fixed(fair, 2).c_str(),
        Fixed(fifo, 2).c_str(), fair <= 3 ? "yes" : "**no**");
  }
  for (size_t i = 0; i < std::size(kFloods); ++i) {
    if (!Wanted(s, kFloods[i])) continue;
    const double fair = Rate(s, kFloods[i], modes[0].floods[i].alone);
    const double fifo = Rate(s, kFloods[i], modes[1].floods[i].alone);
    const double ratio = fifo > 0 ? fair / fifo : 0;
    const bool goal = kFloods[i] != FloodKind::kHits;
    const std::string met =
        goal ? absl::StrCat(Fixed(ratio, 2),
                            "×: ", ratio >= 0.9 ? "yes" : "**no**")
             : absl::StrCat(Fixed(ratio, 2), "× (no goal)");
    std::printf("| flooder alone, %s: %s, fair ÷ FIFO%s | %s | %s | %s |\n",
                FloodTitle(s, kFloods[i]).c_str(),
                RateUnit(s, kFloods[i]).c_str(), goal ? " (≥ 0.90)" : "",
                RateText(fair).c_str(), RateText(fifo).c_str(), met.c_str());
  }
  std::fflush(stdout);
}

std::string CsvLine(const Settings& s, const Mode& m, const std::string& name,
                    const Sampled& sampled, const FloodKind* kind,
                    const FloodResult* f) {
  const double wait = sampled.MeanWaitUs();
  const double service = sampled.MeanServiceUs();
  std::string line = absl::StrCat(
      SchedulerName(m.fair), ",", name, ",", sampled.us.size(), ",",
      Fixed(P50(sampled.us), 1), ",", Fixed(P99(sampled.us), 1), ",",
      Fixed(P99(sampled.us) / P99(m.idle.us), 3), ",",
      Fixed(P50(sampled.health_us), 1), ",", Fixed(P99(sampled.health_us), 1),
      ",", Fixed(P50(sampled.info_us), 1), ",", Fixed(P99(sampled.info_us), 1),
      ",", wait >= 0 ? Fixed(wait, 2) : "", ",",
      service >= 0 ? Fixed(service, 1) : "", ",", Fixed(sampled.MrdCores(), 3),
      ",", Fixed(sampled.BusyCores(), 3), ",", Fixed(sampled.StealCores(), 3),
      ",");
  if (kind == nullptr) return line + ",,,";
  absl::StrAppend(&line, RateUnit(s, *kind), ",",
                  Fixed(Rate(s, *kind, f->alone), 3), ",",
                  Fixed(Rate(s, *kind, f->during), 3), ",",
                  f->alone.errors + f->during.errors);
  return line;
}

absl::Status WriteCsv(const Settings& s, const Mode (&modes)[2]) {
  std::string text =
      "scheduler,case,samples,p50_us,p99_us,p99_over_idle_p99,"
      "health_p50_us,health_p99_us,get_device_info_p50_us,"
      "get_device_info_p99_us,bystander_mean_worker_wait_us,"
      "bystander_mean_worker_service_us,mrd_cpu_cores,machine_busy_cores,"
      "machine_steal_cores,flooder_unit,flooder_alone_per_s,"
      "flooder_during_per_s,flooder_errors\n";
  for (const Mode& m : modes) {
    absl::StrAppend(&text, CsvLine(s, m, "idle", m.idle, nullptr, nullptr),
                    "\n");
    for (size_t i = 0; i < std::size(kFloods); ++i) {
      if (!Wanted(s, kFloods[i])) continue;
      absl::StrAppend(&text,
                      CsvLine(s, m, KindName(kFloods[i]), m.floods[i].bystander,
                              &kFloods[i], &m.floods[i]),
                      "\n");
    }
  }
  return WriteFile(s.out + "/tenant_bench.csv", text);
}

std::string LoadAverage() {
  FILE* f = std::fopen("/proc/loadavg", "r");
  if (f == nullptr) return "?";
  char text[128] = {};
  const bool read = std::fgets(text, sizeof(text), f) != nullptr;
  std::fclose(f);
  return read ? std::string(absl::StripAsciiWhitespace(text)) : "?";
}

int Main(int argc, char** argv) {
  if (!StringFlag(argc, argv, "--child", "").empty()) {
    return ChildMain(argc, argv);
  }
  Settings s = ReadSettings(argc, argv);
  if (::geteuid() != 0) {
    std::fprintf(stderr,
                 "tenant_bench: needs root (the flooder runs as uid %u; mrd "
                 "pins memory)\n",
                 static_cast<unsigned>(kFlooderUid));
    return 1;
  }
  std::error_code error;
  const std::string exe =
      std::filesystem::read_symlink("/proc/self/exe", error);
  if (error) {
    std::fprintf(stderr, "tenant_bench: /proc/self/exe: %s\n",
                 error.message().c_str());
    return 1;
  }
  std::filesystem::create_directories(s.out, error);
  if (error) {
    std::fprintf(stderr, "%s: %s\n", s.out.c_str(), error.message().c_str());
    return 1;
  }
  if (s.pods) {
    for (auto* pod : {&s.mrd_pod, &s.bystander_pod, &s.flooder_pod}) {
      absl::StatusOr<std::unique_ptr<testing::PodCgroup>> made =
          testing::PodCgroup::Create();
      if (!made.ok()) {
        std::fprintf(stderr, "tenant_bench: --pods: %s\n",
                     made.status().ToString().c_str());
        return 1;
      }
      *pod = *std::move(made);
    }
    if (!s.bystander_pod->Join(::getpid())) {
      std::fprintf(stderr, "tenant_bench: --pods: cannot join a pod\n");
      return 1;
    }
  }
  // A flooder that died must not kill us at the next write to its stdin.
  ::signal(SIGPIPE, SIG_IGN);
  const Clock::time_point start = Clock::now();
  const std::string load_before = LoadAverage();
  Mode modes[2];
  modes[1].fair = false;
  absl::Status status = RunAll(s, exe, modes);
  for (Mode& m : modes) status.Update(StopMode(s, &m));
  // Out of the bystander's pod, so that the pods can be removed.
  if (s.pods) testing::PodCgroup::LeaveAll(::getpid());
  if (!status.ok()) {
    std::fprintf(stderr, "tenant_bench: %s\n", status.ToString().c_str());
    return 1;
  }
  PrintTables(s, modes);
  if (absl::Status csv = WriteCsv(s, modes); !csv.ok()) {
    std::fprintf(stderr, "tenant_bench: %s\n", csv.ToString().c_str());
    return 1;
  }
  uint64_t errors = 0;
  for (const Mode& m : modes) {
    for (const FloodResult& f : m.floods) {
      errors += f.alone.errors + f.during.errors;
    }
  }
  std::printf(
      "\n%.0f s in all; load average before: %s, after: %s; "
      "%s/tenant_bench.csv\n",
      Seconds(start), load_before.c_str(), LoadAverage().c_str(),
      s.out.c_str());
  if (errors != 0) {
    std::fprintf(stderr, "tenant_bench: %" PRIu64 " flooder calls failed\n",
                 errors);
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace mrd::bench

int main(int argc, char** argv) { return mrd::bench::Main(argc, argv); }
