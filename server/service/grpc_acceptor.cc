#include "server/service/grpc_acceptor.h"

#include <dirent.h>
#include <fcntl.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/server_posix.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "mrd/status.h"
#include "server/common/log.h"

namespace mrd::service {
namespace {

// How often the acceptor looks for connections gRPC has closed.
constexpr absl::Duration kRefreshInterval = absl::Seconds(1);
// At most this often when a refusal depends on it.
constexpr absl::Duration kRefreshBeforeRefusal = absl::Milliseconds(50);

// The inodes of the sockets among this process's open fds.
std::set<ino_t> OpenSocketInodes() {
  std::set<ino_t> inodes;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return inodes;
  while (const dirent* entry = ::readdir(dir)) {
    char target[64];
    const std::string link = absl::StrCat("/proc/self/fd/", entry->d_name);
    const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    absl::string_view t(target, static_cast<size_t>(n));
    // "socket:[12345]"
    if (!absl::StartsWith(t, "socket:[") || !absl::EndsWith(t, "]")) continue;
    uint64_t inode = 0;
    if (absl::SimpleAtoi(t.substr(8, t.size() - 9), &inode)) {
      inodes.insert(static_cast<ino_t>(inode));
    }
  }
  ::closedir(dir);
  return inodes;
}

// Tells a refused gRPC client why, in HTTP/2: the server's connection
// preface (an empty SETTINGS frame), then GOAWAY with ENHANCE_YOUR_CALM and
// `why` as its debug data. Best effort: the socket is closed right after.
void SendGoaway(int fd, absl::string_view why) {
  std::string frames;
  auto header = [&frames](uint32_t length, uint8_t type) {
    frames.push_back(static_cast<char>((length >> 16) & 0xff));
    frames.push_back(static_cast<char>((length >> 8) & 0xff));
    frames.push_back(static_cast<char>(length & 0xff));
    frames.push_back(static_cast<char>(type));
    frames.append(5, '\0');  // flags, stream 0
  };
  header(0, 0x4);  // SETTINGS
  const absl::string_view debug = why.substr(0, 1024);
  header(static_cast<uint32_t>(8 + debug.size()), 0x7);  // GOAWAY
  frames.append(4, '\0');                                // last stream 0
  frames.append({'\0', '\0', '\0', '\x0b'});             // ENHANCE_YOUR_CALM
  frames.append(debug.data(), debug.size());
  (void)::send(fd, frames.data(), frames.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

}  // namespace

GrpcAcceptor::GrpcAcceptor(const GrpcAcceptorOptions& options)
    : options_(options) {
  stats_.max_connections = options.max_connections;
  stats_.max_connections_per_tenant = options.max_connections_per_tenant;
}

GrpcAcceptor::~GrpcAcceptor() { Shutdown(); }

absl::StatusOr<std::unique_ptr<GrpcAcceptor>> GrpcAcceptor::Listen(
    const GrpcAcceptorOptions& options) {
  if (options.max_connections == 0 || options.max_connections_per_tenant == 0) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_GRPC_LIMITS",
                    "--grpc_max_connections and "
                    "--grpc_max_connections_per_tenant must be at least 1");
  }
  std::unique_ptr<GrpcAcceptor> a(new GrpcAcceptor(options));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (options.socket_path.size() >= sizeof(addr.sun_path)) {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "GRPC_SOCKET",
        absl::StrCat("socket path too long: ", options.socket_path));
  }
  std::memcpy(addr.sun_path, options.socket_path.c_str(),
              options.socket_path.size() + 1);
  a->listen_fd_.Reset(
      ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!a->listen_fd_.valid()) {
    return ErrnoError(errno, "socket", "GRPC_SOCKET");
  }
  ::unlink(options.socket_path.c_str());
  if (::bind(a->listen_fd_.get(), reinterpret_cast<const sockaddr*>(&addr),
             sizeof(addr)) != 0) {
    return ErrnoError(errno, absl::StrCat("bind ", options.socket_path),
                      "GRPC_SOCKET");
  }
  struct stat st {};
  if (::lstat(options.socket_path.c_str(), &st) != 0) {
    return ErrnoError(errno, absl::StrCat("lstat ", options.socket_path),
                      "GRPC_SOCKET");
  }
  a->socket_file_ = SocketFileId{static_cast<uint64_t>(st.st_dev),
                                 static_cast<uint64_t>(st.st_ino)};
  if (::chmod(options.socket_path.c_str(), options.socket_mode) != 0) {
    return ErrnoError(errno, absl::StrCat("chmod ", options.socket_path),
                      "GRPC_SOCKET");
  }
  if (::listen(a->listen_fd_.get(), SOMAXCONN) != 0) {
    return ErrnoError(errno, "listen", "GRPC_SOCKET");
  }
  MRD_RETURN_IF_ERROR(a->OpenHelperFds());
  return a;
}

