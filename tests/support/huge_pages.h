// The kernel's pool of 2 MiB huge pages (vm.nr_hugepages), for tests and
// benchmarks of hugetlbfs memfds: raised for the object's lifetime when this
// process may (root), put back afterwards.
#ifndef MRD_TESTS_SUPPORT_HUGE_PAGES_H_
#define MRD_TESTS_SUPPORT_HUGE_PAGES_H_

#include <cstdint>
#include <fstream>
#include <string>

namespace mrd::test_support {

// HugePages_<field> of /proc/meminfo ("Total", "Free"); 0 if unreadable.
inline uint64_t HugePages(const std::string& field) {
  std::ifstream in("/proc/meminfo");
  std::string line;
  const std::string key = "HugePages_" + field + ":";
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::stoull(line.substr(key.size()));
  }
  return 0;
}

class HugePagePool {
 public:
  // Makes `free_pages` more pages free than there are now (`free_pages` = 0
  // with `exactly_none`: leaves no page free). ok() says whether it worked.
  explicit HugePagePool(uint64_t free_pages, bool exactly_none = false) {
    std::ifstream in(kPath);
    if (!(in >> before_)) return;
    const uint64_t used = before_ - std::min(before_, HugePages("Free"));
    const uint64_t want = exactly_none ? used : before_ + free_pages;
    if (!(std::ofstream(kPath) << want << "\n")) return;
    changed_ = true;
    uint64_t now = 0;
    std::ifstream(kPath) >> now;
    ok_ = now == want;
  }
  ~HugePagePool() {
    if (changed_) std::ofstream(kPath) << before_ << "\n";
  }
  HugePagePool(const HugePagePool&) = delete;
  HugePagePool& operator=(const HugePagePool&) = delete;
  bool ok() const { return ok_; }

 private:
  static constexpr const char* kPath = "/proc/sys/vm/nr_hugepages";
  uint64_t before_ = 0;
  bool changed_ = false;
  bool ok_ = false;
};

}  // namespace mrd::test_support

#endif  // MRD_TESTS_SUPPORT_HUGE_PAGES_H_
