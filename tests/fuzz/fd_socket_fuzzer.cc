// Fuzzes the fd socket (server/fd_socket/fd_server.cc) and memfd validation
// (MapMemfd, server/fd_socket/memory_file.cc) through the real thing: a real
// FdServer on a Unix SOCK_SEQPACKET socket, a handler that validates and maps
// every imported fd with MapMemfd as the core does, and a client that sends
// datagrams built from the fuzz input over a real connection, with real fds
// in SCM_RIGHTS: memfds of fuzzed size, seals and open mode, tmpfs and disk
// files, pipes, sockets, directories, O_PATH fds, /dev/null, eventfds.
//
// Invariants checked on every input:
//   * every datagram gets exactly one reply, which parses, echoes the
//     sequence of a parsed request, and is an error for anything malformed;
//   * an import succeeds exactly when the fd is a memfd that MapMemfd's rules
//     accept (sealed against shrinking, non-empty, size as expected and
//     within the limit, readable, writable when asked and not write-sealed),
//     and the reply's size and inode are the memfd's;
//   * when the client goes, the session ends (OnDisconnect) and every fd the
//     server received is closed: the process has as many fds as before.
#include <fcntl.h>
#include <linux/memfd.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "fuzzer/FuzzedDataProvider.h"
#include "mrd/unique_fd.h"
#include "mrd/v1/fd.pb.h"
#include "server/fd_socket/fd_server.h"
#include "server/fd_socket/memory_file.h"
#include "tests/fuzz/fuzz_util.h"

namespace mrd::fuzz {
namespace {

constexpr uint64_t kMaxBufferSize = 256 * 1024;  // the handler's limit

// What the core does with an fd session, minus the device: MapMemfd and keep
// the mapping until the session ends.
class MappingHandler final : public fd_socket::FdSessionHandler {
 public:
  absl::StatusOr<std::string> OnConnect(
      const fd_socket::PeerCredentials& creds) override {
    absl::MutexLock lock(&mu_);
    FUZZ_CHECK(creds.pid == ::getpid(), "SO_PEERCRED pid ", creds.pid);
    std::string session = absl::StrCat("s", ++next_);
    sessions_[session];
    return session;
  }

  absl::StatusOr<v1::BufferInfo> OnImport(
      const std::string& session, UniqueFd fd,
      const v1::ImportMemfd& request) override {
    fd_socket::MemfdImportOptions options;
    options.writable = request.writable();
    options.expected_size = request.expected_size();
    options.max_size = kMaxBufferSize;
    absl::StatusOr<std::unique_ptr<fd_socket::MappedFile>> file =
        fd_socket::MapMemfd(std::move(fd), options);
    if (!file.ok()) return file.status();
    const fd_socket::MappedFile& f = **file;
    struct stat st;
    FUZZ_CHECK(::fstat(f.fd(), &st) == 0);
    FUZZ_CHECK(static_cast<uint64_t>(st.st_size) == f.size(), st.st_size,
               " vs ", f.size());
    FUZZ_CHECK(f.size() > 0 && f.size() <= kMaxBufferSize);
    FUZZ_CHECK(f.writable() == request.writable());
    // Every byte of the mapping is backed (F_SEAL_SHRINK): touching the
    // last one must not raise SIGBUS.
    volatile const char* last =
        static_cast<const char*>(f.address()) + f.size() - 1;
    (void)*last;
    v1::BufferInfo info;
    info.set_buffer(1);
    info.set_size(f.size());
    info.set_writable(f.writable());
    info.set_device(f.device());
    info.set_inode(f.inode());
    info.set_source(f.source());
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(session);
    FUZZ_CHECK(it != sessions_.end(), "import for unknown session ", session);
    it->second.push_back(*std::move(file));
    return info;
  }

  void OnDisconnect(const std::string& session) override {
    absl::MutexLock lock(&mu_);
    FUZZ_CHECK(sessions_.erase(session) == 1,
               "OnDisconnect twice or unknown: ", session);
  }

  // Waits until no session is open. False after 10 s.
  bool WaitNoSessions() {
    absl::MutexLock lock(&mu_);
    auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return sessions_.empty();
    };
    return mu_.AwaitWithTimeout(absl::Condition(&none), absl::Seconds(10));
  }

