#include "server/device/device_handover.h"

#include "absl/strings/str_cat.h"
#include "mrd/status.h"

namespace mrd::device {
namespace {

// Why a handover call of a device that does not implement it is refused:
// CanHandOver's own refusal, or, for a device that claims it can but left
// the call out, UNIMPLEMENTED.
absl::Status NotHandedOver(const DeviceHandover& device,
                           absl::string_view call) {
  absl::Status can = device.CanHandOver();
  if (!can.ok()) return can;
  return MrdError(absl::StatusCode::kUnimplemented, "HANDOVER_UNIMPLEMENTED",
                  absl::StrCat(call, " is not implemented by this device"));
}

}  // namespace

DeviceHandover& Device::handover() {
  // A device that cannot hand over: every call refused (stateless, so one
  // serves every such device).
  static DeviceHandover* const none = new DeviceHandover();
  return *none;
}

absl::Status DeviceHandover::CanHandOver() const {
  return MrdError(absl::StatusCode::kFailedPrecondition,
                  "HANDOVER_UNSUPPORTED_DEVICE",
                  "this device cannot re-create its memory regions and peer "
                  "tickets in another process");
}

absl::StatusOr<MrKeys> DeviceHandover::AdoptMr(
    PdId /*pd*/, const MemorySpan& /*span*/, uint64_t /*base_address*/,
    uint32_t /*access*/, uint32_t /*lkey*/, uint32_t /*rkey*/) {
  return NotHandedOver(*this, "AdoptMr");
}

absl::Status DeviceHandover::AdoptPeerTicket(PdId /*pd*/,
                                             const std::string& /*ticket*/) {
  return NotHandedOver(*this, "AdoptPeerTicket");
}

absl::StatusOr<DeviceHandover::FastMrState> DeviceHandover::DescribeFastMr(
    MrId /*mr*/) const {
  return NotHandedOver(*this, "DescribeFastMr");
}

absl::StatusOr<LogicalMapping> DeviceHandover::AdoptLam(
    PdId /*pd*/, const MemorySpan& /*span*/, uint64_t /*first_page*/,
    uint32_t /*privileged_key*/) {
  return NotHandedOver(*this, "AdoptLam");
}

absl::StatusOr<MrKeys> DeviceHandover::AdoptFastRegisterMr(
    PdId /*pd*/, const FastMrState& /*state*/) {
  return NotHandedOver(*this, "AdoptFastRegisterMr");
}

absl::StatusOr<UniqueFd> DeviceHandover::StopPeerAccepting() {
  return NotHandedOver(*this, "StopPeerAccepting");
}

void DeviceHandover::ResumePeerAccepting() {}

absl::StatusOr<UniqueFd> DeviceHandover::DuplicatePeerListener() {
  return NotHandedOver(*this, "DuplicatePeerListener");
}

absl::Status DeviceHandover::PinAhead(const MemorySpan& /*span*/) {
  return NotHandedOver(*this, "PinAhead");
}

absl::Status DeviceHandover::AdoptPeer(PdId /*pd*/, HandedOverPeer /*peer*/) {
  return NotHandedOver(*this, "AdoptPeer");
}

}  // namespace mrd::device
