// A fixed-size worker pool. Schedule() never blocks the caller; work runs on
// one of the pool's threads in FIFO order. The destructor finishes every
// scheduled task, then joins. Thread-safe; Start is called once, before any
// Schedule.
#ifndef MRD_SERVER_COMMON_THREAD_POOL_H_
#define MRD_SERVER_COMMON_THREAD_POOL_H_

#include <deque>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/common/thread.h"

namespace mrd {

class ThreadPool {
 public:
  ThreadPool() = default;
  ~ThreadPool();
  // Starts `threads` workers. Errors: INVALID_ARGUMENT BAD_OPTIONS (fewer
  // than 1), THREAD_FAILED (no thread could be made: the workers made so far
  // stop with the pool).
  absl::Status Start(int threads);
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Schedule(absl::AnyInvocable<void() &&> task);

 private:
  void Run();

  absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<Thread> threads_;  // written by Start only
};

}  // namespace mrd

#endif  // MRD_SERVER_COMMON_THREAD_POOL_H_
