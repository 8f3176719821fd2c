// A device's part in a live handover (a new mrd process takes over from
// this one): the new process's device re-creates the old one's objects with
// the same keys and tickets, so that a remote peer's rkey and ticket keep
// working, and takes over the peer path's listening socket and its
// established connections. Device operations are device.h's; this is what
// only a handover asks of a device (Device::handover()). The device model
// serves it for both devices, asking its provider where they differ
// (device_model.h). The defaults here are those of a device that cannot:
// every call is refused with CanHandOver's error.
//
// Thread safety: as Device's.
#ifndef MRD_SERVER_DEVICE_DEVICE_HANDOVER_H_
#define MRD_SERVER_DEVICE_DEVICE_HANDOVER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "mrd/unique_fd.h"
#include "server/device/device.h"

namespace mrd::device {

class DeviceHandover {
 public:
  virtual ~DeviceHandover() = default;

  // OK when this device can re-create its objects in another process with
  // the same keys (AdoptMr, AdoptPeerTicket); otherwise FAILED_PRECONDITION
  // "HANDOVER_UNSUPPORTED_DEVICE" saying why.
  virtual absl::Status CanHandOver() const;
  // RegisterMr, but the MR gets exactly `lkey` and `rkey` (the keys another
  // process had for it). Errors as RegisterMr, plus FAILED_PRECONDITION
  // "KEY_IN_USE" and INVALID_ARGUMENT "BAD_KEY".
  virtual absl::StatusOr<MrKeys> AdoptMr(PdId pd, const MemorySpan& span,
                                         uint64_t base_address, uint32_t access,
                                         uint32_t lkey, uint32_t rkey);
  // The PD's peer ticket becomes exactly `ticket` (one CreatePeerTicket
  // returned in another process), as if CreatePeerTicket had made it.
  virtual absl::Status AdoptPeerTicket(PdId pd, const std::string& ticket);

  // An MR object (AllocateFastRegisterMr) as another process re-creates it:
  // what it was allocated with, its keys, and its fast registration if it
  // has one.
  struct FastMrState {
    bool allow_remote = false;
    uint32_t max_pages = 0;
    uint32_t lkey = 0;
    uint32_t rkey = 0;            // the current one (F5)
    bool valid = false;           // fast-registered; the fields below say how
    std::vector<uint64_t> pages;  // logical addresses, as posted
    uint32_t fbo = 0;
    uint64_t length = 0;
    uint64_t base_address = 0;
    uint32_t access = 0;  // AccessBits
  };
  // The MR object's state for AdoptFastRegisterMr. Errors: NOT_FOUND
  // "UNKNOWN_MR" (unknown, or a normal MR), FAILED_PRECONDITION
  // "MR_BUSY" (a fast registration of it is executing now).
  virtual absl::StatusOr<FastMrState> DescribeFastMr(MrId mr) const;
  // BuildLam, but the pages get exactly the logical addresses
  // `first_page`, `first_page` + page_size, ... and the privileged key is
  // exactly `privileged_key`: the LAM another process had (its
  // LogicalMapping). Errors as BuildLam, plus INVALID_ARGUMENT "BAD_IOVA"
  // (not page-aligned, outside the logical address space, or overlapping
  // a mapped range; the range needs no guard gap of its own, since the
  // other process's layout kept its gaps) and the key errors of AdoptMr.
  virtual absl::StatusOr<LogicalMapping> AdoptLam(PdId pd,
                                                  const MemorySpan& span,
                                                  uint64_t first_page,
                                                  uint32_t privileged_key);
  // AllocateFastRegisterMr with exactly `state`'s keys, then, if
  // state.valid, its fast registration as it was (same rkey, pages
  // resolved through the LAMs adopted before it). Errors as those two, and
  // the key errors of AdoptMr; nothing is left on failure.
  virtual absl::StatusOr<MrKeys> AdoptFastRegisterMr(PdId pd,
                                                     const FastMrState& state);
  // Logical addresses are never reused within a device's life; across a
  // handover they are not either: the old device's watermark (every
  // address it ever handed out lies below it) goes to the new one, which
  // hands out only addresses above it from then on (after the adoptions).
  virtual uint64_t LogicalAddressWatermark() const { return 0; }
  virtual void ContinueLogicalAddressesAbove(uint64_t /*watermark*/) {}
  // The peer path's listening socket, for another process: stops accepting
  // new peer connections (connections already made keep being served) and
  // returns a duplicate of the listening fd (close-on-exec; an empty
  // UniqueFd with OK from a device that can hand over but has no listening
  // socket). A device that cannot hand over (verbs) refuses with
  // CanHandOver's error. ResumePeerAccepting undoes the stop (a no-op when
  // not stopped). After StopPeerAccepting, Shutdown must never shutdown(2)
  // or otherwise disturb the listening socket itself (the other process
  // uses it): only close this process's fd.
  virtual absl::StatusOr<UniqueFd> StopPeerAccepting();
  virtual void ResumePeerAccepting();
  // A duplicate of the peer path's listening socket (close-on-exec) while
  // this device goes on accepting on it: what a new process opens its
  // device with before this one pauses (the socket is the same; it accepts
  // on it only after commit). An empty UniqueFd with OK when there is no
  // listening socket; refused with CanHandOver's error by a device that
  // cannot hand over.
  virtual absl::StatusOr<UniqueFd> DuplicatePeerListener();

