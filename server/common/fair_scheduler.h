// FairScheduler: the workers that run mrd's long requests (pinning a
// registration, a batch, a teardown), shared between tenants instead of
// served first come first served.
//
// Every task is scheduled under a key (a tenant) with a weight and a cost
// (the work it stands for: pages to pin, items of a batch). Each key has its
// own queue in front of the workers, and the queues are served by deficit
// round robin under a share cap, so that one tenant's eight 256 MiB
// registrations no longer make another tenant's 4 KiB registration wait for
// all of them. Long work calls YieldCurrent between its steps, which lets a
// tenant over its share give its worker up to a tenant waiting below its
// share.
//
// The rules (tests/unit/common/fair_scheduler_test.cc holds each of them):
//
//  * Slots. At most `workers` tasks hold a regular slot; `spare_workers` more
//    slots take only tasks of queues below their share (see below), once
//    every regular slot is busy. A running task holds one slot until it
//    returns or yields. There are threads for every slot plus
//    `yield_threads`, so that a slot given up at a yield finds a thread for
//    another tenant's task while the yielder waits on its own thread.
//  * Share. A queue is active while it has tasks queued or running; its share
//    is max(1, floor(workers * weight / sum of the active queues' weights)).
//  * Who may start. When a regular slot is free, the queues below their share
//    that have a task waiting may start; if there are none, every queue with
//    a task waiting may (work-conserving: a tenant alone uses every worker).
//    A spare slot takes only queues below their share. A new task also needs
//    an idle thread; a parked yielder does not (it resumes on its own).
//  * Which one. Among the queues that may start, deficit round robin over the
//    queues with tasks waiting, in the order they became non-empty: a visit to
//    a queue adds quantum * weight to its deficit, and its head task starts
//    once its cost is at most the deficit (which then drops by the cost); the
//    visit goes on while the next head fits, then the next queue is visited.
//    A queue that empties loses its deficit. A queue stopped by the share cap
//    while its deficit still covers its head resumes that visit later instead
//    of being granted again, so a deficit never exceeds one grant plus the
//    head's cost. A task costlier than any grant starts after at most
//    ceil(cost / (quantum * weight)) visits of its queue (rounds in which
//    nothing could start are counted, not looped through), so nothing starves.
//  * Yield. YieldCurrent gives the caller's slot up only if its queue holds at
//    least its share and, with that slot free, a task of another queue may
//    start (by the rules above); the caller then waits in its own queue as a
//    task of cost `next_cost` scheduled now, its queue's current visit ends
//    (so the other queues come first), and it goes on once deficit round
//    robin picks it again. Otherwise YieldCurrent returns at once.
//
// CPU priority. A task of at least `bulk_cost` (a 1 MiB registration, a
// batch of 256 items, a 1 MiB buffer's release) is bulk work: it runs
// `bulk_nice` nice steps below the workers' own priority, so that on a busy
// machine the kernel runs a small request's thread (and gRPC's) before it,
// while a core left idle still goes to it. Where the process may raise a
// thread's priority back (CAP_SYS_NICE, or RLIMIT_NICE), each task sets its
// thread's priority (BulkPriority::kPerTask); elsewhere (an unprivileged
// mrd, as in the DaemonSet) the first `workers` threads run at the bulk
// priority for good and the others at the workers' own, and a task starts
// on an idle thread of its class when there is one, else on any idle
// thread (kFixedThreads).
//
// Bulk slots. With `bulk_slots` > 0, a bulk task starts only while fewer
// than `bulk_slots` slots run bulk work; other work starts in any slot, so
// a small request never waits for bulk work, whoever's. On a machine of few
// cores, bulk work that takes every core leaves a small request's threads
// (gRPC's, the caller's) waiting a scheduler tick for a CPU; with a core
// left over they get one at once. A parked yielder resumes past the limit:
// the task it interrupted may hold what a running one waits for (a cache
// entry being made).
//
// Costs of 0 count as 1, weights of 0 as 1. Every key ever scheduled keeps a
// queue (a few hundred bytes) for Stats until the scheduler is destroyed: the
// keys are tenants, of which a node has few; a queue with nothing queued or
// running is never looked at by a dispatch.
//
// Ownership: the scheduler owns its threads and every task until the task has
// run. Tasks must not destroy the scheduler.
//
// Thread safety: every method is thread-safe. Start is called once, before any
// Schedule. No lock of the scheduler is held while a task runs, so tasks may
// call Schedule, Stats and YieldCurrent (a yield may wait: call it holding no
// lock another task needs).
#ifndef MRD_SERVER_COMMON_FAIR_SCHEDULER_H_
#define MRD_SERVER_COMMON_FAIR_SCHEDULER_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/common/clock.h"
#include "server/common/thread.h"

