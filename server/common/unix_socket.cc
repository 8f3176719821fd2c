#include "server/common/unix_socket.h"

#include <fcntl.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <linux/sock_diag.h>
#include <linux/unix_diag.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"
#include "mrd/unique_fd.h"
#include "server/common/log.h"

namespace mrd {
namespace {

absl::Status BadSocket(absl::string_view reason, absl::string_view message) {
  return MrdError(absl::StatusCode::kInvalidArgument, reason, message);
}

absl::string_view TypeName(int type) {
  switch (type) {
    case SOCK_STREAM:
      return "SOCK_STREAM";
    case SOCK_SEQPACKET:
      return "SOCK_SEQPACKET";
    case SOCK_DGRAM:
      return "SOCK_DGRAM";
    default:
      return "another type";
  }
}

absl::Status GetIntOption(int fd, int option, int* value,
                          absl::string_view reason) {
  socklen_t len = sizeof(*value);
  if (::getsockopt(fd, SOL_SOCKET, option, value, &len) != 0) {
    const int err = errno;
    return BadSocket(reason,
                     absl::StrCat("fd ", fd, " is not a usable socket (",
                                  std::strerror(err), ")"));
  }
  return absl::OkStatus();
}

// The file the Unix socket `fd` is bound to, as the kernel's unix_diag
// reports it: kernel dev_t and the low 32 bits of the inode. nullopt when the
// kernel cannot tell (no unix_diag) or the socket is bound to no file.
struct DiagVfs {
  uint64_t device = 0;
  uint32_t inode = 0;
};
std::optional<DiagVfs> DiagBoundFile(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return std::nullopt;
  UniqueFd nl(
      ::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG));
  if (!nl.valid()) return std::nullopt;
  struct {
    struct nlmsghdr header;
    struct unix_diag_req request;
  } message;
  std::memset(&message, 0, sizeof(message));
  message.header.nlmsg_len = sizeof(message);
  message.header.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  message.header.nlmsg_flags = NLM_F_REQUEST;
  message.header.nlmsg_seq = 1;
  message.request.sdiag_family = AF_UNIX;
  message.request.udiag_states = ~0u;
  message.request.udiag_ino = static_cast<uint32_t>(st.st_ino);
  message.request.udiag_show = UDIAG_SHOW_VFS;
  message.request.udiag_cookie[0] = ~0u;  // any socket with that inode
  message.request.udiag_cookie[1] = ~0u;
  struct sockaddr_nl kernel;
  std::memset(&kernel, 0, sizeof(kernel));
  kernel.nl_family = AF_NETLINK;
  if (::sendto(nl.get(), &message, sizeof(message), 0,
               reinterpret_cast<const struct sockaddr*>(&kernel),
               sizeof(kernel)) != static_cast<ssize_t>(sizeof(message))) {
    return std::nullopt;
  }
  // The kernel answers within sendto: never wait. Parsed with memcpy (the
  // NLMSG_* and RTA_* walking macros cast in C style).
  char buffer[4096];
  const ssize_t n = ::recv(nl.get(), buffer, sizeof(buffer), MSG_DONTWAIT);
  if (n < static_cast<ssize_t>(NLMSG_LENGTH(sizeof(struct unix_diag_msg)))) {
    return std::nullopt;
  }
  struct nlmsghdr header;
  std::memcpy(&header, buffer, sizeof(header));
  // NLMSG_ERROR (e.g. ENOENT: no such socket) or a short answer.
  if (header.nlmsg_type != SOCK_DIAG_BY_FAMILY ||
      header.nlmsg_len < NLMSG_LENGTH(sizeof(struct unix_diag_msg)) ||
      header.nlmsg_len > static_cast<size_t>(n)) {
    return std::nullopt;
  }
  struct unix_diag_msg diag;
  std::memcpy(&diag, buffer + NLMSG_HDRLEN, sizeof(diag));
  if (diag.udiag_ino != static_cast<uint32_t>(st.st_ino)) return std::nullopt;
  size_t offset = NLMSG_LENGTH(NLMSG_ALIGN(sizeof(diag)));
  while (offset + sizeof(struct rtattr) <= header.nlmsg_len) {
    struct rtattr attribute;
    std::memcpy(&attribute, buffer + offset, sizeof(attribute));
    if (attribute.rta_len < sizeof(attribute) ||
        offset + attribute.rta_len > header.nlmsg_len) {
      break;
    }
    if (attribute.rta_type == UNIX_DIAG_VFS &&
        attribute.rta_len >= RTA_LENGTH(sizeof(struct unix_diag_vfs))) {
      struct unix_diag_vfs vfs;
      std::memcpy(&vfs, buffer + offset + RTA_LENGTH(0), sizeof(vfs));
      return DiagVfs{vfs.udiag_vfs_dev, vfs.udiag_vfs_ino};
    }
    offset += RTA_ALIGN(attribute.rta_len);
  }
  return std::nullopt;  // bound to no file
}

}  // namespace

