// How much of one of this process's mappings is mapped in (its page tables
// filled): the Rss of the mapping that contains an address, from
// /proc/self/smaps. For tests of prefaulting (server/common/prefault.h).
#ifndef MRD_TESTS_SUPPORT_MAPPED_PAGES_H_
#define MRD_TESTS_SUPPORT_MAPPED_PAGES_H_

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>

namespace mrd::test_support {

// Bytes of the mapping containing `address` that are mapped in this
// process; 0 when no mapping contains it.
inline uint64_t MappedBytes(const void* address) {
  std::ifstream in("/proc/self/smaps");
  const uint64_t want = reinterpret_cast<uint64_t>(address);
  std::string line;
  bool in_mapping = false;
  while (std::getline(in, line)) {
    unsigned long start = 0;
    unsigned long end = 0;
    // A mapping's header line: "start-end perms offset dev inode [path]";
    // its fields are "Name:  value" lines.
    if (std::sscanf(line.c_str(), "%lx-%lx ", &start, &end) == 2 &&
        line.find(' ') > line.find('-')) {
      in_mapping = start <= want && want < end;
      continue;
    }
    if (in_mapping && line.rfind("Rss:", 0) == 0) {
      return std::stoull(line.substr(4)) * 1024;
    }
  }
  return 0;
}

}  // namespace mrd::test_support

#endif  // MRD_TESTS_SUPPORT_MAPPED_PAGES_H_
