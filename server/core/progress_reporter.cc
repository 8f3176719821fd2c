#include "server/core/progress_reporter.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "mrd/status.h"

namespace mrd::core {

absl::Status ProgressReporter::Start() {
  MRD_ASSIGN_OR_RETURN(thread_,
                       Thread::Start("mrd-progress", [this] { Run(); }));
  return absl::OkStatus();
}

void ProgressReporter::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    wake_ = true;
  }
  thread_.Join();
}

ProgressReporter::Watch ProgressReporter::Begin(
    std::shared_ptr<Session> session, const WorkProgress* progress,
    v1::Completion call) {
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  const uint64_t id = next_id_++;
  call.set_kind(v1::Completion::REGISTRATION_PROGRESS);
  entries_.emplace(id, Entry{std::move(session), progress, std::move(call), now,
                             now + options_.after});
  wake_ = true;
  return Watch(this, id);
}

void ProgressReporter::Unwatch(uint64_t id) {
  absl::MutexLock lock(&mu_);
  entries_.erase(id);
}

uint64_t ProgressReporter::reports() const {
  absl::MutexLock lock(&mu_);
  return reports_;
}

void ProgressReporter::Run() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    const absl::Time now = absl::Now();
    absl::Time next = absl::InfiniteFuture();
    std::vector<std::pair<std::shared_ptr<Session>, v1::Completion>> due;
    for (auto& [id, e] : entries_) {
      if (e.due <= now) {
        v1::Completion c = e.call;
        c.set_bytes_populated(e.progress->populated());
        c.set_bytes_pinned(e.progress->pinned());
        c.set_elapsed_ms(
            static_cast<uint64_t>(absl::ToInt64Milliseconds(now - e.start)));
        due.emplace_back(e.session, std::move(c));
        e.due = now + options_.interval;
      }
      next = std::min(next, e.due);
    }
    if (!due.empty()) {
      reports_ += due.size();
      // Pushing takes the session's lock and wakes its stream: not under
      // ours.
      mu_.Unlock();
      for (auto& [session, c] : due) session->Push(std::move(c));
      due.clear();
      mu_.Lock();
      continue;
    }
    wake_ = false;
    mu_.AwaitWithTimeout(absl::Condition(&wake_), next - now);
  }
}

}  // namespace mrd::core
