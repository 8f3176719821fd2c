// Many-thread stress, meant to run under TSan (-DMRD_SANITIZE=thread) as
// well as in the plain build:
//
//   * RegistrationCache alone: 12 threads acquire the same few keys, release,
//     invalidate, read stats, with slow creations (so that acquirers wait)
//     and injected creation failures (which waiters must share). A ledger
//     outside the cache checks: a creation never runs twice at once for one
//     key and only after the key's previous entry left the cache; test-side
//     reference counts never go negative and are zero when the cache hands
//     an entry back; an entry is never handed out by an Acquire that began
//     after the entry was released or invalidated; the statistics add up.
//   * Core over the real SoftwareDevice: threads register and deregister
//     overlapping ranges and build and release LAMs in shared sessions, read
//     through the peer path, while another releases buffers and closes and
//     replaces sessions, and one runs fast-register/invalidate cycles with
//     completions on its own session. Only the errors such races explain are
//     accepted; at the end nothing is pinned (device, core accounting and
//     the kernel's VmLck + VmPin), the cache is empty, and every mlock/munlock
//     the device made succeeded.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/peer/soft_peer.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "mrd/unique_fd.h"
#include "server/cache/registration_cache.h"
#include "server/common/clock.h"
#include "server/common/log.h"
#include "server/core/core.h"
#include "server/device/software/software_device.h"
#include "tests/support/kernel_pins.h"

#ifndef MRD_STRESS_SCALE
#define MRD_STRESS_SCALE 2
#endif

namespace mrd {

using ::mrd::test_support::KernelPinnedBytesSettled;
namespace {

constexpr int kScale = MRD_STRESS_SCALE;

// Collects the first few unexpected events of many threads.
class Problems {
 public:
  void Add(std::string what) {
    absl::MutexLock lock(&mu_);
    ++count_;
    if (first_.size() < 10) first_.push_back(std::move(what));
  }
  int count() const {
    absl::MutexLock lock(&mu_);
    return count_;
  }
  std::string Describe() const {
    absl::MutexLock lock(&mu_);
    std::string out;
    for (const std::string& p : first_) absl::StrAppend(&out, "\n  ", p);
    return out;
  }

