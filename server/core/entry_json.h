// The directory's entries as JSON, written by hand: a published name's
// entry is written on every RegisterMr with publish_name, where protobuf's
// reflective JSON printer cost more than the rest of the publishing
// (docs/PERFORMANCE.md, "The directory on etcd").
#ifndef MRD_SERVER_CORE_ENTRY_JSON_H_
#define MRD_SERVER_CORE_ENTRY_JSON_H_

#include <string>

#include "absl/strings/string_view.h"
#include "mrd/v1/mrd.pb.h"

namespace mrd::core {

// `text` as a JSON string, quotes included ('"', '\\' and control
// characters escaped; other bytes as they are).
std::string JsonQuoted(absl::string_view text);

// proto3's JSON mapping of `entry` as protobuf prints it (lowerCamelCase
// names, fields left out at their defaults, 64-bit integers as strings),
// but for `key`, `state`, `registration` and `mooncake_key`, which are
// mrd's and never stored.
std::string PublishedEntryJson(const v1::PublishedEntry& entry);

}  // namespace mrd::core

#endif  // MRD_SERVER_CORE_ENTRY_JSON_H_
