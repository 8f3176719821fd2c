#include "server/fd_socket/fd_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "mrd/status.h"
#include "mrd/status_proto.h"
#include "server/common/log.h"

namespace mrd::fd_socket {
namespace {

// epoll_event.data.u64 of the two fixed fds; connections count up from
// kFirstConnectionId and ids are never reused, so an event for a connection
// closed earlier in the same batch finds nothing.
constexpr uint64_t kListenId = 1;
constexpr uint64_t kWakeId = 2;
constexpr uint64_t kFirstConnectionId = 3;

// Room for one fd, and (thanks to cmsg alignment, and said explicitly here)
// exactly one more: a second fd arrives intact and is refused as
// TOO_MANY_FDS; with more, the kernel sets MSG_CTRUNC and drops (closes) the
// ones that did not fit.
constexpr size_t kControlBytes = CMSG_SPACE(2 * sizeof(int));

// Fairness: after this many datagrams from one connection, serve the others.
constexpr int kMaxDatagramsPerWakeup = 32;
constexpr int kMaxAcceptsPerWakeup = 64;
// After accept fails for lack of fds or memory, stop accepting this long
// instead of spinning on a listening socket that stays readable.
constexpr int64_t kAcceptPauseMs = 100;

// The FdServer whose loop runs on this thread, to catch a handler calling
// Shutdown (which would join its own thread).
thread_local const FdServer* tls_loop_server = nullptr;

int64_t SteadyNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void SetError(v1::FdReply& reply, const absl::Status& status) {
  v1::FdError* error = reply.mutable_error();
  error->set_code(static_cast<int32_t>(status.code()));
  error->set_message(std::string(status.message()));
  *error->mutable_detail() = ErrorDetailToProto(GetErrorDetail(status));
}

absl::Status ProtocolError(absl::string_view reason,
                           absl::string_view message) {
  return MrdError(absl::StatusCode::kInvalidArgument, reason, message);
}

// For a connection being turned away: one reply, best effort (the peer may
// already be gone; the socket is fresh, so this cannot block).
void SendOnce(int fd, const v1::FdReply& reply) {
  const std::string bytes = reply.SerializeAsString();
  if (::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
    const int err = errno;
    LogDebug("fd socket: could not send refusal: ", std::strerror(err));
  }
}

// recvmsg returned 0: an empty datagram, or end of file. The peer has shut
// down its sending side in the second case only.
bool PeerShutDown(int fd) {
  struct pollfd pfd;
  pfd.fd = fd;
  pfd.events = POLLIN | POLLRDHUP;
  pfd.revents = 0;
  // A signal can interrupt even a poll that does not wait; that says
  // nothing about the peer (reading it as the end would drop a session
  // whose client sent an empty datagram).
  int ready;
  do {
    ready = ::poll(&pfd, 1, 0);
  } while (ready < 0 && errno == EINTR);
  if (ready < 0) return true;
  return (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

bool PeerAllowed(const FdServerOptions& options, const PeerCredentials& c) {
  if (options.allowed_uids.empty() && options.allowed_gids.empty()) {
    return true;
  }
  const auto& uids = options.allowed_uids;
  const auto& gids = options.allowed_gids;
  return std::find(uids.begin(), uids.end(), c.uid) != uids.end() ||
         std::find(gids.begin(), gids.end(), c.gid) != gids.end();
}

bool FillAddress(const std::string& path, struct sockaddr_un& addr) {
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) return false;
  std::memcpy(addr.sun_path, path.data(), path.size());
  return true;
}

// Something is already at `path`: replace it only if it is a socket nobody
// listens on any more (left by a crashed server).
absl::Status RemoveStaleSocket(const std::string& path,
                               const struct sockaddr_un& addr) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) return absl::OkStatus();
    return ErrnoError(err, absl::StrCat("lstat ", path), "BAD_SOCKET_PATH");
  }
  if (!S_ISSOCK(st.st_mode)) {
    return MrdError(
        absl::StatusCode::kFailedPrecondition, "PATH_NOT_SOCKET",
        absl::StrCat(path, " exists and is not a socket; not replacing it"));
  }
  UniqueFd probe(
      ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!probe.valid()) {
    const int err = errno;
    return ErrnoError(err, "socket", "SOCKET_FAILED");
  }
  if (::connect(probe.get(), reinterpret_cast<const struct sockaddr*>(&addr),
                sizeof(addr)) == 0) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "SOCKET_IN_USE",
                    absl::StrCat("a server is listening on ", path));
  }
  const int err = errno;
  if (err != ECONNREFUSED && err != ENOENT) {
    // EAGAIN (a full backlog) and EPROTOTYPE (another socket type) both mean
    // someone is alive there.
    return MrdError(
        absl::StatusCode::kFailedPrecondition, "SOCKET_IN_USE",
        absl::StrCat(path, " is in use (connect: ", std::strerror(err), ")"));
  }
  if (::unlink(path.c_str()) != 0) {
    const int unlink_err = errno;
    if (unlink_err != ENOENT) {
      return ErrnoError(unlink_err, absl::StrCat("unlink ", path),
                        "BAD_SOCKET_PATH");
    }
  }
  LogInfo("fd socket: removed stale socket ", path);
  return absl::OkStatus();
}

}  // namespace

