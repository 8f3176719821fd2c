#include "client/lib/fd_channel.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/lib/status.h"
#include "mrd/status.h"

namespace mrd::client {
namespace {

// Largest reply we accept; replies are a few hundred bytes.
constexpr size_t kMaxDatagram = 64 * 1024;
// Room for a few fds in case mrd (wrongly) sends some: they get closed.
constexpr size_t kControlSpace = CMSG_SPACE(sizeof(int) * 8);

absl::Status SessionClosed(absl::string_view message) {
  return SeedError(WSAENOTCONN, "FD_SESSION_CLOSED", message);
}

int PollTimeoutMs(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return -1;
  absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  int64_t ms = absl::ToInt64Milliseconds(left + absl::Milliseconds(1) -
                                         absl::Nanoseconds(1));
  return ms > 1'000'000'000 ? 1'000'000'000 : static_cast<int>(ms);
}

absl::Time DeadlineAfter(absl::Duration timeout) {
  if (timeout == absl::InfiniteDuration() || timeout <= absl::ZeroDuration()) {
    return absl::InfiniteFuture();
  }
  return absl::Now() + timeout;
}

void CloseReceivedFds(msghdr* msg) {
  for (cmsghdr* c = CMSG_FIRSTHDR(msg); c != nullptr; c = CMSG_NXTHDR(msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      ::close(fd);
    }
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<FdChannel>> FdChannel::Connect(
    absl::string_view path, absl::Duration timeout) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_FD_SOCKET_PATH",
                    absl::StrCat("fd socket path '", path,
                                 "' is empty or too long for a Unix socket"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  UniqueFd socket(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!socket.valid()) return ErrnoError(errno, "socket", "FD_SOCKET");
  if (::connect(socket.get(), reinterpret_cast<const sockaddr*>(&addr),
                sizeof(addr)) != 0) {
    int err = errno;
    absl::StatusCode code = absl::StatusCode::kUnavailable;
    if (err == EACCES || err == EPERM) {
      code = absl::StatusCode::kPermissionDenied;
    }
    return MrdError(code, "CANNOT_CONNECT",
                    absl::StrCat("cannot connect to the fd socket ", path, ": ",
                                 std::strerror(err),
                                 err == ENOENT ? " (is mrd running? see "
                                                 "--fd-socket and "
                                                 "MRD_RUNTIME_DIR)"
                                               : ""));
  }
  return FromConnectedSocket(std::move(socket), timeout);
}

absl::StatusOr<std::unique_ptr<FdChannel>> FdChannel::FromConnectedSocket(
    UniqueFd socket, absl::Duration timeout) {
  std::unique_ptr<FdChannel> channel(new FdChannel(std::move(socket)));
  MRD_RETURN_IF_ERROR(channel->ReadWelcome(timeout));
  return channel;
}

absl::Status FdChannel::ReadWelcome(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  v1::FdReply reply;
  absl::Status status = ReceiveLocked(DeadlineAfter(timeout), &reply);
  if (!status.ok()) {
    if (absl::IsFailedPrecondition(status)) {
      // mrd closed the connection without a word.
      return MrdError(absl::StatusCode::kUnavailable, "NO_WELCOME",
                      "mrd closed the fd socket before welcoming us");
    }
    return status;
  }
  if (reply.has_error()) return StatusFromFdError(reply.error());
  if (!reply.has_welcome() || reply.welcome().session().empty()) {
    return MrdError(absl::StatusCode::kInternal, "BAD_WELCOME",
                    "the fd socket's first reply is not a welcome");
  }
  welcome_ = reply.welcome();
  return absl::OkStatus();
}

absl::Status FdChannel::ReceiveLocked(absl::Time deadline, v1::FdReply* reply) {
  std::vector<char> data(kMaxDatagram);
  alignas(cmsghdr) char control[kControlSpace];
  while (true) {
    if (!socket_.valid()) return SessionClosed("the fd session is closed");
    pollfd pfd{socket_.get(), POLLIN, 0};
    int ready = ::poll(&pfd, 1, PollTimeoutMs(deadline));
    if (ready < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "poll", "FD_SOCKET");
    }
    if (ready == 0) {
      return MrdError(absl::StatusCode::kDeadlineExceeded, "FD_REPLY_TIMEOUT",
                      "no reply from mrd on the fd socket in time");
    }
    iovec iov{data.data(), data.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t n = ::recvmsg(socket_.get(), &msg, MSG_CMSG_CLOEXEC);
    if (n < 0) {
      int err = errno;
      if (err == EINTR || err == EAGAIN) continue;
      if (err == ECONNRESET || err == ENOTCONN) {
        socket_.Reset();
        return SessionClosed("mrd closed the fd session");
      }
      return ErrnoError(err, "recvmsg", "FD_SOCKET");
    }
    CloseReceivedFds(&msg);
    if (n == 0) {
      socket_.Reset();
      return SessionClosed("mrd closed the fd session");
    }
    if ((msg.msg_flags & MSG_TRUNC) != 0) {
      return MrdError(absl::StatusCode::kInternal, "FD_REPLY_TOO_LARGE",
                      "a reply on the fd socket was larger than 64 KiB");
    }
    if (!reply->ParseFromArray(data.data(), static_cast<int>(n))) {
      return MrdError(absl::StatusCode::kInternal, "MALFORMED_FD_REPLY",
                      "cannot parse a reply on the fd socket");
    }
    return absl::OkStatus();
  }
}

absl::StatusOr<v1::FdReply> FdChannel::Exchange(v1::FdRequest request,
                                                int fd_to_pass,
                                                absl::Duration timeout) {
  absl::Time deadline = DeadlineAfter(timeout);
  absl::MutexLock lock(&mu_);
  if (!socket_.valid()) return SessionClosed("the fd session is closed");
  const uint64_t sequence = next_sequence_++;
  request.set_sequence(sequence);
  std::string bytes = request.SerializeAsString();

  iovec iov{bytes.data(), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  if (fd_to_pass >= 0) {
    std::memset(control, 0, sizeof(control));
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd_to_pass, sizeof(int));
  }
  while (true) {
    ssize_t sent = ::sendmsg(socket_.get(), &msg, MSG_NOSIGNAL);
    if (sent >= 0) break;
    int err = errno;
    if (err == EINTR) continue;
    if (err == EBADF && fd_to_pass >= 0) {
      // Nothing was sent: the socket is as before.
      return MrdError(
          absl::StatusCode::kInvalidArgument, "BAD_FD",
          absl::StrCat("fd ", fd_to_pass, " is not an open file descriptor"));
    }
    if (err == EPIPE || err == ECONNRESET || err == ENOTCONN) {
      socket_.Reset();
      return SessionClosed("mrd closed the fd session");
    }
    return ErrnoError(err, "sendmsg", "FD_SOCKET");
  }

  while (true) {
    v1::FdReply reply;
    MRD_RETURN_IF_ERROR(ReceiveLocked(deadline, &reply));
    if (reply.sequence() == sequence ||
        (reply.sequence() == 0 && reply.has_error())) {
      return reply;
    }
    // A late reply to an earlier exchange that timed out: skip it.
  }
}

absl::StatusOr<v1::BufferInfo> FdChannel::ImportMemfd(int fd, bool writable,
                                                      uint64_t expected_size,
                                                      absl::Duration timeout) {
  if (fd < 0) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_FD",
                    absl::StrCat("fd ", fd, " is not a file descriptor"));
  }
  v1::FdRequest request;
  request.mutable_import_memfd()->set_writable(writable);
  request.mutable_import_memfd()->set_expected_size(expected_size);
  MRD_ASSIGN_OR_RETURN(v1::FdReply reply,
                       Exchange(std::move(request), fd, timeout));
  if (reply.has_error()) return StatusFromFdError(reply.error());
  if (!reply.has_buffer()) {
    return MrdError(absl::StatusCode::kInternal, "BAD_FD_REPLY",
                    "ImportMemfd reply carries no buffer");
  }
  return reply.buffer();
}

absl::Status FdChannel::Ping(absl::Duration timeout) {
  v1::FdRequest request;
  request.mutable_ping();
  MRD_ASSIGN_OR_RETURN(v1::FdReply reply,
                       Exchange(std::move(request), -1, timeout));
  if (reply.has_error()) return StatusFromFdError(reply.error());
  if (!reply.has_pong()) {
    return MrdError(absl::StatusCode::kInternal, "BAD_FD_REPLY",
                    "Ping reply is not a pong");
  }
  return absl::OkStatus();
}

void FdChannel::Close() {
  absl::MutexLock lock(&mu_);
  socket_.Reset();
}

bool FdChannel::is_open() const {
  absl::MutexLock lock(&mu_);
  return socket_.valid();
}

int FdChannel::socket_fd() const {
  absl::MutexLock lock(&mu_);
  return socket_.get();
}

}  // namespace mrd::client
