#include "server/device/device.h"

#include "absl/strings/str_cat.h"
#include "mrd/status.h"

namespace mrd::device {
namespace {

// Why a handover call of a device that does not implement it is refused:
// CanHandOver's own refusal, or, for a device that claims it can but left
// the call out, UNIMPLEMENTED.
absl::Status NotHandedOver(const Device& device, absl::string_view call) {
  absl::Status can = device.CanHandOver();
  if (!can.ok()) return can;
  return MrdError(absl::StatusCode::kUnimplemented, "HANDOVER_UNIMPLEMENTED",
                  absl::StrCat(call, " is not implemented by this device"));
}

}  // namespace

absl::Status Device::CanHandOver() const {
  return MrdError(absl::StatusCode::kFailedPrecondition,
                  "HANDOVER_UNSUPPORTED_DEVICE",
                  "this device cannot re-create its memory regions and peer "
                  "tickets in another process");
}

absl::StatusOr<MrKeys> Device::AdoptMr(PdId /*pd*/, const MemorySpan& /*span*/,
                                       uint64_t /*base_address*/,
                                       uint32_t /*access*/, uint32_t /*lkey*/,
                                       uint32_t /*rkey*/) {
  return NotHandedOver(*this, "AdoptMr");
}

absl::Status Device::AdoptPeerTicket(PdId /*pd*/,
                                     const std::string& /*ticket*/) {
  return NotHandedOver(*this, "AdoptPeerTicket");
}

absl::StatusOr<Device::FastMrState> Device::DescribeFastMr(MrId /*mr*/) const {
  return NotHandedOver(*this, "DescribeFastMr");
}

absl::StatusOr<LogicalMapping> Device::AdoptLam(PdId /*pd*/,
                                                const MemorySpan& /*span*/,
                                                uint64_t /*first_page*/,
                                                uint32_t /*privileged_key*/) {
  return NotHandedOver(*this, "AdoptLam");
}

absl::StatusOr<MrKeys> Device::AdoptFastRegisterMr(
    PdId /*pd*/, const FastMrState& /*state*/) {
  return NotHandedOver(*this, "AdoptFastRegisterMr");
}

absl::StatusOr<UniqueFd> Device::StopPeerAccepting() {
  return NotHandedOver(*this, "StopPeerAccepting");
}

void Device::ResumePeerAccepting() {}

absl::StatusOr<UniqueFd> Device::DuplicatePeerListener() {
  return NotHandedOver(*this, "DuplicatePeerListener");
}

absl::Status Device::PinAhead(const MemorySpan& /*span*/) {
  return NotHandedOver(*this, "PinAhead");
}

absl::Status Device::AdoptPeer(PdId /*pd*/, HandedOverPeer /*peer*/) {
  return NotHandedOver(*this, "AdoptPeer");
}

}  // namespace mrd::device