struct FdServer::Connection {
  uint64_t id = 0;
  FdCharge fd_charge;  // declared before `sock`: released after it is closed
  UniqueFd sock;
  PeerCredentials creds;
  std::string session;
  // Serialized replies the socket could not take yet. While non-empty the
  // connection is watched for EPOLLOUT only, so no new request is read and
  // this holds at most one reply after the welcome.
  std::deque<std::string> outbox;
  bool watching_output = false;
};

struct FdServer::Datagram {
  absl::string_view data;          // what fit in the buffer
  size_t size = 0;                 // the datagram's real length
  bool truncated = false;          // MSG_TRUNC: longer than kMaxRequestBytes
  bool control_truncated = false;  // MSG_CTRUNC
  bool foreign_control = false;    // a control message other than SCM_RIGHTS
  std::vector<UniqueFd> fds;       // every fd that arrived
};

FdServer::FdServer(const FdServerOptions& options, FdSessionHandler* handler)
    : options_(options), handler_(handler), next_id_(kFirstConnectionId) {}

absl::Status FdServer::SetUpEvents() {
  epoll_fd_.Reset(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_fd_.valid()) {
    const int err = errno;
    return ErrnoError(err, "epoll_create1", "EPOLL_FAILED");
  }
  wake_fd_.Reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!wake_fd_.valid()) {
    const int err = errno;
    return ErrnoError(err, "eventfd", "EPOLL_FAILED");
  }
  for (auto [fd, id] : {std::pair<int, uint64_t>{listen_fd_.get(), kListenId},
                        std::pair<int, uint64_t>{wake_fd_.get(), kWakeId}}) {
    struct epoll_event ev;
    std::memset(&ev, 0, sizeof(ev));
    ev.events = EPOLLIN;
    ev.data.u64 = id;
    if (::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
      const int err = errno;
      return ErrnoError(err, "epoll_ctl", "EPOLL_FAILED");
    }
  }

  spare_fd_.Reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!spare_fd_.valid()) {
    const int err = errno;
    return ErrnoError(err, "open /dev/null (spare fd)", "SPARE_FD_FAILED");
  }
  return absl::OkStatus();
}

absl::Status FdServer::CheckOptions(const FdServerOptions& options) {
  struct sockaddr_un addr;
  if (!FillAddress(options.path, addr)) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_SOCKET_PATH",
                    absl::StrCat("socket path \"", options.path,
                                 "\" is empty or longer than ",
                                 sizeof(addr.sun_path) - 1, " bytes"));
  }
  if (options.max_connections == 0) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_OPTIONS",
                    "max_connections must be at least 1");
  }
  return absl::OkStatus();
}

