// Small helpers the standalone benchmarks (rpc_bench, scale_bench) share:
// a clock, percentiles, `--name=N` flags and one-page registrations.
#ifndef MRD_BENCH_BENCH_UTIL_H_
#define MRD_BENCH_BENCH_UTIL_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "client/lib/mrd_client.h"

namespace mrd::bench {

constexpr uint64_t kPage = 4096;

// RegisterMr options for page `page` of buffer `buffer`, remote read.
inline client::RegisterOptions PageOf(uint64_t buffer, uint64_t page) {
  client::RegisterOptions o;
  o.buffer = buffer;
  o.offset = page * kPage;
  o.length = kPage;
  o.flags = 0x2;  // remote read
  return o;
}

using Clock = std::chrono::steady_clock;

inline double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// The p-quantile (0 <= p <= 1) of `v`, nearest rank below; `v` not empty.
inline double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1))];
}

// The value of `--<name>=N` among the arguments, or `fallback`; at least
// `minimum`.
inline uint64_t Flag(int argc, char** argv, const char* name, uint64_t fallback,
                     uint64_t minimum = 0) {
  const size_t n = std::strlen(name);
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], name, n) == 0 && argv[i][n] == '=') {
      return std::max<uint64_t>(minimum,
                                std::strtoull(argv[i] + n + 1, nullptr, 10));
    }
  }
  return std::max(minimum, fallback);
}

}  // namespace mrd::bench

#endif  // MRD_BENCH_BENCH_UTIL_H_
