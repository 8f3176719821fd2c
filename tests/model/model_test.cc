// Model-based test: random sequences of mrd operations, run against the real
// Core over the real SoftwareDevice (real mlock pinning, real keys, the real
// TCP peer path) with real memfds and shared-memory files, and checked step
// by step against ReferenceModel (reference_model.h).
//
// Several sessions live at once (fd sessions on memfds, lease sessions on
// files of a private shared-memory directory), each with a few buffers (some
// files imported twice), a completion stream, and a SoftPeer connected to it.
// Each step does one weighted random operation: RegisterMr (new ranges,
// repeats of live ones with equivalent flag spellings and base addresses,
// MR objects, request-id retries, invalid requests), DeregisterMr,
// ReleaseBuffer, importing buffers, ending a session (CloseSession, the fd
// socket closing, the lease running out) and opening a replacement,
// BuildLam/ReleaseLam, CreateMr/CloseMr, FastRegister and InvalidateMr posted
// on the session's connection (with SILENT_SUCCESS, DEFER, READ_FENCE, bad
// connections and one-defect requests), flushing deferred work, calls on
// ended sessions. After each step the test compares:
//   * every answer (values, references, ids and descriptors of shared
//     entries, error reasons) with the model's;
//   * every completion with the model's, in order;
//   * the core's counts and pinned-byte accounting, and the device's pinned
//     bytes (distinct pages, as its PinTracker counts them), with the model;
//   * a random sample of tokens on the peer path: a token the model says is
//     live must READ (and WRITE where allowed) the right bytes of the
//     client's memory; one it says is dead (deregistered, released,
//     invalidated, of an ended session, of another session, a right the
//     token lacks, out of bounds, a LAM's privileged token) must get
//     REMOTE_ACCESS_ERROR, after which the peer reconnects. One token per
//     step (three more in "probes" steps); every token, and every session's
//     ListRegistrations, every kSweepEvery steps;
//   * every mlock/munlock the device made succeeded (a failing munlock
//     means mrd unmapped pinned memory before unpinning it).
// Two runs: warm pins off (pinned bytes exactly the model's), and warm pins
// on with small caps for a quarter of the steps (pinned bytes between the
// model's live ones and those plus what the warm pins hold; tokens the
// model says are dead stay dead).
//
// Seeded and reproducible: --seed=N or MRD_MODEL_SEED (default: time-based,
// printed at start); --steps=N or MRD_MODEL_STEPS (default
// MRD_MODEL_DEFAULT_STEPS). The first mismatch prints the seed, the step and
// the last operations, and fails the test.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/peer/soft_peer.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "mrd/unique_fd.h"
#include "server/common/clock.h"
#include "server/common/log.h"
#include "server/core/core.h"
#include "server/device/software/software_device.h"
#include "tests/model/reference_model.h"
#include "tests/support/kernel_pins.h"

#ifndef MRD_MODEL_DEFAULT_STEPS
#define MRD_MODEL_DEFAULT_STEPS 100000
#endif

namespace mrd::model_test {

using ::mrd::test_support::KernelPinnedBytesSettled;

// Command-line values (main() below), 0 = not given.
uint64_t g_seed_flag = 0;
bool g_seed_given = false;
uint64_t g_steps_flag = 0;

namespace {

static_assert(kLocalWrite == device::kAccessLocalWrite);
static_assert(kRemoteRead == device::kAccessRemoteRead);
static_assert(kRemoteWrite == device::kAccessRemoteWrite);
static_assert(kReadSink == device::kAccessReadSink);
static_assert(kOpSilent == device::kWorkSilentSuccess);
static_assert(kOpReadFence == device::kWorkReadFence);
static_assert(kOpDefer == device::kWorkDefer);

constexpr size_t kSlots = 3;       // sessions alive at once
constexpr size_t kMaxBuffers = 6;  // per session
constexpr size_t kMaxLams = 8;     // per session
constexpr size_t kMaxMrs = 8;      // per session
constexpr size_t kMaxRegs = 40;    // per session, before deregistering
constexpr uint64_t kSweepEvery = 1000;
constexpr uint64_t kListEvery = 50;
constexpr size_t kRecentOps = 20;
const absl::Duration kEventTimeout = absl::Seconds(20);

uint64_t EnvNumber(const char* name, uint64_t fallback, bool* given) {
  const char* value = std::getenv(name);
  uint64_t n = 0;
  if (value != nullptr && absl::SimpleAtoi(value, &n)) {
    if (given != nullptr) *given = true;
    return n;
  }
  return fallback;
}

std::string HexText(uint64_t v) { return absl::StrCat("0x", absl::Hex(v)); }

// Counts a session's completion-stream notifications.
class Notifier {
 public:
  void Notify() {
    absl::MutexLock lock(&mu_);
    ++count_;
  }
  uint64_t count() const {
    absl::MutexLock lock(&mu_);
    return count_;
  }
  bool WaitBeyond(uint64_t seen, absl::Duration timeout) const {
    absl::MutexLock lock(&mu_);
    auto beyond = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return count_ > seen;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&beyond), timeout);
  }

 private:
  mutable absl::Mutex mu_;
  uint64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

// mlock/munlock as the device makes them, watched: every one must succeed.
// A failing munlock (ENOMEM) means mrd unmapped pinned memory before it
// unpinned it, i.e. the device was left registering memory mrd no longer
// held (and reading through a closed descriptor).
class WatchedPinOps final : public device::PinOps {
 public:
  int Lock(uint64_t address, uint64_t length) override {
    const int err = device::SystemPinOps()->Lock(address, length);
    if (err != 0) Record("mlock", address, length, err);
    return err;
  }
  int Unlock(uint64_t address, uint64_t length) override {
    const int err = device::SystemPinOps()->Unlock(address, length);
    if (err != 0) Record("munlock", address, length, err);
    return err;
  }
  // The first failure since the last call, or "".
  std::string TakeFailure() {
    absl::MutexLock lock(&mu_);
    return std::exchange(failure_, "");
  }

 private:
  void Record(const char* call, uint64_t address, uint64_t length, int err) {
    absl::MutexLock lock(&mu_);
    if (!failure_.empty()) return;
    failure_ = absl::StrCat(call, " of [", HexText(address), ", +", length,
                            ") failed: ", std::strerror(err),
                            err == ENOMEM && std::string(call) == "munlock"
                                ? " (the pinned range was unmapped before it "
                                  "was unpinned)"
                                : "");
  }
  absl::Mutex mu_;
  std::string failure_ ABSL_GUARDED_BY(mu_);
};

// Client memory: a memfd (fd sessions) or a file of the shared-memory
// directory (lease sessions), mapped shared so that the test sees what the
// peer path writes.
struct File {
  UniqueFd fd;
  char* data = nullptr;
  uint64_t size = 0;
  bool shm = false;
  std::string name;  // shm: relative path in the directory
  int dir_fd = -1;
  uint64_t device = 0;
  uint64_t inode = 0;
  ~File() {
    if (data != nullptr) ::munmap(data, size);
    if (shm && dir_fd >= 0) ::unlinkat(dir_fd, name.c_str(), 0);
  }
};

struct Slot {
  uint64_t session = 0;  // model id
  std::string token;
  bool lease = false;
  core::CompletionSubscription stream;
  std::shared_ptr<Notifier> notifier;
  std::string ticket;
  std::unique_ptr<peer::SoftPeer> peer;
  uint64_t connection = 0;
  std::set<uint64_t> my_connections;
  std::set<uint64_t> disconnected;
  std::set<uint64_t> pending_disconnects;  // died, not yet reported
  std::deque<uint64_t> dead_connections;
  std::vector<std::string> request_ids;
};

struct Counters {
  uint64_t probes_ok = 0;
  uint64_t probes_refused = 0;
  uint64_t reconnects = 0;
  uint64_t sweeps = 0;
  uint64_t sessions_ended = 0;
  uint64_t completions = 0;
  uint64_t cache_hits = 0;
  uint64_t errors_expected = 0;
  uint64_t warm_steps = 0;  // steps that ended with warm pins held
  std::map<std::string, uint64_t> ops;
};

// Warm pins (CoreOptions): 0 = off, and then the pinned bytes must equal
// the model's exactly; otherwise they may exceed the live pinned bytes by
// what the warm pins hold, never by more than the caps.
struct WarmCaps {
  uint64_t per_session = 0;
  uint64_t total = 0;
};

class Harness {
 public:
  Harness(uint64_t seed, WarmCaps warm)
      : warm_(warm),
        seed_(seed),
        rng_(seed),
        page_(static_cast<uint64_t>(::sysconf(_SC_PAGESIZE))),
        model_(page_) {}
  ~Harness() {
    for (Slot& slot : slots_) {
      if (slot.stream.session != nullptr && core_ != nullptr) {
        core_->UnsubscribeCompletions(slot.stream);
      }
      slot.peer.reset();
    }
    core_.reset();
    device_.reset();
    files_.clear();
    if (shm_dir_fd_ >= 0) ::close(shm_dir_fd_);
    if (!shm_dir_.empty()) ::rmdir(shm_dir_.c_str());
  }

