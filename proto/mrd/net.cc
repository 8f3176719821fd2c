#include "mrd/net.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"

namespace mrd::peer {
namespace {

absl::Status BadHostPort(absl::string_view host_port, absl::string_view why) {
  return MrdError(absl::StatusCode::kInvalidArgument, "BAD_HOST_PORT",
                  absl::StrCat("peer address \"", host_port, "\": ", why));
}

struct AddrInfoDeleter {
  void operator()(addrinfo* info) const { freeaddrinfo(info); }
};
using AddrInfoPtr = std::unique_ptr<addrinfo, AddrInfoDeleter>;

absl::StatusOr<AddrInfoPtr> Resolve(absl::string_view host_port,
                                    int extra_flags) {
  MRD_ASSIGN_OR_RETURN(auto parts, SplitHostPort(host_port));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | extra_flags;
  addrinfo* result = nullptr;
  int rc =
      getaddrinfo(parts.first.c_str(), parts.second.c_str(), &hints, &result);
  if (rc != 0) return BadHostPort(host_port, gai_strerror(rc));
  return AddrInfoPtr(result);
}

std::string FormatAddress(const sockaddr_storage& addr) {
  char host[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&addr);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    return absl::StrCat(host, ":", ntohs(in->sin_port));
  }
  if (addr.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&addr);
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    return absl::StrCat("[", host, "]:", ntohs(in6->sin6_port));
  }
  return absl::StrCat("family-", addr.ss_family);
}

}  // namespace

absl::StatusOr<std::pair<std::string, std::string>> SplitHostPort(
    absl::string_view host_port) {
  std::string host;
  absl::string_view port;
  if (!host_port.empty() && host_port.front() == '[') {
    size_t close = host_port.find(']');
    if (close == absl::string_view::npos || close + 1 >= host_port.size() ||
        host_port[close + 1] != ':') {
      return BadHostPort(host_port, "expected [host]:port");
    }
    host = std::string(host_port.substr(1, close - 1));
    port = host_port.substr(close + 2);
  } else {
    size_t colon = host_port.rfind(':');
    if (colon == absl::string_view::npos) {
      return BadHostPort(host_port, "expected host:port");
    }
    host = std::string(host_port.substr(0, colon));
    port = host_port.substr(colon + 1);
    if (host.find(':') != std::string::npos) {
      return BadHostPort(host_port, "an IPv6 host must be in brackets");
    }
  }
  if (host.empty()) return BadHostPort(host_port, "empty host");
  if (port.empty() || port.size() > 5 ||
      port.find_first_not_of("0123456789") != absl::string_view::npos) {
    return BadHostPort(host_port, "port must be a decimal number");
  }
  return std::make_pair(std::move(host), std::string(port));
}

void SetNoDelay(int fd) {
  int one = 1;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

absl::StatusOr<UniqueFd> ConnectTcp(absl::string_view host_port) {
  MRD_ASSIGN_OR_RETURN(AddrInfoPtr addrs, Resolve(host_port, 0));
  int last_err = 0;
  for (addrinfo* ai = addrs.get(); ai != nullptr; ai = ai->ai_next) {
    UniqueFd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC,
                         ai->ai_protocol));
    if (!fd.valid()) {
      last_err = errno;
      continue;
    }
    int rc;
    do {
      rc = ::connect(fd.get(), ai->ai_addr, ai->ai_addrlen);
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) {
      last_err = errno;
      continue;
    }
    SetNoDelay(fd.get());
    return fd;
  }
  return MrdError(
      absl::StatusCode::kUnavailable, "PEER_CONNECT_FAILED",
      absl::StrCat("connect to ", host_port, ": ", std::strerror(last_err)));
}

absl::StatusOr<UniqueFd> ListenTcp(absl::string_view host_port, int backlog) {
  MRD_ASSIGN_OR_RETURN(AddrInfoPtr addrs,
                       Resolve(host_port, AI_PASSIVE | AI_NUMERICHOST));
  const addrinfo* ai = addrs.get();
  UniqueFd fd(
      ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
  if (!fd.valid()) return ErrnoError(errno, "socket", "PEER_LISTEN_FAILED");
  int one = 1;
  (void)setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
    int err = errno;
    return ErrnoError(err, absl::StrCat("bind ", host_port),
                      "PEER_LISTEN_FAILED");
  }
  if (::listen(fd.get(), backlog) != 0) {
    return ErrnoError(errno, "listen", "PEER_LISTEN_FAILED");
  }
  return fd;
}

absl::StatusOr<std::string> LocalAddress(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return ErrnoError(errno, "getsockname", "SOCKET_ADDRESS_FAILED");
  }
  return FormatAddress(addr);
}

absl::StatusOr<std::string> RemoteAddress(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return ErrnoError(errno, "getpeername", "SOCKET_ADDRESS_FAILED");
  }
  return FormatAddress(addr);
}

}  // namespace mrd::peer