 private:
  mutable absl::Mutex mu_;
  int count_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> first_ ABSL_GUARDED_BY(mu_);
};

std::string Reason(const absl::Status& s) {
  return s.ok() ? "OK" : GetErrorDetail(s).reason();
}

// ---------------------------------------------------------------------------
// RegistrationCache.

constexpr int kCacheThreads = 12;
constexpr int kCacheOpsPerThread = 50000 * kScale;
constexpr int kKeys = 5;
constexpr uint64_t kMaxRegistrations =
    uint64_t{kCacheThreads} * kCacheOpsPerThread + 1;

// Only the injected creation failures have this code.
constexpr absl::StatusCode kInjected = absl::StatusCode::kAborted;

cache::CacheKey KeyFor(int k) {
  cache::CacheKey key;
  key.session = 1 + static_cast<uint64_t>(k % 2);
  key.buffer = 100 + static_cast<uint64_t>(k);
  key.offset = 4096;
  key.length = 8192;
  key.access = 6;
  key.base_address = 0x10000;
  return key;
}

// What the test knows of one registration (named by the device_mr the
// create function gave it).
struct LedgerEntry {
  std::atomic<int> key{-1};
  std::atomic<uint64_t> entry{0};  // the cache's id, once known
  std::atomic<int64_t> refs{0};    // references held by test threads
  std::atomic<bool> invalidating{false};
  std::atomic<uint64_t> removed_at{0};  // sequence number after removal
};

struct CacheFixture {
  cache::RegistrationCache cache;
  std::vector<LedgerEntry> ledger = std::vector<LedgerEntry>(kMaxRegistrations);
  std::atomic<uint64_t> next_registration{1};
  std::atomic<uint64_t> sequence{1};
  std::atomic<int> in_create[kKeys] = {};
  std::atomic<uint64_t> last_created[kKeys] = {};
  std::atomic<uint64_t> creates{0};
  std::atomic<uint64_t> creates_ok{0};
  std::atomic<uint64_t> acquires_ok{0};
  std::atomic<uint64_t> acquire_failures{0};
  std::atomic<uint64_t> released{0};
  std::atomic<uint64_t> invalidated{0};
  Problems problems;
};

struct Held {
  uint64_t entry = 0;
  uint64_t registration = 0;
};

struct HandOut {
  uint64_t registration = 0;
  uint64_t started_at = 0;
};

absl::StatusOr<cache::CachedRegistration> Create(CacheFixture& f, int k,
                                                 std::mt19937_64& rng) {
  f.creates.fetch_add(1);
  if (int before = f.in_create[k].fetch_add(1); before != 0) {
    f.problems.Add(
        absl::StrCat("key ", k, ": ", before + 1, " creations at once"));
  }
  // The key's previous registration has left the cache.
  if (uint64_t prev = f.last_created[k].load(); prev != 0) {
    const uint64_t entry = f.ledger[prev].entry.load();
    if (entry == 0 || f.cache.KeyOf(entry).has_value() ||
        f.cache.References(entry) != 0) {
      f.problems.Add(absl::StrCat("key ", k, ": created again while entry ",
                                  entry, " is still in the cache"));
    }
  }
  if (rng() % 20 == 0) {
    // Slow: other acquirers of the key wait for this creation.
    absl::SleepFor(absl::Microseconds(50 + rng() % 200));
  }
  if (rng() % 12 == 0) {
    f.in_create[k].fetch_sub(1);
    // The injected failure. The cache hands one failure to every waiter, so
    // copies of it live on several threads; a Status with a message shares a
    // reference-counted representation whose atomics live in Debian's
    // uninstrumented libabsl_status, which TSan cannot see (it reports the
    // last owner's delete as racing the others' reads). A code alone is
    // stored inline: no shared memory, nothing to misreport.
    return absl::Status(kInjected, "");
  }
  const uint64_t id = f.next_registration.fetch_add(1);
  f.ledger[id].key.store(k);
  f.last_created[k].store(id);
  f.creates_ok.fetch_add(1);
  f.in_create[k].fetch_sub(1);
  cache::CachedRegistration reg;
  reg.device_mr = id;
  reg.lkey = static_cast<uint32_t>(id);
  reg.rkey = static_cast<uint32_t>(id);
  reg.pinned_bytes = 8192;
  return reg;
}

// Drops one reference the thread holds, checking what the cache answers.
void Drop(CacheFixture& f, const Held& h) {
  LedgerEntry& l = f.ledger[h.registration];
  if (l.refs.fetch_sub(1) <= 0) {
    f.problems.Add(absl::StrCat("registration ", h.registration,
                                ": test references went negative"));
  }
  absl::StatusOr<cache::ReleaseResult> r = f.cache.Release(h.entry);
  if (!r.ok()) {
    // Only an invalidation (W11) takes an entry away from its holders.
    if (r.status().code() != absl::StatusCode::kNotFound ||
        !l.invalidating.load()) {
      f.problems.Add(absl::StrCat("Release of held entry ", h.entry, ": ",
                                  r.status().ToString()));
    }
    return;
  }
  if (!r->released.has_value()) return;
  // The last reference: nobody else may still hold it.
  f.released.fetch_add(1);
  if (r->released->device_mr != h.registration || r->references != 0 ||
      l.invalidating.load() || l.refs.load() != 0) {
    f.problems.Add(absl::StrCat(
        "last Release of entry ", h.entry, " returned registration ",
        r->released->device_mr, " (expected ", h.registration, ") with ",
        l.refs.load(), " test references still held, invalidating ",
        l.invalidating.load()));
  }
  l.removed_at.store(f.sequence.fetch_add(1));
}

void CacheWorker(CacheFixture& f, int index, std::vector<HandOut>* log) {
  std::mt19937_64 rng(0x5eed0000 + static_cast<uint64_t>(index));
  std::vector<Held> held;
  for (int op = 0; op < kCacheOpsPerThread; ++op) {
    const uint64_t choice = rng() % 100;
    if (choice < 45 || held.empty()) {
      const int k = static_cast<int>(rng() % kKeys);
      const uint64_t started_at = f.sequence.fetch_add(1);
      absl::StatusOr<cache::AcquireResult> r =
          f.cache.Acquire(KeyFor(k), [&]() { return Create(f, k, rng); });
      if (!r.ok()) {
        f.acquire_failures.fetch_add(1);
        if (r.status().code() != kInjected) {
          f.problems.Add("Acquire: " + r.status().ToString());
        }
        continue;
      }
      f.acquires_ok.fetch_add(1);
      const uint64_t id = r->registration.device_mr;
      if (id == 0 || id >= kMaxRegistrations || f.ledger[id].key.load() != k ||
          r->references == 0) {
        f.problems.Add(absl::StrCat(
            "Acquire of key ", k, " returned registration ", id, " (key ",
            id < kMaxRegistrations ? f.ledger[id].key.load() : -1, ") with ",
            r->references, " references"));
        continue;
      }
      LedgerEntry& l = f.ledger[id];
      uint64_t expected_entry = 0;
      if (!l.entry.compare_exchange_strong(expected_entry, r->entry) &&
          expected_entry != r->entry) {
        f.problems.Add(absl::StrCat("registration ", id, " came with entry ",
                                    r->entry, " and entry ", expected_entry));
      }
      l.refs.fetch_add(1);
      held.push_back(Held{r->entry, id});
      log->push_back(HandOut{id, started_at});
    } else if (choice < 85) {
      const size_t at = rng() % held.size();
      const Held h = held[at];
      held[at] = held.back();
      held.pop_back();
      Drop(f, h);
    } else if (choice < 90) {
      // W11: the memory went away; the entry goes whatever its count.
      const size_t at = rng() % held.size();
      const Held h = held[at];
      LedgerEntry& l = f.ledger[h.registration];
      bool expected = false;
      if (!l.invalidating.compare_exchange_strong(expected, true)) continue;
      held[at] = held.back();
      held.pop_back();
      l.refs.fetch_sub(1);
      absl::StatusOr<cache::CachedRegistration> r = f.cache.Invalidate(h.entry);
      if (!r.ok() || r->device_mr != h.registration) {
        f.problems.Add(
            absl::StrCat("Invalidate of held entry ", h.entry, ": ",
                         r.ok() ? absl::StrCat("registration ", r->device_mr)
                                : r.status().ToString()));
        continue;
      }
      f.invalidated.fetch_add(1);
      l.removed_at.store(f.sequence.fetch_add(1));
    } else {
      // Readers: what the cache says of an entry this thread holds.
      const Held& h = held[rng() % held.size()];
      const LedgerEntry& l = f.ledger[h.registration];
      std::optional<cache::CacheKey> key = f.cache.KeyOf(h.entry);
      const uint32_t refs = f.cache.References(h.entry);
      const bool gone = l.invalidating.load();
      if ((!key.has_value() || refs == 0) && !gone) {
        f.problems.Add(
            absl::StrCat("held entry ", h.entry, " is not in the cache"));
      } else if (key.has_value() && *key != KeyFor(l.key.load())) {
        f.problems.Add(absl::StrCat("entry ", h.entry, " has another key"));
      }
      (void)f.cache.Stats();
    }
  }
  for (const Held& h : held) Drop(f, h);
}

TEST(CacheStressTest, ManyThreadsAcquireReleaseInvalidateWithFailures) {
  auto f = std::make_unique<CacheFixture>();
  std::vector<std::vector<HandOut>> logs(kCacheThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kCacheThreads; ++i) {
    threads.emplace_back(CacheWorker, std::ref(*f), i, &logs[i]);
  }
  for (std::thread& t : threads) t.join();

  EXPECT_EQ(f->problems.count(), 0) << f->problems.Describe();
  // An entry is never handed out by an Acquire that began after its
  // release or invalidation had returned.
  int late = 0;
  for (const auto& log : logs) {
    for (const HandOut& h : log) {
      const uint64_t removed = f->ledger[h.registration].removed_at.load();
      if (removed == 0 || h.started_at > removed) ++late;
    }
  }
  EXPECT_EQ(late, 0) << "hand-outs of entries already released, or never "
                        "released";
  for (uint64_t id = 1; id < f->next_registration.load(); ++id) {
    ASSERT_EQ(f->ledger[id].refs.load(), 0) << "registration " << id;
  }
  const cache::CacheStats stats = f->cache.Stats();
  EXPECT_EQ(stats.entries, 0u);
  EXPECT_EQ(stats.misses, f->creates.load()) << "one miss per creation";
  EXPECT_EQ(stats.hits, f->acquires_ok.load() - f->creates_ok.load());
  EXPECT_EQ(stats.releases, f->released.load());
  EXPECT_EQ(stats.invalidations, f->invalidated.load());
  EXPECT_EQ(f->creates_ok.load(), f->released.load() + f->invalidated.load())
      << "every created entry left exactly once";
  // The mix really exercised the interesting paths.
  EXPECT_GT(stats.hits, 1000u);
  EXPECT_GT(f->acquire_failures.load(), 100u);
  EXPECT_GT(f->invalidated.load(), 100u);
}

// ---------------------------------------------------------------------------
// Core over the software device.

// mlock/munlock as the device makes them: every one must succeed (a failed
// munlock means pinned memory was unmapped before it was unpinned).
class WatchedPinOps final : public device::PinOps {
 public:
  int Lock(uint64_t address, uint64_t length) override {
    return Watch("mlock", address, length,
                 device::SystemPinOps()->Lock(address, length));
  }
  int Unlock(uint64_t address, uint64_t length) override {
    return Watch("munlock", address, length,
                 device::SystemPinOps()->Unlock(address, length));
  }
  Problems problems;

