#include "server/common/fair_scheduler.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"
#include "server/common/log.h"

namespace mrd {
namespace {

constexpr uint64_t kMaxU64 = std::numeric_limits<uint64_t>::max();
constexpr int64_t kMaxThreads = 65536;
// The slice bulk work asks for (the kernel allows 0.1 to 100 ms).
constexpr uint64_t kBulkSliceNs = 20'000'000;

uint64_t SatAdd(uint64_t a, uint64_t b) {
  return a > kMaxU64 - b ? kMaxU64 : a + b;
}

uint64_t SatMul(uint64_t a, uint64_t b) {
  if (a != 0 && b > kMaxU64 / a) return kMaxU64;
  return a * b;
}

size_t WaitBucket(absl::Duration waited) {
  const double seconds = absl::ToDoubleSeconds(waited);
  for (size_t i = 0; i + 1 < kFairWaitBuckets; ++i) {
    if (seconds <= kFairWaitBucketsSeconds[i]) return i;
  }
  return kFairWaitBuckets - 1;
}

// What the thread is doing for a scheduler: set for the life of a worker
// thread; `key` only while it runs a task (a parked yielder included).
struct CurrentTask {
  FairScheduler* scheduler = nullptr;
  size_t worker = 0;
  const std::string* key = nullptr;
  bool bulk = false;  // runs at the bulk priority now
};
thread_local CurrentTask current_task;

// sched_setattr(2)'s argument (glibc has no wrapper or type for it).
struct SchedAttr {
  uint32_t size = sizeof(SchedAttr);
  uint32_t sched_policy = 0;  // SCHED_OTHER
  uint64_t sched_flags = 0;
  int32_t sched_nice = 0;
  uint32_t sched_priority = 0;
  uint64_t sched_runtime = 0;  // SCHED_OTHER: the thread's slice (EEVDF)
  uint64_t sched_deadline = 0;
  uint64_t sched_period = 0;
};

// Sets the calling thread's nice value, and with it its time slice: a
// thread below its own priority (bulk work) asks for a long slice, so that
// on an EEVDF kernel (6.6 and later) any thread with the default slice that
// wakes up preempts it at once instead of at the next tick; back at its own
// priority it has the default slice again. Whether the nice value took (a
// kernel without custom slices gets the nice value alone).
bool SetThreadNice(int nice, bool bulk) {
  SchedAttr attr;
  attr.sched_nice = nice;
  attr.sched_runtime = bulk ? kBulkSliceNs : 0;
  if (::syscall(SYS_sched_setattr, 0, &attr, 0) == 0) return true;
  return ::setpriority(PRIO_PROCESS, 0, nice) == 0;
}

// The calling thread's nice value.
int ThreadNice() {
  errno = 0;
  const int nice = ::getpriority(PRIO_PROCESS, 0);
  return errno == 0 ? nice : 0;
}

// Whether a thread may lower its priority and raise it back (CAP_SYS_NICE,
// or an RLIMIT_NICE that allows it), tried on a thread of its own.
bool MayRaiseNiceBack(int base, int lower) {
  bool ok = false;
  absl::StatusOr<Thread> probe =
      Thread::Start("mrd-nice-probe", [&ok, base, lower] {
        ok = SetThreadNice(lower, true) && SetThreadNice(base, false);
      });
  if (!probe.ok()) return false;
  probe->Join();
  return ok;
}

}  // namespace

FairScheduler::FairScheduler() : clock_(RealClock::Get()) {}

absl::Status FairScheduler::Start(const FairSchedulerOptions& options) {
  if (options.workers < 1 || options.spare_workers < -1 ||
      options.yield_threads < -1 || options.quantum == 0 ||
      options.bulk_slots < -1) {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "BAD_OPTIONS",
        absl::StrCat("a fair scheduler needs at least one worker, spare "
                     "workers, yield threads and bulk slots of -1 or more "
                     "and a quantum of at least 1, not ",
                     options.workers, ", ", options.spare_workers, ", ",
                     options.yield_threads, ", ", options.quantum, " and ",
                     options.bulk_slots));
  }
  if (options.bulk_cost == 0 || options.bulk_nice < 0 ||
      options.bulk_nice > 19) {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "BAD_OPTIONS",
        absl::StrCat("bulk work needs a cost of at least 1 and "
                     "a nice step of 0 to 19, not ",
                     options.bulk_cost, " and ", options.bulk_nice));
  }
  const int64_t workers = options.workers;
  const int64_t spare =
      options.spare_workers < 0 ? workers : options.spare_workers;
  const int64_t yield_threads =
      options.yield_threads < 0 ? workers : options.yield_threads;
  const int64_t threads = workers + spare + yield_threads;
  if (threads > kMaxThreads) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_OPTIONS",
                    absl::StrCat("a fair scheduler of ", threads,
                                 " threads; at most ", kMaxThreads));
  }
  // Bulk work's priority, and how it is set (tried before the threads come).
  const int base_nice = ThreadNice();
  const int bulk_nice = std::min(19, base_nice + options.bulk_nice);
  BulkPriority bulk_priority = BulkPriority::kAuto;
  if (bulk_nice != base_nice) {
    const bool per_task =
        options.bulk_priority != BulkPriority::kFixedThreads &&
        MayRaiseNiceBack(base_nice, bulk_nice);
    if (options.bulk_priority == BulkPriority::kPerTask && !per_task) {
      return MrdError(
          absl::StatusCode::kFailedPrecondition, "NICE_NOT_PERMITTED",
          "bulk work per task needs a thread to raise its priority back "
          "(CAP_SYS_NICE or RLIMIT_NICE), which this process may not");
    }
    bulk_priority =
        per_task ? BulkPriority::kPerTask : BulkPriority::kFixedThreads;
  }
  const uint64_t bulk_slots = static_cast<uint64_t>(
      options.bulk_slots >= 0 ? options.bulk_slots
                              : std::max(1, UsableCpus() - 1));
  {
    absl::MutexLock lock(&mu_);
    if (started_) {
      return MrdError(absl::StatusCode::kFailedPrecondition, "ALREADY_STARTED",
                      "the fair scheduler was started already");
    }
    started_ = true;
    bulk_cost_ = options.bulk_cost;
    base_nice_ = base_nice;
    bulk_nice_ = bulk_nice;
    bulk_priority_ = bulk_priority;
    workers_count_ = static_cast<uint64_t>(workers);
    spare_count_ = static_cast<uint64_t>(spare);
    quantum_ = options.quantum;
    bulk_slots_ = bulk_slots;
    if (options.clock != nullptr) clock_ = options.clock;
    workers_.resize(static_cast<size_t>(threads));
    if (bulk_priority_ == BulkPriority::kFixedThreads) {
      for (size_t i = 0; i < static_cast<size_t>(workers); ++i) {
        workers_[i].bulk_thread = true;
      }
    }
  }
  threads_.reserve(static_cast<size_t>(threads));
  absl::Status failure;
  for (size_t i = 0; i < static_cast<size_t>(threads); ++i) {
    // kFixedThreads: the first `workers` threads lower themselves for good.
    const bool bulk_thread = bulk_priority_ == BulkPriority::kFixedThreads &&
                             i < static_cast<size_t>(workers);
    absl::StatusOr<Thread> thread =
        Thread::Start("mrd-worker", [this, i, bulk_thread] {
          const bool low = bulk_thread && SetThreadNice(bulk_nice_, true);
          if (bulk_thread && !low) {
            LogWarning("fair scheduler: worker ", i,
                       " could not lower its priority for bulk work");
          }
          Run(i, low);
        });
    if (!thread.ok()) {
      failure = thread.status();
      break;
    }
    threads_.push_back(*std::move(thread));
  }
  if (threads_.empty()) return failure;
  {
    // Every thread is idle and counted before Start returns, so that what is
    // scheduled next finds them all.
    struct Arg {
      const FairScheduler* scheduler;
      size_t threads;
    } arg{this, threads_.size()};
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](Arg* a) ABSL_EXCLUSIVE_LOCKS_REQUIRED(a->scheduler->mu_) {
          return a->scheduler->registered_ >= a->threads;
        },
        &arg));
  }
  if (!failure.ok()) {
    LogWarning("fair scheduler: going on with ", threads_.size(), " of ",
               threads, " threads: ", failure.message());
  }
  if (bulk_slots > 0) {
    LogInfo("fair scheduler: at most ", bulk_slots,
            " workers start bulk work at once");
  }
  if (bulk_priority_ != BulkPriority::kAuto) {
    LogInfo("fair scheduler: bulk work (cost ", bulk_cost_,
            " or more) runs at nice ", bulk_nice_, ", the rest at nice ",
            base_nice_,
            bulk_priority_ == BulkPriority::kPerTask
                ? " (set per task)"
                : absl::StrCat(" (", workers,
                               " threads for bulk work: this process may not "
                               "raise a thread's priority back)"));
  }
  return absl::OkStatus();
}

