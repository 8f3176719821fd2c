// CheckedThread: a joinable thread whose creation failure is a Status, not
// an exception. std::thread's constructor throws std::system_error when the
// system is out of threads (EAGAIN) or memory, which in mrd (no exceptions)
// means std::terminate; every long-lived thread of the peer path is started
// here instead.
//
// Thread safety: Start is thread-safe; Join must be called by one owner.
#ifndef MRD_SERVER_COMMON_CHECKED_THREAD_H_
#define MRD_SERVER_COMMON_CHECKED_THREAD_H_

#include <pthread.h>

#include <memory>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mrd {

class CheckedThread {
 public:
  CheckedThread() = default;
  // Joins if still joinable.
  ~CheckedThread();
  CheckedThread(CheckedThread&& other) noexcept;
  CheckedThread& operator=(CheckedThread&& other) noexcept;
  CheckedThread(const CheckedThread&) = delete;
  CheckedThread& operator=(const CheckedThread&) = delete;

  // Runs `body` on a new thread named `name` (at most 15 characters are
  // kept). Errors: ErrnoError "THREAD_CREATE_FAILED" with the errno of
  // pthread_create (EAGAIN: out of threads or memory for a stack, which
  // ErrnoError makes STATUS_INSUFFICIENT_RESOURCES).
  static absl::StatusOr<CheckedThread> Start(
      absl::string_view name, absl::AnyInvocable<void() &&> body);

  bool joinable() const { return running_; }
  // Waits for the thread to end. No-op when not joinable.
  void Join();

 private:
  pthread_t thread_{};
  bool running_ = false;
};

}  // namespace mrd

#endif  // MRD_SERVER_COMMON_CHECKED_THREAD_H_