 private:
  int Watch(const char* call, uint64_t address, uint64_t length, int err) {
    if (err != 0) {
      problems.Add(absl::StrCat(
          call, " of ", length, " bytes at 0x", absl::Hex(address), ": ",
          std::strerror(err),
          err == ENOMEM && std::string(call) == "munlock"
              ? " (the range was unmapped before it was unpinned: a buffer's "
                "mapping went while a registration on it was still live)"
              : ""));
    }
    return err;
  }
};

constexpr int kCoreWorkers = 6;
constexpr int kCoreOpsPerWorker = 10000 * kScale;
constexpr int kSharedSessions = 3;
constexpr int kBuffersPerSession = 3;

UniqueFd NewMemfd(uint64_t size) {
  UniqueFd fd(::memfd_create("mrd-stress", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid() || ::ftruncate(fd.get(), static_cast<off_t>(size)) != 0 ||
      ::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
    return UniqueFd();
  }
  return fd;
}

class CoreStress {
 public:
  CoreStress() : page_(static_cast<uint64_t>(::sysconf(_SC_PAGESIZE))) {}

  bool Start() {
    device::SoftwareDeviceOptions options;
    options.pin_ops = &pins_;
    absl::StatusOr<std::unique_ptr<device::SoftwareDevice>> device =
        device::SoftwareDevice::Create(options);
    if (!device.ok() || !(*device)->Start().ok()) return false;
    device_ = std::move(*device);
    core_ = std::make_unique<core::Core>(device_.get(), RealClock::Get(),
                                         core::CoreOptions{});
    for (int i = 0; i < kSharedSessions; ++i) {
      if (!OpenShared(i)) return false;
    }
    return true;
  }

  // An fd session with fresh buffers, in shared slot `i`.
  bool OpenShared(int i) {
    fd_socket::PeerCredentials creds;
    creds.uid = ::getuid();
    creds.pid = ::getpid();
    absl::StatusOr<std::string> token = core_->OnConnect(creds);
    if (!token.ok()) return false;
    std::vector<uint64_t> buffers;
    for (int b = 0; b < kBuffersPerSession; ++b) {
      absl::StatusOr<uint64_t> buffer = Import(*token);
      if (!buffer.ok()) return false;
      buffers.push_back(*buffer);
    }
    v1::CreatePeerTicketRequest req;
    req.set_session(*token);
    v1::PeerTicket ticket;
    if (!core_->CreatePeerTicket(req, &ticket).ok()) return false;
    absl::MutexLock lock(&mu_);
    shared_[i].token = *token;
    shared_[i].ticket = ticket.ticket();
    shared_[i].buffers = std::move(buffers);
    return true;
  }

  absl::StatusOr<uint64_t> Import(const std::string& token) {
    const uint64_t size = 8 * page_;
    UniqueFd fd = NewMemfd(size);
    v1::ImportMemfd req;
    req.set_writable(true);
    req.set_expected_size(size);
    MRD_ASSIGN_OR_RETURN(v1::BufferInfo info,
                         core_->OnImport(token, std::move(fd), req));
    return info.buffer();
  }

  struct Pick {
    std::string token;
    std::string ticket;
    uint64_t buffer = 0;
  };
  Pick PickShared(std::mt19937_64& rng) {
    absl::MutexLock lock(&mu_);
    const Shared& s = shared_[rng() % kSharedSessions];
    return Pick{s.token, s.ticket, s.buffers[rng() % s.buffers.size()]};
  }

  // Races explain these; anything else is a problem.
  void Expect(const absl::Status& s, absl::string_view op,
              std::initializer_list<absl::string_view> allowed) {
    if (s.ok()) return;
    const std::string reason = Reason(s);
    for (absl::string_view a : allowed) {
      if (reason == a) return;
    }
    problems_.Add(absl::StrCat(op, ": ", s.ToString(), " [", reason, "]"));
  }

  void Worker(int index) {
    std::mt19937_64 rng(0xc0de0000 + static_cast<uint64_t>(index));
    struct HeldReg {
      std::string token;
      std::string ticket;
      uint64_t registration = 0;
      uint32_t rkey = 0;
      uint64_t base = 0;
    };
    std::vector<HeldReg> held;
    std::unique_ptr<peer::SoftPeer> peer;
    std::string peer_ticket;
    for (int op = 0; op < kCoreOpsPerWorker; ++op) {
      const uint64_t choice = rng() % 100;
      if (choice < 40 || held.empty()) {
        const Pick p = PickShared(rng);
        v1::RegisterMrRequest req;
        req.set_session(p.token);
        req.set_buffer(p.buffer);
        req.set_offset((rng() % 3) * page_);
        req.set_length((2 + rng() % 3) * page_ - (rng() % 2) * 100);
        const uint32_t flags[] = {0x2, 0x7, 0x0};
        req.set_flags(flags[rng() % 3]);
        v1::RegisterMrResponse out;
        const absl::Status s = core_->RegisterMr(req, &out);
        Expect(s, "RegisterMr", {"SESSION_NOT_CONNECTED", "UNKNOWN_BUFFER"});
        if (s.ok()) {
          held.push_back(HeldReg{p.token, p.ticket, out.registration(),
                                 out.rkey(), out.base_address()});
        }
      } else if (choice < 70) {
        const size_t at = rng() % held.size();
        const HeldReg h = held[at];
        held[at] = held.back();
        held.pop_back();
        v1::DeregisterMrRequest req;
        req.set_session(h.token);
        req.set_registration(h.registration);
        v1::DeregisterMrResponse out;
        Expect(core_->DeregisterMr(req, &out), "DeregisterMr",
               {"SESSION_NOT_CONNECTED", "UNKNOWN_REGISTRATION"});
      } else if (choice < 82) {
        const Pick p = PickShared(rng);
        v1::BuildLamRequest req;
        req.set_session(p.token);
        req.set_buffer(p.buffer);
        req.set_offset((rng() % 4) * page_ + 10);
        req.set_length(2 * page_);
        v1::BuildLamResponse out;
        const absl::Status s = core_->BuildLam(req, &out);
        Expect(s, "BuildLam", {"SESSION_NOT_CONNECTED", "UNKNOWN_BUFFER"});
        if (s.ok()) {
          v1::ReleaseLamRequest rel;
          rel.set_session(p.token);
          rel.set_lam(out.lam());
          Expect(core_->ReleaseLam(rel), "ReleaseLam",
                 {"SESSION_NOT_CONNECTED", "UNKNOWN_LAM"});
        }
      } else if (choice < 95) {
        // The peer path, racing deregistration and session ends: a READ
        // either works or is refused, and a refused connection is dead.
        const HeldReg& h = held[rng() % held.size()];
        if (peer == nullptr || peer_ticket != h.ticket) {
          absl::StatusOr<std::unique_ptr<peer::SoftPeer>> p =
              peer::SoftPeer::Connect(device_->Attributes().peer_address,
                                      h.ticket);
          if (!p.ok() && p.status().code() != absl::StatusCode::kUnavailable) {
            Expect(p.status(), "Connect", {"BAD_TICKET"});
          }
          peer = p.ok() ? std::move(*p) : nullptr;
          peer_ticket = h.ticket;
          if (peer == nullptr) continue;
        }
        absl::StatusOr<std::string> data = peer->Read(h.rkey, h.base, 64);
        if (!data.ok()) {
          if (data.status().code() != absl::StatusCode::kUnavailable) {
            Expect(data.status(), "peer READ", {"REMOTE_ACCESS_ERROR"});
          }
          peer.reset();
        }
      } else {
        const Pick p = PickShared(rng);
        v1::ListRegistrationsRequest req;
        req.set_session(p.token);
        v1::ListRegistrationsResponse out;
        Expect(core_->ListRegistrations(req, &out), "ListRegistrations",
               {"SESSION_NOT_CONNECTED"});
        (void)core_->Stats();
      }
    }
    for (const HeldReg& h : held) {
      v1::DeregisterMrRequest req;
      req.set_session(h.token);
      req.set_registration(h.registration);
      v1::DeregisterMrResponse out;
      Expect(core_->DeregisterMr(req, &out), "DeregisterMr",
             {"SESSION_NOT_CONNECTED", "UNKNOWN_REGISTRATION"});
    }
  }

  // Releases buffers (W11) and ends sessions under the workers' feet.
  void Chaos(const std::atomic<bool>& stop) {
    std::mt19937_64 rng(0xca05);
    int round = 0;
    while (!stop.load()) {
      absl::SleepFor(absl::Microseconds(500));
      const int i = static_cast<int>(rng() % kSharedSessions);
      if (++round % 25 == 0) {
        std::string token;
        {
          absl::MutexLock lock(&mu_);
          token = shared_[i].token;
        }
        v1::CloseSessionRequest req;
        req.set_session(token);
        Expect(core_->CloseSession(req), "CloseSession", {});
        if (!OpenShared(i)) problems_.Add("reopening a shared session");
        continue;
      }
      std::string token;
      uint64_t buffer = 0;
      {
        absl::MutexLock lock(&mu_);
        token = shared_[i].token;
        buffer = shared_[i].buffers[rng() % kBuffersPerSession];
      }
      v1::ReleaseBufferRequest req;
      req.set_session(token);
      req.set_buffer(buffer);
      v1::ReleaseBufferResponse out;
      Expect(core_->ReleaseBuffer(req, &out), "ReleaseBuffer", {});
      absl::StatusOr<uint64_t> fresh = Import(token);
      Expect(fresh.status(), "Import", {});
      absl::MutexLock lock(&mu_);
      for (uint64_t& b : shared_[i].buffers) {
        if (b == buffer && fresh.ok()) b = *fresh;
      }
    }
  }

  // Fast registration cycles on a session of its own: FastRegister, wait for
  // the completion, READ through the new token, invalidate, wait, and the
  // old token must be dead.
  void FastRegisterCycles(int cycles) {
    fd_socket::PeerCredentials creds;
    creds.uid = ::getuid();
    creds.pid = ::getpid();
    absl::StatusOr<std::string> token = core_->OnConnect(creds);
    if (!token.ok()) return problems_.Add("OnConnect");
    absl::StatusOr<uint64_t> buffer = Import(*token);
    if (!buffer.ok()) return problems_.Add("Import");
    absl::StatusOr<core::CompletionSubscription> stream =
        core_->SubscribeCompletions(*token, [] {});
    if (!stream.ok()) return problems_.Add("SubscribeCompletions");
    v1::BuildLamRequest lam_req;
    lam_req.set_session(*token);
    lam_req.set_buffer(*buffer);
    lam_req.set_length(3 * page_);
    v1::BuildLamResponse lam;
    v1::CreateMrRequest mr_req;
    mr_req.set_session(*token);
    mr_req.set_fast_register(true);
    mr_req.set_allow_remote_access(true);
    v1::MrInfo mr;
    v1::CreatePeerTicketRequest ticket_req;
    ticket_req.set_session(*token);
    v1::PeerTicket ticket;
    if (!core_->BuildLam(lam_req, &lam).ok() ||
        !core_->CreateMr(mr_req, &mr).ok() ||
        !core_->CreatePeerTicket(ticket_req, &ticket).ok()) {
      return problems_.Add("fast-register set-up");
    }
    std::unique_ptr<peer::SoftPeer> peer;
    auto wait_for = [&](v1::Completion::Kind kind,
                        uint64_t context) -> std::optional<v1::Completion> {
      const absl::Time deadline = absl::Now() + absl::Seconds(30);
      while (absl::Now() < deadline) {
        while (std::optional<v1::Completion> c = (*stream)->PopCompletion()) {
          if (c->kind() == kind && c->request_context() == context) return c;
        }
        absl::SleepFor(absl::Microseconds(100));
      }
      return std::nullopt;
    };
    for (int i = 0; i < cycles; ++i) {
      if (peer == nullptr) {
        absl::StatusOr<std::unique_ptr<peer::SoftPeer>> p =
            peer::SoftPeer::Connect(device_->Attributes().peer_address,
                                    ticket.ticket());
        if (!p.ok())
          return problems_.Add("peer connect: " + p.status().ToString());
        peer = std::move(*p);
      }
      v1::FastRegisterRequest fr;
      fr.set_session(*token);
      fr.set_connection(peer->connection_id());
      fr.set_request_context(2 * static_cast<uint64_t>(i) + 1);
      fr.set_mr(mr.mr());
      *fr.mutable_pages() = lam.pages();
      fr.set_fbo(lam.fbo());
      fr.set_length(lam.length());
      const uint64_t base = (16 + static_cast<uint64_t>(i)) * page_;
      fr.set_base_address(base);
      fr.set_flags(0x38);  // remote read and write
      v1::FastRegisterResponse posted;
      if (absl::Status s = core_->FastRegister(fr, &posted); !s.ok()) {
        return problems_.Add("FastRegister: " + s.ToString());
      }
      std::optional<v1::Completion> done =
          wait_for(v1::Completion::FAST_REGISTER, fr.request_context());
      if (!done.has_value() || done->status() != v1::STATUS_SUCCESS) {
        return problems_.Add("fast registration did not complete");
      }
      const uint32_t rkey = done->rkey();
      if (absl::Status s = peer->Write(rkey, base, "stress"); !s.ok()) {
        return problems_.Add("WRITE through a fresh token: " + s.ToString());
      }
      v1::InvalidateMrRequest inv;
      inv.set_session(*token);
      inv.set_connection(peer->connection_id());
      inv.set_request_context(2 * static_cast<uint64_t>(i) + 2);
      inv.set_mr(mr.mr());
      v1::InvalidateMrResponse inv_out;
      if (absl::Status s = core_->InvalidateMr(inv, &inv_out); !s.ok()) {
        return problems_.Add("InvalidateMr: " + s.ToString());
      }
      done = wait_for(v1::Completion::INVALIDATE, inv.request_context());
      if (!done.has_value() || done->status() != v1::STATUS_SUCCESS) {
        return problems_.Add("invalidation did not complete");
      }
      if (peer->Read(rkey, base, 6).ok()) {
        return problems_.Add("an invalidated token still reads");
      }
      peer.reset();  // the refused READ killed the connection
    }
    core_->UnsubscribeCompletions(*stream);
    v1::CloseSessionRequest close;
    close.set_session(*token);
    Expect(core_->CloseSession(close), "CloseSession", {});
  }

  // Ends everything; returns what is left over, "" if nothing.
  std::string Finish() {
    std::vector<std::string> tokens;
    {
      absl::MutexLock lock(&mu_);
      for (const Shared& s : shared_) tokens.push_back(s.token);
    }
    for (const std::string& token : tokens) {
      v1::CloseSessionRequest req;
      req.set_session(token);
      Expect(core_->CloseSession(req), "CloseSession", {});
    }
    device_->WaitForWorkerIdle();
    const core::CoreStats stats = core_->Stats();
    std::string left;
    if (stats.sessions != 0 || stats.registrations != 0 ||
        stats.cache.entries != 0 || stats.lams != 0 ||
        stats.accounted_pinned_bytes != 0 || device_->PinnedBytes() != 0) {
      left = absl::StrCat(stats.sessions, " sessions, ", stats.registrations,
                          " registrations, ", stats.cache.entries,
                          " cache entries, ", stats.lams, " LAMs, ",
                          stats.accounted_pinned_bytes, " accounted and ",
                          device_->PinnedBytes(), " pinned bytes left");
    }
    core_.reset();
    device_.reset();
    return left;
  }

  Problems& problems() { return problems_; }
  Problems& pin_problems() { return pins_.problems; }

 private:
  struct Shared {
    std::string token;
    std::string ticket;
    std::vector<uint64_t> buffers;
  };
  const uint64_t page_;
  WatchedPinOps pins_;  // outlives the device
  std::unique_ptr<device::SoftwareDevice> device_;
  std::unique_ptr<core::Core> core_;
  absl::Mutex mu_;
  Shared shared_[kSharedSessions] ABSL_GUARDED_BY(mu_);
  Problems problems_;
};

TEST(CoreStressTest, RegistrationsLamsPeersWhileBuffersAndSessionsGo) {
  SetMinLogLevel(LogLevel::kError);
  const uint64_t kernel_pinned_before = KernelPinnedBytesSettled(0);
  {
    CoreStress stress;
    ASSERT_TRUE(stress.Start());
    std::atomic<bool> stop{false};
    std::thread chaos([&] { stress.Chaos(stop); });
    std::thread fast([&] { stress.FastRegisterCycles(1000 * kScale); });
    std::vector<std::thread> workers;
    for (int i = 0; i < kCoreWorkers; ++i) {
      workers.emplace_back([&stress, i] { stress.Worker(i); });
    }
    for (std::thread& t : workers) t.join();
    fast.join();
    stop.store(true);
    chaos.join();
    const std::string left = stress.Finish();
    EXPECT_EQ(left, "");
    EXPECT_EQ(stress.problems().count(), 0) << stress.problems().Describe();
    EXPECT_EQ(stress.pin_problems().count(), 0)
        << "failed mlock/munlock calls:" << stress.pin_problems().Describe();
  }
  EXPECT_EQ(KernelPinnedBytesSettled(kernel_pinned_before),
            kernel_pinned_before)
      << "the kernel still counts locked "
         "memory";
}

}  // namespace
}  // namespace mrd