namespace mrd {

enum class BulkPriority {
  kAuto,          // kPerTask where permitted, else kFixedThreads
  kPerTask,       // kAuto's choice where permitted; Start refuses it elsewhere
  kFixedThreads,  // even where kPerTask is permitted
};

struct FairSchedulerOptions {
  // Regular slots: threads that serve whichever queue deficit round robin
  // picks. At least 1.
  int workers = 4;
  // More slots (-1 = as many as `workers`) that start only a task of a queue
  // holding fewer running tasks than its share, when every regular slot is
  // busy: a small request of a tenant under its share starts at once while
  // another tenant holds every regular worker (the CPU is shared by the
  // kernel, the queue is not).
  int spare_workers = -1;
  // Threads beyond the slots (-1 = as many as `workers`, 0 = none) for the
  // slots that yielders give up while they wait on their own threads. With
  // no idle thread, a yield that would hand its slot to a new task does not
  // happen.
  int yield_threads = -1;
  // Cost units a queue's deficit grows by per visit, times its weight
  // (16384 = 64 MiB of 4 KiB pages). At least 1.
  uint64_t quantum = 16384;
  // Wait and service times; nullptr = RealClock. Must outlive the scheduler.
  const Clock* clock = nullptr;
  // Bulk work (see "CPU priority" above): its cost, at least 1, and how many
  // nice steps below the workers' own priority it runs (0 = at the same:
  // no bulk class; at most 19, and never past nice 19).
  uint64_t bulk_cost = 256;
  int bulk_nice = 10;
  BulkPriority bulk_priority = BulkPriority::kAuto;
  // At most this many slots start bulk work (see "Bulk slots" above): 0 =
  // no limit, -1 = one less than the CPUs this process may run on (at
  // least 1).
  int bulk_slots = 0;
};

// Upper bounds, in seconds, of the wait histogram's buckets (the +Inf bucket
// follows them).
inline constexpr double kFairWaitBucketsSeconds[] = {
    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5};
inline constexpr size_t kFairWaitBuckets =
    sizeof(kFairWaitBucketsSeconds) / sizeof(kFairWaitBucketsSeconds[0]) + 1;

// One queue's counters; the totals are cumulative since Start.
struct FairQueueStats {
  std::string key;
  uint32_t weight = 1;          // the latest one given
  uint64_t queued = 0;          // waiting now, parked yielders included
  uint64_t running = 0;         // holding a slot now
  uint64_t started_total = 0;   // tasks started (a resumed yielder is not)
  uint64_t finished_total = 0;  // tasks returned
  uint64_t yields_total = 0;    // slots given up by YieldCurrent
  // What deficit round robin charged: every task's cost when it started and
  // every yielder's `next_cost` when it resumed.
  uint64_t cost_total = 0;
  // Time tasks waited before they first started (the histogram's sum).
  double wait_seconds_total = 0;
  // Time parked yielders waited to resume.
  double yield_wait_seconds_total = 0;
  // Time tasks held a slot (a parked yielder holds none).
  double service_seconds_total = 0;
  // Prometheus histogram shape: element i counts the first-start waits of at
  // most kFairWaitBucketsSeconds[i]; the last element (+Inf) counts them all
  // and equals started_total.
  std::vector<uint64_t> wait_bucket_counts;
};

class FairScheduler {
 public:
  FairScheduler();
  // Runs every task scheduled so far and every task they schedule, then joins
  // the threads. If no thread was ever started, runs the queued tasks on the
  // calling thread.
  ~FairScheduler();
  FairScheduler(const FairScheduler&) = delete;
  // Waits, at most `timeout`, until no task is queued or running (tasks may
  // still be scheduled meanwhile: it waits for them too). True when idle.
  // For a shutdown: the calls still running end before what they use goes.
  bool Drain(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);
  FairScheduler& operator=(const FairScheduler&) = delete;

