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
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
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
#include "mrd/v1/handover.pb.h"
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
// closes (a takeover hands its connection over: it should not). A refused
// token (REMOTE_ACCESS_ERROR) is what must never happen.
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
  uint64_t connection_id() const { return connection_id_; }
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
        connection_id_ = p->connection_id();
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
  std::atomic<uint64_t> connection_id_{0};
  std::thread thread_;
  mutable absl::Mutex mu_;
  std::string refusals_ ABSL_GUARDED_BY(mu_);
};

// Scrapes mrd's metrics in a loop, counting the scrapes refused (nobody
// listening) apart from those answered.
class Scraper {
 public:
  explicit Scraper(std::string address) : address_(std::move(address)) {
    thread_ = std::thread([this] {
      while (!stop_) {
        absl::StatusOr<std::string> scrape = ScrapeMetrics(address_);
        if (scrape.ok()) {
          ++answered_;
        } else if (absl::StrContains(scrape.status().message(),
                                     "cannot connect")) {
          ++refused_;
        }
        absl::SleepFor(absl::Milliseconds(2));
      }
    });
  }
  ~Scraper() { Stop(); }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  uint64_t answered() const { return answered_; }
  uint64_t refused() const { return refused_; }

 private:
  const std::string address_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> answered_{0};
  std::atomic<uint64_t> refused_{0};
  std::thread thread_;
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
    // Warm pins on: they are handed over too.
    o.extra_flags = {"--pin_method=mlock",
                     "--warm_pin_bytes_per_session=67108864",
                     "--warm_pin_bytes_total=67108864"};
    for (std::string& f : flags) o.extra_flags.push_back(std::move(f));
    return o;
  }

  void StartOld(std::vector<std::string> flags = {}, bool metrics = false) {
    MrdProcessOptions options = Options(std::move(flags));
    options.metrics = metrics;
    auto mrd = MrdProcess::Start(options);
    ASSERT_TRUE(mrd.ok()) << mrd.status();
    old_ = std::move(*mrd);
    client::ClientOptions client_options;
    client_options.socket_path = old_->grpc_socket();
    client_options.fd_socket_path = old_->fd_socket();
    auto c = client::Client::Connect(client_options);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::make_unique<client::Client>(std::move(*c));
  }

  // Starts `mrd --takeover` (serving metrics if `metrics`: on the old mrd's
  // address when it serves them) and waits until the old mrd has handed
  // over and exited.
  void TakeOver(bool metrics = false, std::vector<std::string> flags = {}) {
    flags.push_back("--takeover");
    MrdProcessOptions options = Options(std::move(flags));
    options.metrics = metrics;
    if (metrics) options.metrics_address = old_->metrics_address();
    auto successor = MrdProcess::Start(options);
    ASSERT_TRUE(successor.ok()) << successor.status();
    new_ = std::move(*successor);
    ASSERT_TRUE(old_->WaitExited(absl::Seconds(30))) << old_->Log();
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
  ASSERT_NO_FATAL_FAILURE(StartOld({}, /*metrics=*/true));
  absl::StatusOr<Session> session = Session::OpenFd(*client_);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_NO_FATAL_FAILURE(Populate(*session));
  // One registration twice: two references to hand over.
  absl::StatusOr<Registration> again = Registration::Register(
      *session, Range(buffers_[0], 0, 4096, kRemoteRead | kRemoteWrite));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->id(), registrations_[0].id());
  // A warm pin: 1 MiB registered and deregistered, its pages kept pinned.
  absl::StatusOr<Registration> warm = Registration::Register(
      *session, Range(buffers_[3], 0, 1 << 20, kRemoteRead));
  ASSERT_TRUE(warm.ok()) << warm.status();
  ASSERT_TRUE(warm->Deregister().ok());
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
  // Scrapes throughout: the metrics socket is handed over too, so none is
  // refused (at most one waits in its backlog a moment).
  Scraper scraper(old_->metrics_address());
  absl::SleepFor(absl::Milliseconds(100));  // the peer at work
  const uint64_t ops_before = peer.operations();
  EXPECT_GT(ops_before, 0u) << peer.refusals();
  absl::StatusOr<v1::Completion> connected = stream.Next(absl::Seconds(10));
  ASSERT_TRUE(connected.ok()) << connected.status();
  EXPECT_EQ(connected->kind(), v1::Completion::PEER_CONNECTED);
  const uint64_t connection = peer.connection_id();
  EXPECT_EQ(connected->connection(), connection);

  ASSERT_NO_FATAL_FAILURE(TakeOver(/*metrics=*/true));
  EXPECT_TRUE(absl::StrContains(old_->Log(), "handed over to the new mrd"))
      << old_->Log();
  // Its health may answer SERVING a moment before its last start line.
  for (int i = 0;
       i < 1000 && !absl::StrContains(new_->Log(), "took over from pid"); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(absl::StrContains(new_->Log(), "took over from pid"))
      << new_->Log();
  // Every registration and the warm pin were pinned before the old process
  // paused, and adopting them took those pins over.
  EXPECT_TRUE(absl::StrContains(
      new_->Log(), "pinned ahead 5 registrations, LAMs and warm pins"))
      << new_->Log();
  // What the new process says it took over (docs/METRICS.md), on the same
  // metrics socket.
  EXPECT_EQ(new_->metrics_address(), old_->metrics_address());
  const uint64_t answered_at_handover = scraper.answered();
  for (int i = 0; i < 500 && scraper.answered() < answered_at_handover + 3;
       ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  scraper.Stop();
  EXPECT_GE(scraper.answered(), answered_at_handover + 3);
  EXPECT_EQ(scraper.refused(), 0u) << "a scrape found nobody listening";
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
  EXPECT_TRUE(absl::StrContains(
      *scrape, "mrd_takeover_objects{kind=\"peer_connections\"} 1"))
      << *scrape;
  EXPECT_FALSE(absl::StrContains(*scrape, "mrd_takeover_seconds 0\n"));
  EXPECT_TRUE(absl::StrContains(*scrape, "mrd_cache_warm_pins 1\n")) << *scrape;
  EXPECT_TRUE(
      absl::StrContains(*scrape, "mrd_takeover_objects{kind=\"warm_pins\"} 1"))
      << *scrape;
  // The peer goes on through the new process, which lists its connection
  // as the session's.
  const uint64_t ops_at_handover = peer.operations();
  absl::SleepFor(absl::Milliseconds(200));
  absl::StatusOr<v1::ListRegistrationsResponse> listed = session->List();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->connections_size(), 1);
  EXPECT_EQ(listed->connections(0).connection(), connection);
  peer.Stop();
  pins.Stop();
  EXPECT_GT(peer.operations(), ops_at_handover);
  EXPECT_EQ(peer.refusals(), "") << "the peer saw a refused token";
  // Its one TCP connection went on through the new process.
  EXPECT_EQ(peer.reconnects(), 1u) << peer.refusals();
  EXPECT_EQ(peer.connection_id(), connection);
  EXPECT_GT(pins.samples(), 10u);
  EXPECT_GE(pins.lowest(), registered_bytes_)
      << "pinned bytes dropped below what is registered";
  EXPECT_TRUE(pins.successor_seen_pinning_before_old_exit());

  // The stream (opened again by the library in the new process) reports
  // the connection's end now that the peer left, and no other connection
  // event before it: it never connected again.
  for (int i = 0; i < 64; ++i) {
    absl::StatusOr<v1::Completion> c = stream.Next(absl::Seconds(10));
    ASSERT_TRUE(c.ok()) << c.status();
    if (c->kind() != v1::Completion::PEER_CONNECTED &&
        c->kind() != v1::Completion::PEER_DISCONNECTED) {
      continue;
    }
    EXPECT_EQ(c->kind(), v1::Completion::PEER_DISCONNECTED) << c->DebugString();
    EXPECT_EQ(c->connection(), connection);
    break;
  }

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
  // The warm pin came along: registering its range again is a warm hit.
  absl::StatusOr<Registration> rewarm = Registration::Register(
      *session, Range(buffers_[3], 0, 1 << 20, kRemoteRead));
  ASSERT_TRUE(rewarm.ok()) << rewarm.status();
  scrape = ScrapeMetrics(new_->metrics_address());
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  EXPECT_TRUE(absl::StrContains(*scrape, "mrd_cache_warm_hits_total 1\n"))
      << *scrape;
  ASSERT_TRUE(rewarm->Deregister().ok());
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
  // A LAM and MR objects too: a new process that fails after adopting
  // them releases them, and the old one's stay as they were.
  client::BuildLamOptions lo;
  lo.buffer = buffers_[2].id();
  lo.length = 1 << 20;
  absl::StatusOr<client::Lam> lam = client::Lam::Build(*session, lo);
  ASSERT_TRUE(lam.ok()) << lam.status();
  absl::StatusOr<client::Mr> fast = client::Mr::Create(*session, true, true);
  ASSERT_TRUE(fast.ok()) << fast.status();
  absl::StatusOr<client::Mr> normal = client::Mr::Create(*session, false);
  ASSERT_TRUE(normal.ok()) << normal.status();
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
  // Frozen for the handover or not, its connection served on.
  EXPECT_EQ(peer.reconnects(), 1u);
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
    ASSERT_NO_FATAL_FAILURE(TakeOver());
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

// A peer of `session`'s PD on the software device, retried while a
// takeover moves the peer path's listener.
std::unique_ptr<peer::Peer> ConnectPeerTo(const client::PeerTicket& ticket) {
  for (int i = 0; i < 500; ++i) {
    auto p = peer::ConnectPeer(TestDeviceKind(), ticket.peer_address(),
                               ticket.ticket());
    if (p.ok()) return std::move(*p);
    absl::SleepFor(absl::Milliseconds(10));
  }
  ADD_FAILURE() << "the peer could not connect";
  return nullptr;
}

// A peer of `session`'s PD and the session's completion stream, past the
// peer's PEER_CONNECTED.
struct ConnectedPeer {
  std::optional<client::PeerTicket> ticket;
  std::optional<client::CompletionStream> stream;
  std::unique_ptr<peer::Peer> peer;
};

void ConnectWithStream(const Session& session, ConnectedPeer* out) {
  absl::StatusOr<client::PeerTicket> ticket =
      client::PeerTicket::Create(session);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  out->ticket.emplace(std::move(*ticket));
  out->stream.emplace(client::CompletionStream::Open(session));
  out->peer = ConnectPeerTo(*out->ticket);
  ASSERT_NE(out->peer, nullptr);
  NextCompletionOfKind(*out->stream, v1::Completion::PEER_CONNECTED);
}

// LAMs (their logical addresses and privileged tokens) and MR objects
// (normal ones with their registration; fast-register ones with their keys,
// free or fast-registered over a LAM) go to the new process as they were:
// the peer reads and writes through the fast registration's rkey after the
// takeover, and the new process invalidates, releases and closes them.
TEST_F(HandoverTest, LamsAndMrObjectsSurviveATakeover) {
  if (TestDeviceKind() != "software") GTEST_SKIP() << "software device only";
  ASSERT_NO_FATAL_FAILURE(StartOld());
  absl::StatusOr<Session> session = Session::OpenFd(*client_);
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<Buffer> buffer = Buffer::Create(*session, 4 * 4096, "lam");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  char* data = static_cast<char*>(buffer->data());
  std::memcpy(data + 100, "fast bytes", 10);
  client::BuildLamOptions lo;
  lo.buffer = buffer->id();
  lo.offset = 100;
  lo.length = 5000;
  // One released before the takeover: its logical addresses are never
  // handed out again, not by the new process either.
  absl::StatusOr<client::Lam> gone = client::Lam::Build(*session, lo);
  ASSERT_TRUE(gone.ok()) << gone.status();
  const uint64_t gone_last_page = gone->pages().back();
  ASSERT_TRUE(gone->Release().ok());
  absl::StatusOr<client::Lam> lam = client::Lam::Build(*session, lo);
  ASSERT_TRUE(lam.ok()) << lam.status();
  absl::StatusOr<client::Mr> normal = client::Mr::Create(*session, false);
  ASSERT_TRUE(normal.ok()) << normal.status();
  absl::StatusOr<Registration> through_mr =
      normal->Register(Range(*buffer, 8192, 4096, kRemoteRead));
  ASSERT_TRUE(through_mr.ok()) << through_mr.status();
  absl::StatusOr<client::Mr> fast = client::Mr::Create(*session, true, true);
  ASSERT_TRUE(fast.ok()) << fast.status();
  absl::StatusOr<client::Mr> spare = client::Mr::Create(*session, true, true);
  ASSERT_TRUE(spare.ok()) << spare.status();
  ConnectedPeer connected;
  ASSERT_NO_FATAL_FAILURE(ConnectWithStream(*session, &connected));
  const client::PeerTicket& ticket = *connected.ticket;
  client::CompletionStream& stream = *connected.stream;
  std::unique_ptr<peer::Peer>& peer = connected.peer;
  client::FastRegisterOptions fr = client::FastRegisterOptions::FromLam(*lam);
  fr.connection = peer->connection_id();
  fr.request_context = 77;
  fr.base_address = 0x10000000 + fr.fbo;
  fr.flags = kOpRemoteRead | kOpRemoteWrite;
  ASSERT_TRUE(fast->FastRegister(fr).ok());
  v1::Completion registered =
      NextCompletionOfKind(stream, v1::Completion::FAST_REGISTER);
  ASSERT_EQ(registered.status(), ::mrd::STATUS_SUCCESS) << registered.message();
  const uint32_t rkey = registered.rkey();
  absl::StatusOr<std::string> read = peer->Read(rkey, fr.base_address, 10);
  ASSERT_TRUE(read.ok()) << read.status();
  const std::string held_before = Held(*session);

  ASSERT_NO_FATAL_FAILURE(TakeOver(/*metrics=*/true));
  EXPECT_EQ(Held(*session), held_before);
  absl::StatusOr<std::string> scrape = ScrapeMetrics(new_->metrics_address());
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  EXPECT_TRUE(
      absl::StrContains(*scrape, "mrd_takeover_objects{kind=\"lams\"} 1"))
      << *scrape;
  EXPECT_TRUE(
      absl::StrContains(*scrape, "mrd_takeover_objects{kind=\"mr_objects\"} 3"))
      << *scrape;

  // The peer's connection went on through the new process: the same rkey
  // reads and writes the same memory.
  read = peer->Read(rkey, fr.base_address, 10);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "fast bytes");
  ASSERT_TRUE(peer->Write(rkey, fr.base_address + 10, "+after").ok());
  EXPECT_EQ(std::string(data + 110, 6), "+after");
  // Normal registration through the adopted MR object: still readable.
  read = peer->Read(through_mr->rkey(), through_mr->base_address(), 4);
  EXPECT_TRUE(read.ok()) << read.status();

  // New logical addresses lie above every one the old process handed out.
  absl::StatusOr<client::Lam> fresh = client::Lam::Build(*session, lo);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_GT(fresh->pages().front(), gone_last_page);
  EXPECT_GT(fresh->pages().front(), lam->pages().back());
  ASSERT_TRUE(fresh->Release().ok());

  // The new process invalidates, releases and closes what it took over,
  // posting on the connection it took over (same id).
  client::Lam second_handle = client::Lam::Adopt(*session, lam->response());
  EXPECT_EQ(second_handle.Release().code(),
            absl::StatusCode::kFailedPrecondition);  // fast-registered
  ASSERT_TRUE(fast->Invalidate(peer->connection_id(), 99).ok());
  v1::Completion invalidated =
      NextCompletionOfKind(stream, v1::Completion::INVALIDATE);
  EXPECT_EQ(invalidated.status(), ::mrd::STATUS_SUCCESS)
      << invalidated.message();
  EXPECT_FALSE(peer->Read(rkey, fr.base_address, 10).ok());
  // A refused key breaks the connection (as a queue pair goes to error).
  peer = ConnectPeerTo(ticket);
  ASSERT_NE(peer, nullptr);
  // The spare MR object registers fast, with a key of the new process.
  fr.connection = peer->connection_id();
  absl::StatusOr<uint64_t> posted = spare->FastRegister(fr);
  ASSERT_TRUE(posted.ok()) << posted.status();
  v1::Completion again =
      NextCompletionOfKind(stream, v1::Completion::FAST_REGISTER);
  ASSERT_EQ(again.status(), ::mrd::STATUS_SUCCESS) << again.message();
  EXPECT_NE(again.rkey(), rkey);
  read = peer->Read(again.rkey(), fr.base_address, 10);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "fast bytes");
  peer.reset();
  ASSERT_TRUE(spare->Close().ok());
  ASSERT_TRUE(fast->Close().ok());
  ASSERT_TRUE(lam->Release().ok());
  ASSERT_TRUE(through_mr->Deregister().ok());
  ASSERT_TRUE(normal->Close().ok());
  absl::StatusOr<v1::ListRegistrationsResponse> left = session->List();
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(left->registrations_size(), 0);
  EXPECT_EQ(left->lams_size(), 0);
  EXPECT_EQ(left->mrs_size(), 0);
}

