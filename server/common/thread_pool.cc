#include "server/common/thread_pool.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"

namespace mrd {

absl::Status ThreadPool::Start(int threads) {
  if (threads < 1) {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "BAD_OPTIONS",
        absl::StrCat("a thread pool needs at least one thread, not ", threads));
  }
  threads_.reserve(static_cast<size_t>(threads));
  for (int i = 0; i < threads; ++i) {
    MRD_ASSIGN_OR_RETURN(Thread thread,
                         Thread::Start("mrd-worker", [this] { Run(); }));
    threads_.push_back(std::move(thread));
  }
  return absl::OkStatus();
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (auto& t : threads_) t.Join();
}

void ThreadPool::Schedule(absl::AnyInvocable<void() &&> task) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(task));
}

void ThreadPool::Run() {
  while (true) {
    absl::AnyInvocable<void() &&> task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](ThreadPool* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) {
            return p->stopping_ || !p->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    std::move(task)();
  }
}

}  // namespace mrd
