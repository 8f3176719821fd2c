// What the kernel has pinned for a process, for tests that check real
// kernel state after mrd pins and unpins memory.
//
// The software device pins through io_uring fixed buffers, which the kernel
// counts in VmPin (pin_user_pages), and falls back to mlock(2), counted in
// VmLck; the verbs device's registrations are in VmPin too. A page is in
// exactly one of them (mrd never pins a page both ways), so their sum is
// what mrd has pinned.
//
// Kernels before 6.13 (Debian 12's 6.1) release an emptied io_uring slot's
// pages from a work item about a second later, so a check that expects
// fewer pinned bytes polls: KernelPinnedBytesSettled.
#ifndef MRD_TESTS_SUPPORT_KERNEL_PINS_H_
#define MRD_TESTS_SUPPORT_KERNEL_PINS_H_

#include <dirent.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace mrd::test_support {

// VmLck + VmPin of /proc/<pid>/status in bytes ("self": this process);
// ~0 if the file cannot be read.
inline uint64_t KernelPinnedBytes(const std::string& pid = "self") {
  std::ifstream status("/proc/" + pid + "/status");
  std::string line;
  uint64_t total = 0;
  int found = 0;
  while (std::getline(status, line)) {
    if (line.rfind("VmLck:", 0) != 0 && line.rfind("VmPin:", 0) != 0) {
      continue;
    }
    std::vector<std::string> parts =
        absl::StrSplit(line, ' ', absl::SkipEmpty());
    uint64_t kib = 0;
    if (parts.size() < 2 || !absl::SimpleAtoi(parts[1], &kib)) {
      return ~uint64_t{0};
    }
    total += kib * 1024;
    ++found;
  }
  return found == 2 ? total : ~uint64_t{0};
}

// A "<field>: <n> kB" line of /proc/<pid>/status (e.g. "RssAnon") in
// bytes; 0 if it cannot be read.
inline uint64_t ProcStatusBytes(const std::string& field,
                                const std::string& pid = "self") {
  std::ifstream status("/proc/" + pid + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) != 0) continue;
    std::vector<std::string> parts =
        absl::StrSplit(line, ' ', absl::SkipEmpty());
    uint64_t kib = 0;
    if (parts.size() < 2 || !absl::SimpleAtoi(parts[1], &kib)) return 0;
    return kib * 1024;
  }
  return 0;
}

// KernelPinnedBytes(pid) once it equals `expected`, or the last reading
// when `timeout` passes first (then the caller's comparison fails).
inline uint64_t KernelPinnedBytesSettled(
    uint64_t expected, const std::string& pid = "self",
    absl::Duration timeout = absl::Seconds(5)) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    const uint64_t now = KernelPinnedBytes(pid);
    if (now == expected || absl::Now() > deadline) return now;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// Registered buffers (io_uring fixed-buffer slots in use) over every
// io_uring ring of process `pid`, from /proc/<pid>/fdinfo: a line
// "<slot>: 0x<address>/<length>" each ("<none>" for an empty slot). The
// kernel lists them only when it can take the ring's lock at once, so call
// it while the process makes no pin or unpin.
inline uint64_t IoUringBuffers(const std::string& pid) {
  const std::string fds = "/proc/" + pid + "/fd";
  DIR* dir = ::opendir(fds.c_str());
  if (dir == nullptr) return 0;
  uint64_t count = 0;
  while (const struct dirent* entry = ::readdir(dir)) {
    char target[64] = {};
    const std::string link = fds + "/" + entry->d_name;
    const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
    if (n <= 0 || std::string(target, static_cast<size_t>(n)) !=
                      "anon_inode:[io_uring]") {
      continue;
    }
    std::ifstream info("/proc/" + pid + "/fdinfo/" + entry->d_name);
    std::string line;
    while (std::getline(info, line)) {
      const size_t colon = line.find(": 0x");
      if (colon != std::string::npos && line.find('/', colon) != line.npos) {
        ++count;
      }
    }
  }
  ::closedir(dir);
  return count;
}

}  // namespace mrd::test_support

#endif  // MRD_TESTS_SUPPORT_KERNEL_PINS_H_