// Work posted on a peer connection and not yet executed (deferred) does not
// move to another process: the takeover is refused, HANDOVER_BUSY, and the
// old mrd serves on. The new process asks again (backing off) until
// --handover_timeout: once the work is gone, the takeover goes through, and
// the work's completion (flushed) reaches the client from the new process.
TEST_F(HandoverTest, WorkInFlightRefusesTheTakeoverUntilItIsDone) {
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
  absl::StatusOr<client::Mr> fast = client::Mr::Create(*session, true, true);
  ASSERT_TRUE(fast.ok()) << fast.status();
  ConnectedPeer connected;
  ASSERT_NO_FATAL_FAILURE(ConnectWithStream(*session, &connected));
  client::CompletionStream& stream = *connected.stream;
  std::unique_ptr<peer::Peer>& peer = connected.peer;
  client::FastRegisterOptions fr = client::FastRegisterOptions::FromLam(*lam);
  fr.connection = peer->connection_id();
  fr.base_address = 0x20000000;
  fr.flags = kOpRemoteRead | 0x200;  // deferred: it waits to be rung
  ASSERT_TRUE(fast->FastRegister(fr).ok());
  const std::string held_before = Held(*session);
  absl::StatusOr<MrdExit> ended = MrdProcess::RunToExit(
      Options({"--takeover", "--handover_timeout=1s"}), 30000);
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_TRUE(absl::StrContains(ended->log, "HANDOVER_BUSY")) << ended->log;
  EXPECT_TRUE(absl::StrContains(ended->log, "asking again in")) << ended->log;
  EXPECT_FALSE(WIFEXITED(ended->status) && WEXITSTATUS(ended->status) == 0);
  EXPECT_FALSE(old_->WaitExited(absl::ZeroDuration()));
  EXPECT_EQ(Held(*session), held_before);
  for (const Registration& r : registrations_) {
    absl::StatusOr<std::string> read =
        peer->Read(r.rkey(), r.base_address(), 8);
    EXPECT_TRUE(read.ok()) << read.status();
  }
  // A takeover started now waits; the peer goes meanwhile: its deferred
  // work is flushed, nothing is in flight, and the takeover goes through.
  std::thread leave([&peer] {
    absl::SleepFor(absl::Milliseconds(500));
    peer.reset();
  });
  ASSERT_NO_FATAL_FAILURE(TakeOver());
  leave.join();
  EXPECT_TRUE(absl::StrContains(new_->Log(), "HANDOVER_BUSY")) << new_->Log();
  v1::Completion flushed =
      NextCompletionOfKind(stream, v1::Completion::FAST_REGISTER);
  EXPECT_NE(flushed.status(), ::mrd::STATUS_SUCCESS);
  absl::StatusOr<v1::ListRegistrationsResponse> list = session->List();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->lams_size(), 1);
  EXPECT_EQ(list->mrs_size(), 1);
}