 private:
  absl::Mutex mu_;
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, std::vector<std::unique_ptr<fd_socket::MappedFile>>>
      sessions_ ABSL_GUARDED_BY(mu_);
};

struct Fixture {
  std::string dir;
  std::string shm_dir;
  MappingHandler handler;
  std::unique_ptr<fd_socket::FdServer> server;
};

Fixture* GetFixture() {
  static Fixture* fixture = [] {
    QuietLogs();
    auto* f = new Fixture;
    f->dir = MakeTempDir("/tmp", "mrd-fuzz-fd-");
    f->shm_dir = MakeTempDir("/dev/shm", "mrd-fuzz-fd-");
    fd_socket::FdServerOptions options;
    options.path = f->dir + "/fd.sock";
    options.max_connections = 4;
    absl::StatusOr<std::unique_ptr<fd_socket::FdServer>> server =
        fd_socket::FdServer::Start(options, &f->handler);
    FUZZ_CHECK(server.ok(), server.status().ToString());
    f->server = *std::move(server);
    std::atexit([] {
      Fixture* f = GetFixture();
      f->server->Shutdown();
      RemoveTree(f->dir);
      RemoveTree(f->shm_dir);
    });
    return f;
  }();
  return fixture;
}

// One fd to pass, and what MapMemfd should think of it.
struct PassedFd {
  UniqueFd fd;
  bool importable_memfd = false;  // a memfd: the rules below decide
  uint64_t size = 0;
  int seals = 0;
  int access = O_RDWR;
  uint64_t inode = 0;
};

// Opens a memfd again through /proc/self/fd with another access mode.
UniqueFd Reopen(int fd, int flags) {
  std::string path = absl::StrCat("/proc/self/fd/", fd);
  return UniqueFd(::open(path.c_str(), flags | O_CLOEXEC));
}

PassedFd MakeFd(FuzzedDataProvider& in, const Fixture& f) {
  PassedFd p;
  switch (in.ConsumeIntegralInRange<int>(0, 11)) {
    default: {  // a memfd; the most likely pick
      // Sizes around page boundaries and the limit.
      static constexpr uint64_t kSizes[] = {0,
                                            1,
                                            4095,
                                            4096,
                                            4097,
                                            8192,
                                            65536,
                                            12345,
                                            1,
                                            kMaxBufferSize,
                                            kMaxBufferSize + 1,
                                            2 << 20};
      p.size = in.ConsumeBool() ? in.PickValueInArray(kSizes)
                                : in.ConsumeIntegralInRange<uint64_t>(
                                      0, kMaxBufferSize + 4096);
      UniqueFd fd = MakeMemfd(p.size);
      int seals = 0;
      const uint8_t bits = in.ConsumeIntegral<uint8_t>();
      if (bits & 1) seals |= F_SEAL_SHRINK;
      if (bits & 2) seals |= F_SEAL_GROW;
      if (bits & 4) seals |= F_SEAL_WRITE;
      if (bits & 8) seals |= F_SEAL_FUTURE_WRITE;
      if (bits & 16) seals |= F_SEAL_SEAL;
      if ((bits & 32) == 0) seals |= F_SEAL_SHRINK;  // mostly sealed right
      if (seals != 0) {
        FUZZ_CHECK(::fcntl(fd.get(), F_ADD_SEALS, seals) == 0,
                   "F_ADD_SEALS: ", std::strerror(errno));
      }
      p.seals = seals;
      struct stat st;
      FUZZ_CHECK(::fstat(fd.get(), &st) == 0);
      p.inode = static_cast<uint64_t>(st.st_ino);
      const int access =
          in.PickValueInArray<int>({O_RDWR, O_RDWR, O_RDONLY, O_WRONLY});
      if (access != O_RDWR) {
        UniqueFd other = Reopen(fd.get(), access);
        // F_SEAL_WRITE refuses a writable open; keep the O_RDWR fd then.
        if (other.valid()) {
          fd = std::move(other);
          p.access = access;
        }
      }
      p.fd = std::move(fd);
      p.importable_memfd = true;
      return p;
    }
    case 1: {  // a tmpfs file that is not a memfd: cannot be sealed
      std::string path = f.shm_dir + "/plain";
      p.fd.Reset(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
      FUZZ_CHECK(p.fd.valid(), "open ", path, ": ", std::strerror(errno));
      FUZZ_CHECK(::ftruncate(p.fd.get(), 4096) == 0);
      return p;
    }
    case 2: {  // a file on disk
      std::string path = f.dir + "/disk";
      p.fd.Reset(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
      FUZZ_CHECK(p.fd.valid(), "open ", path, ": ", std::strerror(errno));
      FUZZ_CHECK(::ftruncate(p.fd.get(), 4096) == 0);
      return p;
    }
    case 3: {  // a pipe
      int fds[2];
      FUZZ_CHECK(::pipe2(fds, O_CLOEXEC) == 0);
      ::close(fds[1]);
      p.fd.Reset(fds[0]);
      return p;
    }
    case 4: {  // a socket
      int fds[2];
      FUZZ_CHECK(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) ==
                 0);
      ::close(fds[1]);
      p.fd.Reset(fds[0]);
      return p;
    }
    case 5:  // a directory
      p.fd.Reset(::open(f.shm_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
      FUZZ_CHECK(p.fd.valid());
      return p;
    case 6: {  // an O_PATH fd of a sealed memfd
      UniqueFd memfd = MakeMemfd(4096);
      FUZZ_CHECK(::fcntl(memfd.get(), F_ADD_SEALS, F_SEAL_SHRINK) == 0);
      p.fd = Reopen(memfd.get(), O_PATH);
      FUZZ_CHECK(p.fd.valid());
      return p;
    }
    case 7:
      p.fd.Reset(::open("/dev/null", O_RDWR | O_CLOEXEC));
      FUZZ_CHECK(p.fd.valid());
      return p;
    case 8:
      p.fd.Reset(::eventfd(0, EFD_CLOEXEC));
      FUZZ_CHECK(p.fd.valid());
      return p;
  }
}

// Sends `bytes` with `fds` in one SCM_RIGHTS message (none if empty).
bool SendDatagram(int sock, const std::string& bytes,
                  const std::vector<int>& fds) {
  struct iovec iov;
  iov.iov_base = const_cast<char*>(bytes.data());
  iov.iov_len = bytes.size();
  struct msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control;
  if (!fds.empty()) {
    control.assign(CMSG_SPACE(fds.size() * sizeof(int)), 0);
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    struct cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
    std::memcpy(CMSG_DATA(c), fds.data(), fds.size() * sizeof(int));
  }
  ssize_t n;
  do {
    n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(bytes.size());
}

v1::FdReply ReceiveReply(int sock) {
  char buffer[65536];
  ssize_t n;
  do {
    n = ::recv(sock, buffer, sizeof(buffer), 0);
  } while (n < 0 && errno == EINTR);
  FUZZ_CHECK(n > 0, "no reply from the fd server: ",
             n < 0 ? std::strerror(errno) : "EOF");
  v1::FdReply reply;
  FUZZ_CHECK(reply.ParseFromArray(buffer, static_cast<int>(n)),
             "unparsable reply of ", n, " bytes");
  return reply;
}

// What one datagram should get back.
struct Expectation {
  bool parsed = false;    // a well-formed FdRequest was sent
  uint64_t sequence = 0;  // its sequence
  bool must_fail = true;  // nothing but an error is acceptable
  bool must_succeed = false;
  bool pong = false;  // a successful ping
  uint64_t size = 0;  // a successful import
  uint64_t inode = 0;
};

void CheckReply(const v1::FdReply& reply, const Expectation& e) {
  FUZZ_CHECK(!reply.has_welcome(), "a second welcome");
  if (e.parsed) {
    FUZZ_CHECK(reply.sequence() == e.sequence, "sequence ", reply.sequence(),
               " for a request of sequence ", e.sequence);
  }
  if (e.must_fail) {
    FUZZ_CHECK(reply.has_error(), "expected an error, got ",
               reply.ShortDebugString());
    FUZZ_CHECK(reply.error().code() != 0, "an error with code OK");
    FUZZ_CHECK(!reply.error().detail().reason().empty(),
               "an error without a reason: ", reply.ShortDebugString());
  }
  if (e.must_succeed) {
    FUZZ_CHECK(!reply.has_error(), "expected success, got ",
               reply.ShortDebugString());
    if (e.pong) {
      FUZZ_CHECK(reply.has_pong(), reply.ShortDebugString());
    } else {
      FUZZ_CHECK(reply.has_buffer(), reply.ShortDebugString());
      FUZZ_CHECK(reply.buffer().size() == e.size, "size ",
                 reply.buffer().size(), " expected ", e.size);
      FUZZ_CHECK(reply.buffer().inode() == e.inode);
    }
  }
}

void RunOne(FuzzedDataProvider& in, Fixture& f) {
  UniqueFd sock(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  FUZZ_CHECK(sock.valid());
  struct timeval tv = {10, 0};
  FUZZ_CHECK(
      ::setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) == 0);
  struct sockaddr_un addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, f.server->path().data(), f.server->path().size());
  const int connect_err = ConnectRetrying(sock.get(), &addr, sizeof(addr));
  FUZZ_CHECK(connect_err == 0, "connect: ", std::strerror(connect_err));
  v1::FdReply welcome = ReceiveReply(sock.get());
  FUZZ_CHECK(welcome.has_welcome(), welcome.ShortDebugString());
  FUZZ_CHECK(welcome.welcome().peer_uid() == ::getuid());

  // Pipelined: send up to this many datagrams before reading their replies
  // (the server reads no more while a reply waits; replies must still come,
  // in order).
  const int window = in.ConsumeIntegralInRange<int>(1, 4);
  // Half-close after the last datagram: the server still answers
  // everything sent before. (Except an empty datagram without fds right
  // before the shutdown: on SOCK_SEQPACKET it reads exactly like the end
  // of stream, so none is sent in that mode.)
  const bool half_close = in.ConsumeBool();
  std::vector<Expectation> pending;
  int datagrams = 0;
  while (in.remaining_bytes() > 0 && datagrams < 32) {
    ++datagrams;
    Expectation e;
    std::string bytes;
    std::vector<PassedFd> fds;
    const int fd_count = in.PickValueInArray<int>({0, 1, 1, 1, 2, 3});
    for (int i = 0; i < fd_count; ++i) fds.push_back(MakeFd(in, f));
    switch (in.ConsumeIntegralInRange<int>(0, 5)) {
      case 0: {  // raw bytes: whatever they parse as
        bytes = in.ConsumeRandomLengthString(256);
        if (bytes.empty() && fds.empty() && half_close) bytes = "\n";
        e.must_fail = false;
        break;
      }
      case 1: {  // too large for the server's buffer
        bytes.assign(in.ConsumeIntegralInRange<size_t>(
                         fd_socket::FdServer::kMaxRequestBytes + 1, 16384),
                     'x');
        break;
      }
      case 2: {  // ping
        v1::FdRequest request;
        request.set_sequence(in.ConsumeIntegral<uint64_t>());
        request.mutable_ping();
        bytes = request.SerializeAsString();
        e.parsed = true;
        e.sequence = request.sequence();
        e.must_fail = !fds.empty();
        e.must_succeed = fds.empty();
        e.pong = true;
        break;
      }
      case 3: {  // an empty request, or one with an unknown field only
        v1::FdRequest request;
        request.set_sequence(in.ConsumeIntegral<uint64_t>());
        bytes = request.SerializeAsString();
        if (in.ConsumeBool() || (bytes.empty() && fds.empty() && half_close)) {
          bytes += std::string("\x78\x01", 2);  // an unknown field, 15
        }
        e.parsed = true;
        e.sequence = request.sequence();
        break;
      }
      default: {  // import
        v1::FdRequest request;
        request.set_sequence(in.ConsumeIntegral<uint64_t>());
        v1::ImportMemfd* import = request.mutable_import_memfd();
        import->set_writable(in.ConsumeBool());
        const int size_pick = in.ConsumeIntegralInRange<int>(0, 3);
        if (size_pick == 1 && !fds.empty()) {
          import->set_expected_size(fds[0].size);
        } else if (size_pick == 2) {
          import->set_expected_size(in.ConsumeIntegral<uint64_t>());
        }
        bytes = request.SerializeAsString();
        e.parsed = true;
        e.sequence = request.sequence();
        if (fds.size() == 1 && fds[0].importable_memfd) {
          const PassedFd& p = fds[0];
          const uint64_t want = import->expected_size();
          const bool ok =
              (p.seals & F_SEAL_SHRINK) != 0 && p.size > 0 &&
              (want == 0 || want == p.size) && p.size <= kMaxBufferSize &&
              p.access != O_WRONLY &&
              (!import->writable() ||
               (p.access == O_RDWR &&
                (p.seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) == 0));
          e.must_fail = !ok;
          e.must_succeed = ok;
          e.size = p.size;
          e.inode = p.inode;
        }
        break;
      }
    }
    std::vector<int> raw_fds;
    for (const PassedFd& p : fds) raw_fds.push_back(p.fd.get());
    FUZZ_CHECK(SendDatagram(sock.get(), bytes, raw_fds),
               "sendmsg: ", std::strerror(errno));
    fds.clear();  // our copies; the server has its own now
    pending.push_back(e);
    if (static_cast<int>(pending.size()) >= window) {
      for (const Expectation& p : pending) {
        CheckReply(ReceiveReply(sock.get()), p);
      }
      pending.clear();
    }
  }
  if (half_close && !pending.empty()) {
    // The server answers everything sent before the shutdown.
    FUZZ_CHECK(::shutdown(sock.get(), SHUT_WR) == 0);
  }
  for (const Expectation& p : pending) CheckReply(ReceiveReply(sock.get()), p);
  sock.Reset();
}

}  // namespace
}  // namespace mrd::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mrd::fuzz;  // NOLINT(build/namespaces)
  Fixture* f = GetFixture();
  const int fds_before = CountOpenFds();
  FuzzedDataProvider in(data, size);
  RunOne(in, *f);
  FUZZ_CHECK(f->handler.WaitNoSessions(),
             "the session did not end after its socket closed");
  // The server closed every fd it received and unmapped every buffer.
  const int fds_after = CountOpenFds();
  FUZZ_CHECK(fds_after == fds_before, "open fds ", fds_before, " -> ",
             fds_after);
  return 0;
}
