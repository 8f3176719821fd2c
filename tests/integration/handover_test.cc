// Live handover (issue 11) with real mrd binaries: a client holds
// registrations of several sizes through the fd socket, a remote peer reads
// and writes through their tokens all along, and a second mrd started with
// --takeover in the same runtime directory takes over. The peer never sees a
// refused token, what it wrote before is read after, the client goes on over
// the same channel and fd session and deregisters through the new process,
// and the pinned bytes (VmLck of both processes, mlock pinning) never drop
// below what is registered. Then each fault point of the handover: the old
// mrd serves on with nothing lost.

#include <dirent.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/lib/mrd_client.h"
#include "client/peer/peer.h"
#include "gtest/gtest.h"
#include "tests/integration/mrd_process.h"
#include "tests/integration/test_env.h"

namespace mrd::testing {
namespace {

using client::Buffer;
using client::Registration;
using client::Session;

// VmLck of `pid` in bytes; nullopt once it is gone (or a zombie).
std::optional<uint64_t> VmLck(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view v = line;
    if (!absl::ConsumePrefix(&v, "VmLck:")) continue;
    uint64_t kb = 0;
    std::vector<absl::string_view> parts =
        absl::StrSplit(v, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (parts.empty() || !absl::SimpleAtoi(parts[0], &kb)) return std::nullopt;
    return kb * 1024;
  }
  return std::nullopt;
}

// The pid of the mrd started with --takeover in `runtime_dir`, or 0.
pid_t FindSuccessor(const std::string& runtime_dir) {
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return 0;
  pid_t found = 0;
  while (dirent* e = readdir(proc)) {
    pid_t pid = 0;
    if (!absl::SimpleAtoi(e->d_name, &pid)) continue;
    std::ifstream in(absl::StrCat("/proc/", pid, "/cmdline"));
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string cmd = ss.str();
    if (absl::StrContains(cmd, "--takeover") &&
        absl::StrContains(cmd, runtime_dir)) {
      found = pid;
      break;
    }
  }
  closedir(proc);
  return found;
}

// Samples VmLck of the old mrd and of its successor every millisecond. Both
// pin the same pages (the clients' memfds), so what stays pinned at each
// sample is the larger of the two; the lowest of those is what the test
// compares with the registered bytes.
class PinSampler {
 public:
  PinSampler(pid_t old_pid, std::string runtime_dir)
      : old_pid_(old_pid), runtime_dir_(std::move(runtime_dir)) {
    thread_ = std::thread([this] { Run(); });
  }
  ~PinSampler() { Stop(); }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  // The lowest pinned bytes any sample saw the holder of the pins with.
  uint64_t lowest() const {
    absl::MutexLock lock(&mu_);
    return lowest_;
  }
  uint64_t samples() const {
    absl::MutexLock lock(&mu_);
    return samples_;
  }
  bool successor_seen_pinning_before_old_exit() const {
    absl::MutexLock lock(&mu_);
    return both_;
  }

 private:
  void Run() {
    pid_t successor = 0;
    bool old_gone = false;
    while (!stop_) {
      if (successor == 0) successor = FindSuccessor(runtime_dir_);
      // -1: no such process (or a zombie).
      const int64_t old_pins =
          old_gone ? -1 : static_cast<int64_t>(VmLck(old_pid_).value_or(~0ull));
      const int64_t new_pins =
          successor != 0
              ? static_cast<int64_t>(VmLck(successor).value_or(~0ull))
              : -1;
      if (old_pins < 0) old_gone = true;
      {
        absl::MutexLock lock(&mu_);
        ++samples_;
        // The same pages, pinned by either process: what stays pinned is
        // the larger of the two (neither at all would be a drop to 0).
        const int64_t held = std::max<int64_t>(std::max(old_pins, new_pins), 0);
        if (static_cast<uint64_t>(held) < lowest_) lowest_ = held;
        if (!old_gone && new_pins > 0) both_ = true;
      }
      absl::SleepFor(absl::Milliseconds(1));
    }
  }

