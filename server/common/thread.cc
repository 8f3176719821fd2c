#include "server/common/thread.h"

#include <sched.h>

#include <algorithm>
#include <string>

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

}  // namespace mrd
