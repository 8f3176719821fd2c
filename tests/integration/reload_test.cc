// systemd reload = live handover, with real mrd binaries: mrd runs as
// systemd runs it (Type=notify: NOTIFY_SOCKET names a datagram socket this
// test reads, each message with its sender's pid), a client holds a
// registration that a remote peer reads through its rkey, and SIGHUP makes
// mrd start its successor (its own binary and arguments plus --takeover).
// The test hears RELOADING=1, then MAINPID=<new pid> and READY=1 from the
// new process; the old one exits 0 and the registration goes on, same id
// and rkey, through the new process. A successor that cannot take over
// leaves the old mrd serving, and systemd hears READY=1 from it again, no
// new main pid. And --after_handover=wait with --handover_status_file and
// --await_handover, the Kubernetes rolling update's pieces.
//
// The test makes itself a child subreaper: a successor whose parent (the
// old mrd) exited is reparented to it, and it reaps the successor to check
// its exit.

#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/lib/mrd_client.h"
#include "client/peer/peer.h"
#include "gtest/gtest.h"
#include "mrd/unique_fd.h"
#include "tests/integration/mrd_process.h"
#include "tests/integration/test_env.h"

namespace mrd::testing {
namespace {

using client::Buffer;
using client::Registration;
using client::Session;

// What systemd's notify socket receives: one datagram per sd_notify call,
// with the sender's pid (SO_PASSCRED).
struct Notification {
  pid_t pid = 0;
  std::string text;
};

class NotifySocket {
 public:
  explicit NotifySocket(std::string path) : path_(std::move(path)) {
    fd_.Reset(socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path_.data(), path_.size());
    bound_ =
        fd_.valid() && bind(fd_.get(), reinterpret_cast<const sockaddr*>(&addr),
                            sizeof(addr)) == 0;
    const int on = 1;
    bound_ = bound_ && setsockopt(fd_.get(), SOL_SOCKET, SO_PASSCRED, &on,
                                  sizeof(on)) == 0;
  }
  bool ok() const { return bound_; }
  const std::string& path() const { return path_; }

  // The next message, or nullopt when none came within `timeout`.
  std::optional<Notification> Next(absl::Duration timeout) {
    timeval tv{};
    tv.tv_sec = absl::ToInt64Seconds(timeout);
    tv.tv_usec = absl::ToInt64Microseconds(timeout) % 1000000;
    setsockopt(fd_.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char data[4096];
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(ucred))];
    iovec iov{data, sizeof(data)};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = recvmsg(fd_.get(), &msg, 0);
    if (n < 0) return std::nullopt;
    Notification got;
    got.text.assign(data, static_cast<size_t>(n));
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr;
         c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS) {
        ucred cred{};
        std::memcpy(&cred, CMSG_DATA(c), sizeof(cred));
        got.pid = cred.pid;
      }
    }
    return got;
  }

  // The first message (within `timeout` each) that has the line `line`;
  // the others it skipped are appended to `*skipped`.
  std::optional<Notification> NextWith(absl::string_view line,
                                       absl::Duration timeout,
                                       std::string* skipped) {
    for (;;) {
      std::optional<Notification> n = Next(timeout);
      if (!n.has_value()) return std::nullopt;
      if (HasLine(n->text, line)) return n;
      absl::StrAppend(skipped, n->pid, ": ", n->text, "\n");
    }
  }

  static bool HasLine(absl::string_view text, absl::string_view line) {
    for (absl::string_view l : absl::StrSplit(text, '\n')) {
      if (l == line) return true;
    }
    return false;
  }

 private:
  const std::string path_;
  UniqueFd fd_;
  bool bound_ = false;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Whether the file at `path` says `content` within 5 s.
bool FileSays(const std::string& path, const std::string& content) {
  for (int i = 0; i < 100 && ReadFile(path) != content; ++i) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  return ReadFile(path) == content;
}

// VmLck of `pid` in KiB ("" when gone).
std::string VmLckKb(pid_t pid) {
  std::istringstream status(ReadFile(absl::StrCat("/proc/", pid, "/status")));
  std::string line;
  while (std::getline(status, line)) {
    if (absl::StartsWith(line, "VmLck:")) {
      std::vector<std::string> parts =
          absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
      return parts.size() > 1 ? parts[1] : "";
    }
  }
  return "";
}

class ReloadTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // Successors outlive their parent, the old mrd: reap them here.
    ASSERT_EQ(prctl(PR_SET_CHILD_SUBREAPER, 1), 0) << std::strerror(errno);
  }

  void SetUp() override {
    char dir[] = "/tmp/mrd-reload-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    runtime_dir_ = dir;
    notify_ = std::make_unique<NotifySocket>(runtime_dir_ + "/notify");
    ASSERT_TRUE(notify_->ok()) << std::strerror(errno);
  }

  void TearDown() override {
    registrations_.clear();
    session_.reset();
    client_.reset();
    if (successor_ > 0) {
      kill(successor_, SIGTERM);
      int status = 0;
      waitpid(successor_, &status, 0);
    }
    if (old_ != nullptr) {
      if (HasFailure()) std::cerr << "---- log ----\n" << old_->Log();
      absl::Status stopped = old_->Stop();
      EXPECT_TRUE(stopped.ok()) << stopped;
      old_.reset();
    }
    std::error_code ec;
    std::filesystem::remove_all(runtime_dir_, ec);
  }

  MrdProcessOptions Options(std::vector<std::string> flags) {
    MrdProcessOptions o;
    o.runtime_dir = runtime_dir_;
    o.extra_flags = {"--pin_method=mlock"};
    for (std::string& f : flags) o.extra_flags.push_back(std::move(f));
    o.env = {{"NOTIFY_SOCKET", notify_->path()}};
    return o;
  }

  // The old mrd, READY=1 heard from it, and a client with one registration
  // of 64 KiB that a peer can read.
  void StartOld(std::vector<std::string> flags = {}) {
    auto mrd = MrdProcess::Start(Options(std::move(flags)));
    ASSERT_TRUE(mrd.ok()) << mrd.status();
    old_ = std::move(*mrd);
    std::optional<Notification> ready = notify_->Next(absl::Seconds(10));
    ASSERT_TRUE(ready.has_value()) << "no READY=1 from mrd";
    EXPECT_EQ(ready->text, "READY=1");
    EXPECT_EQ(ready->pid, old_->pid());

    client::ClientOptions options;
    options.socket_path = old_->grpc_socket();
    options.fd_socket_path = old_->fd_socket();
    auto c = client::Client::Connect(options);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::make_unique<client::Client>(std::move(*c));
    absl::StatusOr<Session> session = Session::OpenFd(*client_);
    ASSERT_TRUE(session.ok()) << session.status();
    session_ = std::make_unique<Session>(std::move(*session));
    absl::StatusOr<Buffer> buffer = Buffer::Create(*session_, 65536, "reload");
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    std::memcpy(buffer->data(), "registered-before-the-reload", 28);
    absl::StatusOr<Registration> reg = Registration::Register(
        *session_, Range(*buffer, 0, 65536, kRemoteRead | kRemoteWrite));
    ASSERT_TRUE(reg.ok()) << reg.status();
    buffer_ = std::make_unique<Buffer>(std::move(*buffer));
    registrations_.push_back(std::move(*reg));
    absl::StatusOr<client::PeerTicket> ticket =
        client::PeerTicket::Create(*session_);
    ASSERT_TRUE(ticket.ok()) << ticket.status();
    peer_address_ = ticket->peer_address();
    ticket_ = ticket->ticket();
    ASSERT_NO_FATAL_FAILURE(PeerReads());
  }

  // A remote peer, connected anew, reads the registration through its rkey.
  void PeerReads() {
    const Registration& r = registrations_.front();
    auto peer = peer::ConnectPeer(TestDeviceKind(), peer_address_, ticket_);
    ASSERT_TRUE(peer.ok()) << peer.status();
    absl::StatusOr<std::string> read =
        (*peer)->Read(r.rkey(), r.base_address(), 28);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(*read, "registered-before-the-reload");
  }

  std::string runtime_dir_;
  std::unique_ptr<NotifySocket> notify_;
  std::unique_ptr<MrdProcess> old_;
  pid_t successor_ = 0;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<Session> session_;
  std::unique_ptr<Buffer> buffer_;
  std::vector<Registration> registrations_;
  std::string peer_address_;
  std::string ticket_;
};

