// Byte counts as people write them, one reading for every place that takes
// one: mrd's byte-size flags, the tenants file, mrctl's sizes and the
// benchmarks' options.
//
// Thread safety: the functions keep no state and may be called from any
// thread.
#ifndef MRD_PROTO_MRD_BYTE_SIZE_H_
#define MRD_PROTO_MRD_BYTE_SIZE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mrd {

// A byte count: decimal digits, 0x hex, or a whole decimal number with a
// unit: K, M, G, T, P (powers of 1024, in either case) or KiB, MiB, GiB,
// TiB, PiB (the same), or KB, MB, GB, TB, PB (powers of 1000). "8G" is
// 8 GiB. Surrounding whitespace is ignored. Errors: INVALID_ARGUMENT
// "BAD_SIZE" naming the text (not a size, or more than 64 bits).
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);

// The shortest exact spelling of `bytes`: "16G", "1536K", "1000" (no unit
// when it is not a whole number of KiB).
std::string FormatByteSize(uint64_t bytes);

// A command-line flag of bytes (ABSL_FLAG(ByteSize, ...)) that takes what
// ParseByteSize takes, and prints its value as FormatByteSize does.
struct ByteSize {
  uint64_t bytes = 0;
};
bool AbslParseFlag(absl::string_view text, ByteSize* size, std::string* error);
std::string AbslUnparseFlag(ByteSize size);

}  // namespace mrd

#endif  // MRD_PROTO_MRD_BYTE_SIZE_H_