absl::Status FdServer::StartThread() {
  absl::MutexLock lock(&shutdown_mu_);
  MRD_ASSIGN_OR_RETURN(thread_,
                       Thread::Start("mrd-fd-socket", [this] { Run(); }));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<FdServer>> FdServer::Start(
    const FdServerOptions& options, FdSessionHandler* handler) {
  MRD_CHECK(handler != nullptr);
  MRD_RETURN_IF_ERROR(CheckOptions(options));
  struct sockaddr_un addr;
  FillAddress(options.path, addr);
  MRD_RETURN_IF_ERROR(RemoveStaleSocket(options.path, addr));

  std::unique_ptr<FdServer> server(new FdServer(options, handler));
  server->listen_fd_.Reset(
      ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!server->listen_fd_.valid()) {
    const int err = errno;
    return ErrnoError(err, "socket", "SOCKET_FAILED");
  }
  if (::bind(server->listen_fd_.get(),
             reinterpret_cast<const struct sockaddr*>(&addr),
             sizeof(addr)) != 0) {
    const int err = errno;
    return ErrnoError(err, absl::StrCat("bind ", options.path), "BIND_FAILED");
  }
  absl::Cleanup unlink_on_error = [&options] {
    ::unlink(options.path.c_str());
  };
  // Before listen(): until then a connect() is refused, so nobody gets in
  // while the file still has the umask's permissions.
  if (::chmod(options.path.c_str(), options.mode) != 0) {
    const int err = errno;
    return ErrnoError(err, absl::StrCat("chmod ", options.path),
                      "CHMOD_FAILED");
  }
  struct stat st;
  if (::lstat(options.path.c_str(), &st) != 0) {
    const int err = errno;
    return ErrnoError(err, absl::StrCat("lstat ", options.path), "BIND_FAILED");
  }
  server->socket_file_ = SocketFileId{static_cast<uint64_t>(st.st_dev),
                                      static_cast<uint64_t>(st.st_ino)};
  if (::listen(server->listen_fd_.get(), SOMAXCONN) != 0) {
    const int err = errno;
    return ErrnoError(err, "listen", "LISTEN_FAILED");
  }

  MRD_RETURN_IF_ERROR(server->SetUpEvents());
  MRD_RETURN_IF_ERROR(server->StartThread());
  std::move(unlink_on_error).Cancel();
  LogInfo("fd socket: listening on ", options.path);
  return server;
}

absl::StatusOr<std::unique_ptr<FdServer>> FdServer::Adopt(
    const FdServerOptions& options, FdSessionHandler* handler,
    DetachedFdServer detached) {
  MRD_CHECK(handler != nullptr);
  MRD_RETURN_IF_ERROR(CheckOptions(options));
  MRD_RETURN_IF_ERROR(
      PrepareHandedOverSocket(detached.listener.get(), SOCK_SEQPACKET,
                              /*listening=*/true, "BAD_LISTENER"));
  for (const DetachedConnection& d : detached.connections) {
    MRD_RETURN_IF_ERROR(PrepareHandedOverSocket(d.socket.get(), SOCK_SEQPACKET,
                                                /*listening=*/false,
                                                "BAD_CONNECTION"));
  }
  if (detached.connections.size() > options.max_connections) {
    return MrdError(
        absl::StatusCode::kResourceExhausted, "TOO_MANY_SESSIONS",
        absl::StrCat(detached.connections.size(),
                     " connections handed over, more than the limit of ",
                     options.max_connections));
  }

  // Nothing below runs a handler call, and the thread starts last: until
  // then the connection table is this thread's.
  std::unique_ptr<FdServer> server(new FdServer(options, handler));
  server->listen_fd_ = std::move(detached.listener);
  server->socket_file_ =
      BoundSocketFile(server->listen_fd_.get(), options.path);
  if (!server->socket_file_.has_value()) {
    LogWarning("fd socket: the adopted listener is not bound to the file at ",
               options.path, "; it will not be removed at shutdown");
  }
  MRD_RETURN_IF_ERROR(server->SetUpEvents());
  for (DetachedConnection& d : detached.connections) {
    MRD_ASSIGN_OR_RETURN(
        FdCharge charge,
        ChargeFd(options.fd_budget, /*owner=*/0, "an fd socket connection"));
    const uint64_t id = server->next_id_++;
    auto owned = std::make_unique<Connection>();
    Connection& conn = *owned;
    conn.id = id;
    conn.fd_charge = std::move(charge);
    conn.sock = std::move(d.socket);
    conn.creds = d.creds;
    conn.session = std::move(d.session);
    // The pending reply goes out first; until it has, nothing is read.
    if (!d.pending_reply.empty()) {
      conn.outbox.push_back(std::move(d.pending_reply));
    }
    conn.watching_output = !conn.outbox.empty();
    server->connections_.emplace(id, std::move(owned));
    struct epoll_event ev;
    std::memset(&ev, 0, sizeof(ev));
    ev.events = conn.watching_output ? EPOLLOUT : EPOLLIN;
    ev.data.u64 = id;
    if (::epoll_ctl(server->epoll_fd_.get(), EPOLL_CTL_ADD, conn.sock.get(),
                    &ev) != 0) {
      const int err = errno;
      return ErrnoError(err, "epoll_ctl", "EPOLL_FAILED");
    }
  }
  const size_t sessions = server->connections_.size();
  {
    absl::MutexLock lock(&server->mu_);
    server->session_count_ = sessions;
  }
  // From here the table is the thread's.
  MRD_RETURN_IF_ERROR(server->StartThread());
  LogInfo("fd socket: adopted the socket ", options.path, " with ", sessions,
          " sessions");
  return server;
}

FdServer::~FdServer() { Shutdown(); }

void FdServer::Shutdown() {
  if (tls_loop_server == this) {
    Fatal("FdServer::Shutdown called on the FdServer thread (from a handler)");
  }
  absl::MutexLock shutdown_lock(&shutdown_mu_);
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (!thread_.joinable()) return;
  Wake();
  thread_.Join();
}

absl::StatusOr<DetachedFdServer> FdServer::Detach() {
  if (tls_loop_server == this) {
    Fatal("FdServer::Detach called on the FdServer thread (from a handler)");
  }
  absl::MutexLock shutdown_lock(&shutdown_mu_);
  if (!thread_.joinable()) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "NOT_SERVING",
                    absl::StrCat("the fd socket server of ", options_.path,
                                 " was shut down or detached already"));
  }
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    detaching_ = true;
  }
  Wake();
  thread_.Join();
  // The thread is gone: everything it owned is this thread's now.
  return TakeDetached();
}