  // Starts the threads. Errors: INVALID_ARGUMENT BAD_OPTIONS (workers < 1,
  // spare_workers, yield_threads or bulk_slots < -1, quantum 0, more
  // than 65536 threads), FAILED_PRECONDITION ALREADY_STARTED (a second Start),
  // THREAD_FAILED (no thread could be made). If only some threads could be
  // made, logs it and goes on with those (the slots stay as configured).
  // Returns once every thread made is waiting for work.
  absl::Status Start(const FairSchedulerOptions& options);

  // Queues `task` under `key` and returns; never blocks. `weight` >= 1 is the
  // key's share (the latest weight given for a key wins), `cost` >= 1 the
  // work the task stands for.
  void Schedule(absl::string_view key, uint32_t weight, uint64_t cost,
                absl::AnyInvocable<void() &&> task);

  // Called by a running task between steps of long work: gives the slot up
  // and waits for deficit round robin to pick the task again, charged
  // `next_cost`, when the rules above say so; otherwise returns at once. A
  // no-op on a thread that is not running a task of a FairScheduler.
  static void YieldCurrent(uint64_t next_cost);

  // The key of the task running on this thread, or "" on a thread that runs
  // none. Valid while that task runs.
  static absl::string_view CurrentKey();

  // Whether this thread runs at the bulk priority now (a worker running
  // bulk work, or a kFixedThreads bulk thread): the locks it holds may wait
  // for a CPU while other threads run, so shared resources it takes (an
  // io_uring ring) are best kept apart from a small request's.
  static bool CurrentIsBulk();

  // One entry per key scheduled and not forgotten, in the order the keys
  // first came.
  std::vector<FairQueueStats> Stats() const;

  // How bulk work is put at its priority since Start (kPerTask or
  // kFixedThreads; kAuto before Start or with bulk_nice 0).
  BulkPriority bulk_priority() const;

  // Drops the queue of `key` and its counters when nothing of it is queued
  // or running (a tenant that is gone: mrd forgets tenants that hold
  // nothing, so that a node's churn of pods does not grow its queues and
  // metrics forever); the next Schedule of the key starts a new queue.
  // Returns whether it was dropped.
  bool Forget(absl::string_view key);

 private:
  static constexpr size_t kNoWorker = ~size_t{0};

  // A task waiting in a queue: a new one (task set) or a parked yielder
  // (parked_worker set, task empty).
  struct Item {
    absl::AnyInvocable<void() &&> task;
    uint64_t cost = 1;
    absl::Time enqueued;
    size_t parked_worker = kNoWorker;
  };
  // One key's queue. Fields are guarded by mu_: a Queue is reached only
  // through queues_.
  struct Queue {
    std::string key;  // set at creation (or reuse), never changed meanwhile
    bool forgotten = false;  // Forget dropped it; its slot awaits reuse
    uint32_t weight = 1;
    std::deque<Item> waiting;
    uint64_t deficit = 0;
    bool in_visit = false;  // at the ring's front and granted for this visit
    bool active = false;    // counted in active_weight_
    uint64_t running = 0;
    uint64_t started_total = 0;
    uint64_t finished_total = 0;
    uint64_t yields_total = 0;
    uint64_t cost_total = 0;
    absl::Duration wait_total;
    absl::Duration yield_wait_total;
    absl::Duration service_total;
    uint64_t wait_buckets[kFairWaitBuckets] = {};  // not cumulative
  };
  // One thread's state. Guarded by mu_: reached only through workers_.
  struct Worker {
    absl::AnyInvocable<void() &&> task;  // handed over by a dispatch
    bool assigned = false;               // `task` is to be run
    bool resumed = false;                // a parked yielder was picked
    uint32_t queue = 0;                  // of the task it runs
    bool bulk = false;                   // that task is bulk work
    bool bulk_slot = false;              // that task counts in running_bulk_
    bool bulk_thread = false;  // kFixedThreads: runs at the bulk priority
    absl::Time slot_since;     // when that task took its slot
    // Signalled when `assigned` or `resumed` is set, and at stop. A worker
    // waits on a condition variable of its own rather than on a condition
    // of mu_: Abseil evaluates a waiter's condition on every unlock of mu_,
    // and the workers are idle nearly always.
    std::unique_ptr<absl::CondVar> wake = std::make_unique<absl::CondVar>();
  };
  // Which queues may take the slot a dispatch fills.
  struct Gate {
    bool regular = false;      // a regular slot (else a spare one)
    bool thread_free = false;  // a new task would find an idle thread
    bool any_below = false;    // some queue below its share may start
  };