TEST_F(ReloadTest, SighupHandsEverythingOverToANewProcess) {
  ASSERT_NO_FATAL_FAILURE(StartOld());
  const uint64_t id = registrations_.front().id();
  const uint32_t rkey = registrations_.front().rkey();

  ASSERT_EQ(kill(old_->pid(), SIGHUP), 0);
  std::string skipped;
  std::optional<Notification> reloading =
      notify_->NextWith("RELOADING=1", absl::Seconds(10), &skipped);
  ASSERT_TRUE(reloading.has_value()) << skipped << old_->Log();
  EXPECT_EQ(reloading->pid, old_->pid());
  EXPECT_TRUE(absl::StrContains(reloading->text, "MONOTONIC_USEC="));
  std::optional<Notification> ready =
      notify_->NextWith("READY=1", absl::Seconds(30), &skipped);
  ASSERT_TRUE(ready.has_value()) << skipped << old_->Log();
  successor_ = ready->pid;
  EXPECT_NE(successor_, old_->pid()) << skipped << old_->Log();
  EXPECT_TRUE(
      NotifySocket::HasLine(ready->text, absl::StrCat("MAINPID=", successor_)))
      << ready->text;
  // The old process exits 0 (Stop in TearDown checks the status and that
  // it pinned nothing at the end).
  ASSERT_TRUE(old_->WaitExited(absl::Seconds(30))) << old_->Log();
  EXPECT_TRUE(absl::StrContains(old_->Log(), "handed over to the new mrd"))
      << old_->Log();
  // The successor is mrd's own binary, by its absolute path, with the old
  // one's arguments and --takeover.
  const std::string cmdline =
      ReadFile(absl::StrCat("/proc/", successor_, "/cmdline"));
  std::vector<std::string> argv = absl::StrSplit(cmdline, '\0');
  ASSERT_GE(argv.size(), 2u);
  EXPECT_EQ(argv[0], MrdBinary());
  EXPECT_TRUE(absl::StrContains(cmdline, runtime_dir_));
  EXPECT_TRUE(absl::StrContains(cmdline, std::string("--takeover\0", 11)));

  // The registration goes on in the new process: same id and rkey, a peer
  // reads through it, and it deregisters there.
  ASSERT_NO_FATAL_FAILURE(PeerReads());
  absl::StatusOr<v1::ListRegistrationsResponse> list = session_->List();
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->registrations_size(), 1);
  EXPECT_EQ(list->registrations(0).registration(), id);
  EXPECT_EQ(list->registrations(0).rkey(), rkey);
  absl::StatusOr<uint32_t> refs = registrations_.front().Deregister();
  ASSERT_TRUE(refs.ok()) << refs.status();
  EXPECT_EQ(*refs, 0u);
  registrations_.clear();

  // And the new main process stops as systemd stops it.
  ASSERT_EQ(kill(successor_, SIGTERM), 0);
  std::optional<Notification> stopping =
      notify_->NextWith("STOPPING=1", absl::Seconds(10), &skipped);
  ASSERT_TRUE(stopping.has_value()) << skipped;
  EXPECT_EQ(stopping->pid, successor_);
  int status = 0;
  const pid_t successor = successor_;
  ASSERT_EQ(waitpid(successor_, &status, 0), successor_);
  successor_ = 0;
  // As MrdProcess::Stop judges an mrd: exit 0, or ThreadSanitizer's 66
  // when every report of the successor's (in the shared runtime directory)
  // is gRPC's alone.
  int library_only = 0;
  const absl::Status reports =
      CheckSanitizerLog(old_->SanitizerLogOf(successor), &library_only);
  EXPECT_TRUE(reports.ok()) << reports;
  EXPECT_TRUE(WIFEXITED(status) &&
              (WEXITSTATUS(status) == 0 ||
               (WEXITSTATUS(status) == 66 && library_only > 0)))
      << status;
  EXPECT_TRUE(
      absl::StrContains(old_->Log(), "mrd stopped; device pinned bytes: 0"))
      << old_->Log();
}

TEST_F(ReloadTest, ASuccessorThatCannotTakeOverLeavesTheOldServing) {
  // The old mrd refuses every hello: each reload's successor exits 1.
  ASSERT_NO_FATAL_FAILURE(StartOld({"--handover_test_fault=old.hello"}));
  for (int reload = 0; reload < 2; ++reload) {
    ASSERT_EQ(kill(old_->pid(), SIGHUP), 0);
    std::string skipped;
    std::optional<Notification> reloading =
        notify_->NextWith("RELOADING=1", absl::Seconds(10), &skipped);
    ASSERT_TRUE(reloading.has_value()) << skipped << old_->Log();
    EXPECT_EQ(reloading->pid, old_->pid());
    // Reloading ends with READY=1 from the old process: no new main pid.
    std::optional<Notification> ready = notify_->Next(absl::Seconds(30));
    ASSERT_TRUE(ready.has_value()) << old_->Log();
    EXPECT_EQ(ready->pid, old_->pid()) << ready->text;
    EXPECT_EQ(ready->text, "READY=1");
    EXPECT_FALSE(old_->WaitExited(absl::ZeroDuration())) << old_->Log();
    ASSERT_NO_FATAL_FAILURE(PeerReads());
  }
  EXPECT_TRUE(absl::StrContains(old_->Log(), "reload failed: pid"))
      << old_->Log();
  EXPECT_TRUE(absl::StrContains(old_->Log(), "HANDOVER_TEST_FAULT"))
      << old_->Log();
  absl::StatusOr<uint32_t> refs = registrations_.front().Deregister();
  ASSERT_TRUE(refs.ok()) << refs.status();
  registrations_.clear();
  // Nothing more was said (no MAINPID from anyone).
  std::optional<Notification> more = notify_->Next(absl::Milliseconds(300));
  EXPECT_FALSE(more.has_value()) << more->pid << ": " << more->text;
}

