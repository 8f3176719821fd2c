// Unix sockets handed between processes (live handover, issue 11): checking
// that a descriptor received from another process really is the kind of
// socket expected, and telling whether the socket file at a path is the one a
// listening socket is bound to, so that only its owner removes it.
//
// Thread safety: every function touches only its arguments (and the kernel).
#ifndef MRD_SERVER_COMMON_UNIX_SOCKET_H_
#define MRD_SERVER_COMMON_UNIX_SOCKET_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace mrd {

// A file as lstat() reports it.
struct SocketFileId {
  uint64_t device = 0;  // st_dev
  uint64_t inode = 0;   // st_ino
};

// Checks that `fd` is an AF_UNIX socket of `type` (SOCK_STREAM,
// SOCK_SEQPACKET) that is listening, or connected when `listening` is false,
// and makes it non-blocking and close-on-exec (a socket received over
// SCM_RIGHTS without MSG_CMSG_CLOEXEC is not). Errors: INVALID_ARGUMENT
// `reason`, saying what the fd is instead (closed, not a socket, another
// family or type, (not) listening); fcntl failures: ErrnoError with `reason`.
absl::Status PrepareHandedOverSocket(int fd, int type, bool listening,
                                     absl::string_view reason);

// The st_dev/st_ino of the socket file at `path` when it is the file
// `listener` is bound to; nullopt when it is not: nothing there, not a
// socket, or the file of another socket (the path was unlinked and bound
// again), or the listener is bound under another name.
//
// fstat on a socket's fd gives its inode in sockfs, not the file's, so the
// file is found by asking the kernel which file the socket is bound to
// (NETLINK_SOCK_DIAG, UDIAG_SHOW_VFS; only 32 bits of the inode are
// reported, and those are compared). Where that is unavailable (no unix_diag
// in the kernel), the name the listener is bound under (getsockname) is all
// that is compared.
std::optional<SocketFileId> BoundSocketFile(int listener,
                                            const std::string& path);

// Whether `path` is still the file `id` names (lstat).
bool SameSocketFile(const std::string& path, const SocketFileId& id);

}  // namespace mrd

#endif  // MRD_SERVER_COMMON_UNIX_SOCKET_H_