  bool SetUp();
  bool Run(uint64_t steps);
  // Ends everything and checks that nothing stays pinned or registered.
  bool TearDown();
  // The first mismatch, with how to reproduce it: `test` is the gtest name,
  // `steps_divisor` what the test divides MRD_MODEL_STEPS by.
  std::string Report(absl::string_view test, uint64_t steps_divisor) const;
  const Counters& counters() const { return counters_; }

 private:
  // --- plumbing -----------------------------------------------------------
  uint64_t Rand(uint64_t n) { return n == 0 ? 0 : rng_() % n; }
  bool Chance(uint64_t percent) { return Rand(100) < percent; }
  template <typename Map>
  uint64_t PickKey(const Map& map) {
    auto it = map.begin();
    std::advance(it, static_cast<long>(Rand(map.size())));
    return it->first;
  }
  Slot& PickSlot() { return slots_[Rand(slots_.size())]; }
  Session& ModelOf(const Slot& slot) { return *model_.Find(slot.session); }
  Slot* SlotOf(uint64_t session) {
    for (Slot& slot : slots_) {
      if (slot.session == session) return &slot;
    }
    return nullptr;
  }
  void Note(std::string what) {
    recent_.push_back(absl::StrCat("step ", step_, ": ", what));
    while (recent_.size() > kRecentOps) recent_.pop_front();
  }
  // Records the first mismatch; returns false if there is one.
  bool Check(const std::string& mismatch) {
    if (mismatch.empty()) return true;
    if (failure_.empty()) failure_ = mismatch;
    return false;
  }
  bool failed() const { return !failure_.empty(); }
  void Count(const std::string& op) { ++counters_.ops[op]; }
  static std::string Outcome(const absl::Status& s) {
    return s.ok() ? "OK" : GetErrorDetail(s).reason();
  }

  // --- sessions and peers --------------------------------------------------
  bool OpenSlot(Slot& slot, bool lease);
  void EndSlot(Slot& slot, absl::string_view how);
  bool EnsurePeer(Slot& slot);
  void PeerDied(Slot& slot);
  void Drain(Slot& slot);
  bool WaitForDisconnect(Slot& slot, uint64_t connection);
  File* NewFile(bool shm);

  // --- operations ---------------------------------------------------------
  void OpImport(Slot& slot);
  void OpRegisterNew(Slot& slot);
  void OpRegisterSame(Slot& slot);
  void OpRegisterRetry(Slot& slot);
  void OpRegisterWithMr(Slot& slot);
  void OpRegisterBad(Slot& slot);
  void DoRegister(Slot& slot, const RegisterParams& p, const char* kind);
  void OpDeregister(Slot& slot);
  void OpDeregisterByMr(Slot& slot);
  void OpCreateMr(Slot& slot, bool fast);
  void OpCloseMr(Slot& slot);
  void OpReleaseBuffer(Slot& slot);
  void OpKill(Slot& slot);
  void OpBuildLam(Slot& slot);
  void OpReleaseLam(Slot& slot);
  void OpFastRegister(Slot& slot);
  void OpInvalidate(Slot& slot);
  void OpFlush(Slot& slot);
  void OpEndedSessionCall();
  void RandomRange(const Buffer& b, uint64_t* offset, uint64_t* length);
  uint64_t PickConnection(Slot& slot, bool* defect);

  // --- checks ---------------------------------------------------------------
  void AfterStep();
  void CheckTotals();
  void CheckList(Slot& slot);
  // A READ (op 0), WRITE (op 1) or either (op -1) with `token` through the
  // peer of `via`; `sweep`: always inside the token's region.
  void Probe(Slot& via, const Token& token, bool sweep, int op);
  void RandomProbe();
  void Sweep();

