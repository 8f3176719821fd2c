// ProgressReporter: REGISTRATION_PROGRESS completions for registrations that
// are still pinning after `after`, then every `interval` until they end, on
// the session's completion stream.
//
// The work itself only adds to its WorkProgress (server/common/progress.h);
// one reporter thread reads it and pushes the completions, so a device call
// that takes long in one step (ibv_reg_mr) still gets its reports, and the
// pinning path never calls into a session's stream.
//
// Thread-safe. The reporter's lock is never held while a completion is
// pushed; Watch's destructor waits for nothing.
#ifndef MRD_SERVER_CORE_PROGRESS_REPORTER_H_
#define MRD_SERVER_CORE_PROGRESS_REPORTER_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mrd/v1/mrd.pb.h"
#include "server/common/progress.h"
#include "server/common/thread.h"
#include "server/core/session.h"

namespace mrd::core {

// Registrations shorter than this are not watched: they take milliseconds.
inline constexpr uint64_t kProgressMinBytes = uint64_t{32} << 20;

struct ProgressOptions {
  absl::Duration after = absl::Seconds(1);     // first report
  absl::Duration interval = absl::Seconds(1);  // then one per interval
};

class ProgressReporter {
 public:
  // A negative `after` counts as 0, an `interval` below 1 ms as 1 ms.
  explicit ProgressReporter(ProgressOptions options)
      : options_{std::max(options.after, absl::ZeroDuration()),
                 std::max(options.interval, absl::Milliseconds(1))} {}
  ~ProgressReporter() { Stop(); }
  ProgressReporter(const ProgressReporter&) = delete;
  ProgressReporter& operator=(const ProgressReporter&) = delete;

  // Starts the reporter thread. Errors: THREAD_FAILED.
  absl::Status Start();
  // Stops and joins it; no report is pushed afterwards. Idempotent.
  void Stop();

  // Watches `progress` until the Watch is destroyed: reports carry the
  // fields of `call` (kind, request_id, buffer, offset, length) and the
  // progress so far. `progress` must outlive the Watch.
  class Watch {
   public:
    Watch() = default;
    Watch(Watch&& other) noexcept : reporter_(other.reporter_), id_(other.id_) {
      other.reporter_ = nullptr;
    }
    Watch& operator=(Watch&&) = delete;
    ~Watch() {
      if (reporter_ != nullptr) reporter_->Unwatch(id_);
    }

   private:
    friend class ProgressReporter;
    Watch(ProgressReporter* reporter, uint64_t id)
        : reporter_(reporter), id_(id) {}
    ProgressReporter* reporter_ = nullptr;
    uint64_t id_ = 0;
  };
  Watch Begin(std::shared_ptr<Session> session, const WorkProgress* progress,
              v1::Completion call) ABSL_LOCKS_EXCLUDED(mu_);

  // Reports pushed so far (tests, metrics).
  uint64_t reports() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    std::shared_ptr<Session> session;
    const WorkProgress* progress = nullptr;
    v1::Completion call;
    absl::Time start;
    absl::Time due;
  };

  void Unwatch(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  void Run() ABSL_LOCKS_EXCLUDED(mu_);

  const ProgressOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t reports_ ABSL_GUARDED_BY(mu_) = 0;
  // Set when an entry was added (its report may be due before the thread's
  // wake-up time) or on Stop.
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  Thread thread_;
};

// What a pin of kProgressMinBytes or more carries while it runs: its
// WorkProgress (set into `span`, so that the prefault and the device count
// into it and ask `cancelled` between steps) and its watch by `reporter`
// (null: none), reporting as `call` (which names the request). Shorter
// spans get neither. Lives on the stack of the call that pins.
class LongPin {
 public:
  LongPin(ProgressReporter* reporter, const std::shared_ptr<Session>& session,
          device::MemorySpan& span, const CancelCheck& cancelled,
          const v1::Completion& call) {
    if (span.length < kProgressMinBytes) return;
    progress_.emplace(span.length, cancelled);
    span.progress = &*progress_;
    if (reporter != nullptr) {
      watch_.emplace(reporter->Begin(session, span.progress, call));
    }
  }
  LongPin(const LongPin&) = delete;
  LongPin& operator=(const LongPin&) = delete;

 private:
  std::optional<WorkProgress> progress_;
  std::optional<ProgressReporter::Watch> watch_;  // ends before progress_
};

}  // namespace mrd::core

#endif  // MRD_SERVER_CORE_PROGRESS_REPORTER_H_
