// SoftPeer: a remote peer of the software device, the way a remote NIC would
// be. It connects over TCP to the device's peer address, presents a ticket
// (CreatePeerTicket) which binds the connection to one protection domain,
// and then issues one-sided READ and WRITE against (rkey, address) pairs.
//
// Errors mirror RDMA completion codes:
//   PERMISSION_DENIED "REMOTE_ACCESS_ERROR"   bad key, bounds, rights or PD
//                                             (the device then closes the
//                                             connection, as an RC QP goes to
//                                             the error state)
//   INVALID_ARGUMENT  "REMOTE_INVALID_REQUEST" malformed request, e.g. longer
//                                             than max_message_size()
//   UNAUTHENTICATED   "BAD_TICKET"            Connect with an unknown ticket
//   UNAVAILABLE       "PEER_CONNECTION_*"     connect failed, connection
//                                             closed or broken
//   INTERNAL          "PEER_PROTOCOL_ERROR"   the device answered nonsense
//
// Ownership: SoftPeer owns its socket; destroying it closes the connection.
// Thread safety: thread-safe; concurrent calls are serialized (one request
// in flight per connection).
#ifndef MRD_CLIENT_PEER_SOFT_PEER_H_
#define MRD_CLIENT_PEER_SOFT_PEER_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "client/peer/peer.h"
#include "mrd/unique_fd.h"
#include "mrd/v1/peer.pb.h"

namespace mrd::peer {

class SoftPeer final : public Peer {
 public:
  // Connects and says hello. `host_port` is the device's peer_address.
  static absl::StatusOr<std::unique_ptr<SoftPeer>> Connect(
      absl::string_view host_port, absl::string_view ticket);

  SoftPeer(const SoftPeer&) = delete;
  SoftPeer& operator=(const SoftPeer&) = delete;
  ~SoftPeer() override = default;

  // RDMA READ of `length` bytes at `address` in the region named by `rkey`.
  absl::StatusOr<std::string> Read(uint32_t rkey, uint64_t address,
                                   uint64_t length) override;
  // RDMA WRITE of `data` at `address`. Data longer than max_message_size()
  // is refused here with INVALID_ARGUMENT "REMOTE_INVALID_REQUEST", exactly
  // as the device would refuse it, without sending it.
  absl::Status Write(uint32_t rkey, uint64_t address,
                     absl::string_view data) override;

  // The device's id of this connection (the queue pair), from hello.
  uint64_t connection_id() const override { return connection_id_; }
  // The largest READ/WRITE the device accepts, from hello.
  uint64_t max_message_size() const override { return max_message_size_; }

 private:
  SoftPeer(UniqueFd fd, uint64_t connection_id, uint64_t max_message_size)
      : fd_(std::move(fd)),
        connection_id_(connection_id),
        max_message_size_(max_message_size) {}

  // Sends `request` and waits for the response with the same id.
  // Non-success peer statuses become the errors listed above.
  static absl::StatusOr<v1::PeerResponse> Exchange(
      int fd, uint64_t max_response_bytes, const v1::PeerRequest& request);

  // Assigns the request id and exchanges it on this connection. After a
  // transport or protocol failure the stream may be out of step, so the
  // connection is latched broken and later calls fail fast with UNAVAILABLE.
  absl::StatusOr<v1::PeerResponse> Call(v1::PeerRequest& request);

  absl::Mutex mu_;
  UniqueFd fd_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 2;  // 1 was the hello
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  const uint64_t connection_id_;
  const uint64_t max_message_size_;
};

}  // namespace mrd::peer

#endif  // MRD_CLIENT_PEER_SOFT_PEER_H_
