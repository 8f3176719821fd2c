#include "mrd/byte_size.h"

#include <algorithm>
#include <cctype>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "mrd/status.h"

namespace mrd {
namespace {

struct Unit {
  const char* name;
  uint64_t base;
  int power;
};
// Single letters are matched in either case (below); the others exactly.
constexpr Unit kUnits[] = {{"K", 1024, 1}, {"KiB", 1024, 1}, {"KB", 1000, 1},
                           {"M", 1024, 2}, {"MiB", 1024, 2}, {"MB", 1000, 2},
                           {"G", 1024, 3}, {"GiB", 1024, 3}, {"GB", 1000, 3},
                           {"T", 1024, 4}, {"TiB", 1024, 4}, {"TB", 1000, 4},
                           {"P", 1024, 5}, {"PiB", 1024, 5}, {"PB", 1000, 5}};

bool AllOf(absl::string_view text, int (*is)(int)) {
  return std::all_of(text.begin(), text.end(), [is](char ch) {
    return is(static_cast<unsigned char>(ch)) != 0;
  });
}

constexpr absl::string_view kNotASize =
    "is not a size (bytes, 0x hex, or a whole number with K, M, G, T, P or "
    "KiB, ..., PiB (1024s) or KB, ..., PB (1000s))";

absl::Status NotASize(absl::string_view text, absl::string_view why) {
  return MrdError(absl::StatusCode::kInvalidArgument, "BAD_SIZE",
                  absl::StrCat("'", text, "' ", why));
}

}  // namespace

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  const absl::string_view t = absl::StripAsciiWhitespace(text);
  uint64_t value = 0;
  if (absl::StartsWithIgnoreCase(t, "0x")) {
    const absl::string_view digits = t.substr(2);
    if (!digits.empty() && AllOf(digits, isxdigit) &&
        absl::SimpleHexAtoi(digits, &value)) {
      return value;
    }
    return NotASize(text, "is not a 64-bit hex number");
  }
  size_t digits = 0;
  while (digits < t.size() && absl::ascii_isdigit(t[digits])) ++digits;
  if (digits == 0) return NotASize(text, kNotASize);
  if (!absl::SimpleAtoi(t.substr(0, digits), &value)) {
    return NotASize(text, "exceeds 64 bits");
  }
  const absl::string_view unit = t.substr(digits);
  if (unit.empty()) return value;
  for (const Unit& u : kUnits) {
    const bool letter = absl::string_view(u.name).size() == 1;
    if (letter ? !absl::EqualsIgnoreCase(unit, u.name) : unit != u.name) {
      continue;
    }
    for (int i = 0; i < u.power; ++i) {
      if (value > UINT64_MAX / u.base) {
        return NotASize(text, "exceeds 64 bits");
      }
      value *= u.base;
    }
    return value;
  }
  return NotASize(text, kNotASize);
}

std::string FormatByteSize(uint64_t bytes) {
  static constexpr const char* kLetters[] = {"K", "M", "G", "T", "P"};
  int power = 0;
  uint64_t value = bytes;
  while (value != 0 && value % 1024 == 0 && power < 5) {
    value /= 1024;
    ++power;
  }
  if (power == 0) return absl::StrCat(bytes);
  return absl::StrCat(value, kLetters[power - 1]);
}

bool AbslParseFlag(absl::string_view text, ByteSize* size, std::string* error) {
  absl::StatusOr<uint64_t> bytes = ParseByteSize(text);
  if (!bytes.ok()) {
    *error = std::string(bytes.status().message());
    return false;
  }
  size->bytes = *bytes;
  return true;
}

std::string AbslUnparseFlag(ByteSize size) {
  return FormatByteSize(size.bytes);
}

}  // namespace mrd