DetachedFdServer FdServer::TakeDetached() {
  DetachedFdServer detached;
  detached.listener = std::move(listen_fd_);
  detached.connections.reserve(connections_.size());
  for (auto& [id, conn] : connections_) {
    DetachedConnection d;
    d.socket = std::move(conn->sock);
    d.session = std::move(conn->session);
    d.creds = conn->creds;
    // A connection's outbox holds at most one reply (see Connection).
    MRD_CHECK(conn->outbox.size() <= 1);
    if (!conn->outbox.empty())
      d.pending_reply = std::move(conn->outbox.front());
    detached.connections.push_back(std::move(d));
  }
  connections_.clear();  // releases the fd charges; the sockets moved out
  {
    absl::MutexLock lock(&mu_);
    session_count_ = 0;
  }
  // The epoll set goes (it only refers to the sockets); the eventfd stays
  // for a late Hangup, which is ignored.
  epoll_fd_.Reset();
  spare_fd_.Reset();
  LogInfo("fd socket: detached ", options_.path, " with ",
          detached.connections.size(), " sessions");
  return detached;
}

void FdServer::SetUnlinkOnShutdown(bool unlink) {
  absl::MutexLock lock(&mu_);
  unlink_on_shutdown_ = unlink;
}

void FdServer::Wake() {
  const uint64_t one = 1;
  if (::write(wake_fd_.get(), &one, sizeof(one)) < 0) {
    const int err = errno;
    // EAGAIN: the counter is saturated, so the loop is awake anyway.
    if (err != EAGAIN) {
      Fatal(absl::StrCat("FdServer: eventfd write: ", std::strerror(err)));
    }
  }
}

void FdServer::Hangup(const std::string& session) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    hangups_.push_back(session);
  }
  Wake();
}

size_t FdServer::ConnectionCount() const {
  absl::MutexLock lock(&mu_);
  return session_count_;
}

void FdServer::Run() {
  tls_loop_server = this;
  constexpr int kMaxEvents = 64;
  struct epoll_event events[kMaxEvents];
  while (true) {
    const int timeout = accept_paused_ ? static_cast<int>(kAcceptPauseMs) : -1;
    const int n = ::epoll_wait(epoll_fd_.get(), events, kMaxEvents, timeout);
    if (n < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      Fatal(absl::StrCat("FdServer: epoll_wait: ", std::strerror(err)));
    }
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) break;
    }
    for (int i = 0; i < n; ++i) {
      const uint64_t id = events[i].data.u64;
      if (id == kWakeId) {
        uint64_t value;
        (void)!::read(wake_fd_.get(), &value, sizeof(value));
        std::vector<std::string> hangups;
        {
          absl::MutexLock lock(&mu_);
          hangups.swap(hangups_);
        }
        HangUp(hangups);
      } else if (id == kListenId) {
        AcceptAll();
      } else {
        HandleEvent(id, events[i].events);
      }
    }
    if (accept_paused_ && SteadyNowMs() >= resume_accept_at_ms_) {
      ResumeAccepting();
    }
  }
  bool detaching;
  std::vector<std::string> hangups;
  {
    absl::MutexLock lock(&mu_);
    detaching = detaching_;
    hangups.swap(hangups_);
  }
  if (detaching) {
    // Sessions already ended over gRPC must not reach the next server.
    HangUp(hangups);
  } else {
    CloseAll();
  }
  tls_loop_server = nullptr;
}