  const pid_t old_pid_;
  const std::string runtime_dir_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  mutable absl::Mutex mu_;
  uint64_t lowest_ ABSL_GUARDED_BY(mu_) = ~uint64_t{0};
  uint64_t samples_ ABSL_GUARDED_BY(mu_) = 0;
  bool both_ ABSL_GUARDED_BY(mu_) = false;
};

// A remote peer that reads and writes the first bytes of each token in a
// loop, reconnecting with the session's ticket whenever its connection
// closes (the old mrd closes peer connections at commit). A refused token
// (REMOTE_ACCESS_ERROR) is what must never happen.
class BusyPeer {
 public:
  struct Target {
    uint32_t rkey;
    uint64_t address;
  };
  BusyPeer(std::string peer_address, std::string ticket,
           std::vector<Target> targets)
      : address_(std::move(peer_address)),
        ticket_(std::move(ticket)),
        targets_(std::move(targets)) {
    thread_ = std::thread([this] { Run(); });
  }
  ~BusyPeer() { Stop(); }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  uint64_t operations() const { return ops_; }
  uint64_t reconnects() const { return reconnects_; }
  std::string refusals() const {
    absl::MutexLock lock(&mu_);
    return refusals_;
  }

 private:
  void Run() {
    std::unique_ptr<peer::Peer> p;
    uint64_t i = 0;
    while (!stop_) {
      if (p == nullptr) {
        auto connected = peer::ConnectPeer(TestDeviceKind(), address_, ticket_);
        if (!connected.ok()) {
          Refused(connected.status());
          absl::SleepFor(absl::Milliseconds(2));
          continue;
        }
        p = std::move(*connected);
        ++reconnects_;
      }
      const Target& t = targets_[i++ % targets_.size()];
      // The last 8 bytes of the first 64 are the peer's own.
      absl::Status s = p->Write(t.rkey, t.address + 56, "peer-was");
      if (s.ok()) {
        absl::StatusOr<std::string> read = p->Read(t.rkey, t.address, 64);
        s = read.status();
      }
      if (s.ok()) {
        ++ops_;
        continue;
      }
      Refused(s);
      p.reset();  // closed by the old process, or broken: reconnect
    }
  }
  // Connection errors are expected at commit; a refused key or ticket not.
  void Refused(const absl::Status& s) {
    if (s.code() == absl::StatusCode::kUnavailable) return;
    absl::MutexLock lock(&mu_);
    absl::StrAppend(&refusals_, s.ToString(), "\n");
  }

  const std::string address_;
  const std::string ticket_;
  const std::vector<Target> targets_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> ops_{0};
  std::atomic<uint64_t> reconnects_{0};
  std::thread thread_;
  mutable absl::Mutex mu_;
  std::string refusals_ ABSL_GUARDED_BY(mu_);
};

// The registrations and buffers of a session as ListRegistrations says,
// without what a handover may change (peer connections, lease expiry).
std::string Held(const Session& session) {
  absl::StatusOr<v1::ListRegistrationsResponse> list = session.List();
  EXPECT_TRUE(list.ok()) << list.status();
  if (!list.ok()) return "";
  list->clear_connections();
  list->clear_session();
  return list->DebugString();
}

class HandoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/mrd-handover-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    runtime_dir_ = dir;
  }
  void TearDown() override {
    client_.reset();
    for (std::unique_ptr<MrdProcess>* p : {&old_, &new_}) {
      if (*p == nullptr) continue;
      if (HasFailure()) std::cerr << "---- log ----\n" << (*p)->Log();
      absl::Status stopped = (*p)->Stop();
      EXPECT_TRUE(stopped.ok()) << stopped;
      p->reset();
    }
    std::error_code ec;
    std::filesystem::remove_all(runtime_dir_, ec);
  }

  MrdProcessOptions Options(std::vector<std::string> flags) {
    MrdProcessOptions o;
    o.runtime_dir = runtime_dir_;
    // mlock pinning: VmLck shows every pinned page.
    o.extra_flags = {"--pin_method=mlock"};
    for (std::string& f : flags) o.extra_flags.push_back(std::move(f));
    return o;
  }

