// FrozenThread: holds one named thread of a child process (the mrd a test
// started) still, with ptrace, while the rest of the process runs on — so a
// test can show that a request is answered without that thread, instead of
// racing it. The thread is frozen only once it has slept in the same futex
// wait for 50 ms without one wake-up (an idle worker waiting for work, with
// nothing else for it to do); stopped anywhere else it is let go and looked
// at again.
//
// The test process must be allowed to trace mrd: its parent, same uid, no
// seccomp filter against ptrace (the test machines and the Soft-RoCE VM).
// Every ptrace request comes from the thread that froze it; the destructor
// (or Thaw) lets the thread go on.
#ifndef MRD_TESTS_SUPPORT_FROZEN_THREAD_H_
#define MRD_TESTS_SUPPORT_FROZEN_THREAD_H_

#include <dirent.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace mrd::testing {

class FrozenThread {
 public:
  // Freezes the one thread of `pid` named `name` (its comm) once it is
  // found idle, trying for `patience`.
  static absl::StatusOr<std::unique_ptr<FrozenThread>> FreezeIdle(
      pid_t pid, absl::string_view name,
      absl::Duration patience = absl::Seconds(20)) {
    std::vector<pid_t> tids = ThreadsNamed(pid, name);
    if (tids.size() != 1) {
      return absl::FailedPreconditionError(
          absl::StrCat(tids.size(), " threads of ", pid, " are named '", name,
                       "', not one"));
    }
    return FreezeIdleThread(pid, tids[0], name, patience);
  }

  // Freezes every thread of `pid` named `name`, each once it is found idle
  // (a pool of workers held still together).
  static absl::StatusOr<std::vector<std::unique_ptr<FrozenThread>>>
  FreezeAllIdle(pid_t pid, absl::string_view name,
                absl::Duration patience = absl::Seconds(20)) {
    std::vector<pid_t> tids = ThreadsNamed(pid, name);
    if (tids.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("no thread of ", pid, " is named '", name, "'"));
    }
    std::vector<std::unique_ptr<FrozenThread>> frozen;
    for (pid_t tid : tids) {
      absl::StatusOr<std::unique_ptr<FrozenThread>> one =
          FreezeIdleThread(pid, tid, name, patience);
      if (!one.ok()) return one.status();
      frozen.push_back(*std::move(one));
    }
    return frozen;
  }

  // Freezes thread `tid` of `pid` once it is found idle.
  static absl::StatusOr<std::unique_ptr<FrozenThread>> FreezeIdleThread(
      pid_t pid, pid_t tid, absl::string_view name, absl::Duration patience) {
    const absl::Time deadline = absl::Now() + patience;
    std::string last;
    while (absl::Now() < deadline) {
      // Idle: the same futex wait, and not one wake-up, 50 ms apart.
      const Observation before = Observe(pid, tid);
      absl::SleepFor(absl::Milliseconds(50));
      const Observation settled = Observe(pid, tid);
      last = settled.syscall;
      if (!IsFutexWait(settled.syscall) || !(before == settled)) continue;
      if (::ptrace(PTRACE_SEIZE, tid, nullptr, nullptr) != 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "PTRACE_SEIZE of ", name, " (", tid, "): ", std::strerror(errno)));
      }
      auto frozen = std::unique_ptr<FrozenThread>(new FrozenThread(tid));
      if (::ptrace(PTRACE_INTERRUPT, tid, nullptr, nullptr) != 0) {
        return absl::InternalError(
            absl::StrCat("PTRACE_INTERRUPT: ", std::strerror(errno)));
      }
      int status = 0;
      if (::waitpid(tid, &status, __WALL) != tid || !WIFSTOPPED(status)) {
        return absl::InternalError(
            absl::StrCat("waiting for ", name, " to stop: status ", status));
      }
      // Stopped in that same wait: it holds nothing anyone else waits for.
      if (Observe(pid, tid).syscall == settled.syscall) return frozen;
      // It woke up just before the stop: let it go and look again.
    }
    return absl::DeadlineExceededError(absl::StrCat(
        name, " was never idle in a futex wait (last seen in: '", last, "')"));
  }

  FrozenThread(const FrozenThread&) = delete;
  FrozenThread& operator=(const FrozenThread&) = delete;
  ~FrozenThread() { Thaw(); }

  // Lets the thread go on (PTRACE_DETACH resumes it). Idempotent.
  void Thaw() {
    if (tid_ <= 0) return;
    (void)::ptrace(PTRACE_DETACH, tid_, nullptr, nullptr);
    tid_ = -1;
  }

  static std::vector<pid_t> ThreadsNamed(pid_t pid, absl::string_view name) {
    std::vector<pid_t> tids;
    const std::string dir = absl::StrCat("/proc/", pid, "/task");
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) return tids;
    while (struct dirent* e = ::readdir(d)) {
      int tid = 0;
      if (!absl::SimpleAtoi(e->d_name, &tid)) continue;
      std::ifstream in(absl::StrCat(dir, "/", tid, "/comm"));
      std::string comm;
      std::getline(in, comm);
      if (comm == name) tids.push_back(tid);
    }
    ::closedir(d);
    return tids;
  }

 private:
  struct Observation {
    std::string syscall;  // /proc/<pid>/task/<tid>/syscall
    std::string voluntary_switches;
    bool operator==(const Observation&) const = default;
  };

  static Observation Observe(pid_t pid, pid_t tid) {
    const std::string dir = absl::StrCat("/proc/", pid, "/task/", tid);
    Observation o;
    std::ifstream syscall(absl::StrCat(dir, "/syscall"));
    std::getline(syscall, o.syscall);
    std::ifstream status(absl::StrCat(dir, "/status"));
    for (std::string line; std::getline(status, line);) {
      if (absl::StartsWith(line, "voluntary_ctxt_switches:")) {
        o.voluntary_switches = line;
      }
    }
    return o;
  }

  // "202 <uaddr> <op> ...": futex(2) with FUTEX_WAIT or FUTEX_WAIT_BITSET
  // (a wake, a requeue or a lock-PI call is not idle).
  static bool IsFutexWait(absl::string_view syscall) {
    std::vector<absl::string_view> fields =
        absl::StrSplit(syscall, ' ', absl::SkipEmpty());
    int number = -1;
    uint64_t op = 0;
    if (fields.size() < 3 || !absl::SimpleAtoi(fields[0], &number) ||
        number != SYS_futex ||
        !absl::SimpleHexAtoi(absl::StripPrefix(fields[2], "0x"), &op)) {
      return false;
    }
    constexpr uint64_t kCommand = 0x7f;  // without PRIVATE and CLOCK_REALTIME
    return (op & kCommand) == 0 || (op & kCommand) == 9;
  }

  explicit FrozenThread(pid_t tid) : tid_(tid) {}

  pid_t tid_;
};

}  // namespace mrd::testing

#endif  // MRD_TESTS_SUPPORT_FROZEN_THREAD_H_
