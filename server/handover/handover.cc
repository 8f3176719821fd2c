#include "server/handover/handover.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"
#include "server/common/log.h"

namespace mrd::handover {
namespace {

absl::Status Unexpected(const v1::HandoverFrame& frame,
                        absl::string_view wanted) {
  if (frame.has_refusal()) return StatusOfRefusal(frame.refusal());
  return MrdError(absl::StatusCode::kInvalidArgument, "HANDOVER_BAD_FRAME",
                  absl::StrCat("expected ", wanted, ", got frame ",
                               static_cast<int>(frame.body_case())));
}

}  // namespace

absl::Status StatusOfRefusal(const v1::HandoverRefusal& refusal) {
  return MrdError(
      absl::StatusCode::kFailedPrecondition,
      refusal.reason().empty() ? "HANDOVER_REFUSED" : refusal.reason(),
      refusal.message());
}

v1::HandoverFrame RefusalFrame(const absl::Status& why) {
  v1::HandoverFrame frame;
  std::string reason = GetErrorDetail(why).reason();
  if (reason.empty()) reason = "HANDOVER_REFUSED";
  frame.mutable_refusal()->set_reason(reason);
  frame.mutable_refusal()->set_message(std::string(why.message()));
  return frame;
}

// --- the old process's end ---------------------------------------------------

HandoverServer::HandoverServer(const HandoverServerOptions& options,
                               HandoverSource* source)
    : options_(options), source_(source) {}

HandoverServer::~HandoverServer() { Shutdown(); }

absl::StatusOr<std::unique_ptr<HandoverServer>> HandoverServer::Start(
    const HandoverServerOptions& options, HandoverSource* source,
    UniqueFd inherited) {
  std::unique_ptr<HandoverServer> server(new HandoverServer(options, source));
  if (inherited.valid()) {
    server->listen_fd_ = std::move(inherited);
  } else {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (options.path.empty() || options.path.size() >= sizeof(addr.sun_path)) {
      return MrdError(absl::StatusCode::kInvalidArgument, "BAD_SOCKET_PATH",
                      absl::StrCat("handover socket path '", options.path,
                                   "' is empty or too long"));
    }
    std::memcpy(addr.sun_path, options.path.data(), options.path.size());
    // A socket file there: another mrd's (refuse), or a stale one (replace).
    struct stat st {};
    if (::lstat(options.path.c_str(), &st) == 0) {
      if (!S_ISSOCK(st.st_mode)) {
        return MrdError(absl::StatusCode::kFailedPrecondition,
                        "PATH_NOT_SOCKET",
                        absl::StrCat(options.path,
                                     " exists and is not a "
                                     "socket; left alone"));
      }
      if (ConnectUnix(options.path).ok()) {
        return MrdError(absl::StatusCode::kFailedPrecondition,
                        "HANDOVER_SOCKET_IN_USE",
                        absl::StrCat("another mrd listens on ", options.path,
                                     ": stop it first, or start this one with "
                                     "--takeover to take over from it"));
      }
      ::unlink(options.path.c_str());
    }
    server->listen_fd_.Reset(
        ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!server->listen_fd_.valid()) {
      return ErrnoError(errno, "socket", "HANDOVER_SOCKET");
    }
    // Owner only: a handover gives away every client's memory.
    const mode_t old_mask = ::umask(0177);
    const int bound =
        ::bind(server->listen_fd_.get(),
               reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
    const int bind_errno = errno;
    ::umask(old_mask);
    if (bound != 0) return ErrnoError(bind_errno, "bind", "HANDOVER_SOCKET");
    if (::listen(server->listen_fd_.get(), 4) != 0) {
      return ErrnoError(errno, "listen", "HANDOVER_SOCKET");
    }
  }
  const int flags = ::fcntl(server->listen_fd_.get(), F_GETFL);
  if (flags >= 0)
    ::fcntl(server->listen_fd_.get(), F_SETFL, flags | O_NONBLOCK);
  struct stat st {};
  if (::stat(options.path.c_str(), &st) == 0) {
    server->socket_device_ = st.st_dev;
    server->socket_inode_ = st.st_ino;
  }
  server->wake_fd_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!server->wake_fd_.valid()) {
    return ErrnoError(errno, "eventfd", "HANDOVER_SOCKET");
  }
  HandoverServer* raw = server.get();
  MRD_ASSIGN_OR_RETURN(Thread thread,
                       Thread::Start("mrd-handover", [raw] { raw->Run(); }));
  server->thread_.emplace(std::move(thread));
  return server;
}

absl::StatusOr<UniqueFd> HandoverServer::DuplicateListener() const {
  const int fd = ::fcntl(listen_fd_.get(), F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return ErrnoError(errno, "dup", "HANDOVER_FD");
  return UniqueFd(fd);
}

void HandoverServer::Shutdown() {
  if (!thread_.has_value()) return;
  const uint64_t one = 1;
  (void)!::write(wake_fd_.get(), &one, sizeof(one));
  thread_->Join();
  thread_.reset();
  struct stat st {};
  if (socket_inode_ != 0 && ::stat(options_.path.c_str(), &st) == 0 &&
      st.st_dev == socket_device_ && st.st_ino == socket_inode_) {
    ::unlink(options_.path.c_str());
  }
  listen_fd_.Reset();
}

HandoverServer::Stats HandoverServer::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void HandoverServer::Run() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_.get(), POLLIN, 0},
                     {wake_fd_.get(), POLLIN, 0}};
    const int n = ::poll(fds, 2, -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 || (fds[1].revents & POLLIN) != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    UniqueFd socket(
        ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!socket.valid()) continue;
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (::getsockopt(socket.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
        cred.uid != ::geteuid()) {
      LogWarning("handover: refused a connection from uid ", cred.uid,
                 " (only mrd's own uid ", ::geteuid(), " may take over)");
      HandoverChannel channel(std::move(socket));
      (void)channel.Send(
          RefusalFrame(MrdError(
              absl::StatusCode::kPermissionDenied, "HANDOVER_PEER_NOT_ALLOWED",
              absl::StrCat("only uid ", ::geteuid(), " may take over"))),
          absl::Now() + absl::Seconds(1));
      continue;
    }
    Serve(std::move(socket));
  }
}

