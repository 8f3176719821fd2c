// How a reader of Mooncake's transfer engine takes a segment's JSON apart,
// for the tests of the directory's Mooncake layout (server/core/
// mooncake_layout.h). The rules are those of its decoder of "rdma"
// segments and of its topology (priority matrix) parser, as read in its
// sources (transfer_metadata.cpp, decodeSegmentDesc; topology.cpp, parse
// and resolve): every device has a name and a GID (and a numeric LID);
// every buffer a name, a non-zero addr and length, at least one rkey and
// as many lkeys; each priority matrix entry is [preferred, available], two
// arrays of device names. A reader picks a buffer's device through the
// entry named as the buffer's location, and indexes the segment's devices
// and the buffer's rkeys by the order in which the matrix first names each
// device, so that order must be the devices'.
//
// With one location (mrd writes one), the matrix's order is its entry's;
// the reader sorts several by location, which Struct's map does not keep.
//
// protobuf's Struct holds numbers as doubles: exact to 2^53, enough for
// LIDs and rkeys; the tests compare 64-bit addresses as text.
#ifndef MRD_TESTS_UNIT_CORE_MOONCAKE_READER_H_
#define MRD_TESTS_UNIT_CORE_MOONCAKE_READER_H_

#include <algorithm>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace mrd::testing {

struct MooncakeSegmentRead {
  std::string name;
  std::vector<std::string> devices;  // in order
  std::vector<std::string> gids;
  std::string buffer_location;
  double length = 0;
  std::vector<double> rkeys;
};

inline absl::Status ReadMooncakeSegment(absl::string_view json,
                                        MooncakeSegmentRead* out) {
  using google::protobuf::ListValue;
  using google::protobuf::Struct;
  using google::protobuf::Value;
  Struct root;
  if (!google::protobuf::util::JsonStringToMessage(std::string(json), &root)
           .ok()) {
    return absl::InvalidArgumentError("not a JSON object");
  }
  auto field = [&](const Struct& s, const char* name) -> const Value* {
    auto it = s.fields().find(name);
    return it == s.fields().end() ? nullptr : &it->second;
  };
  auto text = [&](const Struct& s, const char* name) -> std::string {
    const Value* v = field(s, name);
    return v != nullptr && v->has_string_value() ? v->string_value() : "";
  };
  auto number = [&](const Struct& s, const char* name) -> double {
    const Value* v = field(s, name);
    return v != nullptr && v->has_number_value() ? v->number_value() : -1;
  };
  auto list = [&](const Struct& s, const char* name) -> const ListValue* {
    const Value* v = field(s, name);
    return v != nullptr && v->has_list_value() ? &v->list_value() : nullptr;
  };
  if (text(root, "protocol") != "rdma") {
    return absl::InvalidArgumentError("protocol is not \"rdma\"");
  }
  out->name = text(root, "name");
  const ListValue* devices = list(root, "devices");
  if (devices == nullptr) return absl::InvalidArgumentError("no devices");
  for (const Value& d : devices->values()) {
    if (!d.has_struct_value() || text(d.struct_value(), "name").empty() ||
        text(d.struct_value(), "gid").empty() ||
        number(d.struct_value(), "lid") < 0) {
      return absl::InvalidArgumentError("a device without name, gid or lid");
    }
    out->devices.push_back(text(d.struct_value(), "name"));
    out->gids.push_back(text(d.struct_value(), "gid"));
  }
  const ListValue* buffers = list(root, "buffers");
  if (buffers == nullptr || buffers->values_size() != 1) {
    return absl::InvalidArgumentError("not one buffer");
  }
  const Value& b = buffers->values(0);
  if (!b.has_struct_value()) return absl::InvalidArgumentError("bad buffer");
  const Struct& buffer = b.struct_value();
  out->buffer_location = text(buffer, "name");
  out->length = number(buffer, "length");
  const ListValue* rkey = list(buffer, "rkey");
  const ListValue* lkey = list(buffer, "lkey");
  if (out->buffer_location.empty() || number(buffer, "addr") <= 0 ||
      out->length <= 0 || rkey == nullptr || lkey == nullptr ||
      rkey->values_size() == 0 || rkey->values_size() != lkey->values_size()) {
    return absl::InvalidArgumentError(
        "a buffer without name, addr, length, or with rkeys and lkeys that "
        "do not pair up");
  }
  for (const Value& k : rkey->values()) out->rkeys.push_back(k.number_value());
  const Value* matrix = field(root, "priority_matrix");
  if (matrix == nullptr || !matrix->has_struct_value()) {
    return absl::InvalidArgumentError("no priority matrix");
  }
  std::vector<std::string> order;  // the devices as the matrix names them
  for (const auto& [location, entry] : matrix->struct_value().fields()) {
    if (!entry.has_list_value() || entry.list_value().values_size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat("matrix entry ", location,
                                                     " is not [preferred, "
                                                     "available]"));
    }
    for (const Value& group : entry.list_value().values()) {
      if (!group.has_list_value()) {
        return absl::InvalidArgumentError("a matrix group is not a list");
      }
      for (const Value& name : group.list_value().values()) {
        if (std::find(order.begin(), order.end(), name.string_value()) ==
            order.end()) {
          order.push_back(name.string_value());
        }
      }
    }
  }
  if (!matrix->struct_value().fields().contains(out->buffer_location)) {
    return absl::InvalidArgumentError(
        "the buffer's location has no entry in the matrix");
  }
  if (order != out->devices) {
    return absl::InvalidArgumentError(
        "the matrix names the devices in another order than the segment");
  }
  if (out->rkeys.size() != out->devices.size()) {
    return absl::InvalidArgumentError("not one rkey per device");
  }
  return absl::OkStatus();
}

}  // namespace mrd::testing

#endif  // MRD_TESTS_UNIT_CORE_MOONCAKE_READER_H_