  void StartOld(std::vector<std::string> flags = {}) {
    auto mrd = MrdProcess::Start(Options(std::move(flags)));
    ASSERT_TRUE(mrd.ok()) << mrd.status();
    old_ = std::move(*mrd);
    client::ClientOptions options;
    options.socket_path = old_->grpc_socket();
    options.fd_socket_path = old_->fd_socket();
    auto c = client::Client::Connect(options);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::make_unique<client::Client>(std::move(*c));
  }

  // Registrations of 4 KiB, 64 KiB, 2 MiB and 32 MiB, each in a buffer of
  // its own filled with a pattern.
  void Populate(Session& session) {
    for (uint64_t size : {uint64_t{4096}, uint64_t{65536}, uint64_t{2} << 20,
                          uint64_t{32} << 20}) {
      absl::StatusOr<Buffer> buffer = Buffer::Create(session, size, "ho");
      ASSERT_TRUE(buffer.ok()) << buffer.status();
      std::memset(buffer->data(), static_cast<int>(size % 251), size);
      client::RegisterOptions o =
          Range(*buffer, 0, size, kRemoteRead | kRemoteWrite);
      o.request_id = absl::StrCat("req-", size);
      absl::StatusOr<Registration> reg = Registration::Register(session, o);
      ASSERT_TRUE(reg.ok()) << reg.status();
      registered_bytes_ += size;
      buffers_.push_back(std::move(*buffer));
      registrations_.push_back(std::move(*reg));
    }
  }

  std::vector<BusyPeer::Target> Targets() const {
    std::vector<BusyPeer::Target> t;
    for (const Registration& r : registrations_) {
      t.push_back({r.rkey(), r.base_address()});
    }
    return t;
  }

  std::string runtime_dir_;
  std::unique_ptr<MrdProcess> old_;
  std::unique_ptr<MrdProcess> new_;
  std::unique_ptr<client::Client> client_;
  std::vector<Buffer> buffers_;
  std::vector<Registration> registrations_;
  uint64_t registered_bytes_ = 0;
};