void HandoverServer::Serve(UniqueFd socket) {
  {
    absl::MutexLock lock(&mu_);
    ++stats_.attempts;
  }
  HandoverChannel channel(std::move(socket));
  bool paused = false;
  absl::Time paused_at;
  absl::Status status = ServeSteps(channel, &paused, &paused_at);
  // Only failures come back: a committed handover ends in Finish.
  LogWarning("handover refused or failed, this mrd serves on: ",
             status.ToString());
  (void)channel.Send(RefusalFrame(status), absl::Now() + absl::Seconds(1));
  if (paused) source_->Resume();
  absl::MutexLock lock(&mu_);
  ++stats_.refusals;
  stats_.last_refusal = GetErrorDetail(status).reason();
}

absl::Status HandoverServer::ServeSteps(HandoverChannel& channel, bool* paused,
                                        absl::Time* paused_at) {
  const absl::Time hello_deadline = absl::Now() + absl::Seconds(10);
  MRD_ASSIGN_OR_RETURN(HandoverChannel::Received hello,
                       channel.Receive(hello_deadline));
  if (!hello.frame.has_hello()) return Unexpected(hello.frame, "hello");
  const v1::HandoverHello& h = hello.frame.hello();
  LogInfo("handover: pid ", h.pid(), " (mrd ", h.mrd_version(),
          ") asks to take over");
  if (h.version() != kHandoverVersion) {
    return MrdError(
        absl::StatusCode::kFailedPrecondition, "HANDOVER_VERSION",
        absl::StrCat("this mrd (", options_.mrd_version,
                     ") hands over in format version ", kHandoverVersion,
                     "; the new process speaks version ", h.version()));
  }
  MRD_RETURN_IF_ERROR(source_->Check(h));
  v1::HandoverFrame accept;
  accept.mutable_accept()->set_version(kHandoverVersion);
  accept.mutable_accept()->set_mrd_version(options_.mrd_version);
  accept.mutable_accept()->set_pid(static_cast<uint32_t>(::getpid()));
  MRD_RETURN_IF_ERROR(channel.Send(accept, absl::Now() + options_.timeout));
  {
    // While this process serves: the new one maps the memfds and fills
    // their page tables, the longest part of adopting them.
    v1::HandoverFrame prepare;
    std::vector<UniqueFd> owned;
    MRD_RETURN_IF_ERROR(source_->Prepare(prepare.mutable_prepare(), &owned));
    std::vector<int> fds;
    fds.reserve(owned.size());
    for (const UniqueFd& fd : owned) fds.push_back(fd.get());
    MRD_RETURN_IF_ERROR(
        channel.Send(prepare, fds, absl::Now() + options_.timeout));
  }
  MRD_ASSIGN_OR_RETURN(HandoverChannel::Received prepared,
                       channel.Receive(absl::Now() + options_.timeout));
  if (!prepared.frame.has_prepared()) {
    return Unexpected(prepared.frame, "prepared");
  }
  *paused_at = absl::Now();
  MRD_RETURN_IF_ERROR(source_->Pause());
  *paused = true;

  v1::HandoverFrame snapshot;
  std::vector<UniqueFd> owned;
  MRD_RETURN_IF_ERROR(source_->Export(snapshot.mutable_snapshot(), &owned));
  std::vector<int> fds;
  fds.reserve(owned.size() + 1);
  for (const UniqueFd& fd : owned) fds.push_back(fd.get());
  snapshot.mutable_snapshot()->set_handover_listener(
      static_cast<int32_t>(fds.size()));
  fds.push_back(listen_fd_.get());
  MRD_RETURN_IF_ERROR(
      channel.Send(snapshot, fds, absl::Now() + options_.timeout));
  owned.clear();  // the new process has its own copies now

  MRD_ASSIGN_OR_RETURN(HandoverChannel::Received ready,
                       channel.Receive(absl::Now() + options_.timeout));
  if (!ready.frame.has_ready()) return Unexpected(ready.frame, "ready");
  MRD_RETURN_IF_ERROR(source_->Release());
  v1::HandoverFrame commit;
  commit.mutable_commit();
  MRD_RETURN_IF_ERROR(channel.Send(commit, absl::Now() + options_.timeout));
  source_->Finish(ready.frame.ready(), absl::Now() - *paused_at);
  return MrdError(absl::StatusCode::kInternal, "HANDOVER_NOT_FINISHED",
                  "Finish returned");
}

