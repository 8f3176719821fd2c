// Peer: a remote peer of mrd's device, the side that uses the tokens mrd
// hands out. Two implementations, one per device kind:
//   SoftPeer  (soft_peer.h)  the software device's TCP peer path;
//   VerbsPeer (verbs_peer.h) a real RC queue pair connected with librdmacm.
// Connect(kind, ...) picks one from the device kind that GetDeviceInfo (or
// CreatePeerTicket's peer_address owner) reports, so one test suite runs
// against both devices.
//
// Errors are RDMA completion codes, the same on both devices:
//   PERMISSION_DENIED "REMOTE_ACCESS_ERROR"   bad key, bounds, rights or PD;
//                                             the connection is then dead
//                                             (an RC QP goes to the error
//                                             state): reconnect to go on
//   INVALID_ARGUMENT  "REMOTE_INVALID_REQUEST" e.g. longer than
//                                             max_message_size()
//   UNAUTHENTICATED   "BAD_TICKET"            Connect with an unknown ticket
//   UNAVAILABLE       "PEER_CONNECTION_*"     connect failed, connection
//                                             closed, broken or in error
//
// Thread safety: implementations are thread-safe; calls on one connection
// are serialized.
#ifndef MRD_CLIENT_PEER_PEER_H_
#define MRD_CLIENT_PEER_PEER_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mrd::peer {

class Peer {
 public:
  virtual ~Peer() = default;

  // RDMA READ of `length` bytes at `address` in the region named by `rkey`.
  virtual absl::StatusOr<std::string> Read(uint32_t rkey, uint64_t address,
                                           uint64_t length) = 0;
  // RDMA WRITE of `data` at `address`.
  virtual absl::Status Write(uint32_t rkey, uint64_t address,
                             absl::string_view data) = 0;

  // mrd's id of this connection (what FastRegister and InvalidateMr name).
  virtual uint64_t connection_id() const = 0;
  // The largest READ/WRITE this connection accepts.
  virtual uint64_t max_message_size() const = 0;
};

// Connects to the device of `device_kind` ("software" or "verbs") at
// `peer_address` (host:port) with `ticket` from CreatePeerTicket.
// UNIMPLEMENTED for a kind this build has no peer for.
absl::StatusOr<std::unique_ptr<Peer>> ConnectPeer(
    absl::string_view device_kind, absl::string_view peer_address,
    absl::string_view ticket);

}  // namespace mrd::peer

#endif  // MRD_CLIENT_PEER_PEER_H_
