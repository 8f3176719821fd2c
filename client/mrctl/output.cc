#include "client/mrctl/output.h"

#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/lib/status.h"
#include "client/mrctl/args.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/util/json_util.h"

namespace mrd::mrctl {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

std::string ScalarText(const Message& m, const FieldDescriptor* f, int index) {
  const Reflection* r = m.GetReflection();
  const bool rep = f->is_repeated();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return absl::StrCat(rep ? r->GetRepeatedInt32(m, f, index)
                              : r->GetInt32(m, f));
    case FieldDescriptor::CPPTYPE_INT64:
      return absl::StrCat(rep ? r->GetRepeatedInt64(m, f, index)
                              : r->GetInt64(m, f));
    case FieldDescriptor::CPPTYPE_UINT32:
      return absl::StrCat(rep ? r->GetRepeatedUInt32(m, f, index)
                              : r->GetUInt32(m, f));
    case FieldDescriptor::CPPTYPE_UINT64:
      return absl::StrCat(rep ? r->GetRepeatedUInt64(m, f, index)
                              : r->GetUInt64(m, f));
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return absl::StrCat(rep ? r->GetRepeatedDouble(m, f, index)
                              : r->GetDouble(m, f));
    case FieldDescriptor::CPPTYPE_FLOAT:
      return absl::StrCat(rep ? r->GetRepeatedFloat(m, f, index)
                              : r->GetFloat(m, f));
    case FieldDescriptor::CPPTYPE_BOOL:
      return (rep ? r->GetRepeatedBool(m, f, index) : r->GetBool(m, f))
                 ? "true"
                 : "false";
    case FieldDescriptor::CPPTYPE_ENUM: {
      int value =
          rep ? r->GetRepeatedEnumValue(m, f, index) : r->GetEnumValue(m, f);
      const auto* v = f->enum_type()->FindValueByNumber(value);
      return v != nullptr ? v->name() : absl::StrCat(value);
    }
    case FieldDescriptor::CPPTYPE_STRING: {
      std::string s =
          rep ? r->GetRepeatedString(m, f, index) : r->GetString(m, f);
      if (f->type() == FieldDescriptor::TYPE_BYTES) return EncodeHex(s);
      return absl::CEscape(s);
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      break;
  }
  return "";
}

void AppendHuman(const Message& m, const std::string& prefix,
                 std::string* out) {
  const auto* d = m.GetDescriptor();
  const Reflection* r = m.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    std::string key = absl::StrCat(prefix, f->name());
    if (f->is_repeated()) {
      int n = r->FieldSize(m, f);
      if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
        for (int j = 0; j < n; ++j) {
          AppendHuman(r->GetRepeatedMessage(m, f, j),
                      absl::StrCat(key, "[", j, "]."), out);
        }
      } else {
        std::vector<std::string> items;
        for (int j = 0; j < n; ++j) items.push_back(ScalarText(m, f, j));
        absl::StrAppend(out, key, "=", absl::StrJoin(items, ","), "\n");
      }
      continue;
    }
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      if (r->HasField(m, f)) {
        AppendHuman(r->GetMessage(m, f), absl::StrCat(key, "."), out);
      }
      continue;
    }
    // Unset oneof members and unset proto3 `optional` fields are absent.
    if (f->has_presence() && !r->HasField(m, f)) continue;
    absl::StrAppend(out, key, "=", ScalarText(m, f, 0), "\n");
  }
}

}  // namespace

int ExitCodeFor(const absl::Status& status) {
  if (status.ok()) return kExitOk;
  if (IsUsageError(status)) return kExitUsage;
  switch (status.code()) {
    case absl::StatusCode::kNotFound:
      return kExitNotFound;
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
      return kExitDenied;
    case absl::StatusCode::kResourceExhausted:
      return kExitExhausted;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      return kExitUnavailable;
    case absl::StatusCode::kFailedPrecondition:
      return kExitPrecondition;
    default:
      // INVALID_ARGUMENT, OUT_OF_RANGE, ALREADY_EXISTS, ABORTED, CANCELLED,
      // UNKNOWN, UNIMPLEMENTED, INTERNAL, DATA_LOSS.
      return kExitFailed;
  }
}

std::string HumanForm(const Message& message, absl::string_view prefix) {
  std::string out;
  AppendHuman(message, std::string(prefix), &out);
  return out;
}

absl::StatusOr<std::string> JsonForm(const Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = false;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = false;
  std::string out;
  auto status =
      google::protobuf::util::MessageToJsonString(message, &out, options);
  if (!status.ok()) {
    return absl::InternalError(
        absl::StrCat("cannot print JSON: ", status.ToString()));
  }
  return out;
}

std::string ErrorLine(const absl::Status& status) {
  if (IsUsageError(status)) return absl::StrCat("mrctl: ", status.message());
  return absl::StrCat("mrctl: ", client::FormatStatus(status));
}

}  // namespace mrd::mrctl