absl::StatusOr<std::unique_ptr<GrpcAcceptor>> GrpcAcceptor::Adopt(
    const GrpcAcceptorOptions& options, UniqueFd listener) {
  if (options.max_connections == 0 || options.max_connections_per_tenant == 0) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_GRPC_LIMITS",
                    "--grpc_max_connections and "
                    "--grpc_max_connections_per_tenant must be at least 1");
  }
  MRD_RETURN_IF_ERROR(PrepareHandedOverSocket(listener.get(), SOCK_STREAM,
                                              /*listening=*/true,
                                              "BAD_LISTENER"));
  std::unique_ptr<GrpcAcceptor> a(new GrpcAcceptor(options));
  a->listen_fd_ = std::move(listener);
  a->socket_file_ = BoundSocketFile(a->listen_fd_.get(), options.socket_path);
  if (!a->socket_file_.has_value()) {
    LogWarning("gRPC acceptor: the adopted listener is not bound to the file ",
               "at ", options.socket_path,
               "; it will not be removed at shutdown");
  }
  MRD_RETURN_IF_ERROR(a->OpenHelperFds());
  LogInfo("gRPC acceptor: adopted the socket ", options.socket_path);
  return a;
}

absl::Status GrpcAcceptor::OpenHelperFds() {
  wake_fd_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd_.valid()) return ErrnoError(errno, "eventfd", "GRPC_SOCKET");
  spare_fd_.Reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!spare_fd_.valid()) {
    return ErrnoError(errno, "open /dev/null", "GRPC_SOCKET");
  }
  return absl::OkStatus();
}

absl::Status GrpcAcceptor::Start(grpc::Server* server) {
  if (detached_) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "ACCEPTOR_DETACHED",
                    "this acceptor gave its socket away (Detach); adopt it "
                    "into a new acceptor to accept again");
  }
  if (thread_.has_value()) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "ACCEPTOR_STARTED",
                    "the acceptor is already accepting");
  }
  MRD_ASSIGN_OR_RETURN(
      Thread t,
      Thread::Start("mrd-grpc-accept", [this, server] { Run(server); }));
  thread_ = std::move(t);
  return absl::OkStatus();
}

void GrpcAcceptor::StopThread() {
  if (!thread_.has_value()) return;
  const uint64_t one = 1;
  (void)::write(wake_fd_.get(), &one, sizeof(one));
  thread_->Join();
  thread_.reset();
}

absl::StatusOr<UniqueFd> GrpcAcceptor::Detach() {
  if (!listen_fd_.valid()) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "NOT_LISTENING",
                    absl::StrCat("the gRPC acceptor of ", options_.socket_path,
                                 " was shut down or detached already"));
  }
  // The thread accepts nothing more once joined; whatever it accepted is
  // gRPC's already, and what waits in the backlog stays there.
  StopThread();
  detached_ = true;
  socket_file_.reset();
  LogInfo("gRPC acceptor: detached ", options_.socket_path);
  return std::move(listen_fd_);
}

void GrpcAcceptor::Shutdown() {
  StopThread();
  if (listen_fd_.valid()) {
    listen_fd_.Reset();
    // Unless another server has replaced the socket file since.
    if (socket_file_.has_value() &&
        SameSocketFile(options_.socket_path, *socket_file_)) {
      ::unlink(options_.socket_path.c_str());
    }
  }
}

GrpcAcceptorStats GrpcAcceptor::Stats() const {
  absl::MutexLock lock(&mu_);
  GrpcAcceptorStats s = stats_;
  s.connections = live_.size();
  return s;
}

void GrpcAcceptor::Run(grpc::Server* server) {
  while (true) {
    pollfd fds[2] = {{listen_fd_.get(), POLLIN, 0},
                     {wake_fd_.get(), POLLIN, 0}};
    const int n = ::poll(
        fds, 2, static_cast<int>(absl::ToInt64Milliseconds(kRefreshInterval)));
    if (n < 0 && errno != EINTR) {
      LogError("gRPC acceptor: poll: ", std::strerror(errno));
      absl::SleepFor(absl::Milliseconds(100));
      continue;
    }
    if (n > 0 && (fds[1].revents & POLLIN) != 0) return;
    if (n > 0 && (fds[0].revents & POLLIN) != 0) AcceptAll(server);
    Refresh(kRefreshInterval);
  }
}

void GrpcAcceptor::RefuseForLackOfFds(int err) {
  // Give the spare up to take the connection off the queue and close it, so
  // that the client learns at once and the listening socket keeps working.
  spare_fd_.Reset();
  UniqueFd dropped(::accept4(listen_fd_.get(), nullptr, nullptr,
                             SOCK_CLOEXEC | SOCK_NONBLOCK));
  if (dropped.valid()) {
    SendGoaway(dropped.get(),
               "mrd: LIMIT_OPEN_FILES: mrd has no file descriptor left "
               "for a gRPC connection");
  }
  dropped.Reset();
  spare_fd_.Reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  {
    absl::MutexLock lock(&mu_);
    ++stats_.refused_no_fd;
  }
  LogError("gRPC acceptor: out of file descriptors (", std::strerror(err),
           "); a gRPC connection was refused. Raise the open-file limit or "
           "lower --grpc_max_connections");
}