void FdServer::HangUp(const std::vector<std::string>& sessions) {
  for (const std::string& session : sessions) {
    for (const auto& [conn_id, conn] : connections_) {
      if (conn->session == session) {
        Close(conn_id);
        break;
      }
    }
  }
}

void FdServer::AcceptAll() {
  for (int i = 0; i < kMaxAcceptsPerWakeup; ++i) {
    const int fd = ::accept4(listen_fd_.get(), nullptr, nullptr,
                             SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      Accept(UniqueFd(fd));
      continue;
    }
    const int err = errno;
    switch (err) {
      case EAGAIN:
        return;
      case EINTR:
      case ECONNABORTED:
      case EPROTO:
        continue;
      case EMFILE:
      case ENFILE:
        if (AcceptWithSpareFd()) continue;
        [[fallthrough]];
      default:
        // EMFILE, ENFILE, ENOBUFS, ENOMEM: the pending connection stays in
        // the backlog and the socket stays readable.
        LogWarning("fd socket: accept failed: ", std::strerror(err),
                   "; pausing accepts for ", kAcceptPauseMs, " ms");
        PauseAccepting();
        return;
    }
  }
}

bool FdServer::AcceptWithSpareFd() {
  if (!spare_fd_.valid()) return false;
  spare_fd_.Reset();
  UniqueFd sock(::accept4(listen_fd_.get(), nullptr, nullptr,
                          SOCK_NONBLOCK | SOCK_CLOEXEC));
  const bool accepted = sock.valid();
  if (accepted) {
    v1::FdReply refusal;
    SetError(refusal,
             SeedError(STATUS_INSUFFICIENT_RESOURCES, "LIMIT_OPEN_FILES",
                       "mrd has reached its open-file limit (RLIMIT_NOFILE); "
                       "try again later"));
    SendOnce(sock.get(), refusal);
    sock.Reset();
    LogError(
        "fd socket: out of file descriptors (accept: EMFILE/ENFILE); "
        "refused a connection with LIMIT_OPEN_FILES");
  }
  spare_fd_.Reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  return accepted && spare_fd_.valid();
}

void FdServer::PauseAccepting() {
  struct epoll_event ev;
  std::memset(&ev, 0, sizeof(ev));
  ev.events = 0;
  ev.data.u64 = kListenId;
  if (::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_MOD, listen_fd_.get(), &ev) != 0) {
    const int err = errno;
    Fatal(
        absl::StrCat("FdServer: epoll_ctl(MOD listen): ", std::strerror(err)));
  }
  accept_paused_ = true;
  resume_accept_at_ms_ = SteadyNowMs() + kAcceptPauseMs;
}

void FdServer::ResumeAccepting() {
  struct epoll_event ev;
  std::memset(&ev, 0, sizeof(ev));
  ev.events = EPOLLIN;
  ev.data.u64 = kListenId;
  if (::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_MOD, listen_fd_.get(), &ev) != 0) {
    const int err = errno;
    Fatal(
        absl::StrCat("FdServer: epoll_ctl(MOD listen): ", std::strerror(err)));
  }
  accept_paused_ = false;
}

