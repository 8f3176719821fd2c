// `mrctl peer read|write`: one-sided operations as a remote peer of either
// device (mrd::peer::ConnectPeer picks SoftPeer or VerbsPeer).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/mrctl/commands.h"
#include "client/mrctl/output.h"
#include "client/peer/peer.h"
#include "mrd/status.h"

namespace mrd::mrctl {
namespace {

struct Target {
  std::string address;
  std::string kind;    // "software" | "verbs"
  std::string device;  // --device: whose address and kind are the defaults
  std::string ticket;
  uint32_t rkey = 0;
  uint64_t va = 0;
};

absl::StatusOr<Target> TargetOf(const Invocation& inv) {
  FlagValues flags(inv);
  Target target;
  MRD_ASSIGN_OR_RETURN(target.ticket, flags.RequiredString("ticket"));
  MRD_ASSIGN_OR_RETURN(uint64_t rkey, flags.Uint64("rkey"));
  if (rkey > UINT32_MAX) return UsageError("--rkey exceeds 32 bits");
  target.rkey = static_cast<uint32_t>(rkey);
  MRD_ASSIGN_OR_RETURN(target.va, flags.Uint64("va"));
  target.address = flags.String("address").value_or("");
  target.kind = flags.String("kind").value_or("");
  target.device = flags.String("device").value_or("");
  if (!target.kind.empty() && target.kind != "software" &&
      target.kind != "verbs") {
    return UsageError(absl::StrCat("--kind must be software or verbs, not '",
                                   target.kind, "'"));
  }
  return target;
}

// The entry of GetDeviceInfo's devices named `name`. INVALID_ARGUMENT
// UNKNOWN_DEVICE, naming the devices mrd serves, when there is none.
absl::StatusOr<v1::DeviceInfo> DeviceNamed(const v1::DeviceInfo& info,
                                           const std::string& name) {
  std::vector<std::string> names;
  for (const v1::DeviceInfo& device : info.devices()) {
    if (device.name() == name) return device;
    names.push_back(device.name());
  }
  return MrdError(absl::StatusCode::kInvalidArgument, "UNKNOWN_DEVICE",
                  absl::StrCat("no device '", name, "': mrd serves ",
                               absl::StrJoin(names, ", ")));
}

// The peer address and device kind: --address and --kind, else what the
// local mrd's GetDeviceInfo reports for --device (default: its first).
absl::Status ResolveAddress(const Invocation& inv, Target& target) {
  if (!target.address.empty() && !target.kind.empty()) return absl::OkStatus();
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(inv.global));
  MRD_ASSIGN_OR_RETURN(v1::DeviceInfo info, c.GetDeviceInfo());
  if (!target.device.empty()) {
    MRD_ASSIGN_OR_RETURN(info, DeviceNamed(info, target.device));
  }
  if (target.kind.empty()) target.kind = info.kind();
  if (target.address.empty()) {
    if (info.peer_address().empty()) {
      return UsageError(
          "mrd reports no peer address; pass --address=HOST:PORT");
    }
    target.address = info.peer_address();
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status PeerRead(const Invocation& inv, std::FILE* out,
                      std::FILE* /*err*/) {
  FlagValues flags(inv);
  MRD_ASSIGN_OR_RETURN(Target target, TargetOf(inv));
  MRD_ASSIGN_OR_RETURN(uint64_t length, flags.Size("length"));
  MRD_ASSIGN_OR_RETURN(bool hex, flags.Bool("hex"));
  MRD_RETURN_IF_ERROR(ResolveAddress(inv, target));
  MRD_ASSIGN_OR_RETURN(
      std::unique_ptr<peer::Peer> peer,
      peer::ConnectPeer(target.kind, target.address, target.ticket));
  MRD_ASSIGN_OR_RETURN(std::string data,
                       peer->Read(target.rkey, target.va, length));
  if (inv.global.json) {
    std::fprintf(out, "{\"data\":\"%s\",\"length\":\"%zu\"}\n",
                 absl::Base64Escape(data).c_str(), data.size());
  } else if (hex) {
    std::fprintf(out, "%s\n", EncodeHex(data).c_str());
  } else {
    std::fwrite(data.data(), 1, data.size(), out);
  }
  std::fflush(out);
  return absl::OkStatus();
}

absl::Status PeerWrite(const Invocation& inv, std::FILE* out, std::FILE* err) {
  FlagValues flags(inv);
  MRD_ASSIGN_OR_RETURN(Target target, TargetOf(inv));
  std::string data;
  if (flags.Has("data") == flags.Has("hex")) {
    return UsageError("give exactly one of --data and --hex");
  }
  if (flags.Has("data")) {
    data = *flags.String("data");
  } else {
    absl::StatusOr<std::string> decoded = DecodeHex(*flags.String("hex"));
    if (!decoded.ok()) {
      return UsageError(absl::StrCat("--hex: ", decoded.status().message()));
    }
    data = *std::move(decoded);
  }
  MRD_RETURN_IF_ERROR(ResolveAddress(inv, target));
  MRD_ASSIGN_OR_RETURN(
      std::unique_ptr<peer::Peer> peer,
      peer::ConnectPeer(target.kind, target.address, target.ticket));
  MRD_RETURN_IF_ERROR(peer->Write(target.rkey, target.va, data));
  if (inv.global.json) {
    std::fprintf(out, "{\"written\":\"%zu\"}\n", data.size());
  } else if (!inv.global.quiet) {
    std::fprintf(err, "mrctl: wrote %zu bytes\n", data.size());
  }
  std::fflush(out);
  return absl::OkStatus();
}

}  // namespace mrd::mrctl
