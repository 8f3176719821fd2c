// FdServer over a real SOCK_SEQPACKET socket, with raw clients and a handler
// that really maps what it is given (MapMemfd). Every test ends with the
// invariant that each session OnConnect opened got exactly one OnDisconnect
// and holds no buffer any more.
#include "server/fd_socket/fd_server.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "server/common/fd_budget.h"
#include "server/fd_socket/memory_file.h"
#include "tests/unit/fd_socket/fd_socket_test_util.h"

namespace mrd::fd_socket {
namespace {

using ::mrd::fd_socket::testing::CountOpenFds;
using ::mrd::fd_socket::testing::FdIsOpen;
using ::mrd::fd_socket::testing::IsErrorReply;
using ::mrd::fd_socket::testing::MakeMemfd;
using ::mrd::fd_socket::testing::MakeSealedMemfd;
using ::mrd::fd_socket::testing::RawClient;
using ::mrd::fd_socket::testing::TempDir;

constexpr absl::Duration kWait = absl::Seconds(10);
constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

// A handler as the core would write it: a session is a set of mapped
// buffers, released when the connection goes away.
class MappingHandler final : public FdSessionHandler {
 public:
  // Session tokens are `prefix` and a count.
  explicit MappingHandler(std::string prefix = "session-")
      : prefix_(std::move(prefix)) {}

  absl::StatusOr<std::string> OnConnect(const PeerCredentials& creds) override {
    absl::MutexLock lock(&mu_);
    connects_.push_back(creds);
    if (!connect_error_.ok()) return connect_error_;
    std::string session = absl::StrCat(prefix_, connects_.size());
    sessions_.push_back(session);
    return session;
  }

  absl::StatusOr<v1::BufferInfo> OnImport(
      const std::string& session, UniqueFd fd,
      const v1::ImportMemfd& request) override {
    absl::Notification* entered;
    absl::Notification* release;
    {
      absl::MutexLock lock(&mu_);
      entered = import_entered_;
      release = import_release_;
    }
    if (entered != nullptr) {
      entered->Notify();
      release->WaitForNotification();
    }
    // MSG_CMSG_CLOEXEC: a received fd must not leak into a child process.
    const bool cloexec = (::fcntl(fd.get(), F_GETFD) & FD_CLOEXEC) != 0;
    {
      absl::MutexLock lock(&mu_);
      if (!cloexec) ++imports_without_cloexec_;
    }
    MemfdImportOptions options;
    options.writable = request.writable();
    options.expected_size = request.expected_size();
    options.max_size = 1 << 20;
    absl::StatusOr<std::unique_ptr<MappedFile>> file =
        MapMemfd(std::move(fd), options);
    if (!file.ok()) return file.status();
    v1::BufferInfo info;
    info.set_size((*file)->size());
    info.set_writable((*file)->writable());
    info.set_device((*file)->device());
    info.set_inode((*file)->inode());
    info.set_source((*file)->source());
    info.set_address(reinterpret_cast<uintptr_t>((*file)->address()));
    absl::MutexLock lock(&mu_);
    std::vector<std::unique_ptr<MappedFile>>& buffers = buffers_[session];
    buffers.push_back(*std::move(file));
    info.set_buffer(buffers.size());
    ++imports_;
    return info;
  }

  void OnDisconnect(const std::string& session) override {
    absl::MutexLock lock(&mu_);
    ++disconnects_[session];
    ++total_disconnects_;
    buffers_.erase(session);
  }

  void FailConnects(absl::Status status) {
    absl::MutexLock lock(&mu_);
    connect_error_ = std::move(status);
  }
  // OnImport signals `entered`, then waits for `release`.
  void BlockImports(absl::Notification* entered, absl::Notification* release) {
    absl::MutexLock lock(&mu_);
    import_entered_ = entered;
    import_release_ = release;
  }

  // Polls rather than Mutex::Await, which TSan cannot follow with Debian's
  // uninstrumented absl (see tsan_absl_annotations.cc).
  bool WaitForDisconnects(int total) {
    const absl::Time deadline = absl::Now() + kWait;
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        if (total_disconnects_ >= total) return true;
      }
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(1));
    }
  }
  int DisconnectsOf(const std::string& session) {
    absl::MutexLock lock(&mu_);
    auto it = disconnects_.find(session);
    return it == disconnects_.end() ? 0 : it->second;
  }
  int TotalDisconnects() {
    absl::MutexLock lock(&mu_);
    return total_disconnects_;
  }
  int ImportsWithoutCloexec() {
    absl::MutexLock lock(&mu_);
    return imports_without_cloexec_;
  }
  int Imports() {
    absl::MutexLock lock(&mu_);
    return imports_;
  }
  std::vector<PeerCredentials> Connects() {
    absl::MutexLock lock(&mu_);
    return connects_;
  }
  size_t BuffersOf(const std::string& session) {
    absl::MutexLock lock(&mu_);
    auto it = buffers_.find(session);
    return it == buffers_.end() ? 0 : it->second.size();
  }
  // The bytes of buffer `index` (0-based) of `session`, through the mapping.
  std::string BufferBytes(const std::string& session, size_t index) {
    absl::MutexLock lock(&mu_);
    const MappedFile& file = *buffers_.at(session).at(index);
    return std::string(static_cast<const char*>(file.address()), file.size());
  }

  // What a handover does to the core's side of a session: `from` forgets it
  // (without a disconnect) and `to` holds it, buffers included.
  static void HandOver(MappingHandler& from, MappingHandler& to,
                       const std::string& session) {
    std::vector<std::unique_ptr<MappedFile>> buffers;
    {
      absl::MutexLock lock(&from.mu_);
      auto& sessions = from.sessions_;
      sessions.erase(std::remove(sessions.begin(), sessions.end(), session),
                     sessions.end());
      auto it = from.buffers_.find(session);
      if (it != from.buffers_.end()) {
        buffers = std::move(it->second);
        from.buffers_.erase(it);
      }
    }
    absl::MutexLock lock(&to.mu_);
    to.sessions_.push_back(session);
    if (!buffers.empty()) to.buffers_[session] = std::move(buffers);
  }

  // Each opened session was closed exactly once, and nothing is held.
  ::testing::AssertionResult EverySessionClosedOnce() {
    absl::MutexLock lock(&mu_);
    for (const std::string& session : sessions_) {
      auto it = disconnects_.find(session);
      const int count = it == disconnects_.end() ? 0 : it->second;
      if (count != 1) {
        return ::testing::AssertionFailure()
               << session << " got " << count << " OnDisconnect calls";
      }
    }
    if (disconnects_.size() != sessions_.size()) {
      return ::testing::AssertionFailure()
             << "OnDisconnect for a session that was never opened";
    }
    if (!buffers_.empty()) {
      return ::testing::AssertionFailure() << "buffers still held";
    }
    return ::testing::AssertionSuccess();
  }

 private:
  const std::string prefix_;
  absl::Mutex mu_;
  absl::Status connect_error_ ABSL_GUARDED_BY(mu_);
  absl::Notification* import_entered_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Notification* import_release_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::vector<PeerCredentials> connects_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> sessions_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> disconnects_ ABSL_GUARDED_BY(mu_);
  int total_disconnects_ ABSL_GUARDED_BY(mu_) = 0;
  int imports_ ABSL_GUARDED_BY(mu_) = 0;
  int imports_without_cloexec_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, std::vector<std::unique_ptr<MappedFile>>> buffers_
      ABSL_GUARDED_BY(mu_);
};

