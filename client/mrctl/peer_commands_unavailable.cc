// Stand-ins for `mrctl peer read|write` when mrctl is built without
// mrd_peer_client (client/peer).
#include "client/mrctl/commands.h"

namespace mrd::mrctl {

absl::Status PeerRead(const Invocation&, std::FILE*, std::FILE*) {
  return absl::UnimplementedError(
      "this mrctl was built without the peer client (client/peer)");
}

absl::Status PeerWrite(const Invocation&, std::FILE*, std::FILE*) {
  return absl::UnimplementedError(
      "this mrctl was built without the peer client (client/peer)");
}

}  // namespace mrd::mrctl