absl::StatusOr<FdCharge> FdServer::AdmitPeer(const PeerCredentials& creds) {
  if (!PeerAllowed(options_, creds)) {
    LogInfo("fd socket: refused pid ", creds.pid, " uid ", creds.uid, " gid ",
            creds.gid, ": not in the allow-list");
    return MrdError(absl::StatusCode::kPermissionDenied, "PEER_NOT_ALLOWED",
                    absl::StrCat("uid ", creds.uid, " (gid ", creds.gid,
                                 ") may not use mrd's fd socket"));
  }
  if (connections_.size() >= options_.max_connections) {
    LogWarning("fd socket: refused pid ", creds.pid, ": ", connections_.size(),
               " connections open, the limit");
    return MrdError(
        absl::StatusCode::kResourceExhausted, "TOO_MANY_SESSIONS",
        absl::StrCat("the fd socket already serves ", connections_.size(),
                     " connections, its limit (", options_.max_connections,
                     ")"));
  }
  // The connection's socket is an fd a client makes mrd hold.
  absl::StatusOr<FdCharge> charge =
      ChargeFd(options_.fd_budget, /*owner=*/0, "an fd socket connection");
  if (!charge.ok()) {
    LogWarning("fd socket: refused pid ", creds.pid, ": ",
               charge.status().message());
  }
  return charge;
}

void FdServer::Accept(UniqueFd sock) {
  struct ucred cred;
  socklen_t len = sizeof(cred);
  if (::getsockopt(sock.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    const int err = errno;
    LogWarning("fd socket: SO_PEERCRED failed: ", std::strerror(err));
    return;
  }
  PeerCredentials creds;
  creds.pid = cred.pid;
  creds.uid = cred.uid;
  creds.gid = cred.gid;
  if (options_.read_cgroup) {
    absl::StatusOr<CgroupIdentity> cgroup = ReadPeerCgroup(sock.get());
    if (cgroup.ok()) {
      creds.cgroup = *std::move(cgroup);
    } else {
      creds.cgroup_error = std::string(cgroup.status().message());
    }
  }
  absl::StatusOr<FdCharge> charge = AdmitPeer(creds);
  absl::StatusOr<std::string> session =
      charge.ok() ? handler_->OnConnect(creds)
                  : absl::StatusOr<std::string>(charge.status());
  if (charge.ok() && !session.ok()) {
    LogInfo("fd socket: no session for pid ", creds.pid, ": ",
            session.status().ToString());
  }
  if (!session.ok()) {
    v1::FdReply refusal;
    SetError(refusal, session.status());
    SendOnce(sock.get(), refusal);
    return;
  }

  const uint64_t id = next_id_++;
  auto owned = std::make_unique<Connection>();
  Connection& conn = *owned;
  conn.id = id;
  conn.sock = std::move(sock);
  conn.creds = creds;
  conn.session = *std::move(session);
  conn.fd_charge = *std::move(charge);
  connections_.emplace(id, std::move(owned));
  {
    absl::MutexLock lock(&mu_);
    ++session_count_;
  }
  LogDebug("fd socket: session ", conn.session, " for pid ", creds.pid, " uid ",
           creds.uid);

  struct epoll_event ev;
  std::memset(&ev, 0, sizeof(ev));
  ev.events = EPOLLIN;
  ev.data.u64 = id;
  if (::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, conn.sock.get(), &ev) != 0) {
    const int err = errno;
    LogWarning("fd socket: epoll_ctl(ADD): ", std::strerror(err));
    Close(id);
    return;
  }
  v1::FdReply welcome;
  v1::FdWelcome* w = welcome.mutable_welcome();
  w->set_session(conn.session);
  w->set_peer_uid(creds.uid);
  w->set_peer_pid(static_cast<uint32_t>(creds.pid));
  w->set_protocol_version(kProtocolVersion);
  if (!Send(conn, welcome)) Close(id);
}

void FdServer::HandleEvent(uint64_t id, uint32_t events) {
  auto it = connections_.find(id);
  if (it == connections_.end()) return;
  Connection& conn = *it->second;
  // The peer is gone: nobody could read a reply, so whatever it queued is
  // dropped with the socket (the kernel closes fds still in flight).
  if ((events & (EPOLLERR | EPOLLHUP)) != 0) {
    Close(id);
    return;
  }
  if ((events & EPOLLOUT) != 0 && !Flush(conn)) {
    Close(id);
    return;
  }
  if ((events & EPOLLIN) != 0 && conn.outbox.empty()) ReadRequests(conn);
}

