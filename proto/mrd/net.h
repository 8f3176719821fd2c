// TCP plumbing of the peer path, shared by the device's listener and the
// SoftPeer client: host:port parsing, connect, listen, and naming the two
// ends of a socket. Sockets are close-on-exec and have TCP_NODELAY set (the
// protocol is strictly request/response).
//
// Thread safety: the functions keep no state and may be called from any
// thread.
#ifndef MRD_PROTO_MRD_NET_H_
#define MRD_PROTO_MRD_NET_H_

#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "mrd/unique_fd.h"

namespace mrd::peer {

// Splits "host:port", "[v6-host]:port". Errors: INVALID_ARGUMENT
// "BAD_HOST_PORT" naming the input.
absl::StatusOr<std::pair<std::string, std::string>> SplitHostPort(
    absl::string_view host_port);

// Connects to the first address of `host_port` that accepts. Errors:
// INVALID_ARGUMENT "BAD_HOST_PORT" (unparsable or unresolvable), UNAVAILABLE
// "PEER_CONNECT_FAILED" (nobody accepted).
absl::StatusOr<UniqueFd> ConnectTcp(absl::string_view host_port);

// A listening socket bound to `host_port` (numeric host; port 0 = any).
// Errors: INVALID_ARGUMENT "BAD_HOST_PORT", or the errno of socket, bind or
// listen with reason "PEER_LISTEN_FAILED".
absl::StatusOr<UniqueFd> ListenTcp(absl::string_view host_port, int backlog);

// "a.b.c.d:port" or "[v6]:port" of the local or the remote end. Errors: the
// errno of getsockname/getpeername.
absl::StatusOr<std::string> LocalAddress(int fd);
absl::StatusOr<std::string> RemoteAddress(int fd);

// Sets TCP_NODELAY; failures are ignored (it is an optimisation only).
void SetNoDelay(int fd);

}  // namespace mrd::peer

#endif  // MRD_PROTO_MRD_NET_H_