// Nothing to read and no hangup on `fd` right now.
bool Quiet(int fd) {
  struct pollfd pfd;
  pfd.fd = fd;
  pfd.events = POLLIN | POLLRDHUP;
  pfd.revents = 0;
  return ::poll(&pfd, 1, 0) == 0;
}

bool SocketFileExists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
}

bool CanConnect(const std::string& path) {
  UniqueFd sock(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  struct sockaddr_un addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  return ::connect(sock.get(), reinterpret_cast<const struct sockaddr*>(&addr),
                   sizeof(addr)) == 0;
}

class FdServerTest : public ::testing::Test {
 protected:
  FdServerTest() : dir_("/tmp") {}

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
    EXPECT_TRUE(handler_.EverySessionClosedOnce());
  }

  std::string SocketPath() const { return dir_.Sub("fd.sock"); }

  void StartServer(FdServerOptions options = FdServerOptions()) {
    options.path = SocketPath();
    absl::StatusOr<std::unique_ptr<FdServer>> server =
        FdServer::Start(options, &handler_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  // A client past its welcome; its session token in `session`.
  std::unique_ptr<RawClient> Connect(std::string* session = nullptr) {
    auto client = std::make_unique<RawClient>(SocketPath());
    if (!client->valid()) return nullptr;
    std::optional<v1::FdWelcome> welcome = client->ReceiveWelcome();
    if (!welcome.has_value()) return nullptr;
    if (session != nullptr) *session = welcome->session();
    return client;
  }

  // An import of a memfd of `contents` on `client` works.
  ::testing::AssertionResult ImportWorks(RawClient& client, uint64_t sequence,
                                         absl::string_view contents) {
    UniqueFd memfd = MakeMemfd(contents, F_SEAL_SHRINK);
    if (!client.SendImport(sequence, memfd.get())) {
      return ::testing::AssertionFailure() << "send failed";
    }
    std::optional<v1::FdReply> reply = client.Receive();
    if (!reply.has_value()) {
      return ::testing::AssertionFailure() << "no reply";
    }
    if (!reply->has_buffer() || reply->sequence() != sequence) {
      return ::testing::AssertionFailure()
             << "expected buffer " << sequence << ", got "
             << reply->ShortDebugString();
    }
    return ::testing::AssertionSuccess();
  }

  // The connection still works: a ping gets its pong.
  ::testing::AssertionResult PingWorks(RawClient& client, uint64_t sequence) {
    if (!client.SendPing(sequence)) {
      return ::testing::AssertionFailure() << "send failed";
    }
    std::optional<v1::FdReply> reply = client.Receive();
    if (!reply.has_value()) {
      return ::testing::AssertionFailure() << "no reply";
    }
    if (!reply->has_pong() || reply->sequence() != sequence) {
      return ::testing::AssertionFailure()
             << "expected pong " << sequence << ", got "
             << reply->ShortDebugString();
    }
    return ::testing::AssertionSuccess();
  }

  // Declared in this order so the server goes before the handler and dir.
  MappingHandler handler_;
  TempDir dir_;
  std::unique_ptr<FdServer> server_;
};

// ---------------------------------------------------------------------------
// Connecting

TEST_F(FdServerTest, WelcomeCarriesSessionAndPeerCredentials) {
  StartServer();
  RawClient client(SocketPath());
  ASSERT_TRUE(client.valid());
  std::optional<v1::FdReply> reply = client.Receive();
  ASSERT_TRUE(reply.has_value());
  ASSERT_TRUE(reply->has_welcome()) << reply->ShortDebugString();
  EXPECT_EQ(reply->sequence(), 0u);
  EXPECT_EQ(reply->welcome().session(), "session-1");
  EXPECT_EQ(reply->welcome().peer_uid(), ::getuid());
  EXPECT_EQ(reply->welcome().peer_pid(), static_cast<uint32_t>(::getpid()));
  EXPECT_EQ(reply->welcome().protocol_version(), FdServer::kProtocolVersion);
  std::vector<PeerCredentials> connects = handler_.Connects();
  ASSERT_EQ(connects.size(), 1u);
  EXPECT_EQ(connects[0].pid, ::getpid());
  EXPECT_EQ(connects[0].uid, ::getuid());
  EXPECT_EQ(connects[0].gid, ::getgid());
  EXPECT_EQ(server_->ConnectionCount(), 1u);
}

TEST_F(FdServerTest, SocketFileGetsTheDefaultMode) {
  StartServer();
  struct stat st;
  ASSERT_EQ(::lstat(SocketPath().c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0660u);
}

TEST_F(FdServerTest, SocketFileGetsTheConfiguredMode) {
  FdServerOptions options;
  options.mode = 0600;
  StartServer(options);
  struct stat st;
  ASSERT_EQ(::lstat(SocketPath().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
}

TEST_F(FdServerTest, PeerNotInTheAllowListIsRefusedWithItsUid) {
  FdServerOptions options;
  options.allowed_uids = {::getuid() + 4242};
  StartServer(options);
  RawClient client(SocketPath());
  ASSERT_TRUE(client.valid());
  std::optional<v1::FdReply> reply = client.Receive();
  ASSERT_TRUE(reply.has_value());
  EXPECT_TRUE(IsErrorReply(*reply, absl::StatusCode::kPermissionDenied,
                           "PEER_NOT_ALLOWED"));
  EXPECT_NE(reply->error().message().find(absl::StrCat("uid ", ::getuid())),
            std::string::npos)
      << reply->error().message();
  EXPECT_TRUE(client.ReceiveEof());
  EXPECT_TRUE(handler_.Connects().empty());
}

TEST_F(FdServerTest, PeerAllowedByGroup) {
  FdServerOptions options;
  options.allowed_uids = {::getuid() + 4242};
  options.allowed_gids = {::getgid()};
  StartServer(options);
  EXPECT_NE(Connect(), nullptr);
}

TEST_F(FdServerTest, PeerAllowedByUid) {
  FdServerOptions options;
  options.allowed_uids = {::getuid()};
  options.allowed_gids = {::getgid() + 4242};
  StartServer(options);
  EXPECT_NE(Connect(), nullptr);
}

TEST_F(FdServerTest, OnConnectErrorIsSentAndTheConnectionClosed) {
  handler_.FailConnects(
      MrdError(absl::StatusCode::kUnavailable, "SHUTTING_DOWN", "not now"));
  StartServer();
  RawClient client(SocketPath());
  std::optional<v1::FdReply> reply = client.Receive();
  ASSERT_TRUE(reply.has_value());
  EXPECT_TRUE(
      IsErrorReply(*reply, absl::StatusCode::kUnavailable, "SHUTTING_DOWN"));
  EXPECT_EQ(reply->error().message(), "not now");
  EXPECT_TRUE(client.ReceiveEof());
  EXPECT_EQ(server_->ConnectionCount(), 0u);
}

TEST_F(FdServerTest, ConnectionsBeyondTheLimitAreRefused) {
  FdServerOptions options;
  options.max_connections = 2;
  StartServer(options);
  std::unique_ptr<RawClient> a = Connect();
  std::unique_ptr<RawClient> b = Connect();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);

  RawClient c(SocketPath());
  std::optional<v1::FdReply> reply = c.Receive();
  ASSERT_TRUE(reply.has_value());
  EXPECT_TRUE(IsErrorReply(*reply, absl::StatusCode::kResourceExhausted,
                           "TOO_MANY_SESSIONS"));
  EXPECT_TRUE(c.ReceiveEof());
  EXPECT_EQ(handler_.Connects().size(), 2u);

  a->Close();
  ASSERT_TRUE(handler_.WaitForDisconnects(1));
  EXPECT_NE(Connect(), nullptr);
}

TEST_F(FdServerTest, ConnectionsBeyondTheFdBudgetAreRefused) {
  FdBudgetOptions budget_options;
  budget_options.limit = 12;
  budget_options.reserve = 10;  // room for two connections
  absl::StatusOr<std::unique_ptr<FdBudget>> budget =
      FdBudget::Create(budget_options);
  ASSERT_TRUE(budget.ok()) << budget.status();
  FdServerOptions options;
  options.fd_budget = budget->get();
  StartServer(options);
  std::unique_ptr<RawClient> a = Connect();
  std::unique_ptr<RawClient> b = Connect();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ((*budget)->Stats().charged, 2u);

  RawClient c(SocketPath());
  std::optional<v1::FdReply> reply = c.Receive();
  ASSERT_TRUE(reply.has_value());
  EXPECT_TRUE(IsErrorReply(*reply, absl::StatusCode::kResourceExhausted,
                           "LIMIT_TOTAL_FDS"));
  EXPECT_TRUE(c.ReceiveEof());
  EXPECT_EQ(handler_.Connects().size(), 2u);

  a->Close();
  ASSERT_TRUE(handler_.WaitForDisconnects(1));
  EXPECT_NE(Connect(), nullptr);
  server_->Shutdown();
  EXPECT_EQ((*budget)->Stats().charged, 0u);
}

// The process is out of fds when a client connects: the server gives up its
// spare fd to accept the connection and refuse it (LIMIT_OPEN_FILES), instead
// of leaving it in the backlog, and serves normally once fds are back.
TEST_F(FdServerTest, AcceptAtTheOpenFileLimitRefusesWithTheSpareFd) {
#if defined(__SANITIZE_ADDRESS__)
  // UBSan's vptr check probes memory through a pipe it opens; with no fd
  // left it reports every object as invalid. The plain and TSan builds run
  // this test.
  GTEST_SKIP() << "sanitizer runtime needs fds at the open-file limit";
#endif
  StartServer();
  std::unique_ptr<RawClient> a = Connect();
  ASSERT_NE(a, nullptr);
  struct rlimit saved;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  // Fill every hole below the highest open fd, so that with the limit at
  // highest + 2 exactly one fd is left: the client's socket.
  std::vector<UniqueFd> fillers;
  int highest = -1;
  for (int fd = 0; fd < 65536; ++fd) {
    if (FdIsOpen(fd)) highest = fd;
  }
  while (true) {
    UniqueFd filler(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(filler.valid());
    if (filler.get() > highest) break;
    fillers.push_back(std::move(filler));
  }
  struct rlimit tight = saved;
  tight.rlim_cur = static_cast<rlim_t>(highest) + 2;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &tight), 0);
  std::optional<v1::FdReply> reply;
  {
    RawClient c(SocketPath());
    reply = c.Receive();
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  }
  ASSERT_TRUE(reply.has_value());
  EXPECT_TRUE(IsErrorReply(*reply, absl::StatusCode::kResourceExhausted,
                           "LIMIT_OPEN_FILES"));
  EXPECT_TRUE(PingWorks(*a, 1));
  EXPECT_NE(Connect(), nullptr);
}

// ---------------------------------------------------------------------------
// Requests

TEST_F(FdServerTest, PingGetsPongWithItsSequence) {
  StartServer();
  std::unique_ptr<RawClient> client = Connect();
  ASSERT_NE(client, nullptr);
  EXPECT_TRUE(PingWorks(*client, 7));
  EXPECT_TRUE(PingWorks(*client, 8));
}

TEST_F(FdServerTest, ImportMapsTheMemfd) {
  StartServer();
  std::string session;
  std::unique_ptr<RawClient> client = Connect(&session);
  ASSERT_NE(client, nullptr);
  const std::string contents = "bytes the server must see";
  UniqueFd memfd = MakeMemfd(contents, F_SEAL_SHRINK);
  struct stat st;
  ASSERT_EQ(::fstat(memfd.get(), &st), 0);

  ASSERT_TRUE(
      client->SendImport(41, memfd.get(), /*writable=*/true, contents.size()));
  std::optional<v1::FdReply> reply = client->Receive();
  ASSERT_TRUE(reply.has_value());
  ASSERT_TRUE(reply->has_buffer()) << reply->ShortDebugString();
  EXPECT_EQ(reply->sequence(), 41u);
  EXPECT_EQ(reply->buffer().buffer(), 1u);
  EXPECT_EQ(reply->buffer().size(), contents.size());
  EXPECT_TRUE(reply->buffer().writable());
  EXPECT_EQ(reply->buffer().source(), "memfd");
  EXPECT_EQ(reply->buffer().inode(), static_cast<uint64_t>(st.st_ino));
  EXPECT_NE(reply->buffer().address(), 0u);
  EXPECT_EQ(handler_.BufferBytes(session, 0), contents);
  EXPECT_EQ(handler_.ImportsWithoutCloexec(), 0);

  // The server holds its own reference: closing ours changes nothing there,
  // and its writable mapping is shared with our view.
  memfd.Reset();
  EXPECT_EQ(handler_.BufferBytes(session, 0), contents);
}

TEST_F(FdServerTest, ImportErrorComesBackAsFdErrorWithDetail) {
  StartServer();
  std::unique_ptr<RawClient> client = Connect();
  ASSERT_NE(client, nullptr);
  UniqueFd unsealed = MakeMemfd("not sealed", 0);
  const int before = CountOpenFds();
  ASSERT_TRUE(client->SendImport(5, unsealed.get()));
  std::optional<v1::FdReply> reply = client->Receive();
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(reply->sequence(), 5u);
  EXPECT_TRUE(IsErrorReply(*reply, kInvalid, "NOT_SEALED"));
  EXPECT_EQ(reply->error().detail().seed_status(),
            ::mrd::STATUS_INVALID_PARAMETER);
  EXPECT_NE(reply->error().message().find("F_SEAL_SHRINK"), std::string::npos);
  EXPECT_EQ(CountOpenFds(), before) << "the refused fd was not closed";
  // A second error, from the handler's size check.
  UniqueFd sealed = MakeSealedMemfd(4096);
  ASSERT_TRUE(client->SendImport(6, sealed.get(), false, 8192));
  reply = client->Receive();
  ASSERT_TRUE(reply.has_value());
  EXPECT_TRUE(IsErrorReply(*reply, kInvalid, "SIZE_MISMATCH"));
  EXPECT_TRUE(PingWorks(*client, 7));
}

TEST_F(FdServerTest, GarbageIsMalformedAndTheConnectionStaysUsable) {
  StartServer();
  std::unique_ptr<RawClient> client = Connect();
  ASSERT_NE(client, nullptr);
  const std::string garbage = "\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff";
  ASSERT_FALSE(v1::FdRequest().ParseFromString(garbage));
  ASSERT_TRUE(client->SendRaw(garbage));
  std::optional<v1::FdReply> reply = client->Receive();
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(reply->sequence(), 0u);
  EXPECT_TRUE(IsErrorReply(*reply, kInvalid, "MALFORMED_REQUEST"));
  EXPECT_TRUE(PingWorks(*client, 2));
}

TEST_F(FdServerTest, GarbageWithAnFdIsMalformedAndTheFdIsClosed) {
  StartServer();
  std::unique_ptr<RawClient> client = Connect();
  ASSERT_NE(client, nullptr);
  UniqueFd memfd = MakeSealedMemfd(4096);
  const int before = CountOpenFds();
  ASSERT_TRUE(client->SendRaw("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",
                              {memfd.get()}));
  std::optional<v1::FdReply> reply = client->Receive();
  ASSERT_TRUE(reply.has_value());
  EXPECT_TRUE(IsErrorReply(*reply, kInvalid, "MALFORMED_REQUEST"));
  EXPECT_EQ(CountOpenFds(), before);
  EXPECT_EQ(handler_.Imports(), 0);
}

TEST_F(FdServerTest, EmptyDatagramIsAnUnknownOperation) {
  StartServer();
  std::unique_ptr<RawClient> client = Connect();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->SendRaw(""));
  std::optional<v1::FdReply> reply = client->Receive();
  ASSERT_TRUE(reply.has_value());
  EXPECT_TRUE(IsErrorReply(*reply, kInvalid, "UNKNOWN_OPERATION"));
  EXPECT_TRUE(PingWorks(*client, 3));
}

// The server thread's tid, found by its name (Thread::Start names it).
pid_t FdServerThreadId() {
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) return 0;
  pid_t found = 0;
  while (struct dirent* e = ::readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream comm(absl::StrCat("/proc/self/task/", e->d_name, "/comm"));
    std::string name;
    std::getline(comm, name);
    if (name == "mrd-fd-socket")
      found = static_cast<pid_t>(std::atoi(e->d_name));
  }
  ::closedir(dir);
  return found;
}

void IgnoreSignal(int) {}

// An empty datagram reads like the end of the stream; the server tells them
// apart by asking whether the peer shut down. A signal landing on the
// server thread right then must not make it take the datagram for the end
// and drop the session.
TEST_F(FdServerTest,
       EmptyDatagramsUnderASignalStormAreAnsweredNotTakenForTheEnd) {
  StartServer();
  std::unique_ptr<RawClient> client = Connect();
  ASSERT_NE(client, nullptr);
  const pid_t server_thread = FdServerThreadId();
  ASSERT_NE(server_thread, 0);
  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  action.sa_handler = IgnoreSignal;  // no SA_RESTART: calls see EINTR
  struct sigaction previous;
  ASSERT_EQ(::sigaction(SIGUSR2, &action, &previous), 0);
  std::atomic<bool> stop{false};
  std::thread storm([&] {
    while (!stop.load()) {
      ::syscall(SYS_tgkill, ::getpid(), server_thread, SIGUSR2);
    }
  });
  int answered = 0;
  constexpr int kDatagrams = 20000;
  for (int i = 0; i < kDatagrams; ++i) {
    if (!client->SendRaw("")) break;
    std::optional<v1::FdReply> reply = client->Receive();
    if (!reply.has_value()) break;
    if (!IsErrorReply(*reply, kInvalid, "UNKNOWN_OPERATION")) break;
    ++answered;
  }
  stop.store(true);
  storm.join();
  // A signal sent may still be pending on the server thread (a loaded
  // machine had not scheduled it yet): ignoring the signal discards it,
  // where the default action restored straight away would end the process.
  struct sigaction ignore;
  std::memset(&ignore, 0, sizeof(ignore));
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(::sigaction(SIGUSR2, &ignore, nullptr), 0);
  ::sigaction(SIGUSR2, &previous, nullptr);
  EXPECT_EQ(answered, kDatagrams);
  EXPECT_TRUE(PingWorks(*client, 3));
}

TEST_F(FdServerTest, RequestWithoutOperationEchoesItsSequence) {
  StartServer();
  std::unique_ptr<RawClient> client = Connect();
  ASSERT_NE(client, nullptr);
  v1::FdRequest request;
  request.set_sequence(99);
  ASSERT_TRUE(client->Send(request));
  std::optional<v1::FdReply> reply = client->Receive();
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(reply->sequence(), 99u);
  EXPECT_TRUE(IsErrorReply(*reply, kInvalid, "UNKNOWN_OPERATION"));
}

TEST_F(FdServerTest, OversizedDatagramIsRefusedAndTheConnectionStaysUsable) {
  StartServer();
  std::unique_ptr<RawClient> client = Connect();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(
      client->SendRaw(std::string(3 * FdServer::kMaxRequestBytes, 'x')));
  std::optional<v1::FdReply> reply = client->Receive();
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(reply->sequence(), 0u);
  EXPECT_TRUE(IsErrorReply(*reply, kInvalid, "MESSAGE_TOO_LARGE"));
  EXPECT_NE(reply->error().message().find(
                absl::StrCat(3 * FdServer::kMaxRequestBytes)),
            std::string::npos)
      << reply->error().message();
  EXPECT_TRUE(PingWorks(*client, 4));
}

TEST_F(FdServerTest, ImportWithoutAnFdIsMissingFd) {
  StartServer();
  std::unique_ptr<RawClient> client = Connect();
  ASSERT_NE(client, nullptr);
  v1::FdRequest request;
  request.set_sequence(12);
  request.mutable_import_memfd();
  ASSERT_TRUE(client->Send(request));
  std::optional<v1::FdReply> reply = client->Receive();
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(reply->sequence(), 12u);
  EXPECT_TRUE(IsErrorReply(*reply, kInvalid, "MISSING_FD"));
  EXPECT_TRUE(PingWorks(*client, 13));
}

TEST_F(FdServerTest, PingWithAnFdIsUnexpectedAndTheFdIsClosed) {
  StartServer();
  std::unique_ptr<RawClient> client = Connect();
  ASSERT_NE(client, nullptr);
  UniqueFd memfd = MakeSealedMemfd(4096);
  const int before = CountOpenFds();
  v1::FdRequest request;
  request.set_sequence(21);
  request.mutable_ping();
  ASSERT_TRUE(client->Send(request, {memfd.get()}));
  std::optional<v1::FdReply> reply = client->Receive();
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(reply->sequence(), 21u);
  EXPECT_TRUE(IsErrorReply(*reply, kInvalid, "UNEXPECTED_FD"));
  EXPECT_EQ(CountOpenFds(), before) << "the server kept the fd";
  EXPECT_TRUE(PingWorks(*client, 22));
}

TEST_F(FdServerTest, TwoFdsAreRefusedAndBothClosed) {
  StartServer();
  std::unique_ptr<RawClient> client = Connect();
  ASSERT_NE(client, nullptr);
  UniqueFd a = MakeSealedMemfd(4096);
  UniqueFd b = MakeSealedMemfd(4096);
  const int before = CountOpenFds();
  v1::FdRequest request;
  request.set_sequence(31);
  request.mutable_import_memfd();
  ASSERT_TRUE(client->Send(request, {a.get(), b.get()}));
  std::optional<v1::FdReply> reply = client->Receive();
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(reply->sequence(), 31u);
  EXPECT_TRUE(IsErrorReply(*reply, kInvalid, "TOO_MANY_FDS"));
  EXPECT_EQ(CountOpenFds(), before) << "the server kept a received fd";
  EXPECT_EQ(handler_.Imports(), 0);
  EXPECT_TRUE(PingWorks(*client, 32));
}

TEST_F(FdServerTest, ManyFdsTruncateTheControlDataAndLeakNothing) {
  StartServer();
  std::unique_ptr<RawClient> client = Connect();
  ASSERT_NE(client, nullptr);
  std::vector<UniqueFd> memfds;
  std::vector<int> numbers;
  for (int i = 0; i < 10; ++i) {
    memfds.push_back(MakeSealedMemfd(4096));
    numbers.push_back(memfds.back().get());
  }
  const int before = CountOpenFds();
  v1::FdRequest request;
  request.set_sequence(51);
  request.mutable_import_memfd();
  ASSERT_TRUE(client->Send(request, numbers));
  std::optional<v1::FdReply> reply = client->Receive();
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(reply->sequence(), 51u);
  EXPECT_TRUE(IsErrorReply(*reply, kInvalid, "CONTROL_TRUNCATED"));
  EXPECT_EQ(CountOpenFds(), before) << "a received fd leaked";
  EXPECT_EQ(handler_.Imports(), 0);
  // Still usable, also for a proper import.
  ASSERT_TRUE(client->SendImport(52, numbers[0]));
  reply = client->Receive();
  ASSERT_TRUE(reply.has_value());
  EXPECT_TRUE(reply->has_buffer()) << reply->ShortDebugString();
}

TEST_F(FdServerTest, SlowReaderIsNotReadFromButGetsEveryReplyInOrder) {
  StartServer();
  std::unique_ptr<RawClient> client = Connect();
  ASSERT_NE(client, nullptr);
  // Send without reading replies until the socket refuses, pause so the
  // server can catch up, and repeat. A server that keeps reading (buffering
  // replies without bound) always makes room again; one that stops reading
  // from a client that does not read leaves the socket full, so some round
  // sends nothing.
  constexpr int kMaxRounds = 200;
  uint64_t sent = 0;
  v1::FdRequest request;
  request.mutable_ping();
  bool server_stopped_reading = false;
  for (int round = 0; round < kMaxRounds && !server_stopped_reading; ++round) {
    uint64_t this_round = 0;
    while (true) {
      request.set_sequence(sent + 1);
      if (!client->SendRaw(request.SerializeAsString(), {}, MSG_DONTWAIT)) {
        break;
      }
      ++sent;
      ++this_round;
    }
    server_stopped_reading = round > 0 && this_round == 0;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(server_stopped_reading)
      << "the server kept reading requests from a client that reads no "
         "replies ("
      << sent << " sent)";
  for (uint64_t i = 1; i <= sent; ++i) {
    std::optional<v1::FdReply> reply = client->Receive();
    ASSERT_TRUE(reply.has_value()) << "reply " << i << " of " << sent;
    ASSERT_TRUE(reply->has_pong());
    ASSERT_EQ(reply->sequence(), i);
  }
  EXPECT_TRUE(PingWorks(*client, sent + 1));
}

TEST_F(FdServerTest, HalfClosedClientGetsItsRepliesThenTheSessionEnds) {
  StartServer();
  std::string session;
  std::unique_ptr<RawClient> client = Connect(&session);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->SendPing(1));
  ASSERT_TRUE(client->SendPing(2));
  ASSERT_EQ(::shutdown(client->fd(), SHUT_WR), 0);
  for (uint64_t i = 1; i <= 2; ++i) {
    std::optional<v1::FdReply> reply = client->Receive();
    ASSERT_TRUE(reply.has_value());
    EXPECT_EQ(reply->sequence(), i);
  }
  EXPECT_TRUE(client->ReceiveEof());
  ASSERT_TRUE(handler_.WaitForDisconnects(1));
  EXPECT_EQ(handler_.DisconnectsOf(session), 1);
}

// ---------------------------------------------------------------------------
// Disconnecting

TEST_F(FdServerTest, ClosingTheConnectionReleasesTheSessionOnce) {
  StartServer();
  const int baseline = CountOpenFds();
  std::string session;
  std::unique_ptr<RawClient> client = Connect(&session);
  ASSERT_NE(client, nullptr);
  {
    UniqueFd memfd = MakeSealedMemfd(4096);
    ASSERT_TRUE(client->SendImport(1, memfd.get()));
    ASSERT_TRUE(client->Receive().has_value());
  }
  EXPECT_EQ(handler_.BuffersOf(session), 1u);
  EXPECT_EQ(server_->ConnectionCount(), 1u);
  client->Close();
  ASSERT_TRUE(handler_.WaitForDisconnects(1));
  EXPECT_EQ(handler_.DisconnectsOf(session), 1);
  EXPECT_EQ(handler_.BuffersOf(session), 0u);
  EXPECT_EQ(server_->ConnectionCount(), 0u);
  EXPECT_EQ(CountOpenFds(), baseline);
}

TEST_F(FdServerTest, ClientClosingRightAfterAnImportDisturbsNothing) {
  StartServer();
  const int baseline = CountOpenFds();
  std::string session;
  {
    std::unique_ptr<RawClient> client = Connect(&session);
    ASSERT_NE(client, nullptr);
    UniqueFd memfd = MakeSealedMemfd(4096);
    ASSERT_TRUE(client->SendImport(1, memfd.get()));
  }  // closes the socket and our memfd with the request possibly unread
  ASSERT_TRUE(handler_.WaitForDisconnects(1));
  std::unique_ptr<RawClient> other = Connect();
  ASSERT_NE(other, nullptr);
  EXPECT_TRUE(PingWorks(*other, 1));
  EXPECT_EQ(handler_.DisconnectsOf(session), 1);
  other.reset();
  ASSERT_TRUE(handler_.WaitForDisconnects(2));
  EXPECT_EQ(CountOpenFds(), baseline);
}

TEST_F(FdServerTest, ClientGoneWhileItsImportRunsIsDisconnectedOnce) {
  StartServer();
  const int baseline = CountOpenFds();
  absl::Notification entered;
  absl::Notification release;
  handler_.BlockImports(&entered, &release);
  std::string session;
  std::unique_ptr<RawClient> client = Connect(&session);
  ASSERT_NE(client, nullptr);
  {
    UniqueFd memfd = MakeSealedMemfd(4096);
    ASSERT_TRUE(client->SendImport(1, memfd.get()));
  }
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(kWait));
  client.reset();  // gone while the server is inside OnImport
  handler_.BlockImports(nullptr, nullptr);
  release.Notify();
  ASSERT_TRUE(handler_.WaitForDisconnects(1));
  EXPECT_EQ(handler_.Imports(), 1);  // it completed, then was released
  EXPECT_EQ(handler_.BuffersOf(session), 0u);

  std::unique_ptr<RawClient> other = Connect();
  ASSERT_NE(other, nullptr);
  EXPECT_TRUE(PingWorks(*other, 1));
  EXPECT_EQ(handler_.DisconnectsOf(session), 1);
  other.reset();
  ASSERT_TRUE(handler_.WaitForDisconnects(2));
  EXPECT_EQ(CountOpenFds(), baseline);
}