void FdServer::ReadRequests(Connection& conn) {
  char buffer[kMaxRequestBytes];
  for (int i = 0; i < kMaxDatagramsPerWakeup; ++i) {
    alignas(struct cmsghdr) char control[kControlBytes];
    struct iovec iov;
    iov.iov_base = buffer;
    iov.iov_len = sizeof(buffer);
    struct msghdr msg;
    std::memset(&msg, 0, sizeof(msg));
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    // MSG_TRUNC: return the real length of a datagram too long for the
    // buffer (the rest of it is discarded either way).
    ssize_t n;
    do {
      n = ::recvmsg(conn.sock.get(), &msg,
                    MSG_CMSG_CLOEXEC | MSG_TRUNC | MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    if (n < 0) {
      const int err = errno;
      if (err == EAGAIN) return;
      LogDebug("fd socket: recvmsg on session ", conn.session, ": ",
               std::strerror(err));
      Close(conn.id);
      return;
    }

    Datagram datagram;
    // Take ownership of every fd first, so each path below closes them.
    for (struct cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr;
         c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        // cmsg_len counts the fds the kernel installed; never trust it past
        // the end of our buffer.
        const unsigned char* data = CMSG_DATA(c);
        const auto* end = reinterpret_cast<const unsigned char*>(control) +
                          msg.msg_controllen;
        const size_t payload =
            c->cmsg_len > CMSG_LEN(0) ? c->cmsg_len - CMSG_LEN(0) : 0;
        const size_t room = end > data ? static_cast<size_t>(end - data) : 0;
        const size_t count = std::min(payload, room) / sizeof(int);
        for (size_t k = 0; k < count; ++k) {
          int fd;
          std::memcpy(&fd, data + k * sizeof(int), sizeof(int));
          datagram.fds.emplace_back(fd);
        }
      } else {
        datagram.foreign_control = true;
      }
    }
    datagram.size = static_cast<size_t>(n);
    datagram.truncated = (msg.msg_flags & MSG_TRUNC) != 0;
    datagram.control_truncated = (msg.msg_flags & MSG_CTRUNC) != 0;
    datagram.data =
        absl::string_view(buffer, std::min(datagram.size, sizeof(buffer)));
    if (n == 0 && datagram.fds.empty() && !datagram.foreign_control &&
        !datagram.control_truncated && PeerShutDown(conn.sock.get())) {
      Close(conn.id);  // end of file
      return;
    }

    const v1::FdReply reply = Process(conn, std::move(datagram));
    if (!Send(conn, reply)) {
      Close(conn.id);
      return;
    }
    if (!conn.outbox.empty()) return;  // wait until the peer reads
  }
}

v1::FdReply FdServer::Process(const Connection& conn, Datagram datagram) {
  v1::FdReply reply;
  v1::FdRequest request;
  const bool parsed =
      !datagram.truncated &&
      request.ParseFromArray(datagram.data.data(),
                             static_cast<int>(datagram.data.size()));
  reply.set_sequence(parsed ? request.sequence() : 0);
  const size_t fd_count = datagram.fds.size();

  if (datagram.truncated) {
    SetError(reply, ProtocolError("MESSAGE_TOO_LARGE",
                                  absl::StrCat("a datagram of ", datagram.size,
                                               " bytes; requests are at most ",
                                               kMaxRequestBytes, " bytes")));
    return reply;
  }
  if (datagram.control_truncated) {
    SetError(reply,
             ProtocolError(
                 "CONTROL_TRUNCATED",
                 absl::StrCat("the control data did not fit (", fd_count,
                              " fds arrived before it was cut off and were "
                              "closed, the rest were dropped): pass exactly "
                              "one fd with ImportMemfd and nothing else")));
    return reply;
  }
  if (datagram.foreign_control) {
    SetError(reply, ProtocolError("UNEXPECTED_CONTROL_MESSAGE",
                                  "only SCM_RIGHTS control messages are "
                                  "accepted"));
    return reply;
  }
  if (fd_count > 1) {
    SetError(reply,
             ProtocolError("TOO_MANY_FDS",
                           absl::StrCat(fd_count,
                                        " fds in one request (all closed); "
                                        "ImportMemfd takes exactly one")));
    return reply;
  }
  if (!parsed) {
    SetError(reply,
             ProtocolError("MALFORMED_REQUEST",
                           absl::StrCat("a datagram of ", datagram.size,
                                        " bytes that is not an FdRequest")));
    return reply;
  }
  switch (request.op_case()) {
    case v1::FdRequest::kImportMemfd: {
      if (fd_count == 0) {
        SetError(reply, ProtocolError("MISSING_FD",
                                      "ImportMemfd needs the memfd in an "
                                      "SCM_RIGHTS control message"));
        return reply;
      }
      absl::StatusOr<v1::BufferInfo> buffer = handler_->OnImport(
          conn.session, std::move(datagram.fds[0]), request.import_memfd());
      if (buffer.ok()) {
        *reply.mutable_buffer() = *std::move(buffer);
      } else {
        SetError(reply, buffer.status());
      }
      return reply;
    }
    case v1::FdRequest::kPing:
      if (fd_count != 0) {
        SetError(reply, ProtocolError("UNEXPECTED_FD",
                                      "an fd came with a request that takes "
                                      "none (Ping); it was closed"));
        return reply;
      }
      reply.mutable_pong();
      return reply;
    case v1::FdRequest::OP_NOT_SET:
      break;
  }
  SetError(reply, ProtocolError("UNKNOWN_OPERATION",
                                "the request names no operation this server "
                                "knows (empty, or from a newer protocol)"));
  return reply;
}

bool FdServer::Send(Connection& conn, const v1::FdReply& reply) {
  std::string bytes = reply.SerializeAsString();
  if (!conn.outbox.empty()) {
    conn.outbox.push_back(std::move(bytes));
    return true;
  }
  while (true) {
    if (::send(conn.sock.get(), bytes.data(), bytes.size(),
               MSG_NOSIGNAL | MSG_DONTWAIT) >= 0) {
      return true;
    }
    const int err = errno;
    if (err == EINTR) continue;
    if (err == EAGAIN) {
      conn.outbox.push_back(std::move(bytes));
      return Watch(conn, /*want_output=*/true);
    }
    LogDebug("fd socket: send on session ", conn.session, ": ",
             std::strerror(err));
    return false;
  }
}

bool FdServer::Flush(Connection& conn) {
  while (!conn.outbox.empty()) {
    const std::string& bytes = conn.outbox.front();
    if (::send(conn.sock.get(), bytes.data(), bytes.size(),
               MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      if (err == EAGAIN) return true;  // still watching for EPOLLOUT
      LogDebug("fd socket: send on session ", conn.session, ": ",
               std::strerror(err));
      return false;
    }
    conn.outbox.pop_front();
  }
  return Watch(conn, /*want_output=*/false);
}

bool FdServer::Watch(Connection& conn, bool want_output) {
  if (conn.watching_output == want_output) return true;
  struct epoll_event ev;
  std::memset(&ev, 0, sizeof(ev));
  // Never both: a reader that does not read is not read from. (EPOLLHUP and
  // EPOLLERR are always reported.)
  ev.events = want_output ? EPOLLOUT : EPOLLIN;
  ev.data.u64 = conn.id;
  if (::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_MOD, conn.sock.get(), &ev) != 0) {
    const int err = errno;
    LogWarning("fd socket: epoll_ctl(MOD): ", std::strerror(err));
    return false;
  }
  conn.watching_output = want_output;
  return true;
}

void FdServer::Close(uint64_t id) {
  auto it = connections_.find(id);
  if (it == connections_.end()) return;
  std::unique_ptr<Connection> conn = std::move(it->second);
  connections_.erase(it);
  // Fails harmlessly (ENOENT) if the ADD never happened.
  ::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, conn->sock.get(), nullptr);
  conn->sock.Reset();
  {
    absl::MutexLock lock(&mu_);
    --session_count_;
  }
  LogDebug("fd socket: session ", conn->session, " disconnected");
  handler_->OnDisconnect(conn->session);
}

void FdServer::CloseAll() {
  ::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, listen_fd_.get(), nullptr);
  listen_fd_.Reset();
  // Remove the socket file unless another server has replaced it since (or
  // it is to stay).
  bool unlink;
  {
    absl::MutexLock lock(&mu_);
    unlink = unlink_on_shutdown_;
  }
  if (unlink && socket_file_.has_value() &&
      SameSocketFile(options_.path, *socket_file_)) {
    ::unlink(options_.path.c_str());
  }
  while (!connections_.empty()) Close(connections_.begin()->first);
  LogInfo("fd socket: stopped listening on ", options_.path);
}

}  // namespace mrd::fd_socket
