#include "server/common/thread.h"

#include <dirent.h>
#include <sched.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "mrd/status.h"
#include "server/common/log.h"

namespace mrd {
namespace {

void* RunBody(void* arg) {
  auto* body = static_cast<absl::AnyInvocable<void() &&>*>(arg);
  std::move (*body)();
  delete body;
  return nullptr;
}

}  // namespace

Thread::~Thread() {
  if (started_) Fatal("mrd::Thread destroyed while still joinable");
}

Thread& Thread::operator=(Thread&& other) noexcept {
  if (this != &other) {
    if (started_) Fatal("mrd::Thread assigned to while still joinable");
    handle_ = other.handle_;
    started_ = std::exchange(other.started_, false);
  }
  return *this;
}

absl::StatusOr<Thread> Thread::Start(absl::string_view name,
                                     absl::AnyInvocable<void() &&> body) {
  auto* owned = new absl::AnyInvocable<void() &&>(std::move(body));
  Thread thread;
  const int err = ::pthread_create(&thread.handle_, nullptr, RunBody, owned);
  if (err != 0) {
    delete owned;
    return ErrnoError(err, absl::StrCat("pthread_create (", name, ")"),
                      "THREAD_FAILED");
  }
  thread.started_ = true;
  // Best effort: the name only helps debugging (top -H, gdb).
  std::string short_name(name.substr(0, 15));
  (void)::pthread_setname_np(thread.handle_, short_name.c_str());
  return thread;
}

void Thread::Join() {
  if (!started_) return;
  const int err = ::pthread_join(handle_, nullptr);
  if (err != 0) Fatal(absl::StrCat("pthread_join: error ", err));
  started_ = false;
}

int UsableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

absl::Status SetProcessNice(int nice) {
  if (nice < -20 || nice > 19) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_NICE",
                    absl::StrCat("a nice value is -20 to 19, not ", nice));
  }
  // The calling thread first: a refusal there has changed nothing.
  errno = 0;
  const int old = ::getpriority(PRIO_PROCESS, 0);
  if (::setpriority(PRIO_PROCESS, 0, nice) != 0) {
    const int err = errno;
    if (err == EACCES || err == EPERM) {
      return MrdError(absl::StatusCode::kFailedPrecondition,
                      "NICE_NOT_PERMITTED",
                      absl::StrCat("nice ", nice, " (from ", old,
                                   ") needs CAP_SYS_NICE or an RLIMIT_NICE of ",
                                   20 - nice, " or more"));
    }
    return ErrnoError(err, "setpriority", "NICE_FAILED");
  }
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) {
    return ErrnoError(errno, "opendir /proc/self/task", "NICE_FAILED");
  }
  std::vector<id_t> threads;
  while (const struct dirent* entry = ::readdir(dir)) {
    id_t tid = 0;
    if (absl::SimpleAtoi(entry->d_name, &tid) && tid > 0) {
      threads.push_back(tid);
    }
  }
  ::closedir(dir);
  for (id_t tid : threads) {
    if (::setpriority(PRIO_PROCESS, tid, nice) != 0 && errno != ESRCH) {
      return ErrnoError(errno, absl::StrCat("setpriority of thread ", tid),
                        "NICE_FAILED");
    }
  }
  return absl::OkStatus();
}

}  // namespace mrd