// The software device's handover; the verbs device refuses (below).
TEST_F(HandoverTest, EveryRegistrationSurvivesATakeover) {
  if (TestDeviceKind() != "software") GTEST_SKIP() << "software device only";
  ASSERT_NO_FATAL_FAILURE(StartOld());
  absl::StatusOr<Session> session = Session::OpenFd(*client_);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_NO_FATAL_FAILURE(Populate(*session));
  // One registration twice: two references to hand over.
  absl::StatusOr<Registration> again = Registration::Register(
      *session, Range(buffers_[0], 0, 4096, kRemoteRead | kRemoteWrite));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->id(), registrations_[0].id());
  absl::StatusOr<client::PeerTicket> ticket =
      client::PeerTicket::Create(*session);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  // A lease session next to it, with its token and ttl.
  absl::StatusOr<Session> lease =
      Session::OpenLease(*client_, absl::Seconds(300));
  ASSERT_TRUE(lease.ok()) << lease.status();
  const std::string held_before = Held(*session);
  // The session's completion stream, open across the handover.
  client::CompletionStream stream = client::CompletionStream::Open(*session);

  PinSampler pins(old_->pid(), runtime_dir_);
  BusyPeer peer(ticket->peer_address(), ticket->ticket(), Targets());
  absl::SleepFor(absl::Milliseconds(100));  // the peer at work
  const uint64_t ops_before = peer.operations();
  EXPECT_GT(ops_before, 0u) << peer.refusals();
  absl::StatusOr<v1::Completion> connected = stream.Next(absl::Seconds(10));
  ASSERT_TRUE(connected.ok()) << connected.status();
  EXPECT_EQ(connected->kind(), v1::Completion::PEER_CONNECTED);

  MrdProcessOptions successor_options = Options({"--takeover"});
  successor_options.metrics = true;
  auto successor = MrdProcess::Start(successor_options);
  ASSERT_TRUE(successor.ok()) << successor.status();
  new_ = std::move(*successor);
  ASSERT_TRUE(old_->WaitExited(absl::Seconds(30))) << old_->Log();
  EXPECT_TRUE(absl::StrContains(old_->Log(), "handed over to the new mrd"))
      << old_->Log();
  // Its health may answer SERVING a moment before its last start line.
  for (int i = 0;
       i < 1000 && !absl::StrContains(new_->Log(), "took over from pid"); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(absl::StrContains(new_->Log(), "took over from pid"))
      << new_->Log();
  // What the new process says it took over (docs/METRICS.md).
  absl::StatusOr<std::string> scrape = ScrapeMetrics(new_->metrics_address());
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  EXPECT_TRUE(absl::StrContains(
      *scrape, "mrd_takeover_objects{kind=\"registrations\"} 4"))
      << *scrape;
  EXPECT_TRUE(
      absl::StrContains(*scrape, "mrd_takeover_objects{kind=\"sessions\"} 2"))
      << *scrape;
  EXPECT_TRUE(absl::StrContains(
      *scrape, "mrd_takeover_objects{kind=\"fd_connections\"} 1"))
      << *scrape;
  EXPECT_FALSE(absl::StrContains(*scrape, "mrd_takeover_seconds 0\n"));
  // The peer goes on through the new process.
  const uint64_t ops_at_handover = peer.operations();
  absl::SleepFor(absl::Milliseconds(200));
  peer.Stop();
  pins.Stop();
  EXPECT_GT(peer.operations(), ops_at_handover);
  EXPECT_EQ(peer.refusals(), "") << "the peer saw a refused token";
  EXPECT_GE(peer.reconnects(), 2u);
  EXPECT_GT(pins.samples(), 10u);
  EXPECT_GE(pins.lowest(), registered_bytes_)
      << "pinned bytes dropped below what is registered";
  EXPECT_TRUE(pins.successor_seen_pinning_before_old_exit());

  // The stream goes on (opened again by the library in the new process):
  // the peer's connections there are reported on it.
  bool reconnect_seen = false;
  for (int i = 0; i < 64 && !reconnect_seen; ++i) {
    absl::StatusOr<v1::Completion> c = stream.Next(absl::Seconds(10));
    ASSERT_TRUE(c.ok()) << c.status();
    reconnect_seen = c->kind() == v1::Completion::PEER_CONNECTED;
  }
  EXPECT_TRUE(reconnect_seen);

  // The same session, channel and fd connection, now served by the new
  // process: everything as it was, same ids, keys and references.
  EXPECT_EQ(Held(*session), held_before);
  EXPECT_TRUE(session->Ping().ok());
  absl::StatusOr<v1::SessionInfo> lease_info = lease->Info();
  ASSERT_TRUE(lease_info.ok()) << lease_info.status();
  EXPECT_EQ(lease_info->ttl_seconds(), 300u);
  // What the peer wrote before is there, and the client's pattern.
  for (size_t i = 0; i < buffers_.size(); ++i) {
    const char* data = static_cast<const char*>(buffers_[i].data());
    EXPECT_EQ(std::string(data + 56, 8), "peer-was");
    EXPECT_EQ(static_cast<unsigned char>(data[100]), buffers_[i].size() % 251);
  }
  // A retried request id is answered as the first time.
  client::RegisterOptions replay =
      Range(buffers_[1], 0, 65536, kRemoteRead | kRemoteWrite);
  replay.request_id = "req-65536";
  absl::StatusOr<Registration> replayed =
      Registration::Register(*session, replay);
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  EXPECT_EQ(replayed->id(), registrations_[1].id());
  EXPECT_EQ(replayed->rkey(), registrations_[1].rkey());
  replayed->Detach();  // a replay holds no reference of its own
  // The fd session imports and registers anew.
  absl::StatusOr<Buffer> fresh = Buffer::Create(*session, 8192, "after");
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  absl::StatusOr<Registration> fresh_reg =
      Registration::Register(*session, Range(*fresh, 0, 8192, kRemoteRead));
  ASSERT_TRUE(fresh_reg.ok()) << fresh_reg.status();
  // Deregistered through the new process: references count down as before.
  absl::StatusOr<uint32_t> left_after_again = again->Deregister();
  ASSERT_TRUE(left_after_again.ok()) << left_after_again.status();
  EXPECT_EQ(*left_after_again, 1u);
  for (Registration& r : registrations_) {
    absl::StatusOr<uint32_t> refs = r.Deregister();
    ASSERT_TRUE(refs.ok()) << refs.status();
    EXPECT_EQ(*refs, 0u);
  }
  ASSERT_TRUE(fresh_reg->Deregister().ok());
  absl::StatusOr<v1::ListRegistrationsResponse> left = session->List();
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(left->registrations_size(), 0);
}