// The handover protocol by hand (server/handover/channel.h: a 12-byte
// header, magic "MRDH", payload length and fd count as little-endian
// uint32s, then a serialized HandoverFrame), for what no mrd would send.
std::string HandoverBytes(const v1::HandoverFrame& frame) {
  const std::string payload = frame.SerializeAsString();
  const uint32_t header[3] = {0x4844524d, static_cast<uint32_t>(payload.size()),
                              0};
  return std::string(reinterpret_cast<const char*>(header), sizeof(header)) +
         payload;
}

// Connects to `path`, sends `bytes` and reads until the other side closes
// (at most 64 KiB): only raw system calls, so that it may run in a forked
// child of this multithreaded process. "" when it could not connect.
std::string ExchangeRaw(const std::string& path, const std::string& bytes) {
  static char buffer[65536];
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) !=
      0) {
    ::close(fd);
    return "";
  }
  // The other side may refuse and close before reading: no SIGPIPE.
  (void)!::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  size_t got = 0;
  while (got < sizeof(buffer)) {
    const ssize_t n = ::read(fd, buffer + got, sizeof(buffer) - got);
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  return std::string(buffer, got);
}

// The first frame of `bytes` (as ExchangeRaw read them), parsed.
std::optional<v1::HandoverFrame> FirstFrame(const std::string& bytes) {
  if (bytes.size() < 12) return std::nullopt;
  uint32_t header[3];
  std::memcpy(header, bytes.data(), sizeof(header));
  if (header[0] != 0x4844524d || bytes.size() < 12 + header[1]) {
    return std::nullopt;
  }
  v1::HandoverFrame frame;
  if (!frame.ParseFromArray(bytes.data() + 12, static_cast<int>(header[1]))) {
    return std::nullopt;
  }
  return frame;
}

