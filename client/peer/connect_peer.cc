// ConnectPeer: the one place that maps a device kind to its peer.
#include "client/peer/peer.h"
#include "client/peer/soft_peer.h"
#ifdef MRD_HAVE_VERBS_PEER
#include "client/peer/verbs_peer.h"
#endif

#include "absl/strings/str_cat.h"

namespace mrd::peer {

absl::StatusOr<std::unique_ptr<Peer>> ConnectPeer(
    absl::string_view device_kind, absl::string_view peer_address,
    absl::string_view ticket) {
  if (device_kind == "software") {
    auto peer = SoftPeer::Connect(peer_address, ticket);
    if (!peer.ok()) return peer.status();
    return std::unique_ptr<Peer>(std::move(*peer));
  }
#ifdef MRD_HAVE_VERBS_PEER
  if (device_kind == "verbs") {
    auto peer = VerbsPeer::Connect(peer_address, ticket);
    if (!peer.ok()) return peer.status();
    return std::unique_ptr<Peer>(std::move(*peer));
  }
#endif
  return absl::UnimplementedError(absl::StrCat("no peer for device kind '",
                                               device_kind, "' in this build"));
}

}  // namespace mrd::peer