std::string GrpcAcceptor::Admit(const std::string& tenant, uint64_t inode) {
  auto at_limit = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto of_tenant = per_tenant_.find(tenant);
    return live_.size() >= options_.max_connections ||
           (of_tenant != per_tenant_.end() &&
            of_tenant->second >= options_.max_connections_per_tenant);
  };
  bool refresh = false;
  {
    absl::MutexLock lock(&mu_);
    refresh = at_limit();
  }
  // Connections gRPC closed since the last look may have made room.
  if (refresh) Refresh(kRefreshBeforeRefusal);
  absl::MutexLock lock(&mu_);
  auto found = per_tenant_.find(tenant);
  const uint64_t of_tenant = found != per_tenant_.end() ? found->second : 0;
  if (live_.size() >= options_.max_connections) {
    ++stats_.refused_total_limit;
    return absl::StrCat("mrd: LIMIT_GRPC_CONNECTIONS: mrd holds ", live_.size(),
                        " gRPC connections, its limit (--grpc_max_connections=",
                        options_.max_connections, ")");
  }
  if (of_tenant >= options_.max_connections_per_tenant) {
    ++stats_.refused_tenant_limit;
    return absl::StrCat(
        "mrd: LIMIT_TENANT_GRPC_CONNECTIONS: tenant ", tenant, " holds ",
        of_tenant,
        " gRPC connections, its limit (--grpc_max_connections_per_tenant=",
        options_.max_connections_per_tenant, ")");
  }
  live_[inode] = tenant;
  ++per_tenant_[tenant];
  ++stats_.accepted_total;
  return std::string();
}

void GrpcAcceptor::AcceptAll(grpc::Server* server) {
  while (true) {
    UniqueFd conn(::accept4(listen_fd_.get(), nullptr, nullptr,
                            SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!conn.valid()) {
      const int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      if (err == EINTR || err == ECONNABORTED) continue;
      if ((err == EMFILE || err == ENFILE) && spare_fd_.valid()) {
        RefuseForLackOfFds(err);
        continue;
      }
      LogError("gRPC acceptor: accept4: ", std::strerror(err));
      return;
    }
    ucred cred{};
    socklen_t len = sizeof(cred);
    struct stat st {};
    if (::getsockopt(conn.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
        ::fstat(conn.get(), &st) != 0) {
      continue;  // the client is already gone
    }
    const auto& allowed = options_.allowed_uids;
    if (!allowed.empty() &&
        std::find(allowed.begin(), allowed.end(), cred.uid) == allowed.end()) {
      LogWarning("connection of pid ", cred.pid, " uid ", cred.uid, " to ",
                 options_.socket_path, " refused: not allowed");
      SendGoaway(
          conn.get(),
          absl::StrCat("mrd: PEER_NOT_ALLOWED: uid ", cred.uid, " may not use ",
                       options_.socket_path, " (root and mrd's own uid only)"));
      continue;  // closes it
    }
    const std::string tenant = options_.tenant_of
                                   ? options_.tenant_of(conn.get(), cred.uid)
                                   : absl::StrCat("uid:", cred.uid);
    const std::string refusal = Admit(tenant, st.st_ino);
    if (!refusal.empty()) {
      LogWarning("gRPC connection of pid ", cred.pid, " uid ", cred.uid,
                 " (tenant ", tenant, ")", " refused: ", refusal.substr(5));
      SendGoaway(conn.get(), refusal);
      continue;  // closes it
    }
    // gRPC owns the fd from here on.
    grpc::AddInsecureChannelFromFd(server, conn.Release());
  }
}

void GrpcAcceptor::Refresh(absl::Duration min_interval) {
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (now - last_refresh_ < min_interval) return;
    last_refresh_ = now;
    if (live_.empty()) return;
  }
  // Only the acceptor thread adds connections, and it is the one calling:
  // nothing handed over meanwhile is missed.
  const std::set<ino_t> open = OpenSocketInodes();
  absl::MutexLock lock(&mu_);
  for (auto it = live_.begin(); it != live_.end();) {
    if (open.count(it->first) != 0) {
      ++it;
      continue;
    }
    auto tenant = per_tenant_.find(it->second);
    if (tenant != per_tenant_.end() && --tenant->second == 0) {
      per_tenant_.erase(tenant);
    }
    it = live_.erase(it);
  }
}

void BoundOpenCallsPerConnection(grpc::ServerBuilder& builder,
                                 uint32_t streams) {
  if (streams == 0) return;
  builder.AddChannelArgument(
      GRPC_ARG_MAX_CONCURRENT_STREAMS,
      static_cast<int>(std::min<uint32_t>(
          streams, static_cast<uint32_t>(std::numeric_limits<int>::max()))));
}

}  // namespace mrd::service