// Kubernetes: the old pod's mrd (--after_handover=wait) stays after
// handing over, holding nothing, until SIGTERM; --handover_status_file says
// where each one is, and --await_handover (the preStop hook) returns at
// once for a process that handed over.
TEST_F(ReloadTest, AfterHandoverWaitHoldsNothingUntilSigterm) {
  const std::string old_status = runtime_dir_ + "/old.status";
  const std::string new_status = runtime_dir_ + "/new.status";
  ASSERT_NO_FATAL_FAILURE(StartOld(
      {"--after_handover=wait", "--handover_status_file=" + old_status}));
  EXPECT_TRUE(FileSays(old_status, "serving\n")) << ReadFile(old_status);
  std::string skipped;
  auto successor =
      MrdProcess::Start(Options({"--takeover", "--after_handover=wait",
                                 "--handover_status_file=" + new_status}));
  ASSERT_TRUE(successor.ok()) << successor.status();
  std::unique_ptr<MrdProcess> next = std::move(*successor);
  std::optional<Notification> ready =
      notify_->NextWith("READY=1", absl::Seconds(30), &skipped);
  ASSERT_TRUE(ready.has_value()) << skipped;
  EXPECT_EQ(ready->pid, next->pid());
  EXPECT_EQ(ReadFile(new_status), "serving\n");
  // The old one handed over and stays, holding nothing.
  EXPECT_TRUE(FileSays(old_status, "handed-over\n")) << ReadFile(old_status);
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_FALSE(old_->WaitExited(absl::ZeroDuration())) << old_->Log();
  EXPECT_EQ(VmLckKb(old_->pid()), "0");
  EXPECT_TRUE(absl::StrContains(old_->Log(), "--after_handover=wait"))
      << old_->Log();
  // SIGHUP now is no reload (it has nothing to hand over).
  ASSERT_EQ(kill(old_->pid(), SIGHUP), 0);
  std::optional<Notification> none = notify_->Next(absl::Milliseconds(300));
  EXPECT_FALSE(none.has_value()) << none->pid << ": " << none->text;
  // preStop: returns at once, for the old one as for the new one.
  for (const std::string& status : {old_status, new_status}) {
    MrdProcessOptions await =
        Options({"--handover_status_file=" + status, "--await_handover=5s"});
    absl::StatusOr<MrdExit> waited = MrdProcess::RunToExit(await, 3000);
    ASSERT_TRUE(waited.ok()) << waited.status();
    EXPECT_TRUE(WIFEXITED(waited->status) && WEXITSTATUS(waited->status) == 0)
        << waited->log;
  }
  // The registration is the new one's; the old exits 0 on SIGTERM.
  ASSERT_NO_FATAL_FAILURE(PeerReads());
  absl::Status stopped = old_->Stop();
  EXPECT_TRUE(stopped.ok()) << stopped;
  old_.reset();
  ASSERT_NO_FATAL_FAILURE(PeerReads());
  ASSERT_TRUE(registrations_.front().Deregister().ok());
  registrations_.clear();
  session_.reset();
  client_.reset();
  absl::Status next_stopped = next->Stop();
  EXPECT_TRUE(next_stopped.ok()) << next_stopped;
  EXPECT_EQ(ReadFile(new_status), "stopped\n");
}

// --await_handover waits while the status file says a handover is in
// progress, and gives up (exit 1) when it still is at the deadline.
TEST_F(ReloadTest, AwaitHandoverWaitsForAHandoverInProgress) {
  const std::string status = runtime_dir_ + "/status";
  {
    std::ofstream out(status);
    out << "handing-over\n";
  }
  MrdProcessOptions await =
      Options({"--handover_status_file=" + status, "--await_handover=1s"});
  const absl::Time start = absl::Now();
  absl::StatusOr<MrdExit> waited = MrdProcess::RunToExit(await, 5000);
  ASSERT_TRUE(waited.ok()) << waited.status();
  EXPECT_TRUE(WIFEXITED(waited->status) && WEXITSTATUS(waited->status) == 1)
      << waited->log;
  EXPECT_GE(absl::Now() - start, absl::Seconds(1));
  EXPECT_TRUE(absl::StrContains(waited->log, "still says handing-over"))
      << waited->log;
}

}  // namespace
}  // namespace mrd::testing