absl::Status PrepareHandedOverSocket(int fd, int type, bool listening,
                                     absl::string_view reason) {
  struct stat st;
  if (fd < 0 || ::fstat(fd, &st) != 0) {
    return BadSocket(reason, absl::StrCat("fd ", fd, " is not open"));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return BadSocket(reason, absl::StrCat("fd ", fd, " is not a socket"));
  }
  int domain = 0;
  int actual_type = 0;
  int accepting = 0;
  MRD_RETURN_IF_ERROR(GetIntOption(fd, SO_DOMAIN, &domain, reason));
  MRD_RETURN_IF_ERROR(GetIntOption(fd, SO_TYPE, &actual_type, reason));
  MRD_RETURN_IF_ERROR(GetIntOption(fd, SO_ACCEPTCONN, &accepting, reason));
  if (domain != AF_UNIX) {
    return BadSocket(
        reason,
        absl::StrCat("fd ", fd, " is not a Unix socket (family ", domain, ")"));
  }
  if (actual_type != type) {
    return BadSocket(reason,
                     absl::StrCat("fd ", fd, " is a ", TypeName(actual_type),
                                  " socket, not ", TypeName(type)));
  }
  if ((accepting != 0) != listening) {
    return BadSocket(reason,
                     absl::StrCat("fd ", fd,
                                  listening ? " is not a listening socket"
                                            : " is a listening socket, not a "
                                              "connection"));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    const int err = errno;
    return ErrnoError(err, "fcntl(O_NONBLOCK)", reason);
  }
  const int fd_flags = ::fcntl(fd, F_GETFD);
  if (fd_flags < 0 || ::fcntl(fd, F_SETFD, fd_flags | FD_CLOEXEC) != 0) {
    const int err = errno;
    return ErrnoError(err, "fcntl(FD_CLOEXEC)", reason);
  }
  return absl::OkStatus();
}

std::optional<SocketFileId> BoundSocketFile(int listener,
                                            const std::string& path) {
  struct sockaddr_un bound;
  std::memset(&bound, 0, sizeof(bound));
  socklen_t len = sizeof(bound);
  if (::getsockname(listener, reinterpret_cast<struct sockaddr*>(&bound),
                    &len) != 0 ||
      bound.sun_family != AF_UNIX) {
    return std::nullopt;
  }
  const size_t name_bytes =
      len > offsetof(struct sockaddr_un, sun_path)
          ? ::strnlen(bound.sun_path,
                      len - offsetof(struct sockaddr_un, sun_path))
          : 0;
  if (std::string(bound.sun_path, name_bytes) != path) return std::nullopt;
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) {
    return std::nullopt;
  }
  const SocketFileId id{static_cast<uint64_t>(st.st_dev),
                        static_cast<uint64_t>(st.st_ino)};
  const std::optional<DiagVfs> vfs = DiagBoundFile(listener);
  if (!vfs.has_value()) {
    LogDebug("socket ", path,
             ": the kernel cannot say which file a socket is bound to "
             "(unix_diag); trusting the name it is bound under");
    return id;
  }
  // The kernel's dev_t is major << 20 | minor.
  const auto device = static_cast<uint64_t>(
      makedev(static_cast<unsigned>(vfs->device >> 20),
              static_cast<unsigned>(vfs->device & 0xfffff)));
  if (device != id.device || vfs->inode != static_cast<uint32_t>(id.inode)) {
    return std::nullopt;
  }
  return id;
}

bool SameSocketFile(const std::string& path, const SocketFileId& id) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode) &&
         static_cast<uint64_t>(st.st_dev) == id.device &&
         static_cast<uint64_t>(st.st_ino) == id.inode;
}

}  // namespace mrd