// The handover format this mrd speaks (server/handover/handover.h): a test
// speaks the wire protocol as an outsider would.
constexpr uint32_t kFormatVersion = 2;

v1::HandoverFrame Hello(uint32_t version, const std::string& device_kind) {
  v1::HandoverFrame frame;
  frame.mutable_hello()->set_version(version);
  frame.mutable_hello()->set_mrd_version("test");
  frame.mutable_hello()->set_pid(static_cast<uint32_t>(::getpid()));
  frame.mutable_hello()->set_device_kind(device_kind);
  return frame;
}

// Who may take over, and with what: another uid (even with the socket's
// mode opened up), another format version or another device kind is
// refused with its reason, and the old mrd serves on and still hands over
// to a process that may.
TEST_F(HandoverTest, OnlyItsOwnUidWithItsFormatAndDeviceMayTakeOver) {
  if (TestDeviceKind() != "software") GTEST_SKIP() << "software device only";
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as another uid";
  ASSERT_NO_FATAL_FAILURE(StartOld());
  absl::StatusOr<Session> session = Session::OpenFd(*client_);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_NO_FATAL_FAILURE(Populate(*session));
  const std::string held_before = Held(*session);
  const std::string path = runtime_dir_ + "/handover.sock";
  // The socket's mode keeps other uids out...
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // ...and behind it, SO_PEERCRED: opened to all, uid 65534 is refused.
  ASSERT_EQ(::chmod(path.c_str(), 0666), 0);
  ASSERT_EQ(::chmod(runtime_dir_.c_str(), 0755), 0);
  int pipe_fds[2];
  ASSERT_EQ(::pipe2(pipe_fds, O_CLOEXEC), 0);
  const std::string hello = HandoverBytes(Hello(kFormatVersion, "software"));
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(2);
    const std::string answer = ExchangeRaw(path, hello);
    (void)!::write(pipe_fds[1], answer.data(), answer.size());
    ::_exit(answer.empty() ? 3 : 0);
  }
  ::close(pipe_fds[1]);
  std::string answer;
  char chunk[4096];
  ssize_t n;
  while ((n = ::read(pipe_fds[0], chunk, sizeof(chunk))) > 0) {
    answer.append(chunk, static_cast<size_t>(n));
  }
  ::close(pipe_fds[0]);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) << wstatus;
  std::optional<v1::HandoverFrame> refusal = FirstFrame(answer);
  ASSERT_TRUE(refusal.has_value());
  EXPECT_EQ(refusal->refusal().reason(), "HANDOVER_PEER_NOT_ALLOWED")
      << refusal->ShortDebugString();
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);

  // Another format version, another device.
  refusal =
      FirstFrame(ExchangeRaw(path, HandoverBytes(Hello(999, "software"))));
  ASSERT_TRUE(refusal.has_value());
  EXPECT_EQ(refusal->refusal().reason(), "HANDOVER_VERSION")
      << refusal->ShortDebugString();
  refusal = FirstFrame(
      ExchangeRaw(path, HandoverBytes(Hello(kFormatVersion, "verbs"))));
  ASSERT_TRUE(refusal.has_value());
  EXPECT_EQ(refusal->refusal().reason(), "HANDOVER_DEVICE_MISMATCH")
      << refusal->ShortDebugString();
  // Not a frame at all.
  refusal = FirstFrame(ExchangeRaw(path, std::string(64, 'x')));
  ASSERT_TRUE(refusal.has_value());
  EXPECT_EQ(refusal->refusal().reason(), "HANDOVER_BAD_FRAME")
      << refusal->ShortDebugString();

  EXPECT_FALSE(old_->WaitExited(absl::ZeroDuration()));
  EXPECT_EQ(Held(*session), held_before);
  EXPECT_TRUE(session->Ping().ok());
  ASSERT_NO_FATAL_FAILURE(TakeOver());
  EXPECT_EQ(Held(*session), held_before);
}

