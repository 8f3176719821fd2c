// Helpers shared by the fuzz targets: invariant checks that abort (so that
// libFuzzer records the input as a crash), real memfds, open-fd counting, and
// private directories.
#ifndef MRD_TESTS_FUZZ_FUZZ_UTIL_H_
#define MRD_TESTS_FUZZ_FUZZ_UTIL_H_

#include <sys/types.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "mrd/unique_fd.h"

namespace mrd::fuzz {

// Prints `message` and aborts: an invariant of mrd does not hold for this
// input. libFuzzer then keeps the input as a crash artifact.
[[noreturn]] void Fail(absl::string_view message);

#define FUZZ_CHECK(cond, ...)                                           \
  do {                                                                  \
    if (!(cond)) {                                                      \
      ::mrd::fuzz::Fail(                                                \
          ::absl::StrCat(__FILE__, ":", __LINE__,                       \
                         ": check " #cond " failed: ", ##__VA_ARGS__)); \
    }                                                                   \
  } while (0)

// A memfd (MFD_ALLOW_SEALING) of `size` bytes whose content is `pattern`
// repeated; aborts if the kernel refuses (the harness is broken then).
UniqueFd MakeMemfd(uint64_t size, absl::string_view pattern = "");

// Reads a fuzz input front to back (FuzzedDataProvider takes integers from
// the back, which makes seed inputs hard to write by hand). Past the end
// everything reads as zero. An integer in [lo, hi] takes 1, 2, 4 or 8 bytes,
// the fewest that cover the range, little-endian, modulo its size; a string
// is a length byte (capped at `max_length`) and that many bytes.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  size_t remaining_bytes() const { return size_ - pos_; }
  uint8_t Byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  bool ConsumeBool() { return (Byte() & 1) != 0; }
  template <typename T>
  T ConsumeIntegral() {
    return ConsumeIntegralInRange<T>(std::numeric_limits<T>::min(),
                                     std::numeric_limits<T>::max());
  }
  template <typename T>
  T ConsumeIntegralInRange(T lo, T hi) {
    const uint64_t range =
        static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo);
    const int bytes = range < (uint64_t{1} << 8)    ? 1
                      : range < (uint64_t{1} << 16) ? 2
                      : range < (uint64_t{1} << 32) ? 4
                                                    : 8;
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i)
      v |= static_cast<uint64_t>(Byte()) << (8 * i);
    if (range != std::numeric_limits<uint64_t>::max()) v %= range + 1;
    return static_cast<T>(static_cast<uint64_t>(lo) + v);
  }
  std::string ConsumeRandomLengthString(size_t max_length) {
    size_t n = std::min<size_t>(Byte(), max_length);
    n = std::min(n, remaining_bytes());
    std::string out(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return out;
  }
  template <typename T>
  T PickValueInArray(std::initializer_list<const T> list) {
    return *(list.begin() + ConsumeIntegralInRange<size_t>(0, list.size() - 1));
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// Entries of /proc/self/fd.
int CountOpenFds();

// connect(2) that survives a signal: libFuzzer's own timers interrupt
// blocking calls, and an interrupted connect goes on in the background, so
// it waits for the outcome instead of failing. 0 or the errno.
int ConnectRetrying(int fd, const void* addr, unsigned addr_len);

// mkdtemp under `parent`; the directory is removed with everything in it by
// RemoveTree.
std::string MakeTempDir(const std::string& parent, absl::string_view prefix);
void RemoveTree(const std::string& path);

// Silences mrd's logs below errors (a fuzzer logs millions of refusals).
void QuietLogs();

}  // namespace mrd::fuzz

#endif  // MRD_TESTS_FUZZ_FUZZ_UTIL_H_