  const WarmCaps warm_;
  const uint64_t seed_;
  std::mt19937_64 rng_;
  const uint64_t page_;
  uint64_t step_ = 0;
  uint64_t kernel_pinned_before_ = 0;
  std::string shm_dir_;
  int shm_dir_fd_ = -1;
  FakeClock clock_;
  WatchedPinOps pin_ops_;  // outlives the device
  std::unique_ptr<device::SoftwareDevice> device_;
  std::unique_ptr<core::Core> core_;
  ReferenceModel model_;
  std::vector<Slot> slots_;
  std::vector<std::unique_ptr<File>> files_;
  std::deque<std::string> ended_tokens_;
  std::map<std::string, RegisterParams> request_params_;
  uint64_t next_request_id_ = 1;
  uint64_t next_context_ = 1;
  std::deque<std::string> recent_;
  std::string failure_;
  Counters counters_;
};

// --- set-up and tear-down
// ------------------------------------------------------

bool Harness::SetUp() {
  SetMinLogLevel(LogLevel::kWarning);  // session open/close lines are noise
  kernel_pinned_before_ = KernelPinnedBytesSettled(0);
  char dir[] = "/dev/shm/mrd-model-XXXXXX";
  if (::mkdtemp(dir) != nullptr) {
    shm_dir_ = dir;
    shm_dir_fd_ = ::open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
  }
  if (shm_dir_fd_ < 0) {
    std::cout << "[ model ] no shared-memory directory ("
              << std::strerror(errno) << "): lease sessions are left out"
              << std::endl;
  }
  device::SoftwareDeviceOptions device_options;
  device_options.pin_ops = &pin_ops_;
  absl::StatusOr<std::unique_ptr<device::SoftwareDevice>> device =
      device::SoftwareDevice::Create(device_options);
  if (!device.ok()) {
    return Check("SoftwareDevice::Create: " + DescribeStatus(device.status()));
  }
  device_ = std::move(*device);
  if (absl::Status s = device_->Start(); !s.ok()) {
    return Check("SoftwareDevice::Start: " + DescribeStatus(s));
  }
  core::CoreOptions options;
  options.shm_dir = shm_dir_fd_ >= 0 ? shm_dir_ : "";
  options.allowed_uids = {static_cast<uint32_t>(::getuid())};
  // Leases here are anonymous and stand for an owner-only gRPC socket: they
  // may import what this uid may open (the files are its own, mode 0600).
  options.anonymous_reach = core::CoreOptions::Reach::kUser;
  options.anonymous_id = static_cast<uint32_t>(::geteuid());
  options.warm_pin_bytes_per_session = warm_.per_session;
  options.warm_pin_bytes_total = warm_.total;
  // No Core::Start(): leases end when this test moves the clock and reaps.
  core_ = std::make_unique<core::Core>(device_.get(), &clock_, options);
  model_.SetNow(clock_.Now());
  slots_.resize(kSlots);
  for (size_t i = 0; i < kSlots; ++i) {
    if (!OpenSlot(slots_[i], /*lease=*/i == kSlots - 1)) return false;
  }
  return !failed();
}

bool Harness::TearDown() {
  for (Slot& slot : slots_) {
    if (slot.stream.session != nullptr)
      core_->UnsubscribeCompletions(slot.stream);
    slot.stream = {};
    slot.peer.reset();
  }
  core_->Shutdown();
  device_->WaitForWorkerIdle();
  const core::CoreStats stats = core_->Stats();
  if (stats.sessions != 0 || stats.cache.entries != 0 ||
      stats.accounted_pinned_bytes != 0 || device_->PinnedBytes() != 0) {
    return Check(absl::StrCat(
        "after Shutdown: ", stats.sessions, " sessions, ", stats.cache.entries,
        " cache entries, ", stats.accounted_pinned_bytes, " accounted bytes, ",
        device_->PinnedBytes(), " pinned bytes left"));
  }
  core_.reset();
  device_.reset();
  if (!Check(pin_ops_.TakeFailure())) return false;
  if (const uint64_t kernel_pinned =
          KernelPinnedBytesSettled(kernel_pinned_before_);
      kernel_pinned != kernel_pinned_before_) {
    return Check(absl::StrCat("the kernel still counts ", kernel_pinned,
                              " locked bytes (", kernel_pinned_before_,
                              " before the test)"));
  }
  return true;
}

std::string Harness::Report(absl::string_view test,
                            uint64_t steps_divisor) const {
  const uint64_t steps = step_ * steps_divisor;
  std::string out = absl::StrCat(
      "MODEL MISMATCH (seed ", seed_, ", step ", step_, "): ", failure_,
      "\nreproduce with: MRD_MODEL_SEED=", seed_, " MRD_MODEL_STEPS=", steps,
      " model_test --gtest_filter=ModelTest.", test,
      "\n  (or: model_test --seed=", seed_, " --steps=", steps,
      " --gtest_filter=ModelTest.", test, ")\nlast operations:\n");
  for (const std::string& line : recent_)
    absl::StrAppend(&out, "  ", line, "\n");
  return out;
}

// --- sessions and peers
// --------------------------------------------------------

File* Harness::NewFile(bool shm) {
  auto file = std::make_unique<File>();
  const uint64_t pages = 1 + Rand(6);
  uint64_t size = pages * page_;
  if (Chance(25)) size -= 1 + Rand(page_ - 1);  // a partial last page
  if (shm) {
    file->shm = true;
    file->dir_fd = shm_dir_fd_;
    file->name = absl::StrCat("f", files_.size());
    file->fd.Reset(::openat(shm_dir_fd_, file->name.c_str(),
                            O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  } else {
    file->fd.Reset(
        ::memfd_create("mrd-model", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  }
  if (!file->fd.valid() ||
      ::ftruncate(file->fd.get(), static_cast<off_t>(size)) != 0 ||
      (!shm && ::fcntl(file->fd.get(), F_ADD_SEALS, F_SEAL_SHRINK) != 0)) {
    Check(absl::StrCat("creating a test file: ", std::strerror(errno)));
    return nullptr;
  }
  void* map = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED,
                     file->fd.get(), 0);
  if (map == MAP_FAILED) {
    Check(absl::StrCat("mapping a test file: ", std::strerror(errno)));
    return nullptr;
  }
  file->data = static_cast<char*>(map);
  file->size = size;
  for (uint64_t i = 0; i < size; i += 8) {
    const uint64_t word = rng_();
    std::memcpy(file->data + i, &word, std::min<uint64_t>(8, size - i));
  }
  struct stat st {};
  ::fstat(file->fd.get(), &st);
  file->device = static_cast<uint64_t>(st.st_dev);
  file->inode = static_cast<uint64_t>(st.st_ino);
  files_.push_back(std::move(file));
  return files_.back().get();
}

bool Harness::OpenSlot(Slot& slot, bool lease) {
  slot = Slot();
  slot.lease = lease && shm_dir_fd_ >= 0;
  if (slot.lease) {
    const uint32_t ttl = static_cast<uint32_t>(10 + Rand(50));
    v1::OpenLeaseSessionRequest req;
    req.set_ttl_seconds(ttl);
    v1::SessionInfo info;
    absl::Status s = core_->OpenLeaseSession(req, &info);
    if (!s.ok()) return Check("OpenLeaseSession: " + DescribeStatus(s));
    slot.token = info.session();
    slot.session = model_.OpenSession(slot.token, true, absl::Seconds(ttl));
    Note(absl::StrCat("opened lease session ", slot.session, " (ttl ", ttl,
                      " s)"));
  } else {
    fd_socket::PeerCredentials creds;
    creds.uid = ::getuid();
    creds.gid = ::getgid();
    creds.pid = ::getpid();
    absl::StatusOr<std::string> token = core_->OnConnect(creds);
    if (!token.ok())
      return Check("OnConnect: " + DescribeStatus(token.status()));
    slot.token = *token;
    slot.session = model_.OpenSession(slot.token, false, absl::ZeroDuration());
    Note(absl::StrCat("opened fd session ", slot.session));
  }
  slot.notifier = std::make_shared<Notifier>();
  std::shared_ptr<Notifier> notifier = slot.notifier;
  absl::StatusOr<core::CompletionSubscription> stream =
      core_->SubscribeCompletions(slot.token,
                                  [notifier] { notifier->Notify(); });
  if (!stream.ok()) {
    return Check("SubscribeCompletions: " + DescribeStatus(stream.status()));
  }
  slot.stream = *stream;
  model_.Touch(slot.session);
  v1::CreatePeerTicketRequest ticket_req;
  ticket_req.set_session(slot.token);
  v1::PeerTicket ticket;
  if (absl::Status s = core_->CreatePeerTicket(ticket_req, &ticket); !s.ok()) {
    return Check("CreatePeerTicket: " + DescribeStatus(s));
  }
  model_.Touch(slot.session);
  slot.ticket = ticket.ticket();
  const uint64_t buffers = 1 + Rand(3);
  for (uint64_t i = 0; i < buffers && !failed(); ++i) OpImport(slot);
  return !failed();
}

void Harness::EndSlot(Slot& slot, absl::string_view how) {
  Note(absl::StrCat("session ", slot.session, " ended: ", how));
  model_.EndSession(slot.session);
  ended_tokens_.push_back(slot.token);
  while (ended_tokens_.size() > 8) ended_tokens_.pop_front();
  if (slot.stream.session != nullptr)
    core_->UnsubscribeCompletions(slot.stream);
  slot.stream = {};
  slot.peer.reset();
  ++counters_.sessions_ended;
  // It is gone for the server too.
  v1::GetSessionRequest req;
  req.set_session(slot.token);
  v1::SessionInfo info;
  Check(model_.CallOnEndedSession("GetSession", core_->GetSession(req, &info)));
}

bool Harness::EnsurePeer(Slot& slot) {
  if (slot.peer != nullptr) return true;
  absl::StatusOr<std::unique_ptr<peer::SoftPeer>> peer =
      peer::SoftPeer::Connect(device_->Attributes().peer_address, slot.ticket);
  if (!peer.ok()) {
    return Check(
        absl::StrCat("the peer of session ", slot.session,
                     " cannot connect: ", DescribeStatus(peer.status())));
  }
  slot.peer = std::move(*peer);
  slot.connection = slot.peer->connection_id();
  slot.my_connections.insert(slot.connection);
  model_.ConnectionUp(slot.session, slot.connection);
  ++counters_.reconnects;
  return true;
}

void Harness::PeerDied(Slot& slot) {
  const uint64_t connection = slot.connection;
  std::unique_ptr<peer::SoftPeer> old = std::move(slot.peer);
  slot.connection = 0;
  if (Chance(10)) {
    // A connection in the error state moves no more data, even for a
    // token that is valid on it.
    for (const Token& token : model_.LiveTokens()) {
      if (token.session != slot.session) continue;
      absl::StatusOr<std::string> read = old->Read(token.rkey, token.base, 1);
      if (read.ok()) {
        Check(absl::StrCat("connection ", connection, " of session ",
                           slot.session,
                           " served a READ after its remote "
                           "access error"));
        return;
      }
      break;
    }
  }
  old.reset();
  slot.dead_connections.push_back(connection);
  while (slot.dead_connections.size() > 4) slot.dead_connections.pop_front();
  const bool flushes = !ModelOf(slot).held.empty();
  model_.ConnectionDied(slot.session);
  if (flushes) {
    // Its held work completes (flushed) before PEER_DISCONNECTED, and must
    // before anything is posted on the next connection.
    WaitForDisconnect(slot, connection);
  } else {
    slot.pending_disconnects.insert(connection);  // checked at sweeps
  }
}

void Harness::Drain(Slot& slot) {
  if (slot.stream.session == nullptr) return;
  while (std::optional<v1::Completion> c = slot.stream->PopCompletion()) {
    switch (c->kind()) {
      case v1::Completion::PEER_CONNECTED:
      case v1::Completion::PEER_DISCONNECTED:
        if (!slot.my_connections.contains(c->connection())) {
          Check(absl::StrCat("session ", slot.session, " got ",
                             c->ShortDebugString(),
                             " for a connection that is not its own"));
          return;
        }
        if (c->kind() == v1::Completion::PEER_DISCONNECTED) {
          slot.disconnected.insert(c->connection());
          slot.pending_disconnects.erase(c->connection());
        }
        break;
      default:
        ++counters_.completions;
        if (!Check(model_.OnCompletion(slot.session, *c))) return;
    }
  }
}

bool Harness::WaitForDisconnect(Slot& slot, uint64_t connection) {
  const absl::Time deadline = absl::Now() + kEventTimeout;
  while (!failed()) {
    const uint64_t seen = slot.notifier->count();
    Drain(slot);
    if (slot.disconnected.contains(connection)) return true;
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration() ||
        !slot.notifier->WaitBeyond(seen, left)) {
      return Check(absl::StrCat("session ", slot.session,
                                ": PEER_DISCONNECTED of connection ",
                                connection, " never came"));
    }
  }
  return false;
}

uint64_t Harness::PickConnection(Slot& slot, bool* defect) {
  *defect = false;
  if (Chance(92)) return EnsurePeer(slot) ? slot.connection : 0;
  *defect = true;
  switch (Rand(3)) {
    case 0:
      for (Slot& other : slots_) {
        if (&other != &slot && EnsurePeer(other)) return other.connection;
      }
      return 0;
    case 1:
      if (!slot.dead_connections.empty()) {
        return slot.dead_connections[Rand(slot.dead_connections.size())];
      }
      return 0;
    default:
      return 0;
  }
}

// --- operations
// ------------------------------------------------------------------

void Harness::OpImport(Slot& slot) {
  Session& s = ModelOf(slot);
  if (s.buffers.size() >= kMaxBuffers) return OpReleaseBuffer(slot);
  Count("import");
  int index = -1;
  if (Chance(35)) {
    // A file that a session of the same kind imported: perhaps this one,
    // which then holds the same file twice.
    std::vector<int> candidates;
    for (const Slot& other : slots_) {
      const Session* os = model_.Find(other.session);
      if (os == nullptr || other.lease != slot.lease) continue;
      for (const auto& [id, b] : os->buffers) candidates.push_back(b.file);
    }
    if (!candidates.empty()) index = candidates[Rand(candidates.size())];
  }
  if (index < 0) {
    if (NewFile(slot.lease) == nullptr) return;
    index = static_cast<int>(files_.size()) - 1;
  }
  const File& file = *files_[index];
  const bool writable = Chance(85);
  absl::StatusOr<v1::BufferInfo> info;
  if (slot.lease) {
    v1::ImportFileRequest req;
    req.set_session(slot.token);
    req.set_path(file.name);
    req.set_writable(writable);
    v1::BufferInfo out;
    absl::Status s2 = core_->ImportFile(req, &out);
    info = s2.ok() ? absl::StatusOr<v1::BufferInfo>(out) : s2;
  } else {
    v1::ImportMemfd req;
    req.set_writable(writable);
    if (Chance(50)) req.set_expected_size(file.size);
    info = core_->OnImport(
        slot.token, UniqueFd(::fcntl(file.fd.get(), F_DUPFD_CLOEXEC, 0)), req);
  }
  Note(absl::StrCat("session ", slot.session, " imports file ", index, " (",
                    file.size, " bytes, ", writable ? "rw" : "ro", ") -> ",
                    info.ok() ? absl::StrCat("buffer ", info->buffer())
                              : Outcome(info.status())));
  Check(model_.ImportBuffer(slot.session, index, file.size, writable,
                            file.device, file.inode,
                            slot.lease ? "file:" + file.name : "memfd", info));
}

void Harness::RandomRange(const Buffer& b, uint64_t* offset, uint64_t* length) {
  const uint64_t size = b.size;
  const uint64_t offsets[] = {0,         page_ / 2,       page_,
                              2 * page_, 3 * page_ + 100, Rand(size)};
  uint64_t off = offsets[Rand(6)];
  if (off >= size) off = 0;
  const uint64_t room = size - off;
  const uint64_t lengths[] = {page_, 2 * page_, 1, 100, room, 1 + Rand(room)};
  uint64_t len = lengths[Rand(6)];
  if (len > room) len = room;
  *offset = off;
  *length = len;
}

namespace {
struct FlagChoice {
  uint32_t flags;
  uint32_t mem;
};
constexpr FlagChoice kFlagChoices[] = {{0x0, 0}, {0x1, 0}, {0x2, 0}, {0x5, 0},
                                       {0x7, 0}, {0x3, 0}, {0xA, 0}, {0xF, 0},
                                       {0, 0x1}, {0, 0x2}, {0, 0x3}};
}  // namespace

void Harness::OpRegisterNew(Slot& slot) {
  Session& s = ModelOf(slot);
  if (s.regs.size() >= kMaxRegs) return OpDeregister(slot);
  if (s.buffers.empty()) return OpImport(slot);
  Count("register");
  const Buffer& b = s.buffers.at(PickKey(s.buffers));
  RegisterParams p;
  p.buffer = b.id;
  RandomRange(b, &p.offset, &p.length);
  const FlagChoice& f = kFlagChoices[Rand(std::size(kFlagChoices))];
  p.flags = f.flags;
  p.mem_flags = f.mem;
  const uint64_t r = Rand(100);
  if (r >= 65) {
    p.has_base = true;
    if (r < 80) {
      p.base = b.address + p.offset;  // the default, spelled out
    } else {
      const uint64_t bases[] = {0x10000,
                                (uint64_t{0x7f34} << 32) + 3 * page_ + 17,
                                uint64_t{1} << 40};
      p.base = bases[Rand(3)];
    }
  }
  if (Chance(10)) p.descriptor_capacity = Chance(50) ? 24 : 100;
  if (model_.RequestIdsLeft(slot.session) && Chance(15)) {
    p.request_id = absl::StrCat("rq-", next_request_id_++);
  }
  DoRegister(slot, p, "new");
}

void Harness::OpRegisterSame(Slot& slot) {
  Session& s = ModelOf(slot);
  if (s.regs.empty()) return OpRegisterNew(slot);
  Count("register_same");
  const Registration& r = s.regs.at(PickKey(s.regs));
  const Buffer& b = s.buffers.at(r.buffer);
  RegisterParams p;
  p.buffer = r.buffer;
  p.offset = r.offset;
  p.length = r.length;
  // The same access, spelled either way (W5: the same registration).
  p.flags = ((r.access & kLocalWrite) ? 0x1 : 0) |
            ((r.access & kRemoteRead) ? 0x2 : 0) |
            ((r.access & kRemoteWrite) ? 0x4 : 0) |
            ((r.access & kReadSink) ? 0x8 : 0);
  if (Chance(50)) {
    const uint32_t rw = kRemoteWrite | kLocalWrite;
    uint32_t mem = 0;
    if (r.access == kRemoteRead) mem = 0x1;
    if (r.access == rw) mem = 0x2;
    if (r.access == (rw | kRemoteRead)) mem = 0x3;
    if (mem != 0) {
      p.flags = 0;
      p.mem_flags = mem;
    }
  }
  if (r.base != b.address + r.offset || Chance(50)) {
    p.has_base = true;
    p.base = r.base;
  }
  DoRegister(slot, p, "same");
}

void Harness::OpRegisterRetry(Slot& slot) {
  if (slot.request_ids.empty()) return OpRegisterNew(slot);
  Count("register_retry");
  const std::string& id = slot.request_ids[Rand(slot.request_ids.size())];
  DoRegister(slot, request_params_.at(id), "retry");
}

void Harness::OpRegisterWithMr(Slot& slot) {
  Session& s = ModelOf(slot);
  if (s.buffers.empty()) return OpImport(slot);
  std::vector<uint64_t> free_normal;
  std::vector<uint64_t> others;
  for (const auto& [id, m] : s.mrs) {
    (!m.fast && m.registration == 0 ? free_normal : others).push_back(id);
  }
  uint64_t mr = 0;
  if (!free_normal.empty() && Chance(85)) {
    mr = free_normal[Rand(free_normal.size())];
  } else if (!others.empty() && Chance(50)) {
    mr = others[Rand(others.size())];
  } else {
    return OpCreateMr(slot, false);
  }
  Count("register_mr");
  const Buffer& b = s.buffers.at(PickKey(s.buffers));
  RegisterParams p;
  p.buffer = b.id;
  RandomRange(b, &p.offset, &p.length);
  const FlagChoice& f = kFlagChoices[Rand(std::size(kFlagChoices))];
  p.flags = f.flags;
  p.mem_flags = f.mem;
  p.mr = mr;
  DoRegister(slot, p, "mr");
}

void Harness::OpRegisterBad(Slot& slot) {
  Session& s = ModelOf(slot);
  if (s.buffers.empty()) return OpImport(slot);
  Count("register_bad");
  const Buffer& b = s.buffers.at(PickKey(s.buffers));
  RegisterParams p;
  p.buffer = b.id;
  RandomRange(b, &p.offset, &p.length);
  p.flags = 0x2;
  switch (Rand(12)) {
    case 0:
      p.flags = 0x10;
      break;
    case 1:
      p.flags = 0x4;
      break;
    case 2:
      p.mem_flags = 0x1;
      break;
    case 3:
      p.flags = 0;
      p.mem_flags = 0x4;
      break;
    case 4:
      p.length = 0;
      break;
    case 5:
      p.offset = b.size;
      p.length = 1;
      break;
    case 6:
      p.length = b.size - p.offset + 1;
      break;
    case 7:
      p.offset = 1;
      p.length = ~uint64_t{0};
      break;
    case 8:
      p.has_base = true;
      p.base = 0;
      break;
    case 9:
      p.has_base = true;
      p.base = ~uint64_t{0} - 10;
      break;
    case 10:
      p.descriptor_capacity = 8;
      break;
    default:
      p.buffer = uint64_t{1} << 50;
  }
  DoRegister(slot, p, "bad");
}

void Harness::DoRegister(Slot& slot, const RegisterParams& p,
                         const char* kind) {
  v1::RegisterMrRequest req;
  req.set_session(slot.token);
  req.set_buffer(p.buffer);
  req.set_offset(p.offset);
  req.set_length(p.length);
  req.set_flags(p.flags);
  req.set_mem_flags(p.mem_flags);
  if (p.has_base) req.set_base_address(p.base);
  req.set_mr(p.mr);
  req.set_request_id(p.request_id);
  req.set_descriptor_capacity(p.descriptor_capacity);
  v1::RegisterMrResponse out;
  const absl::Status status = core_->RegisterMr(req, &out);
  Note(absl::StrCat(
      "session ", slot.session, " RegisterMr[", kind, "] buffer ", p.buffer,
      " [", p.offset, ", +", p.length, ") flags ", HexText(p.flags), "/",
      HexText(p.mem_flags), " base ", p.has_base ? HexText(p.base) : "default",
      p.mr != 0 ? absl::StrCat(" mr ", p.mr) : "",
      p.request_id.empty() ? "" : " id " + p.request_id, " -> ",
      status.ok()
          ? absl::StrCat("reg ", out.registration(), " rkey ",
                         HexText(out.rkey()), " refs ", out.references(),
                         out.cache_hit() ? " (hit)" : "")
          : Outcome(status)));
  if (status.ok() && out.cache_hit()) ++counters_.cache_hits;
  if (!status.ok()) ++counters_.errors_expected;
  const absl::StatusOr<v1::RegisterMrResponse> got =
      status.ok() ? absl::StatusOr<v1::RegisterMrResponse>(out) : status;
  if (Check(model_.Register(slot.session, p, got)) && status.ok() &&
      !p.request_id.empty() && !request_params_.contains(p.request_id)) {
    request_params_[p.request_id] = p;
    slot.request_ids.push_back(p.request_id);
  }
}

void Harness::OpDeregister(Slot& slot) {
  Session& s = ModelOf(slot);
  uint64_t target = 0;
  if (s.regs.empty() || Chance(4)) {
    // A registration this session does not have: another session's, or
    // one that never existed.
    for (const Slot& other : slots_) {
      const Session* os = model_.Find(other.session);
      if (&other != &slot && os != nullptr && !os->regs.empty()) {
        target = os->regs.begin()->first;
      }
    }
    if (target == 0) target = uint64_t{1} << 40;
  } else {
    target = PickKey(s.regs);
  }
  Count("deregister");
  v1::DeregisterMrRequest req;
  req.set_session(slot.token);
  req.set_registration(target);
  v1::DeregisterMrResponse out;
  const absl::Status status = core_->DeregisterMr(req, &out);
  Note(absl::StrCat(
      "session ", slot.session, " DeregisterMr reg ", target, " -> ",
      status.ok() ? absl::StrCat(out.references(), " left") : Outcome(status)));
  Check(model_.Deregister(
      slot.session, false, target,
      status.ok() ? absl::StatusOr<uint32_t>(out.references()) : status));
}

void Harness::OpDeregisterByMr(Slot& slot) {
  Session& s = ModelOf(slot);
  std::vector<uint64_t> normal;
  std::vector<uint64_t> fast;
  for (const auto& [id, m] : s.mrs) (m.fast ? fast : normal).push_back(id);
  if (normal.empty() && fast.empty()) return OpCreateMr(slot, false);
  Count("deregister_mr");
  const uint64_t mr = !normal.empty() && (fast.empty() || Chance(90))
                          ? normal[Rand(normal.size())]
                          : fast[Rand(fast.size())];
  v1::DeregisterMrRequest req;
  req.set_session(slot.token);
  req.set_mr(mr);
  v1::DeregisterMrResponse out;
  const absl::Status status = core_->DeregisterMr(req, &out);
  Note(absl::StrCat(
      "session ", slot.session, " DeregisterMr mr ", mr, " -> ",
      status.ok() ? absl::StrCat(out.references(), " left") : Outcome(status)));
  Check(model_.Deregister(
      slot.session, true, mr,
      status.ok() ? absl::StatusOr<uint32_t>(out.references()) : status));
}

void Harness::OpCreateMr(Slot& slot, bool fast) {
  Session& s = ModelOf(slot);
  if (s.mrs.size() >= kMaxMrs) return OpCloseMr(slot);
  Count(fast ? "create_fast_mr" : "create_mr");
  const bool remote = Chance(75);
  v1::CreateMrRequest req;
  req.set_session(slot.token);
  req.set_fast_register(fast);
  req.set_allow_remote_access(remote);
  v1::MrInfo out;
  const absl::Status status = core_->CreateMr(req, &out);
  Note(absl::StrCat(
      "session ", slot.session, " CreateMr fast ", fast, " remote ", remote,
      " -> ",
      status.ok() ? absl::StrCat("mr ", out.mr(), " lkey ", HexText(out.lkey()))
                  : Outcome(status)));
  Check(
      model_.CreateMr(slot.session, fast, remote,
                      status.ok() ? absl::StatusOr<v1::MrInfo>(out) : status));
}

void Harness::OpCloseMr(Slot& slot) {
  Session& s = ModelOf(slot);
  if (s.mrs.empty()) return OpCreateMr(slot, Chance(50));
  Count("close_mr");
  const uint64_t mr = PickKey(s.mrs);
  v1::CloseMrRequest req;
  req.set_session(slot.token);
  req.set_mr(mr);
  const absl::Status status = core_->CloseMr(req);
  Note(absl::StrCat("session ", slot.session, " CloseMr ", mr, " -> ",
                    Outcome(status)));
  Check(model_.CloseMr(slot.session, mr, status));
}

void Harness::OpReleaseBuffer(Slot& slot) {
  Session& s = ModelOf(slot);
  if (s.buffers.empty()) return OpImport(slot);
  Count("release_buffer");
  const uint64_t buffer = Chance(5) ? uint64_t{1} << 50 : PickKey(s.buffers);
  v1::ReleaseBufferRequest req;
  req.set_session(slot.token);
  req.set_buffer(buffer);
  v1::ReleaseBufferResponse out;
  const absl::Status status = core_->ReleaseBuffer(req, &out);
  Note(absl::StrCat("session ", slot.session, " ReleaseBuffer ", buffer, " -> ",
                    status.ok() ? out.ShortDebugString() : Outcome(status)));
  Check(model_.ReleaseBuffer(
      slot.session, buffer,
      status.ok() ? absl::StatusOr<v1::ReleaseBufferResponse>(out) : status));
}

void Harness::OpKill(Slot& slot) {
  Count("end_session");
  const uint64_t how = Rand(2);
  if (slot.lease && how == 0) {
    // The lease runs out: the clock moves to its expiry, and every lease
    // that has run out by then ends with it.
    const absl::Duration wait = ModelOf(slot).expires - model_.now();
    clock_.Advance(wait);
    model_.SetNow(clock_.Now());
    core_->ReapExpiredLeases();
    const std::vector<uint64_t> expired = model_.ExpiredLeases();
    Note(absl::StrCat("clock +", absl::FormatDuration(wait), ": ",
                      expired.size(), " lease(s) run out"));
    for (uint64_t id : expired) {
      Slot* victim = SlotOf(id);
      EndSlot(*victim, "its lease ran out");
      if (failed() || !OpenSlot(*victim, Chance(35))) return;
    }
    return;
  }
  if (!slot.lease && how == 0) {
    core_->OnDisconnect(slot.token);  // the client's fd socket closed
    EndSlot(slot, "its fd socket closed");
  } else {
    v1::CloseSessionRequest req;
    req.set_session(slot.token);
    const absl::Status status = core_->CloseSession(req);
    model_.Touch(slot.session);
    if (!status.ok()) {
      Check("CloseSession: " + DescribeStatus(status));
      return;
    }
    EndSlot(slot, "CloseSession");
  }
  if (!failed()) OpenSlot(slot, Chance(35));
}

void Harness::OpBuildLam(Slot& slot) {
  Session& s = ModelOf(slot);
  if (s.lams.size() >= kMaxLams) return OpReleaseLam(slot);
  if (s.buffers.empty()) return OpImport(slot);
  Count("build_lam");
  const Buffer& b = s.buffers.at(PickKey(s.buffers));
  uint64_t offset = 0;
  uint64_t length = 0;
  RandomRange(b, &offset, &length);
  if (Chance(3)) length = 0;
  const uint64_t pages =
      length == 0 ? 0 : (offset + length - 1) / page_ - offset / page_ + 1;
  uint32_t capacity = 0;
  if (const uint64_t r = Rand(10); r == 0) {
    capacity = static_cast<uint32_t>(8 + 8 * pages);
  } else if (r == 1) {
    capacity = static_cast<uint32_t>(8 * pages);  // one entry short
  }
  v1::BuildLamRequest req;
  req.set_session(slot.token);
  req.set_buffer(b.id);
  req.set_offset(offset);
  req.set_length(length);
  req.set_lam_capacity(capacity);
  v1::BuildLamResponse out;
  const absl::Status status = core_->BuildLam(req, &out);
  Note(absl::StrCat("session ", slot.session, " BuildLam buffer ", b.id, " [",
                    offset, ", +", length, ") capacity ", capacity, " -> ",
                    status.ok()
                        ? absl::StrCat("lam ", out.lam(), " ", out.pages_size(),
                                       " pages fbo ", out.fbo())
                        : Outcome(status)));
  Check(model_.BuildLam(
      slot.session, b.id, offset, length, capacity,
      status.ok() ? absl::StatusOr<v1::BuildLamResponse>(out) : status));
}

void Harness::OpReleaseLam(Slot& slot) {
  Session& s = ModelOf(slot);
  if (s.lams.empty()) return OpBuildLam(slot);
  Count("release_lam");
  const uint64_t lam = Chance(4) ? uint64_t{1} << 50 : PickKey(s.lams);
  v1::ReleaseLamRequest req;
  req.set_session(slot.token);
  req.set_lam(lam);
  const absl::Status status = core_->ReleaseLam(req);
  Note(absl::StrCat("session ", slot.session, " ReleaseLam ", lam, " -> ",
                    Outcome(status)));
  Check(model_.ReleaseLam(slot.session, lam, status));
}

void Harness::OpFastRegister(Slot& slot) {
  Session& s = ModelOf(slot);
  std::vector<uint64_t> fast;
  std::vector<uint64_t> free_fast;
  for (const auto& [id, m] : s.mrs) {
    if (!m.fast) continue;
    fast.push_back(id);
    if (!m.valid) free_fast.push_back(id);
  }
  if (fast.empty()) return OpCreateMr(slot, true);
  if (s.lams.empty()) return OpBuildLam(slot);
  Count("fast_register");
  FastRegisterParams p;
  p.mr = !free_fast.empty() && Chance(80) ? free_fast[Rand(free_fast.size())]
                                          : fast[Rand(fast.size())];
  const Lam& lam = s.lams.at(PickKey(s.lams));
  const uint64_t n = lam.pages.size();
  const uint64_t first = Rand(n);
  const uint64_t end = first + 1 + Rand(n - first);
  p.pages.assign(lam.pages.begin() + static_cast<long>(first),
                 lam.pages.begin() + static_cast<long>(end));
  if (s.lams.size() > 1 && Chance(20)) {
    // Pages of two LAMs, perhaps in any order (F2: entries need not be
    // consecutive).
    const Lam& other = s.lams.at(PickKey(s.lams));
    const uint64_t from = Rand(other.pages.size());
    p.pages.insert(p.pages.end(), other.pages.begin() + static_cast<long>(from),
                   other.pages.end());
    if (Chance(50)) std::shuffle(p.pages.begin(), p.pages.end(), rng_);
  }
  p.fbo =
      static_cast<uint32_t>(first == 0 && Chance(60) ? lam.fbo : Rand(page_));
  const uint64_t capacity = p.pages.size() * page_ - p.fbo;
  p.length = Chance(30) ? capacity : 1 + Rand(capacity);
  p.base = (1 + Rand(uint64_t{1} << 20)) * page_ + p.fbo;
  const uint32_t access[] = {kOpRemoteRead,
                             kOpRemoteWrite,
                             kOpRemoteRead | kOpRemoteWrite,
                             kOpLocalWrite,
                             0,
                             kOpRemoteRead | kOpReadSink};
  p.flags = access[Rand(std::size(access))];
  if (Chance(40)) p.flags |= kOpSilent;
  if (Chance(20)) p.flags |= kOpDefer;
  if (Chance(10)) p.flags |= kOpReadFence;
  p.request_context = next_context_++;
  bool defect = false;
  p.connection = PickConnection(slot, &defect);
  if (failed()) return;
  if (!defect && Chance(8)) {
    switch (Rand(8)) {
      case 0:
        p.pages[Rand(p.pages.size())] += 8;
        break;
      case 1:
        p.fbo = static_cast<uint32_t>(page_ + Rand(100));
        break;
      case 2:
        p.length = capacity + 1 + Rand(page_);
        break;
      case 3:
        p.base += 1;
        break;
      case 4:
        p.base = 0;
        break;
      case 5:
        p.pages[Rand(p.pages.size())] =
            (uint64_t{1} << 60) + Rand(uint64_t{1} << 20) * page_;
        break;
      case 6:
        p.pages.clear();
        break;
      default:
        p.flags |= 0x4;  // no NDK_OP_FLAG_* has this bit
    }
  }
  v1::FastRegisterRequest req;
  req.set_session(slot.token);
  req.set_connection(p.connection);
  req.set_request_context(p.request_context);
  req.set_mr(p.mr);
  for (uint64_t page : p.pages) req.add_pages(page);
  req.set_fbo(p.fbo);
  req.set_length(p.length);
  req.set_base_address(p.base);
  req.set_flags(p.flags);
  v1::FastRegisterResponse out;
  const absl::Status status = core_->FastRegister(req, &out);
  Note(absl::StrCat(
      "session ", slot.session, " FastRegister mr ", p.mr, " conn ",
      p.connection, " ", p.pages.size(), " pages fbo ", p.fbo, " length ",
      p.length, " base ", HexText(p.base), " flags ", HexText(p.flags), " ctx ",
      p.request_context, " -> ",
      status.ok() ? absl::StrCat("wr ", out.work_request()) : Outcome(status)));
  Check(model_.FastRegister(
      slot.session, p,
      status.ok() ? absl::StatusOr<v1::FastRegisterResponse>(out) : status));
  device_->WaitForWorkerIdle();
}

void Harness::OpInvalidate(Slot& slot) {
  Session& s = ModelOf(slot);
  std::vector<uint64_t> fast;
  std::vector<uint64_t> valid;
  std::vector<uint64_t> normal;
  for (const auto& [id, m] : s.mrs) {
    if (!m.fast) {
      normal.push_back(id);
      continue;
    }
    fast.push_back(id);
    if (m.valid) valid.push_back(id);
  }
  if (fast.empty()) return OpCreateMr(slot, true);
  Count("invalidate");
  uint64_t mr = !valid.empty() && Chance(75) ? valid[Rand(valid.size())]
                                             : fast[Rand(fast.size())];
  if (!normal.empty() && Chance(4)) mr = normal[Rand(normal.size())];
  uint32_t flags = 0;
  if (Chance(40)) flags |= kOpSilent;
  if (Chance(20)) flags |= kOpDefer;
  if (Chance(10)) flags |= kOpReadFence;
  if (Chance(3)) flags |= kOpRemoteRead;  // not an InvalidateMr flag
  const uint64_t context = next_context_++;
  bool defect = false;
  const uint64_t connection = PickConnection(slot, &defect);
  if (failed()) return;
  v1::InvalidateMrRequest req;
  req.set_session(slot.token);
  req.set_connection(connection);
  req.set_request_context(context);
  req.set_mr(mr);
  req.set_flags(flags);
  v1::InvalidateMrResponse out;
  const absl::Status status = core_->InvalidateMr(req, &out);
  Note(absl::StrCat(
      "session ", slot.session, " InvalidateMr mr ", mr, " conn ", connection,
      " flags ", HexText(flags), " ctx ", context, " -> ",
      status.ok() ? absl::StrCat("wr ", out.work_request()) : Outcome(status)));
  Check(model_.Invalidate(
      slot.session, connection, mr, flags, context,
      status.ok() ? absl::StatusOr<v1::InvalidateMrResponse>(out) : status));
  device_->WaitForWorkerIdle();
}

void Harness::OpFlush(Slot& slot) {
  if (ModelOf(slot).held.empty() || slot.peer == nullptr) {
    return OpFastRegister(slot);
  }
  Count("flush_deferred");
  const absl::Status status = device_->FlushDeferred(slot.connection);
  Note(absl::StrCat("session ", slot.session, " flushes deferred work on conn ",
                    slot.connection, " -> ", Outcome(status)));
  if (!status.ok()) {
    Check("FlushDeferred of a live connection: " + DescribeStatus(status));
    return;
  }
  model_.FlushDeferred(slot.session);
  device_->WaitForWorkerIdle();
}

void Harness::OpEndedSessionCall() {
  if (ended_tokens_.empty()) return;
  Count("ended_session_call");
  const std::string& token = ended_tokens_[Rand(ended_tokens_.size())];
  absl::Status status;
  std::string op;
  switch (Rand(5)) {
    case 0: {
      v1::RegisterMrRequest req;
      req.set_session(token);
      req.set_buffer(1);
      req.set_length(1);
      v1::RegisterMrResponse out;
      status = core_->RegisterMr(req, &out);
      op = "RegisterMr";
      break;
    }
    case 1: {
      v1::ReleaseBufferRequest req;
      req.set_session(token);
      req.set_buffer(1);
      v1::ReleaseBufferResponse out;
      status = core_->ReleaseBuffer(req, &out);
      op = "ReleaseBuffer";
      break;
    }
    case 2: {
      v1::BuildLamRequest req;
      req.set_session(token);
      req.set_buffer(1);
      req.set_length(1);
      v1::BuildLamResponse out;
      status = core_->BuildLam(req, &out);
      op = "BuildLam";
      break;
    }
    case 3: {
      v1::CreateMrRequest req;
      req.set_session(token);
      v1::MrInfo out;
      status = core_->CreateMr(req, &out);
      op = "CreateMr";
      break;
    }
    default: {
      v1::CreatePeerTicketRequest req;
      req.set_session(token);
      v1::PeerTicket out;
      status = core_->CreatePeerTicket(req, &out);
      op = "CreatePeerTicket";
    }
  }
  Note(absl::StrCat(op, " on an ended session -> ", Outcome(status)));
  Check(model_.CallOnEndedSession(op, status));
}

// --- checks
// ------------------------------------------------------------------------

void Harness::CheckTotals() {
  const core::CoreStats st = core_->Stats();
  const Totals t = model_.ExpectedTotals();
  // Warm pins hold pages (never keys) beyond the live ones: counted in the
  // accounting, at most their own bytes more on the device, within the cap.
  const uint64_t warm = st.warm.bytes;
  const bool pinned_ok =
      warm_.total == 0
          ? warm == 0 &&
                st.accounted_pinned_bytes == t.accounted_pinned_bytes &&
                st.device_pinned_bytes == t.pinned_bytes
          : warm <= warm_.total &&
                st.accounted_pinned_bytes == t.accounted_pinned_bytes + warm &&
                st.device_pinned_bytes >= t.pinned_bytes &&
                st.device_pinned_bytes <= t.pinned_bytes + warm;
  if (st.sessions != t.sessions || st.buffers != t.buffers ||
      st.registrations != t.registrations || st.lams != t.lams ||
      st.mrs != t.mrs || st.cache.entries != t.registrations || !pinned_ok) {
    Check(absl::StrCat("state differs from the model: sessions ", st.sessions,
                       "/", t.sessions, ", buffers ", st.buffers, "/",
                       t.buffers, ", registrations ", st.registrations, "/",
                       t.registrations, ", cache entries ", st.cache.entries,
                       "/", t.registrations, ", LAMs ", st.lams, "/", t.lams,
                       ", MRs ", st.mrs, "/", t.mrs, ", accounted pinned ",
                       st.accounted_pinned_bytes, "/", t.accounted_pinned_bytes,
                       ", device pinned ", st.device_pinned_bytes, "/",
                       t.pinned_bytes, " (real/model); warm pins hold ", warm,
                       " bytes (cap ", warm_.total, ")"));
  }
  if (warm != 0) ++counters_.warm_steps;
}

void Harness::CheckList(Slot& slot) {
  v1::ListRegistrationsRequest req;
  req.set_session(slot.token);
  v1::ListRegistrationsResponse out;
  const absl::Status status = core_->ListRegistrations(req, &out);
  model_.Touch(slot.session);
  if (!status.ok()) {
    Check("ListRegistrations: " + DescribeStatus(status));
    return;
  }
  if (!Check(model_.LearnFromList(slot.session, out))) return;
  Check(model_.CheckList(slot.session, out, warm_.per_session));
}

void Harness::Probe(Slot& via, const Token& token, bool sweep, int op) {
  if (!EnsurePeer(via)) return;
  const uint64_t region = std::max<uint64_t>(token.length, 1);
  uint64_t address = token.base;
  uint64_t length = 1;
  const uint64_t shape = sweep ? 0 : Rand(10);
  if (shape < 7) {
    const uint64_t off = Rand(region);
    address = token.base + off;
    length = 1 + Rand(std::min<uint64_t>(region - off, 512));
  } else if (shape == 7) {
    length = std::min<uint64_t>(region, 64 << 10);
  } else if (shape == 8 && token.base > 64) {
    address = token.base - 1 - Rand(32);  // straddles the start
    length = token.base - address + 1 + Rand(16);
  } else {
    address = token.base + region - std::min<uint64_t>(region, 1 + Rand(16));
    length = 32;  // straddles the end
  }
  const bool write = op < 0 ? Chance(50) : op == 1;
  const ProbeExpectation want =
      model_.ExpectProbe(via.session, token.rkey, address, length, write);
  const std::string what = absl::StrCat(
      write ? "WRITE" : "READ", " via session ", via.session, " conn ",
      via.connection, " rkey ", HexText(token.rkey), " [", HexText(address),
      ", +", length, ") (", token.what, " of session ", token.session,
      "): expect ", want.ok ? "success" : "REMOTE_ACCESS_ERROR", " (", want.why,
      ")");
  Note(what);
  absl::Status status;
  std::string data;
  if (write) {
    data.resize(length);
    for (char& c : data) c = static_cast<char>(rng_());
    status = via.peer->Write(token.rkey, address, data);
  } else {
    absl::StatusOr<std::string> read =
        via.peer->Read(token.rkey, address, length);
    status = read.status();
    if (read.ok()) data = std::move(*read);
  }
  if (want.ok) {
    if (!status.ok()) {
      Check(what + ": got " + DescribeStatus(status));
      return;
    }
    if (data.size() != length) {
      Check(absl::StrCat(what, ": got ", data.size(), " bytes"));
      return;
    }
    ++counters_.probes_ok;
    // The bytes are the client's, where the model says. A page array may
    // name one page twice: for a WRITE the later bytes win, so segments are
    // checked from the last, each byte against the last write to it.
    std::vector<uint64_t> starts;
    uint64_t at = 0;
    for (const Segment& seg : want.segments) {
      starts.push_back(at);
      at += seg.length;
    }
    std::vector<const Segment*> later;
    for (size_t i = want.segments.size(); i-- > 0;) {
      const Segment& seg = want.segments[i];
      const File* file = files_[seg.file].get();
      if (file == nullptr || seg.offset + seg.length > file->size) {
        Check(what + ": the model names memory the test no longer holds");
        return;
      }
      for (uint64_t k = 0; k < seg.length; ++k) {
        const uint64_t offset = seg.offset + k;
        bool overwritten = false;
        for (const Segment* l : later) {
          overwritten =
              overwritten || (l->file == seg.file && offset >= l->offset &&
                              offset < l->offset + l->length);
        }
        if (write && overwritten) continue;
        if (file->data[offset] != data[starts[i] + k]) {
          Check(absl::StrCat(what,
                             write ? ": the client's memory of file "
                                   : ": the bytes differ from the "
                                     "client's memory of file ",
                             seg.file, write ? " does not show the write" : "",
                             " at offset ", offset));
          return;
        }
      }
      later.push_back(&seg);
    }
    return;
  }
  if (status.ok()) {
    Check(what + ": but it succeeded");
    return;
  }
  if (status.code() != absl::StatusCode::kPermissionDenied ||
      GetErrorDetail(status).reason() != "REMOTE_ACCESS_ERROR") {
    Check(what + ": got " + DescribeStatus(status));
    return;
  }
  ++counters_.probes_refused;
  PeerDied(via);  // an RC connection dies on a remote access error
}

void Harness::RandomProbe() {
  const std::vector<Token> live = model_.LiveTokens();
  const std::vector<Token> dead = model_.DeadTokens();
  if (live.empty() && dead.empty()) return;
  const bool use_dead = !dead.empty() && (live.empty() || Chance(25));
  const Token& token =
      use_dead ? dead[Rand(dead.size())] : live[Rand(live.size())];
  Slot* own = SlotOf(token.session);
  Slot& via = own != nullptr && Chance(85) ? *own : PickSlot();
  // Mostly what the token allows (to check the bytes), else anything.
  int op = -1;
  if (!use_dead && Chance(80)) {
    std::vector<int> allowed;
    if (token.access & kRemoteRead) allowed.push_back(0);
    if (token.access & kRemoteWrite) allowed.push_back(1);
    if (!allowed.empty()) op = allowed[Rand(allowed.size())];
  }
  Probe(via, token, /*sweep=*/op >= 0 && Chance(80), op);
}

void Harness::Sweep() {
  ++counters_.sweeps;
  Note("sweep: every token, every session's state");
  for (const Token& token : model_.LiveTokens()) {
    Slot* own = SlotOf(token.session);
    if (own == nullptr) continue;
    Probe(*own, token, /*sweep=*/true, /*op=*/0);
    if (failed()) return;
    Probe(*own, token, /*sweep=*/true, /*op=*/1);
    if (failed()) return;
    Probe(PickSlot(), token, /*sweep=*/true, -1);  // W8: another session
    if (failed()) return;
  }
  for (const Token& token : model_.DeadTokens()) {
    Slot* own = SlotOf(token.session);
    Probe(own != nullptr ? *own : PickSlot(), token, /*sweep=*/true, -1);
    if (failed()) return;
  }
  for (Slot& slot : slots_) {
    // Every connection that died has been reported by now.
    const std::set<uint64_t> pending = slot.pending_disconnects;
    for (uint64_t connection : pending) {
      if (!WaitForDisconnect(slot, connection)) return;
    }
    CheckList(slot);
    if (failed()) return;
  }
}

void Harness::AfterStep() {
  device_->WaitForWorkerIdle();
  for (Slot& slot : slots_) {
    Drain(slot);
    if (!Check(model_.CheckNothingExpected(slot.session))) return;
  }
  for (Slot& slot : slots_) {
    if (!model_.MrsWithUnknownKeys(slot.session).empty()) CheckList(slot);
    if (failed()) return;
  }
  if (!Check(pin_ops_.TakeFailure())) return;
  CheckTotals();
  RandomProbe();
  if (failed()) return;
  if (step_ % kListEvery == 0) CheckList(PickSlot());
  if (!failed() && step_ % kSweepEvery == 0) Sweep();
  if (step_ % 200 == 0) {
    // Client memory no live buffer uses any more goes away.
    std::set<int> used;
    for (const auto& [id, s] : model_.sessions()) {
      for (const auto& [bid, b] : s.buffers) used.insert(b.file);
    }
    for (size_t i = 0; i < files_.size(); ++i) {
      if (files_[i] != nullptr && !used.contains(static_cast<int>(i))) {
        files_[i].reset();
      }
    }
  }
}

bool Harness::Run(uint64_t steps) {
  struct Op {
    const char* name;
    uint64_t weight;
    std::function<void(Slot&)> run;
  };
  const std::vector<Op> ops = {
      {"register", 16, [this](Slot& s) { OpRegisterNew(s); }},
      {"register_same", 8, [this](Slot& s) { OpRegisterSame(s); }},
      {"register_retry", 3, [this](Slot& s) { OpRegisterRetry(s); }},
      {"register_mr", 3, [this](Slot& s) { OpRegisterWithMr(s); }},
      {"register_bad", 2, [this](Slot& s) { OpRegisterBad(s); }},
      {"deregister", 15, [this](Slot& s) { OpDeregister(s); }},
      {"deregister_mr", 3, [this](Slot& s) { OpDeregisterByMr(s); }},
      {"create_mr", 3, [this](Slot& s) { OpCreateMr(s, Chance(60)); }},
      {"close_mr", 2, [this](Slot& s) { OpCloseMr(s); }},
      {"release_buffer", 2, [this](Slot& s) { OpReleaseBuffer(s); }},
      {"import", 4, [this](Slot& s) { OpImport(s); }},
      {"end_session", 1, [this](Slot& s) { OpKill(s); }},
      {"build_lam", 6, [this](Slot& s) { OpBuildLam(s); }},
      {"release_lam", 5, [this](Slot& s) { OpReleaseLam(s); }},
      {"fast_register", 10, [this](Slot& s) { OpFastRegister(s); }},
      {"invalidate", 6, [this](Slot& s) { OpInvalidate(s); }},
      {"flush", 2, [this](Slot& s) { OpFlush(s); }},
      {"ended_call", 1, [this](Slot&) { OpEndedSessionCall(); }},
      {"probes", 3,
       [this](Slot&) {
         Count("probes");
         for (int i = 0; i < 3 && !failed(); ++i) RandomProbe();
       }},
  };
  uint64_t total = 0;
  for (const Op& op : ops) total += op.weight;
  while (step_ < steps && !failed()) {
    ++step_;
    uint64_t pick = Rand(total);
    const Op* chosen = &ops.front();
    for (const Op& op : ops) {
      if (pick < op.weight) {
        chosen = &op;
        break;
      }
      pick -= op.weight;
    }
    chosen->run(PickSlot());
    if (!failed()) AfterStep();
  }
  if (!failed()) Sweep();
  return !failed();
}

uint64_t TestSeed() {
  if (g_seed_given) return g_seed_flag;
  bool given = false;
  const uint64_t seed = EnvNumber("MRD_MODEL_SEED", 0, &given);
  if (given) return seed;
  // Time-based, once per process: both tests of a run share it.
  static const uint64_t time_seed =
      static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())) ^
      (static_cast<uint64_t>(::getpid()) << 40);
  return time_seed;
}

uint64_t TestSteps() {
  if (g_steps_flag != 0) return g_steps_flag;
  return EnvNumber("MRD_MODEL_STEPS", MRD_MODEL_DEFAULT_STEPS, nullptr);
}

void PrintCounters(const Counters& c, uint64_t steps, absl::Duration took) {
  std::cout << "[ model ] " << steps << " steps in "
            << absl::FormatDuration(took) << ": " << c.probes_ok
            << " peer ops succeeded, " << c.probes_refused
            << " refused as expected, " << c.reconnects << " peer connects, "
            << c.completions << " completions, " << c.cache_hits
            << " cache hits, " << c.errors_expected << " expected errors, "
            << c.sessions_ended << " sessions ended, " << c.sweeps
            << " sweeps, " << c.warm_steps
            << " steps with warm pins held\n[ model ] ops:";
  for (const auto& [name, n] : c.ops) std::cout << " " << name << "=" << n;
  std::cout << std::endl;
}

void RunModel(absl::string_view test, WarmCaps warm, uint64_t steps_divisor) {
  const uint64_t seed = TestSeed();
  const uint64_t steps = std::max<uint64_t>(TestSteps() / steps_divisor, 1);
  std::cout << "[ model ] seed " << seed << ", " << steps
            << " steps (reproduce with MRD_MODEL_SEED=" << seed << ")"
            << std::endl;
  const absl::Time start = absl::Now();
  Harness harness(seed, warm);
  ASSERT_TRUE(harness.SetUp()) << harness.Report(test, steps_divisor);
  ASSERT_TRUE(harness.Run(steps)) << harness.Report(test, steps_divisor);
  ASSERT_TRUE(harness.TearDown()) << harness.Report(test, steps_divisor);
  PrintCounters(harness.counters(), steps, absl::Now() - start);
}

// Warm pins off: pinned bytes must match the model exactly.
TEST(ModelTest, RandomOperationsMatchTheReferenceModel) {
  RunModel("RandomOperationsMatchTheReferenceModel", WarmCaps{}, 1);
}

// Warm pins on (small caps, so that they are kept, taken and evicted all
// the time): every token the model says is dead must still be dead, and the
// pinned bytes lie between the model's live ones and those plus the warm
// pins'. A quarter of the steps.
TEST(ModelTest, RandomOperationsMatchTheReferenceModelWithWarmPins) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  RunModel("RandomOperationsMatchTheReferenceModelWithWarmPins",
           WarmCaps{6 * page, 12 * page}, 4);
}

}  // namespace
}  // namespace mrd::model_test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (absl::ConsumePrefix(&arg, "--seed=") &&
        absl::SimpleAtoi(arg, &mrd::model_test::g_seed_flag)) {
      mrd::model_test::g_seed_given = true;
    } else if (absl::ConsumePrefix(&arg, "--steps=") &&
               absl::SimpleAtoi(arg, &mrd::model_test::g_steps_flag)) {
    } else {
      std::cerr << "unknown argument " << argv[i]
                << " (this test takes --seed=N and --steps=N)" << std::endl;
      return 2;
    }
  }
  return RUN_ALL_TESTS();
}