  // The new process, while the old one still serves: pins `span` as a
  // registration or LAM of exactly that span (same host address and
  // length) pins it, so that adopting it (AdoptMr, AdoptLam; a warm pin's
  // BuildLam) takes this pin over instead of pinning while clients wait.
  // Each pin ahead goes to at most one registration or LAM; DropPinsAhead
  // unpins the ones none took (and the device's end does). Errors: the pin's
  // (RESOURCE_EXHAUSTED "PIN_FAILED", "LIMIT_MEMORY_MAPS", INVALID_ARGUMENT for
  // a bad span); nothing stays pinned then. Refused with CanHandOver's error by
  // a device that cannot hand over.
  virtual absl::Status PinAhead(const MemorySpan& span);
  virtual void DropPinsAhead() {}
  // Pins ahead not yet taken by an adoption nor dropped.
  virtual size_t PinsAhead() const { return 0; }
  // Closes every peer connection and waits (up to `timeout`) until each is
  // gone, its operation in flight finished: from then on no peer reaches
  // memory through this process. A live handover's old process does this
  // before the new one serves, so that a key the new one revokes is not
  // still honoured here. The PDs and their tickets stay: peers may connect
  // again (after ResumePeerAccepting). False when some were still there.
  virtual bool DisconnectPeers(absl::Duration timeout) {
    (void)timeout;
    return true;
  }

  // Established peer connections, handed over where the device can (the
  // software device: its connections are TCP sockets this process owns).
  // One connection past hello, with what is in flight on it.
  struct HandedOverPeer {
    ConnectionId id = 0;
    PdId pd = 0;
    std::string remote;
    UniqueFd socket;       // a duplicate
    std::string received;  // a frame read in part
    std::string unsent;    // a response sent in part
  };
  // Stops serving every peer connection once no peer operation is running
  // (waiting up to `timeout`) and returns those past hello with no work
  // held back on them; they stay open here, untouched, until ThawPeers
  // (the handover was called off) or DropFrozenPeers (it committed: this
  // process's fds close without shutdown(2)). ThawPeers in the new process
  // takes up the adopted ones (AdoptPeer). The default hands over none.
  // Errors: UNAVAILABLE "HANDOVER_BUSY" (an operation was still running;
  // nothing stays stopped).
  virtual absl::StatusOr<std::vector<HandedOverPeer>> FreezePeers(
      absl::Duration timeout) {
    (void)timeout;
    return std::vector<HandedOverPeer>{};
  }
  virtual void ThawPeers() {}
  virtual void DropFrozenPeers() {}
  // The new process's side: `peer` (another process's, frozen there) is
  // to be served in `pd` with its old connection id, as established (no
  // OnPeerConnected; the PD's sink owner counts it itself). Nothing is read
  // or written on it, and the device does not know it, until ThawPeers at
  // commit takes it up (a connection it cannot take then is closed, and
  // logged); until then a failed takeover only closes this process's fd.
  // Errors: CanHandOver's, INVALID_ARGUMENT "BAD_PEER_CONNECTION" (no
  // socket).
  virtual absl::Status AdoptPeer(PdId pd, HandedOverPeer peer);
  // Connection ids are not reused across a handover either (a client may
  // still name a closed one): as the logical address watermark.
  virtual uint64_t ConnectionIdWatermark() const { return 0; }
  virtual void ContinueConnectionIdsAbove(uint64_t /*watermark*/) {}
};

}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_DEVICE_HANDOVER_H_