BulkPriority FairScheduler::bulk_priority() const { return bulk_priority_; }

void FairScheduler::SetBulk(bool bulk, bool* now) const {
  if (bulk == *now) return;
  if (SetThreadNice(bulk ? bulk_nice_ : base_nice_, bulk)) *now = bulk;
}

size_t FairScheduler::TakeIdleLocked(bool bulk) {
  MRD_CHECK(!idle_.empty());
  size_t at = idle_.size() - 1;
  if (bulk_priority_ == BulkPriority::kFixedThreads) {
    for (size_t i = idle_.size(); i-- > 0;) {
      if (workers_[idle_[i]].bulk_thread == bulk) {
        at = i;
        break;
      }
    }
  }
  const size_t worker = idle_[at];
  idle_[at] = idle_.back();
  idle_.pop_back();
  return worker;
}

bool FairScheduler::Drain(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return waiting_total_ == 0 && running_total_ == 0;
  };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

FairScheduler::~FairScheduler() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    WakeIfStoppedLocked();
  }
  for (Thread& t : threads_) t.Join();
  // The threads left only with nothing queued or running; anything still
  // queued was scheduled to a scheduler that never got a thread.
  while (true) {
    absl::AnyInvocable<void() &&> task;
    {
      absl::MutexLock lock(&mu_);
      if (ring_.empty()) break;
      const uint32_t id = ring_.front();
      Queue& q = queues_[id];
      Item item = std::move(q.waiting.front());
      q.waiting.pop_front();
      --waiting_total_;
      if (q.waiting.empty()) {
        ring_.pop_front();
        q.deficit = 0;
        q.in_visit = false;
      }
      const absl::Duration waited = clock_->Now() - item.enqueued;
      ++q.started_total;
      ++q.finished_total;
      q.cost_total = SatAdd(q.cost_total, item.cost);
      q.wait_total += waited;
      ++q.wait_buckets[WaitBucket(waited)];
      task = std::move(item.task);
      UpdateActiveLocked(q);
    }
    if (task) std::move(task)();
  }
}

