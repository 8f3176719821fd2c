// A fixed-size worker pool. Schedule() never blocks the caller; work runs on
// one of the pool's threads in FIFO order. The destructor finishes every
// scheduled task, then joins. Thread-safe.
#ifndef MRD_SERVER_COMMON_THREAD_POOL_H_
#define MRD_SERVER_COMMON_THREAD_POOL_H_

#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace mrd {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Schedule(absl::AnyInvocable<void() &&> task);

 private:
  void Run();

  absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace mrd

#endif  // MRD_SERVER_COMMON_THREAD_POOL_H_