// --- the new process's end ---------------------------------------------------

absl::StatusOr<std::unique_ptr<Takeover>> Takeover::Begin(
    const TakeoverOptions& options, v1::HandoverHello hello) {
  MRD_ASSIGN_OR_RETURN(UniqueFd socket, ConnectUnix(options.path));
  std::unique_ptr<Takeover> takeover(new Takeover(options, std::move(socket)));
  hello.set_version(options.version);
  v1::HandoverFrame frame;
  *frame.mutable_hello() = std::move(hello);
  MRD_RETURN_IF_ERROR(
      takeover->channel_.Send(frame, absl::Now() + options.timeout));
  MRD_ASSIGN_OR_RETURN(
      HandoverChannel::Received answer,
      takeover->channel_.Receive(absl::Now() + options.timeout));
  if (!answer.frame.has_accept()) return Unexpected(answer.frame, "accept");
  takeover->accept_ = answer.frame.accept();
  return takeover;
}

absl::StatusOr<HandoverChannel::Received> Takeover::ReceivePrepare() {
  MRD_ASSIGN_OR_RETURN(HandoverChannel::Received prepare,
                       channel_.Receive(absl::Now() + options_.timeout));
  if (!prepare.frame.has_prepare()) {
    return Unexpected(prepare.frame, "prepare");
  }
  return prepare;
}

absl::Status Takeover::Prepared() {
  v1::HandoverFrame frame;
  frame.mutable_prepared();
  return channel_.Send(frame, absl::Now() + options_.timeout);
}

absl::StatusOr<HandoverChannel::Received> Takeover::ReceiveSnapshot() {
  MRD_ASSIGN_OR_RETURN(HandoverChannel::Received snapshot,
                       channel_.Receive(absl::Now() + options_.timeout));
  if (!snapshot.frame.has_snapshot()) {
    return Unexpected(snapshot.frame, "snapshot");
  }
  return snapshot;
}

absl::Status Takeover::Ready(const v1::HandoverReady& ready) {
  v1::HandoverFrame frame;
  *frame.mutable_ready() = ready;
  MRD_RETURN_IF_ERROR(channel_.Send(frame, absl::Now() + options_.timeout));
  MRD_ASSIGN_OR_RETURN(HandoverChannel::Received commit,
                       channel_.Receive(absl::Now() + options_.timeout));
  if (!commit.frame.has_commit()) return Unexpected(commit.frame, "commit");
  return absl::OkStatus();
}

void Takeover::Refuse(const absl::Status& why) {
  (void)channel_.Send(RefusalFrame(why), absl::Now() + absl::Seconds(1));
}

}  // namespace mrd::handover