void FairScheduler::Schedule(absl::string_view key, uint32_t weight,
                             uint64_t cost,
                             absl::AnyInvocable<void() &&> task) {
  weight = std::max<uint32_t>(weight, 1);
  cost = std::max<uint64_t>(cost, 1);
  absl::MutexLock lock(&mu_);
  uint32_t id;
  auto it = ids_.find(key);
  if (it != ids_.end()) {
    id = it->second;
  } else if (!free_ids_.empty()) {
    id = free_ids_.back();
    free_ids_.pop_back();
    queues_[id] = Queue();
    queues_[id].key = std::string(key);
    ids_.emplace(std::string(key), id);
  } else {
    id = static_cast<uint32_t>(queues_.size());
    queues_.emplace_back();
    queues_.back().key = std::string(key);
    ids_.emplace(std::string(key), id);
  }
  Queue& q = queues_[id];
  if (q.active) active_weight_ = active_weight_ - q.weight + weight;
  q.weight = weight;
  Item item;
  item.task = std::move(task);
  item.cost = cost;
  item.enqueued = clock_->Now();
  PushLocked(id, std::move(item));
  UpdateActiveLocked(q);
  DispatchLocked();
}

void FairScheduler::YieldCurrent(uint64_t next_cost) {
  if (current_task.scheduler == nullptr || current_task.key == nullptr) return;
  current_task.scheduler->Yield(current_task.worker, next_cost);
}

