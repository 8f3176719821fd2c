#include "server/handover/channel.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"

namespace mrd::handover {
namespace {

constexpr uint32_t kMagic = 0x4844524d;  // "MRDH" little-endian
constexpr size_t kHeaderSize = 12;

void PutU32(char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) {
    v |= uint32_t{static_cast<unsigned char>(p[i])} << (8 * i);
  }
  return v;
}

absl::Status Timeout(absl::string_view what) {
  return MrdError(absl::StatusCode::kDeadlineExceeded, "HANDOVER_TIMEOUT",
                  absl::StrCat("the other mrd did not ", what, " in time"));
}
absl::Status PeerGone() {
  return MrdError(absl::StatusCode::kUnavailable, "HANDOVER_PEER_GONE",
                  "the other mrd closed the handover socket");
}
absl::Status BadFrame(absl::string_view why) {
  return MrdError(absl::StatusCode::kInvalidArgument, "HANDOVER_BAD_FRAME",
                  why);
}

}  // namespace

HandoverChannel::HandoverChannel(UniqueFd socket) : socket_(std::move(socket)) {
  const int flags = ::fcntl(socket_.get(), F_GETFL);
  if (flags >= 0) ::fcntl(socket_.get(), F_SETFL, flags | O_NONBLOCK);
}

absl::Status HandoverChannel::Wait(short events, absl::Time deadline) {
  for (;;) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return Timeout(events == POLLIN ? "answer" : "read");
    }
    pollfd p{socket_.get(), events, 0};
    const int64_t ms = std::min<int64_t>(
        absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))),
        60000);
    const int n = ::poll(&p, 1, static_cast<int>(ms));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError(errno, "poll", "HANDOVER_SOCKET");
    if (n > 0) return absl::OkStatus();
  }
}

absl::Status HandoverChannel::SendMessage(const char* header,
                                          size_t header_size, const int* fds,
                                          size_t nfds, absl::Time deadline) {
  // The fds ride on the first byte: once sendmsg took any of the header,
  // they are sent, and the rest of the header is plain data.
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
  for (;;) {
    iovec iov{const_cast<char*>(header), header_size};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (nfds > 0) {
      std::memset(control, 0, sizeof(control));
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
      std::memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
    }
    const ssize_t n = ::sendmsg(socket_.get(), &msg, MSG_NOSIGNAL);
    if (n > 0) {
      return WriteAll(header + n, header_size - static_cast<size_t>(n),
                      deadline);
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      MRD_RETURN_IF_ERROR(Wait(POLLOUT, deadline));
      continue;
    }
    if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) return PeerGone();
    return ErrnoError(n < 0 ? errno : EIO, "sendmsg", "HANDOVER_SOCKET");
  }
}

absl::Status HandoverChannel::WriteAll(const char* data, size_t size,
                                       absl::Time deadline) {
  while (size > 0) {
    const ssize_t n = ::send(socket_.get(), data, size, MSG_NOSIGNAL);
    if (n > 0) {
      data += n;
      size -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      MRD_RETURN_IF_ERROR(Wait(POLLOUT, deadline));
      continue;
    }
    if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) return PeerGone();
    return ErrnoError(n < 0 ? errno : EIO, "send", "HANDOVER_SOCKET");
  }
  return absl::OkStatus();
}

absl::Status HandoverChannel::Send(const v1::HandoverFrame& frame,
                                   const std::vector<int>& fds,
                                   absl::Time deadline) {
  std::string payload;
  if (!frame.SerializeToString(&payload) || payload.empty() ||
      payload.size() > kMaxPayload) {
    return BadFrame("the frame cannot be serialized");
  }
  char header[kHeaderSize];
  size_t sent = 0;
  // Fds beyond one message's share go ahead in frames of fds only.
  while (fds.size() - sent > kMaxFdsPerMessage) {
    PutU32(header, kMagic);
    PutU32(header + 4, 0);
    PutU32(header + 8, kMaxFdsPerMessage);
    MRD_RETURN_IF_ERROR(SendMessage(header, kHeaderSize, fds.data() + sent,
                                    kMaxFdsPerMessage, deadline));
    sent += kMaxFdsPerMessage;
  }
  PutU32(header, kMagic);
  PutU32(header + 4, static_cast<uint32_t>(payload.size()));
  PutU32(header + 8, static_cast<uint32_t>(fds.size() - sent));
  MRD_RETURN_IF_ERROR(SendMessage(header, kHeaderSize, fds.data() + sent,
                                  fds.size() - sent, deadline));
  return WriteAll(payload.data(), payload.size(), deadline);
}

