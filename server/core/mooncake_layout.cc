#include "server/core/mooncake_layout.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "server/core/entry_json.h"

namespace mrd::core {
namespace {

constexpr absl::string_view kNullGid =
    "00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00";
// The memory's location in the segment's priority matrix.
constexpr absl::string_view kLocation = "cpu:0";

const MooncakeDevice* Find(const std::vector<MooncakeDevice>& devices,
                           absl::string_view name) {
  for (const MooncakeDevice& d : devices) {
    if (d.name == name) return &d;
  }
  return nullptr;
}

}  // namespace

std::string MooncakeSegmentKey(absl::string_view prefix,
                               absl::string_view name) {
  return absl::StrCat(prefix, "ram/", name);
}

std::string MooncakeSegmentJson(const v1::PublishedEntry& entry,
                                const std::vector<MooncakeDevice>& devices,
                                absl::Time now) {
  // Numbers are JSON numbers (readers take addr and length as 64-bit
  // unsigned integers), not proto3 JSON's strings.
  std::string device_list;
  std::string names;
  std::string rkeys;
  std::string lkeys;
  std::string peers;
  for (int i = 0; i < entry.tokens_size(); ++i) {
    const v1::PublishedToken& token = entry.tokens(i);
    const MooncakeDevice* device = Find(devices, token.device());
    const absl::string_view gid = device != nullptr && !device->gid.empty()
                                      ? absl::string_view(device->gid)
                                      : kNullGid;
    const absl::string_view sep = i == 0 ? "" : ",";
    absl::StrAppend(&device_list, sep, "{\"name\":", JsonQuoted(token.device()),
                    ",\"lid\":", device != nullptr ? device->lid : 0,
                    ",\"gid\":", JsonQuoted(gid), "}");
    absl::StrAppend(&names, sep, JsonQuoted(token.device()));
    absl::StrAppend(&rkeys, sep, token.rkey());
    absl::StrAppend(&lkeys, sep, "0");
    absl::StrAppend(&peers, sep, "{\"device\":", JsonQuoted(token.device()),
                    ",\"peer_address\":", JsonQuoted(token.peer_address()),
                    "}");
  }
  return absl::StrCat(
      "{\"name\":", JsonQuoted(entry.name()), ",\"protocol\":\"rdma\"",
      ",\"tcp_data_port\":0,\"timestamp\":",
      JsonQuoted(
          absl::FormatTime("%Y-%m-%d %H:%M:%E6S", now, absl::UTCTimeZone())),
      ",\"devices\":[", device_list,
      "],\"buffers\":[{\"name\":", JsonQuoted(kLocation),
      ",\"addr\":", entry.address(), ",\"length\":", entry.length(),
      ",\"rkey\":[", rkeys, "],\"lkey\":[", lkeys, "]}],\"priority_matrix\":{",
      JsonQuoted(kLocation), ":[[", names,
      "],[]]},\"mrd\":{\"tenant\":", JsonQuoted(entry.tenant()),
      ",\"cluster\":", JsonQuoted(entry.cluster()),
      ",\"node\":", JsonQuoted(entry.node()), ",\"epoch\":", entry.epoch(),
      ",\"flags\":", entry.flags(), ",\"tokens\":[", peers, "]}}");
}

}  // namespace mrd::core