bool FairScheduler::CurrentIsBulk() { return current_task.bulk; }

absl::string_view FairScheduler::CurrentKey() {
  if (current_task.key == nullptr) return "";
  return *current_task.key;
}

std::vector<FairQueueStats> FairScheduler::Stats() const {
  absl::MutexLock lock(&mu_);
  std::vector<FairQueueStats> out;
  out.reserve(queues_.size());
  for (const Queue& q : queues_) {
    if (q.forgotten) continue;
    FairQueueStats s;
    s.key = q.key;
    s.weight = q.weight;
    s.queued = q.waiting.size();
    s.running = q.running;
    s.started_total = q.started_total;
    s.finished_total = q.finished_total;
    s.yields_total = q.yields_total;
    s.cost_total = q.cost_total;
    s.wait_seconds_total = absl::ToDoubleSeconds(q.wait_total);
    s.yield_wait_seconds_total = absl::ToDoubleSeconds(q.yield_wait_total);
    s.service_seconds_total = absl::ToDoubleSeconds(q.service_total);
    s.wait_bucket_counts.resize(kFairWaitBuckets);
    uint64_t cumulative = 0;
    for (size_t i = 0; i < kFairWaitBuckets; ++i) {
      cumulative += q.wait_buckets[i];
      s.wait_bucket_counts[i] = cumulative;
    }
    out.push_back(std::move(s));
  }
  return out;
}

void FairScheduler::Run(size_t worker, bool low) {
  current_task.scheduler = this;
  current_task.worker = worker;
  current_task.bulk = low;
  bool bulk_now = false;  // kPerTask: at the bulk priority now
  mu_.Lock();
  ++registered_;
  idle_.push_back(worker);
  DispatchLocked();  // what was scheduled before this thread came
  while (true) {
    while (!WorkerReadyLocked(worker)) workers_[worker].wake->Wait(&mu_);
    Worker& w = workers_[worker];
    if (!w.assigned) break;  // stopping, and nothing is queued or running
    absl::AnyInvocable<void()&&> task = std::move(w.task);
    w.task = nullptr;
    w.assigned = false;
    const uint32_t id = w.queue;
    const bool bulk = w.bulk;
    current_task.key = &queues_[id].key;
    mu_.Unlock();
    if (bulk_priority_ == BulkPriority::kPerTask) {
      SetBulk(bulk, &bulk_now);
      current_task.bulk = bulk_now;
    }

    std::move(task)();
    task = nullptr;  // what it captured goes before the lock is taken
    current_task.key = nullptr;

    mu_.Lock();
    Queue& q = queues_[id];
    const absl::Time now = clock_->Now();
    --q.running;
    --running_total_;
    (void)ReleaseBulkSlotLocked(worker);
    ++q.finished_total;
    q.service_total += now - workers_[worker].slot_since;
    UpdateActiveLocked(q);
    idle_.push_back(worker);
    DispatchLocked();
    WakeIfStoppedLocked();
  }
  mu_.Unlock();
  current_task = CurrentTask();
}

void FairScheduler::Yield(size_t worker, uint64_t next_cost) {
  next_cost = std::max<uint64_t>(next_cost, 1);
  absl::MutexLock lock(&mu_);
  const uint32_t id = workers_[worker].queue;
  Queue& q = queues_[id];
  if (q.running < ShareLocked(q)) return;
  // Give the slot up for a moment and see whether another queue would take
  // it; if not, take it back.
  const absl::Time now = clock_->Now();
  --q.running;
  --running_total_;
  const bool bulk_slot = ReleaseBulkSlotLocked(worker);
  Item item;
  item.cost = next_cost;
  item.enqueued = now;
  item.parked_worker = worker;
  PushLocked(id, std::move(item));
  bool other_may_start = false;
  Gate gate;
  if (GateLocked(&gate)) {
    for (uint32_t other : ring_) {
      if (other != id && MayStartLocked(gate, queues_[other])) {
        other_may_start = true;
        break;
      }
    }
  }
  if (!other_may_start) {
    UnpushLastLocked(id);
    ++q.running;
    ++running_total_;
    if (bulk_slot) {
      workers_[worker].bulk_slot = true;
      ++running_bulk_;
    }
    return;
  }
  ++q.yields_total;
  q.service_total += now - workers_[worker].slot_since;
  if (ring_.front() == id) RotateLocked();  // the others go first
  DispatchLocked();
  while (!workers_[worker].resumed) workers_[worker].wake->Wait(&mu_);
  workers_[worker].resumed = false;
}