absl::Status HandoverChannel::ReadAll(char* data, size_t size,
                                      absl::Time deadline) {
  while (size > 0) {
    const ssize_t n = ::recv(socket_.get(), data, size, 0);
    if (n > 0) {
      data += n;
      size -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return PeerGone();
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      MRD_RETURN_IF_ERROR(Wait(POLLIN, deadline));
      continue;
    }
    if (errno == ECONNRESET) return PeerGone();
    return ErrnoError(errno, "recv", "HANDOVER_SOCKET");
  }
  return absl::OkStatus();
}

absl::Status HandoverChannel::ReadHeader(char* header,
                                         std::vector<UniqueFd>* fds,
                                         absl::Time deadline) {
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
  size_t got = 0;
  while (got < kHeaderSize) {
    iovec iov{header + got, kHeaderSize - got};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = ::recvmsg(socket_.get(), &msg, MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      MRD_RETURN_IF_ERROR(Wait(POLLIN, deadline));
      continue;
    }
    if (n < 0 && errno == ECONNRESET) return PeerGone();
    if (n < 0) return ErrnoError(errno, "recvmsg", "HANDOVER_SOCKET");
    // Fds first, so that none leaks whatever comes next.
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr;
         c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds->emplace_back(fd);
      }
    }
    if ((msg.msg_flags & MSG_CTRUNC) != 0) {
      return BadFrame("more fds than one message carries (MSG_CTRUNC)");
    }
    if (n == 0) return PeerGone();
    got += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<HandoverChannel::Received> HandoverChannel::Receive(
    absl::Time deadline) {
  Received received;
  for (;;) {
    char header[kHeaderSize];
    const size_t fds_before = received.fds.size();
    MRD_RETURN_IF_ERROR(ReadHeader(header, &received.fds, deadline));
    if (GetU32(header) != kMagic) return BadFrame("bad magic");
    const uint32_t length = GetU32(header + 4);
    const uint32_t nfds = GetU32(header + 8);
    if (received.fds.size() - fds_before != nfds) {
      return BadFrame(absl::StrCat("the header names ", nfds, " fds but ",
                                   received.fds.size() - fds_before, " came"));
    }
    if (length == 0) continue;  // fds only: the frame follows
    if (length > kMaxPayload) return BadFrame("payload too long");
    // Not resize(): a length the peer made up must not abort us.
    char* data = new (std::nothrow) char[length];
    if (data == nullptr) {
      return MrdError(
          absl::StatusCode::kResourceExhausted, "HANDOVER_NO_MEMORY",
          absl::StrCat("no memory for a frame of ", length, " bytes"));
    }
    std::unique_ptr<char[]> owned(data);
    MRD_RETURN_IF_ERROR(ReadAll(data, length, deadline));
    if (!received.frame.ParseFromArray(data, static_cast<int>(length))) {
      return BadFrame("the payload does not parse");
    }
    return received;
  }
}

absl::StatusOr<UniqueFd> ConnectUnix(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_SOCKET_PATH",
                    absl::StrCat(path, " is too long for a Unix socket"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoError(errno, "socket", "HANDOVER_SOCKET");
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr),
                sizeof(addr)) != 0) {
    if (errno == ENOENT || errno == ECONNREFUSED) {
      return MrdError(absl::StatusCode::kNotFound, "HANDOVER_NOBODY",
                      absl::StrCat("no mrd listens on ", path));
    }
    return ErrnoError(errno, "connect", "HANDOVER_SOCKET");
  }
  return fd;
}

}  // namespace mrd::handover