// A takeover that fails at `fault` (a test fault point of either side, see
// server/handover/handover.h): the new mrd exits non-zero saying why, and
// the old one serves on as if nothing happened — same registrations, keys
// and references, pins never dropped, the peer never refused, the client's
// channel and fd session work.
class HandoverFaultTest : public HandoverTest,
                          public ::testing::WithParamInterface<const char*> {};

TEST_P(HandoverFaultTest, TheOldMrdServesOnWithNothingLost) {
  if (TestDeviceKind() != "software") GTEST_SKIP() << "software device only";
  const std::string fault = GetParam();
  const std::string flag = absl::StrCat("--handover_test_fault=", fault);
  const bool old_side = absl::StartsWith(fault, "old.");
  ASSERT_NO_FATAL_FAILURE(StartOld(old_side ? std::vector<std::string>{flag}
                                            : std::vector<std::string>{}));
  absl::StatusOr<Session> session = Session::OpenFd(*client_);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_NO_FATAL_FAILURE(Populate(*session));
  absl::StatusOr<client::PeerTicket> ticket =
      client::PeerTicket::Create(*session);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  const std::string held_before = Held(*session);
  absl::StatusOr<v1::DeviceInfo> before = client_->GetDeviceInfo();
  ASSERT_TRUE(before.ok()) << before.status();

  PinSampler pins(old_->pid(), runtime_dir_);
  BusyPeer peer(ticket->peer_address(), ticket->ticket(), Targets());
  absl::SleepFor(absl::Milliseconds(50));
  std::vector<std::string> flags = {"--takeover"};
  if (!old_side) flags.push_back(flag);
  absl::StatusOr<MrdExit> ended =
      MrdProcess::RunToExit(Options(std::move(flags)), 30000);
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_FALSE(WIFEXITED(ended->status) && WEXITSTATUS(ended->status) == 0)
      << ended->log;
  if (fault != "new.crash" && fault != "new.prepare") {
    EXPECT_TRUE(absl::StrContains(ended->log, "the running mrd serves on"))
        << ended->log;
  }
  EXPECT_FALSE(old_->WaitExited(absl::ZeroDuration())) << old_->Log();
  EXPECT_TRUE(absl::StrContains(old_->Log(), "handover refused or failed"))
      << old_->Log();
  const uint64_t ops = peer.operations();
  absl::SleepFor(absl::Milliseconds(100));
  peer.Stop();
  pins.Stop();
  EXPECT_GT(peer.operations(), ops) << peer.refusals();
  EXPECT_EQ(peer.refusals(), "") << "the peer saw a refused token";
  EXPECT_GE(pins.lowest(), registered_bytes_);

  EXPECT_EQ(Held(*session), held_before);
  absl::StatusOr<v1::DeviceInfo> after = client_->GetDeviceInfo();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->pinned_bytes(), before->pinned_bytes());
  absl::StatusOr<Buffer> fresh = Buffer::Create(*session, 8192, "after");
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  absl::StatusOr<Registration> fresh_reg =
      Registration::Register(*session, Range(*fresh, 0, 8192, kRemoteRead));
  ASSERT_TRUE(fresh_reg.ok()) << fresh_reg.status();
  // And a takeover without the fault still works afterwards.
  if (!old_side) {
    auto successor = MrdProcess::Start(Options({"--takeover"}));
    ASSERT_TRUE(successor.ok()) << successor.status();
    new_ = std::move(*successor);
    ASSERT_TRUE(old_->WaitExited(absl::Seconds(30))) << old_->Log();
    EXPECT_EQ(Held(*session).size() > 0, true);
  }
}