void FairScheduler::WakeIfStoppedLocked() {
  if (!StoppedLocked()) return;
  for (Worker& w : workers_) w.wake->Signal();
}

bool FairScheduler::StoppedLocked() const {
  return stopping_ && waiting_total_ == 0 && running_total_ == 0;
}

bool FairScheduler::WorkerReadyLocked(size_t worker) const {
  return workers_[worker].assigned || StoppedLocked();
}

uint64_t FairScheduler::ShareLocked(const Queue& q) const {
  if (active_weight_ == 0) return 1;
  return std::max<uint64_t>(1, workers_count_ * q.weight / active_weight_);
}

bool FairScheduler::ReleaseBulkSlotLocked(size_t worker) {
  if (!workers_[worker].bulk_slot) return false;
  workers_[worker].bulk_slot = false;
  --running_bulk_;
  return true;
}

bool FairScheduler::LaunchableLocked(const Queue& q, bool thread_free) const {
  if (q.waiting.empty()) return false;
  const Item& head = q.waiting.front();
  if (head.parked_worker != kNoWorker) return true;  // past the bulk slots
  if (!thread_free) return false;
  return bulk_slots_ == 0 || head.cost < bulk_cost_ ||
         running_bulk_ < bulk_slots_;
}

bool FairScheduler::GateLocked(Gate* gate) const {
  if (running_total_ < workers_count_) {
    gate->regular = true;
  } else if (running_total_ < workers_count_ + spare_count_) {
    gate->regular = false;
  } else {
    return false;
  }
  gate->thread_free = !idle_.empty();
  gate->any_below = false;
  for (uint32_t id : ring_) {
    const Queue& q = queues_[id];
    if (LaunchableLocked(q, gate->thread_free) && q.running < ShareLocked(q)) {
      gate->any_below = true;
      break;
    }
  }
  return gate->regular || gate->any_below;
}

bool FairScheduler::MayStartLocked(const Gate& gate, const Queue& q) const {
  if (!LaunchableLocked(q, gate.thread_free)) return false;
  return q.running < ShareLocked(q) || (gate.regular && !gate.any_below);
}

uint64_t FairScheduler::GrantLocked(const Queue& q) const {
  return SatMul(quantum_, q.weight);
}

void FairScheduler::RotateLocked() {
  const uint32_t id = ring_.front();
  ring_.pop_front();
  ring_.push_back(id);
  queues_[id].in_visit = false;
}

bool FairScheduler::PickLocked(const Gate& gate, uint32_t* picked) {
  bool any = false;
  for (uint32_t id : ring_) {
    if (MayStartLocked(gate, queues_[id])) {
      any = true;
      break;
    }
  }
  if (!any) return false;
  // Ends: a pass over the ring either starts a task or grants every queue
  // that may start once, and after a pass with no start SkipIdleRoundsLocked
  // makes the next pass start one.
  size_t steps_left = ring_.size();
  while (true) {
    const uint32_t id = ring_.front();
    Queue& q = queues_[id];
    if (MayStartLocked(gate, q)) {
      const uint64_t cost = q.waiting.front().cost;
      if (!q.in_visit) {
        q.in_visit = true;
        // A visit the share cap cut short goes on with what it had.
        if (q.deficit < cost) q.deficit = SatAdd(q.deficit, GrantLocked(q));
      }
      if (cost <= q.deficit) {
        *picked = id;
        return true;
      }
    }
    RotateLocked();
    if (--steps_left == 0) {
      SkipIdleRoundsLocked(gate);
      steps_left = ring_.size();
    }
  }
}