// Waits (up to 10 s) until `peer` has done `more` operations past `from`.
bool PeerWorked(const BusyPeer& peer, uint64_t from, uint64_t more = 10) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (peer.operations() < from + more) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

// mrd serving two software devices (issue 26) hands both over: a
// registration on both devices and one on the second alone keep their
// tokens, a peer on each device's peer path reads and writes through them
// all along on the same connection, each device's ticket and the session's
// default devices go on, and a new process of another device count is
// refused by name while the old one serves on.
TEST_F(HandoverTest, EveryDeviceIsHandedOverWithItsPeers) {
  if (TestDeviceKind() != "software") GTEST_SKIP() << "software device only";
  ASSERT_NO_FATAL_FAILURE(StartOld({"--software_devices=2"}));
  absl::StatusOr<Session> session = Session::OpenFd(*client_);
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<Buffer> buffer = Buffer::Create(*session, 4 * 4096, "two");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  std::memset(buffer->data(), 'b', 4 * 4096);
  client::RegisterOptions o =
      Range(*buffer, 0, 2 * 4096, kRemoteRead | kRemoteWrite);
  o.all_devices = true;
  absl::StatusOr<Registration> both = Registration::Register(*session, o);
  ASSERT_TRUE(both.ok()) << both.status();
  ASSERT_EQ(both->tokens().size(), 2);
  o = Range(*buffer, 2 * 4096, 4096, kRemoteRead | kRemoteWrite);
  o.devices = {"software1"};
  absl::StatusOr<Registration> second = Registration::Register(*session, o);
  ASSERT_TRUE(second.ok()) << second.status();
  v1::SetDefaultDevicesRequest defaults_req;
  defaults_req.set_session(session->token());
  defaults_req.mutable_devices()->set_all(true);
  ASSERT_TRUE(client_->SetDefaultDevices(defaults_req).ok());
  absl::StatusOr<client::PeerTicket> ticket0 =
      client::PeerTicket::Create(*session, "software");
  absl::StatusOr<client::PeerTicket> ticket1 =
      client::PeerTicket::Create(*session, "software1");
  ASSERT_TRUE(ticket0.ok() && ticket1.ok());
  ASSERT_NE(ticket0->peer_address(), ticket1->peer_address());
  const std::string held_before = Held(*session);

  // Another device count: refused by name, the old mrd serves on.
  absl::StatusOr<MrdExit> refused = MrdProcess::RunToExit(
      Options({"--takeover", "--software_devices=1"}), 30000);
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused->log, "HANDOVER_DEVICE_MISMATCH"))
      << refused->log;
  EXPECT_FALSE(old_->WaitExited(absl::ZeroDuration())) << old_->Log();

  BusyPeer peer0(ticket0->peer_address(), ticket0->ticket(),
                 {{both->tokens()[0].rkey(), both->base_address()}});
  BusyPeer peer1(ticket1->peer_address(), ticket1->ticket(),
                 {{both->tokens()[1].rkey(), both->base_address()},
                  {second->rkey(), second->base_address()}});
  ASSERT_TRUE(PeerWorked(peer0, 0)) << peer0.refusals();
  ASSERT_TRUE(PeerWorked(peer1, 0)) << peer1.refusals();
  // A new process that fails once it adopted both devices' state: the old
  // one thaws both devices' peers and serves on.
  absl::StatusOr<MrdExit> failed =
      MrdProcess::RunToExit(Options({"--takeover", "--software_devices=2",
                                     "--handover_test_fault=new.adopt"}),
                            30000);
  ASSERT_TRUE(failed.ok()) << failed.status();
  EXPECT_TRUE(absl::StrContains(failed->log, "the running mrd serves on"))
      << failed->log;
  EXPECT_TRUE(PeerWorked(peer0, peer0.operations())) << peer0.refusals();
  EXPECT_TRUE(PeerWorked(peer1, peer1.operations())) << peer1.refusals();
  EXPECT_EQ(Held(*session), held_before);
  ASSERT_NO_FATAL_FAILURE(TakeOver(false, {"--software_devices=2"}));
  const uint64_t after0 = peer0.operations();
  const uint64_t after1 = peer1.operations();
  EXPECT_TRUE(PeerWorked(peer0, after0)) << peer0.refusals();
  EXPECT_TRUE(PeerWorked(peer1, after1)) << peer1.refusals();
  peer0.Stop();
  peer1.Stop();
  EXPECT_EQ(peer0.refusals(), "");
  EXPECT_EQ(peer1.refusals(), "");
  // Each peer's connection was handed over, not made again.
  EXPECT_EQ(peer0.reconnects(), 1u);
  EXPECT_EQ(peer1.reconnects(), 1u);
  EXPECT_GE(peer1.connection_id(), uint64_t{1} << 56);

  EXPECT_EQ(Held(*session), held_before);
  // The tickets are the ones peers hold: a new peer on the second device
  // reads what the first peer wrote.
  std::unique_ptr<peer::Peer> fresh = ConnectPeerTo(*ticket1);
  ASSERT_NE(fresh, nullptr);
  absl::StatusOr<std::string> read =
      fresh->Read(second->rkey(), second->base_address() + 56, 8);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "peer-was");
  // The default devices went along: a registration naming none is on both.
  absl::StatusOr<Registration> defaults = Registration::Register(
      *session, Range(*buffer, 3 * 4096, 4096, kRemoteRead));
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->tokens().size(), 2);
  ASSERT_TRUE(defaults->Deregister().ok());
  ASSERT_TRUE(both->Deregister().ok());
  ASSERT_TRUE(second->Deregister().ok());
  EXPECT_FALSE(fresh->Read(second->rkey(), second->base_address(), 8).ok());
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