TEST_F(FdServerTest, ShutdownDisconnectsEveryClient) {
  StartServer();
  std::vector<std::unique_ptr<RawClient>> clients;
  std::vector<std::string> sessions(3);
  for (std::string& session : sessions) {
    clients.push_back(Connect(&session));
    ASSERT_NE(clients.back(), nullptr);
  }
  UniqueFd memfd = MakeSealedMemfd(4096);
  ASSERT_TRUE(clients[0]->SendImport(1, memfd.get()));
  ASSERT_TRUE(clients[0]->Receive().has_value());

  server_->Shutdown();
  EXPECT_EQ(handler_.TotalDisconnects(), 3);
  for (const std::string& session : sessions) {
    EXPECT_EQ(handler_.DisconnectsOf(session), 1) << session;
    EXPECT_EQ(handler_.BuffersOf(session), 0u) << session;
  }
  for (auto& client : clients) EXPECT_TRUE(client->ReceiveEof());
  EXPECT_EQ(server_->ConnectionCount(), 0u);
  struct stat st;
  EXPECT_NE(::lstat(SocketPath().c_str(), &st), 0) << "socket file left";
  EXPECT_FALSE(CanConnect(SocketPath()));

  server_->Shutdown();  // idempotent
  EXPECT_EQ(handler_.TotalDisconnects(), 3);
}