  // The thread of workers_[worker]; `low`: it runs at the bulk priority for
  // good (kFixedThreads).
  void Run(size_t worker, bool low) ABSL_LOCKS_EXCLUDED(mu_);
  void Yield(size_t worker, uint64_t next_cost) ABSL_LOCKS_EXCLUDED(mu_);
  // Wakes every worker once stopping with nothing queued or running (the
  // moment WorkerReadyLocked turns true for the idle ones).
  void WakeIfStoppedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stopping, with nothing queued or running: the workers may leave.
  bool StoppedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  uint64_t ShareLocked(const Queue& q) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives back the bulk slot `worker` holds, if it holds one; whether it did.
  bool ReleaseBulkSlotLocked(size_t worker) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool LaunchableLocked(const Queue& q, bool thread_free) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // False when no slot is free.
  bool GateLocked(Gate* gate) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool MayStartLocked(const Gate& gate, const Queue& q) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t GrantLocked(const Queue& q) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Deficit round robin: the queue (at the ring's front) whose head starts
  // next in a slot described by `gate`, or false.
  bool PickLocked(const Gate& gate, uint32_t* picked)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Grants the rounds in which no queue that may start could start.
  void SkipIdleRoundsLocked(const Gate& gate)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RotateLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts the head of queue `id`, which PickLocked returned.
  void StartLocked(uint32_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fills every free slot the rules allow.
  void DispatchLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateActiveLocked(Queue& q) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PushLocked(uint32_t id, Item item) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes `id`'s last waiting item back off (a yield that did not happen).
  void UnpushLastLocked(uint32_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool WorkerReadyLocked(size_t worker) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes an idle thread for a task (`bulk`: bulk work) off idle_.
  size_t TakeIdleLocked(bool bulk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Puts this thread at the priority for bulk work or not (kPerTask).
  void SetBulk(bool bulk, bool* now) const;

  mutable absl::Mutex mu_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t workers_count_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t spare_count_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t quantum_ ABSL_GUARDED_BY(mu_) = 16384;
  uint64_t bulk_slots_ ABSL_GUARDED_BY(mu_) = 0;  // 0: no limit
  uint64_t running_bulk_ ABSL_GUARDED_BY(mu_) = 0;
  // Written by Start before any thread exists; read-only afterwards.
  uint64_t bulk_cost_ = 256;
  int base_nice_ = 0;  // the workers' own priority
  int bulk_nice_ = 0;  // bulk work's (== base_nice_: no bulk class)
  BulkPriority bulk_priority_ = BulkPriority::kAuto;
  const Clock* clock_ ABSL_GUARDED_BY(mu_);
  // Queues never go away (std::deque keeps their addresses, so CurrentKey may
  // point into them); ids_ maps a key to its index.
  std::deque<Queue> queues_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, uint32_t> ids_ ABSL_GUARDED_BY(mu_);
  std::vector<uint32_t> free_ids_ ABSL_GUARDED_BY(mu_);  // forgotten queues
  // The queues with tasks waiting, in round robin order; the front is the
  // one being visited.
  std::deque<uint32_t> ring_ ABSL_GUARDED_BY(mu_);
  uint64_t active_weight_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t waiting_total_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t running_total_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Worker> workers_ ABSL_GUARDED_BY(mu_);
  std::vector<size_t> idle_ ABSL_GUARDED_BY(mu_);  // indexes into workers_
  size_t registered_ ABSL_GUARDED_BY(mu_) = 0;     // threads that came up
  std::vector<Thread> threads_;  // written by Start and the destructor only
};

}  // namespace mrd

#endif  // MRD_SERVER_COMMON_FAIR_SCHEDULER_H_
