// mrd::client::PeerTicket: a ticket with which remote peers connect to this
// session on the device's peer path (CreatePeerTicket). mrd has no call to
// revoke a ticket: it stops working when the session ends, so this handle
// releases nothing.
//
// Movable, not copyable. Immutable, hence thread-safe.
#ifndef MRD_CLIENT_LIB_PEER_TICKET_H_
#define MRD_CLIENT_LIB_PEER_TICKET_H_

#include <string>

#include "absl/status/statusor.h"
#include "client/lib/session.h"
#include "mrd/v1/mrd.pb.h"

namespace mrd::client {

class PeerTicket {
 public:
  // For the peer path of mrd's device `device` ("": the first). Errors:
  // FAILED_PRECONDITION (WSAENOTCONN), RESOURCE_EXHAUSTED, INVALID_ARGUMENT
  // UNKNOWN_DEVICE.
  static absl::StatusOr<PeerTicket> Create(const Session& session,
                                           const std::string& device = "");

  PeerTicket(PeerTicket&&) noexcept = default;
  PeerTicket& operator=(PeerTicket&&) noexcept = default;
  PeerTicket(const PeerTicket&) = delete;
  PeerTicket& operator=(const PeerTicket&) = delete;
  ~PeerTicket() = default;

  const std::string& ticket() const { return ticket_.ticket(); }
  // host:port where peers connect.
  const std::string& peer_address() const { return ticket_.peer_address(); }
  // The device whose peer path it opens.
  const std::string& device() const { return ticket_.device(); }
  const v1::PeerTicket& proto() const { return ticket_; }

 private:
  explicit PeerTicket(v1::PeerTicket ticket) : ticket_(std::move(ticket)) {}

  v1::PeerTicket ticket_;
};

}  // namespace mrd::client

#endif  // MRD_CLIENT_LIB_PEER_TICKET_H_
