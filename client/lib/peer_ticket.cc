#include "client/lib/peer_ticket.h"

#include <utility>

#include "client/lib/session_core.h"
#include "mrd/status.h"

namespace mrd::client {

absl::StatusOr<PeerTicket> PeerTicket::Create(const Session& session,
                                              const std::string& device) {
  if (session.core() == nullptr) {
    return absl::FailedPreconditionError("use of a moved-from Session");
  }
  v1::CreatePeerTicketRequest request;
  request.set_session(session.token());
  request.set_device(device);
  MRD_ASSIGN_OR_RETURN(v1::PeerTicket ticket,
                       session.client().CreatePeerTicket(request));
  return PeerTicket(std::move(ticket));
}

}  // namespace mrd::client
