// Big registrations past the one-thread pinning floor (issue 9, part 3),
// through the real mrd on the software device over its real sockets:
//
// - `--buffers` memfds (default 4) of `--gib` GiB each (default 2), made and
//   written by the client, every page;
// - the floor: one thread of the client mlocks all of them (through the
//   mappings it wrote through) and munlocks them;
// - mrd: the client imports the memfds anew (so mrd's mappings of them are
//   fresh, as on a buffer's first registration) and registers each whole
//   buffer, all at once from one thread per buffer, then deregisters them
//   and releases the imports. Once with --prefault_threads=0 (the pin
//   faults mrd's mapping in by itself) and once with the default;
// - then, when it may raise vm.nr_hugepages (root, with the memory free),
//   the same memfds in 2 MiB pages (hugetlbfs) through mrd, and the pool
//   put back; otherwise it says why it skipped that case.
//
// Each case runs `--rounds` times (default 3); the median is reported, and
// the speed-up as floor time / case time (issue 9's goal: at least 1.6 for
// 8 GiB of 4 KiB pages on the 2-core machine).
//
//   build/bench/big_bench [--buffers=4] [--gib=2] [--rounds=3]
//
// Needs the memory (the memfds and nothing else, as pins do not copy) and
// the right to mlock it (root or a large RLIMIT_MEMLOCK). The measurement
// is bench/big_memory.h's, which e2e_bench's figure f runs too.

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "bench/big_memory.h"

namespace mrd::bench {
namespace {

void PrintRow(const char* what, double seconds, double gb, double floor) {
  std::printf("%-56s %9.3f %9.1f %10.2f\n", what, seconds, gb / seconds,
              floor / seconds);
}

int Main(int argc, char** argv) {
  const uint64_t count = Flag(argc, argv, "--buffers", 4, 1);
  const uint64_t gib = Flag(argc, argv, "--gib", 2, 1);
  const uint64_t rounds = Flag(argc, argv, "--rounds", 3, 1);
  auto big =
      MeasureBigMemory(count, gib << 30, rounds,
                       {{"--prefault_threads=0"}, {"--prefault_threads=8"}},
                       {"--prefault_threads=8"});
  if (!big.ok()) {
    std::fprintf(stderr, "big_bench: %s\n", big.status().ToString().c_str());
    return 1;
  }
  if (big->huge_page_seconds < 0) {
    std::fprintf(stderr, "no 2 MiB-page case: %s\n",
                 big->huge_pages_skipped.c_str());
  }
  const double gb = static_cast<double>(big->total_bytes) / 1e9;
  const double floor = big->floor_seconds;
  std::printf("%llu x %llu GiB of written memfds, median of %llu\n",
              static_cast<unsigned long long>(count),
              static_cast<unsigned long long>(gib),
              static_cast<unsigned long long>(rounds));
  std::printf("%-56s %9s %9s %10s\n", "case", "seconds", "GB/s", "x floor");
  PrintRow("floor: one thread mlocks the client's 4 KiB pages", floor, gb,
           floor);
  PrintRow("mrd, 4 KiB pages, fresh imports, --prefault_threads=0",
           big->small_page_seconds[0], gb, floor);
  PrintRow("mrd, 4 KiB pages, fresh imports, --prefault_threads=8",
           big->small_page_seconds[1], gb, floor);
  if (big->huge_page_seconds > 0) {
    PrintRow("mrd, 2 MiB pages (hugetlbfs), fresh imports",
             big->huge_page_seconds, gb, floor);
  }
  return 0;
}

}  // namespace
}  // namespace mrd::bench

int main(int argc, char** argv) { return mrd::bench::Main(argc, argv); }
