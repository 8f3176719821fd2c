#include "server/common/sd_notify.h"

#include <sys/socket.h>
#include <sys/un.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"
#include "mrd/unique_fd.h"

namespace mrd {

absl::Status SdNotify(absl::string_view state) {
  const char* env = std::getenv("NOTIFY_SOCKET");
  if (env == nullptr || *env == '\0') return absl::OkStatus();
  const std::string path = env;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if ((path[0] != '/' && path[0] != '@') || path.size() < 2 ||
      path.size() > sizeof(addr.sun_path)) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_NOTIFY_SOCKET",
                    absl::StrCat("NOTIFY_SOCKET='", path,
                                 "' is neither an absolute path nor @name"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  // An abstract address starts with a NUL byte and is exactly as long as
  // given; a path is NUL-terminated (when it fits).
  socklen_t length =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size());
  if (path[0] == '@') {
    addr.sun_path[0] = '\0';
  } else if (path.size() < sizeof(addr.sun_path)) {
    ++length;
  }
  UniqueFd fd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoError(errno, "socket", "NOTIFY_FAILED");
  ssize_t sent;
  do {
    sent = ::sendto(fd.get(), state.data(), state.size(), MSG_NOSIGNAL,
                    reinterpret_cast<const sockaddr*>(&addr), length);
  } while (sent < 0 && errno == EINTR);
  if (sent < 0) return ErrnoError(errno, "sendto", "NOTIFY_FAILED");
  return absl::OkStatus();
}

}  // namespace mrd