INSTANTIATE_TEST_SUITE_P(EveryStep, HandoverFaultTest,
                         ::testing::Values("old.hello", "old.pause",
                                           "old.export", "old.commit",
                                           "new.version", "new.prepare",
                                           "new.adopt", "new.crash"),
                         [](const ::testing::TestParamInfo<const char*>& p) {
                           std::string name = p.param;
                           for (char& c : name) {
                             if (c == '.') c = '_';
                           }
                           return name;
                         });

TEST_F(HandoverTest, WhatCannotBeHandedOverYetIsRefusedAndTheOldServesOn) {
  if (TestDeviceKind() != "software") GTEST_SKIP() << "software device only";
  ASSERT_NO_FATAL_FAILURE(StartOld());
  absl::StatusOr<Session> session = Session::OpenFd(*client_);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_NO_FATAL_FAILURE(Populate(*session));
  client::BuildLamOptions lo;
  lo.buffer = buffers_[1].id();
  lo.length = 4096;
  absl::StatusOr<client::Lam> lam = client::Lam::Build(*session, lo);
  ASSERT_TRUE(lam.ok()) << lam.status();
  const std::string held_before = Held(*session);
  absl::StatusOr<MrdExit> ended =
      MrdProcess::RunToExit(Options({"--takeover"}), 30000);
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_TRUE(absl::StrContains(ended->log, "HANDOVER_UNSUPPORTED_STATE"))
      << ended->log;
  EXPECT_FALSE(old_->WaitExited(absl::ZeroDuration()));
  EXPECT_EQ(Held(*session), held_before);
  // Without the LAM it goes.
  ASSERT_TRUE(lam->Release().ok());
  auto successor = MrdProcess::Start(Options({"--takeover"}));
  ASSERT_TRUE(successor.ok()) << successor.status();
  new_ = std::move(*successor);
  ASSERT_TRUE(old_->WaitExited(absl::Seconds(30))) << old_->Log();
}

// The verbs device (run in the Soft-RoCE VM, label verbs): its objects
// cannot leave the process (rxe refuses ibv_import_device), so the old mrd
// refuses the takeover and serves on: the peer still reads through the
// same rkey, the registrations are as they were.
TEST_F(HandoverTest, TheVerbsDeviceRefusesAndServesOn) {
  if (TestDeviceKind() != "verbs") GTEST_SKIP() << "verbs device only";
  ASSERT_NO_FATAL_FAILURE(StartOld());
  absl::StatusOr<Session> session = Session::OpenFd(*client_);
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<Buffer> buffer = Buffer::Create(*session, 65536, "verbs");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  std::memcpy(buffer->data(), "kept by the old mrd", 19);
  absl::StatusOr<Registration> reg = Registration::Register(
      *session, Range(*buffer, 0, 65536, kRemoteRead | kRemoteWrite));
  ASSERT_TRUE(reg.ok()) << reg.status();
  absl::StatusOr<client::PeerTicket> ticket =
      client::PeerTicket::Create(*session);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  auto peer = peer::ConnectPeer(TestDeviceKind(), ticket->peer_address(),
                                ticket->ticket());
  ASSERT_TRUE(peer.ok()) << peer.status();
  const std::string held_before = Held(*session);

  absl::StatusOr<MrdExit> ended =
      MrdProcess::RunToExit(Options({"--takeover"}), 60000);
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_TRUE(WIFEXITED(ended->status) && WEXITSTATUS(ended->status) == 1)
      << ended->log;
  EXPECT_TRUE(absl::StrContains(ended->log, "HANDOVER_UNSUPPORTED_DEVICE"))
      << ended->log;
  EXPECT_TRUE(absl::StrContains(ended->log, "ibv_import_device")) << ended->log;
  EXPECT_FALSE(old_->WaitExited(absl::ZeroDuration()));
  EXPECT_EQ(Held(*session), held_before);
  absl::StatusOr<std::string> read =
      (*peer)->Read(reg->rkey(), reg->base_address(), 19);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "kept by the old mrd");
}

}  // namespace
}  // namespace mrd::testing