TEST_F(FdServerTest, DestructorShutsDown) {
  StartServer();
  std::unique_ptr<RawClient> a = Connect();
  std::unique_ptr<RawClient> b = Connect();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  server_.reset();
  EXPECT_EQ(handler_.TotalDisconnects(), 2);
  EXPECT_TRUE(a->ReceiveEof());
}

TEST_F(FdServerTest, ConcurrentShutdownCallsBothReturnAfterTheWork) {
  StartServer();
  std::unique_ptr<RawClient> a = Connect();
  ASSERT_NE(a, nullptr);
  std::thread other([this] {
    server_->Shutdown();
    EXPECT_EQ(handler_.TotalDisconnects(), 1);
  });
  server_->Shutdown();
  EXPECT_EQ(handler_.TotalDisconnects(), 1);
  other.join();
}

TEST_F(FdServerTest, ManyClientsInParallel) {
  StartServer();
  constexpr int kClients = 8;
  constexpr int kRounds = 25;
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([this] {
      std::string session;
      std::unique_ptr<RawClient> client = Connect(&session);
      ASSERT_NE(client, nullptr);
      for (int r = 0; r < kRounds; ++r) {
        UniqueFd memfd = MakeSealedMemfd(4096);
        ASSERT_TRUE(client->SendImport(2 * r + 1, memfd.get()));
        std::optional<v1::FdReply> reply = client->Receive();
        ASSERT_TRUE(reply.has_value());
        ASSERT_TRUE(reply->has_buffer()) << reply->ShortDebugString();
        ASSERT_EQ(reply->buffer().buffer(), static_cast<uint64_t>(r + 1));
        ASSERT_TRUE(PingWorks(*client, 2 * r + 2));
      }
      EXPECT_EQ(handler_.BuffersOf(session), static_cast<size_t>(kRounds));
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_TRUE(handler_.WaitForDisconnects(kClients));
  EXPECT_EQ(handler_.Imports(), kClients * kRounds);
}

// ---------------------------------------------------------------------------
// Start

TEST_F(FdServerTest, StaleSocketFileIsReplaced) {
  {
    UniqueFd stale(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    struct sockaddr_un addr;
    std::memset(&addr, 0, sizeof(addr));
    addr.sun_family = AF_UNIX;
    const std::string path = SocketPath();
    std::memcpy(addr.sun_path, path.data(), path.size());
    ASSERT_EQ(::bind(stale.get(), reinterpret_cast<struct sockaddr*>(&addr),
                     sizeof(addr)),
              0);
  }  // closed, file left behind as by a crashed server
  ASSERT_FALSE(CanConnect(SocketPath()));
  StartServer();
  std::unique_ptr<RawClient> client = Connect();
  ASSERT_NE(client, nullptr);
  EXPECT_TRUE(PingWorks(*client, 1));
}

TEST_F(FdServerTest, SomethingElseAtThePathIsLeftAlone) {
  dir_.WriteFile("fd.sock", "precious");
  FdServerOptions options;
  options.path = SocketPath();
  auto server = FdServer::Start(options, &handler_);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(GetErrorDetail(server.status()).reason(), "PATH_NOT_SOCKET");
  std::ifstream in(SocketPath());
  std::string contents;
  std::getline(in, contents);
  EXPECT_EQ(contents, "precious");
}

TEST_F(FdServerTest, LiveServerIsNotReplaced) {
  StartServer();
  FdServerOptions options;
  options.path = SocketPath();
  auto second = FdServer::Start(options, &handler_);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(GetErrorDetail(second.status()).reason(), "SOCKET_IN_USE");
  std::unique_ptr<RawClient> client = Connect();
  ASSERT_NE(client, nullptr);
  EXPECT_TRUE(PingWorks(*client, 1));
}

TEST_F(FdServerTest, BadOptionsAreRefused) {
  FdServerOptions options;
  auto server = FdServer::Start(options, &handler_);
  EXPECT_EQ(GetErrorDetail(server.status()).reason(), "BAD_SOCKET_PATH");
  options.path = "/tmp/" + std::string(200, 'p');
  server = FdServer::Start(options, &handler_);
  EXPECT_EQ(GetErrorDetail(server.status()).reason(), "BAD_SOCKET_PATH");
  options.path = SocketPath();
  options.max_connections = 0;
  server = FdServer::Start(options, &handler_);
  EXPECT_EQ(server.status().code(), kInvalid);
  EXPECT_EQ(GetErrorDetail(server.status()).reason(), "BAD_OPTIONS");
}

TEST_F(FdServerTest, MissingDirectoryFailsToBind) {
  FdServerOptions options;
  options.path = dir_.Sub("no/such/dir/fd.sock");
  auto server = FdServer::Start(options, &handler_);
  EXPECT_FALSE(server.ok());
  EXPECT_EQ(GetErrorDetail(server.status()).reason(), "BIND_FAILED");
}

// ---------------------------------------------------------------------------
// Live handover: Detach and Adopt

// Server A (server_, handler_) detaches; server B (server_b_, handler_b_)
// adopts, in this process, as a new mrd would in another.
class FdHandoverTest : public FdServerTest {
 protected:
  void TearDown() override {
    if (server_b_ != nullptr) server_b_->Shutdown();
    FdServerTest::TearDown();
    EXPECT_TRUE(handler_b_.EverySessionClosedOnce());
  }

  FdServerOptions Options(FdBudget* budget = nullptr) const {
    FdServerOptions options;
    options.path = SocketPath();
    options.fd_budget = budget;
    return options;
  }

  // Sends pings without reading the replies until the server stops reading
  // (it holds a reply the client has made no room for); the count sent.
  uint64_t FloodUntilTheServerStopsReading(RawClient& client) {
    v1::FdRequest request;
    request.mutable_ping();
    uint64_t sent = 0;
    for (int round = 0; round < 200; ++round) {
      uint64_t this_round = 0;
      while (true) {
        request.set_sequence(sent + 1);
        if (!client.SendRaw(request.SerializeAsString(), {}, MSG_DONTWAIT)) {
          break;
        }
        ++sent;
        ++this_round;
      }
      if (round > 0 && this_round == 0) return sent;
      absl::SleepFor(absl::Milliseconds(20));
    }
    ADD_FAILURE() << "the server kept reading";
    return sent;
  }

  MappingHandler handler_b_{"b-session-"};
  std::unique_ptr<FdServer> server_b_;
};

TEST_F(FdHandoverTest, SessionCarriesOnInTheAdoptingServerWithoutReconnecting) {
  FdBudgetOptions budget_options;
  budget_options.limit = 64;
  budget_options.reserve = 32;
  absl::StatusOr<std::unique_ptr<FdBudget>> budget =
      FdBudget::Create(budget_options);
  ASSERT_TRUE(budget.ok()) << budget.status();
  StartServer(Options(budget->get()));
  std::string session;
  std::unique_ptr<RawClient> client = Connect(&session);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(ImportWorks(*client, 1, "imported through A"));
  EXPECT_EQ((*budget)->Stats().charged, 1u);

  absl::StatusOr<DetachedFdServer> detached = server_->Detach();
  ASSERT_TRUE(detached.ok()) << detached.status();
  EXPECT_TRUE(detached->listener.valid());
  ASSERT_EQ(detached->connections.size(), 1u);
  const DetachedConnection& conn = detached->connections[0];
  EXPECT_TRUE(conn.socket.valid());
  EXPECT_EQ(conn.session, session);
  EXPECT_EQ(conn.creds.pid, ::getpid());
  EXPECT_EQ(conn.creds.uid, ::getuid());
  EXPECT_EQ(conn.creds.gid, ::getgid());
  EXPECT_TRUE(conn.pending_reply.empty());
  EXPECT_EQ(server_->ConnectionCount(), 0u);
  EXPECT_EQ((*budget)->Stats().charged, 0u);  // A's charges are released

  // Nobody serves: a request waits in the socket, a newcomer in the backlog.
  ASSERT_TRUE(client->SendPing(2));
  RawClient newcomer(SocketPath());
  ASSERT_TRUE(newcomer.valid());
  // A's Shutdown after Detach closes nothing and removes nothing.
  server_->Shutdown();
  EXPECT_EQ(handler_.TotalDisconnects(), 0);
  EXPECT_TRUE(SocketFileExists(SocketPath()));
  EXPECT_TRUE(Quiet(client->fd())) << "the client saw a reply or a hangup";
  EXPECT_TRUE(Quiet(newcomer.fd())) << "the newcomer was served by A";

  MappingHandler::HandOver(handler_, handler_b_, session);
  absl::StatusOr<std::unique_ptr<FdServer>> adopted = FdServer::Adopt(
      Options(budget->get()), &handler_b_, *std::move(detached));
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  server_b_ = *std::move(adopted);

  // The ping sent during the pause, then an import under the same token.
  std::optional<v1::FdReply> reply = client->Receive();
  ASSERT_TRUE(reply.has_value());
  EXPECT_TRUE(reply->has_pong()) << reply->ShortDebugString();
  EXPECT_EQ(reply->sequence(), 2u);
  ASSERT_TRUE(ImportWorks(*client, 3, "imported through B"));
  ASSERT_EQ(handler_b_.BuffersOf(session), 2u);
  EXPECT_EQ(handler_b_.BufferBytes(session, 0), "imported through A");
  EXPECT_EQ(handler_b_.BufferBytes(session, 1), "imported through B");
  EXPECT_EQ(handler_.Imports(), 1);
  EXPECT_EQ(handler_b_.Imports(), 1);

  // The newcomer is B's: welcomed with B's token.
  std::optional<v1::FdWelcome> welcome = newcomer.ReceiveWelcome();
  ASSERT_TRUE(welcome.has_value());
  EXPECT_EQ(welcome->session(), "b-session-1");
  EXPECT_EQ(handler_.Connects().size(), 1u);
  EXPECT_EQ(server_b_->ConnectionCount(), 2u);
  EXPECT_EQ((*budget)->Stats().charged, 2u);  // charged again, by B
  EXPECT_EQ(handler_.TotalDisconnects(), 0);
  EXPECT_EQ(handler_b_.TotalDisconnects(), 0);

  // B's Shutdown ends both sessions and removes the socket file it adopted.
  server_b_->Shutdown();
  EXPECT_TRUE(client->ReceiveEof());
  EXPECT_EQ(handler_b_.DisconnectsOf(session), 1);
  EXPECT_EQ(handler_b_.DisconnectsOf("b-session-1"), 1);
  EXPECT_FALSE(SocketFileExists(SocketPath())) << "socket file left";
  EXPECT_EQ((*budget)->Stats().charged, 0u);
}

// The failed-handover path: the process adopts its own detached state.
TEST_F(FdHandoverTest, AdoptingBackIntoAFreshServerKeepsServing) {
  StartServer();
  std::string session;
  std::unique_ptr<RawClient> client = Connect(&session);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(ImportWorks(*client, 1, "before"));

  absl::StatusOr<DetachedFdServer> detached = server_->Detach();
  ASSERT_TRUE(detached.ok()) << detached.status();
  absl::StatusOr<std::unique_ptr<FdServer>> resumed =
      FdServer::Adopt(Options(), &handler_, *std::move(detached));
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  server_ = *std::move(resumed);  // the detached one goes: it closes nothing

  EXPECT_TRUE(PingWorks(*client, 2));
  ASSERT_TRUE(ImportWorks(*client, 3, "after"));
  EXPECT_EQ(handler_.BuffersOf(session), 2u);
  std::string other_session;
  std::unique_ptr<RawClient> other = Connect(&other_session);
  ASSERT_NE(other, nullptr);
  EXPECT_TRUE(PingWorks(*other, 1));
  EXPECT_EQ(handler_.TotalDisconnects(), 0);
  EXPECT_EQ(server_->ConnectionCount(), 2u);

  server_->Shutdown();
  EXPECT_TRUE(client->ReceiveEof());
  EXPECT_TRUE(other->ReceiveEof());
  EXPECT_EQ(handler_.DisconnectsOf(session), 1);
  EXPECT_FALSE(SocketFileExists(SocketPath())) << "socket file left";
}

// A client that does not read: the reply A could not send is handed over
// and B sends it before anything else, so every reply arrives once, in
// order.
TEST_F(FdHandoverTest, PendingReplyIsSentFirstByTheAdoptingServer) {
  StartServer();
  std::unique_ptr<RawClient> client = Connect();
  ASSERT_NE(client, nullptr);
  const uint64_t sent = FloodUntilTheServerStopsReading(*client);
  ASSERT_GT(sent, 0u);

  absl::StatusOr<DetachedFdServer> detached = server_->Detach();
  ASSERT_TRUE(detached.ok()) << detached.status();
  ASSERT_EQ(detached->connections.size(), 1u);
  const std::string& pending = detached->connections[0].pending_reply;
  ASSERT_FALSE(pending.empty());
  v1::FdReply pending_reply;
  ASSERT_TRUE(pending_reply.ParseFromString(pending));
  EXPECT_TRUE(pending_reply.has_pong()) << pending_reply.ShortDebugString();

  absl::StatusOr<std::unique_ptr<FdServer>> resumed =
      FdServer::Adopt(Options(), &handler_, *std::move(detached));
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  server_ = *std::move(resumed);
  for (uint64_t i = 1; i <= sent; ++i) {
    std::optional<v1::FdReply> reply = client->Receive();
    ASSERT_TRUE(reply.has_value()) << "reply " << i << " of " << sent;
    ASSERT_TRUE(reply->has_pong());
    ASSERT_EQ(reply->sequence(), i);
  }
  EXPECT_TRUE(PingWorks(*client, sent + 1));
}

TEST_F(FdHandoverTest, HangupsAskedBeforeDetachAreCarriedOut) {
  StartServer();
  std::string ended;
  std::string kept;
  std::unique_ptr<RawClient> a = Connect(&ended);
  std::unique_ptr<RawClient> b = Connect(&kept);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  server_->Hangup(ended);
  absl::StatusOr<DetachedFdServer> detached = server_->Detach();
  ASSERT_TRUE(detached.ok()) << detached.status();
  // Either the loop saw the hangup before it stopped, or Detach did.
  ASSERT_EQ(detached->connections.size(), 1u);
  EXPECT_EQ(detached->connections[0].session, kept);
  EXPECT_EQ(handler_.DisconnectsOf(ended), 1);
  EXPECT_TRUE(a->ReceiveEof());
  absl::StatusOr<std::unique_ptr<FdServer>> resumed =
      FdServer::Adopt(Options(), &handler_, *std::move(detached));
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  server_ = *std::move(resumed);
  EXPECT_TRUE(PingWorks(*b, 1));
}

TEST_F(FdHandoverTest, DetachIsRefusedWhenNotServing) {
  StartServer();
  ASSERT_TRUE(server_->Detach().ok());
  absl::StatusOr<DetachedFdServer> again = server_->Detach();
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(GetErrorDetail(again.status()).reason(), "NOT_SERVING");
  server_->Hangup("session-1");  // ignored, no crash

  FdServerOptions options = Options();
  options.path = dir_.Sub("other.sock");
  absl::StatusOr<std::unique_ptr<FdServer>> other =
      FdServer::Start(options, &handler_);
  ASSERT_TRUE(other.ok()) << other.status();
  (*other)->Shutdown();
  absl::StatusOr<DetachedFdServer> stopped = (*other)->Detach();
  EXPECT_EQ(GetErrorDetail(stopped.status()).reason(), "NOT_SERVING");
}

TEST_F(FdHandoverTest, AdoptRefusesWhatIsNotAListeningSeqpacketSocket) {
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
  UniqueFd keep(pair[1]);
  DetachedFdServer connected;
  connected.listener.Reset(pair[0]);
  absl::StatusOr<std::unique_ptr<FdServer>> server =
      FdServer::Adopt(Options(), &handler_b_, std::move(connected));
  EXPECT_EQ(server.status().code(), kInvalid);
  EXPECT_EQ(GetErrorDetail(server.status()).reason(), "BAD_LISTENER");

  StartServer();
  absl::StatusOr<DetachedFdServer> detached = server_->Detach();
  ASSERT_TRUE(detached.ok()) << detached.status();
  DetachedConnection stream;
  stream.socket.Reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  stream.session = "not-a-session";
  detached->connections.push_back(std::move(stream));
  server = FdServer::Adopt(Options(), &handler_b_, *std::move(detached));
  EXPECT_EQ(GetErrorDetail(server.status()).reason(), "BAD_CONNECTION");
  EXPECT_TRUE(handler_b_.Connects().empty());
}

TEST_F(FdHandoverTest, ASocketFileReplacedMeanwhileIsNotTheAdoptersToRemove) {
  StartServer();
  absl::StatusOr<DetachedFdServer> detached = server_->Detach();
  ASSERT_TRUE(detached.ok()) << detached.status();
  // Someone else's socket at the path now.
  ASSERT_EQ(::unlink(SocketPath().c_str()), 0);
  UniqueFd other(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  struct sockaddr_un addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  const std::string path = SocketPath();
  std::memcpy(addr.sun_path, path.data(), path.size());
  ASSERT_EQ(::bind(other.get(), reinterpret_cast<struct sockaddr*>(&addr),
                   sizeof(addr)),
            0);
  absl::StatusOr<std::unique_ptr<FdServer>> adopted =
      FdServer::Adopt(Options(), &handler_b_, *std::move(detached));
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  (*adopted)->Shutdown();
  EXPECT_TRUE(SocketFileExists(SocketPath())) << "removed another's socket";
}

TEST_F(FdServerTest, ShutdownCanBeToldToLeaveTheSocketFile) {
  StartServer();
  server_->SetUnlinkOnShutdown(false);
  server_->Shutdown();
  EXPECT_TRUE(SocketFileExists(SocketPath()));
}

}  // namespace
}  // namespace mrd::fd_socket
