// Thread: a joinable thread whose creation failure is a Status, not an
// exception. std::thread's constructor throws std::system_error when the
// system is out of threads or memory (EAGAIN), which in mrd (built without
// catching) would abort the whole service; every thread of the server is
// started through Thread::Start instead, and a failure becomes an error at
// start-up (or a refusal at run time).
//
// Thread safety: Start is thread-safe. A Thread object itself is not: Join
// and the move operations must not race (the owner serializes them, like
// std::thread).
#ifndef MRD_SERVER_COMMON_THREAD_H_
#define MRD_SERVER_COMMON_THREAD_H_

#include <pthread.h>

#include <utility>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mrd {

class Thread {
 public:
  Thread() = default;
  // Aborts if still joinable (as std::thread would): join first.
  ~Thread();
  Thread(Thread&& other) noexcept
      : handle_(other.handle_),
        started_(std::exchange(other.started_, false)) {}
  Thread& operator=(Thread&& other) noexcept;
  Thread(const Thread&) = delete;
  Thread& operator=(const Thread&) = delete;

  // Runs `body` on a new thread named `name` (at most 15 characters are
  // kept). Errors: pthread_create's, as ErrnoError(..., "THREAD_FAILED");
  // EAGAIN gives RESOURCE_EXHAUSTED.
  static absl::StatusOr<Thread> Start(absl::string_view name,
                                      absl::AnyInvocable<void() &&> body);

  bool joinable() const { return started_; }
  // Waits for the thread to finish. No-op if not joinable.
  void Join();

 private:
  pthread_t handle_{};
  bool started_ = false;
};

// The CPUs the calling thread may run on (its affinity mask: a container's
// cpuset), at least 1.
int UsableCpus();

// Sets the nice value of every thread of this process to `nice` (-20 to
// 19); threads started later inherit it from the thread that starts them.
// Errors: INVALID_ARGUMENT "BAD_NICE" out of range; FAILED_PRECONDITION
// "NICE_NOT_PERMITTED", with no thread changed, when the calling thread
// lacks the right to a higher priority (CAP_SYS_NICE, or an RLIMIT_NICE of
// 20 - nice or more); setpriority's other errors ("NICE_FAILED").
absl::Status SetProcessNice(int nice);

}  // namespace mrd

#endif  // MRD_SERVER_COMMON_THREAD_H_