void FairScheduler::SkipIdleRoundsLocked(const Gate& gate) {
  // Every queue that may start has a head costlier than its deficit. The
  // first to fit needs `rounds` more visits; the rounds before it start
  // nothing, so grant them all at once.
  uint64_t rounds = kMaxU64;
  for (uint32_t id : ring_) {
    const Queue& q = queues_[id];
    if (!MayStartLocked(gate, q)) continue;
    const uint64_t need = q.waiting.front().cost - q.deficit;
    const uint64_t grant = GrantLocked(q);
    rounds = std::min(rounds, need / grant + (need % grant != 0 ? 1 : 0));
  }
  if (rounds == kMaxU64 || rounds <= 1) return;
  for (uint32_t id : ring_) {
    Queue& q = queues_[id];
    if (!MayStartLocked(gate, q)) continue;
    q.deficit = SatAdd(q.deficit, SatMul(rounds - 1, GrantLocked(q)));
  }
}

void FairScheduler::StartLocked(uint32_t id) {
  MRD_CHECK(!ring_.empty() && ring_.front() == id);
  Queue& q = queues_[id];
  Item item = std::move(q.waiting.front());
  q.waiting.pop_front();
  --waiting_total_;
  q.deficit -= item.cost;  // PickLocked saw it fit
  if (q.waiting.empty()) {
    ring_.pop_front();
    q.deficit = 0;
    q.in_visit = false;
  }
  ++q.running;
  ++running_total_;
  const bool bulk_slot = bulk_slots_ != 0 && item.cost >= bulk_cost_;
  if (bulk_slot) ++running_bulk_;
  q.cost_total = SatAdd(q.cost_total, item.cost);
  const absl::Time now = clock_->Now();
  const absl::Duration waited = now - item.enqueued;
  if (item.parked_worker != kNoWorker) {
    Worker& w = workers_[item.parked_worker];
    MRD_CHECK(w.queue == id);
    w.bulk_slot = bulk_slot;
    w.resumed = true;
    w.slot_since = now;
    w.wake->Signal();
    q.yield_wait_total += waited;
    return;
  }
  const bool bulk = bulk_nice_ != base_nice_ && item.cost >= bulk_cost_;
  const size_t worker = TakeIdleLocked(bulk);
  Worker& w = workers_[worker];
  w.task = std::move(item.task);
  w.assigned = true;
  w.queue = id;
  w.bulk = bulk;
  w.bulk_slot = bulk_slot;
  w.slot_since = now;
  w.wake->Signal();
  ++q.started_total;
  q.wait_total += waited;
  ++q.wait_buckets[WaitBucket(waited)];
}

void FairScheduler::DispatchLocked() {
  Gate gate;
  while (!ring_.empty() && GateLocked(&gate)) {
    uint32_t id;
    if (!PickLocked(gate, &id)) return;
    StartLocked(id);
  }
}

bool FairScheduler::Forget(absl::string_view key) {
  absl::MutexLock lock(&mu_);
  auto it = ids_.find(key);
  if (it == ids_.end()) return false;
  Queue& q = queues_[it->second];
  // Idle: in no ring, on no worker (no CurrentKey points at its key).
  if (!q.waiting.empty() || q.running > 0) return false;
  q.forgotten = true;
  free_ids_.push_back(it->second);
  ids_.erase(it);
  return true;
}

void FairScheduler::UpdateActiveLocked(Queue& q) {
  const bool active = !q.waiting.empty() || q.running > 0;
  if (active == q.active) return;
  q.active = active;
  if (active) {
    active_weight_ += q.weight;
  } else {
    active_weight_ -= q.weight;
  }
}

void FairScheduler::PushLocked(uint32_t id, Item item) {
  Queue& q = queues_[id];
  q.waiting.push_back(std::move(item));
  ++waiting_total_;
  if (q.waiting.size() == 1) ring_.push_back(id);
}

void FairScheduler::UnpushLastLocked(uint32_t id) {
  Queue& q = queues_[id];
  q.waiting.pop_back();
  --waiting_total_;
  if (q.waiting.empty()) {
    MRD_CHECK(ring_.back() == id);
    ring_.pop_back();
    q.in_visit = false;
  }
}

}  // namespace mrd
