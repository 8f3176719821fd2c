#include "client/lib/deferred_release.h"

#include <deque>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace mrd::client::internal {
namespace {

// One process-wide thread, started on first use and never joined: it may
// still be dropping references while the process exits, which is harmless.
class Releaser {
 public:
  Releaser() {
    std::thread([this] { Run(); }).detach();
  }

  void Add(std::shared_ptr<const void> object) {
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(object));
  }

 private:
  void Run() {
    while (true) {
      std::shared_ptr<const void> object;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](std::deque<std::shared_ptr<const void>>* q) {
              return !q->empty();
            },
            &queue_));
        object = std::move(queue_.front());
        queue_.pop_front();
      }
      object.reset();  // outside the lock: destructors may take their own
    }
  }

  absl::Mutex mu_;
  std::deque<std::shared_ptr<const void>> queue_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

void DeferRelease(std::shared_ptr<const void> object) {
  if (object == nullptr) return;
  static Releaser* releaser = new Releaser();
  releaser->Add(std::move(object));
}

}  // namespace mrd::client::internal
