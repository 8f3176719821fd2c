#include "server/core/entry_json.h"

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace mrd::core {
namespace {

// `,"name":"text"` when `text` is not empty; `first` says whether a field
// came before.
void Text(std::string* out, bool* first, absl::string_view name,
          absl::string_view text) {
  if (text.empty()) return;
  absl::StrAppend(out, *first ? "\"" : ",\"", name, "\":", JsonQuoted(text));
  *first = false;
}

// 64-bit integers are strings in proto3's JSON.
template <typename Int>
void Int64(std::string* out, bool* first, absl::string_view name, Int value) {
  if (value == 0) return;
  absl::StrAppend(out, *first ? "\"" : ",\"", name, "\":\"", value, "\"");
  *first = false;
}

void Int32(std::string* out, bool* first, absl::string_view name,
           uint32_t value) {
  if (value == 0) return;
  absl::StrAppend(out, *first ? "\"" : ",\"", name, "\":", value);
  *first = false;
}

}  // namespace

std::string JsonQuoted(absl::string_view text) {
  std::string out = "\"";
  out.reserve(text.size() + 2);
  for (char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (u < 0x20 || u == 0x7f) {
      absl::StrAppendFormat(&out, "\\u%04x", u);
    } else {
      out += c;
    }
  }
  out += '"';
  return out;
}

std::string PublishedEntryJson(const v1::PublishedEntry& entry) {
  std::string out = "{";
  out.reserve(256);
  bool first = true;
  Text(&out, &first, "name", entry.name());
  Text(&out, &first, "tenant", entry.tenant());
  Text(&out, &first, "cluster", entry.cluster());
  Text(&out, &first, "node", entry.node());
  Int64(&out, &first, "address", entry.address());
  Int64(&out, &first, "length", entry.length());
  Int32(&out, &first, "flags", entry.flags());
  if (entry.tokens_size() > 0) {
    absl::StrAppend(&out, first ? "\"" : ",\"", "tokens\":[");
    first = false;
    for (int i = 0; i < entry.tokens_size(); ++i) {
      const v1::PublishedToken& token = entry.tokens(i);
      out += i == 0 ? "{" : ",{";
      bool token_first = true;
      Text(&out, &token_first, "device", token.device());
      Int32(&out, &token_first, "rkey", token.rkey());
      Text(&out, &token_first, "peerAddress", token.peer_address());
      out += "}";
    }
    out += "]";
  }
  Int64(&out, &first, "epoch", entry.epoch());
  Int64(&out, &first, "publishedUnixMs", entry.published_unix_ms());
  out += "}";
  return out;
}

}  // namespace mrd::core
