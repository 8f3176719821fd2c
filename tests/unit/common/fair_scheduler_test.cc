// server/common/fair_scheduler.h: tenants share the workers by deficit round
// robin under a share cap, work-conserving when alone, with spare slots for
// tenants below their share and yields between steps of long work.
//
// Every test is about order, never timing: tasks held on notifications build
// a backlog, the test releases them, and the start order it records is the
// one deficit round robin dictates (with one worker, each pick happens only
// after the previous task is accounted for, so the order is exact).
#include "server/common/fair_scheduler.h"

#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "server/common/clock.h"
#include "server/common/thread.h"
#include "server/common/thread_pool.h"

namespace mrd {
namespace {

// Long enough never to be reached by a passing test; only a hang ends there.
constexpr absl::Duration kHang = absl::Seconds(10);
constexpr uint64_t k256MiB = 65536;  // pages
constexpr uint64_t k64MiB = 16384;

// Records the order tasks start in; a held task waits for Release(name).
class Lab {
 public:
  absl::AnyInvocable<void() &&> Task(const std::string& name,
                                     bool hold = false) {
    absl::Notification* gate = hold ? Gate(name) : nullptr;
    return [this, name, gate] {
      Record(name);
      if (gate != nullptr) {
        EXPECT_TRUE(gate->WaitForNotificationWithTimeout(kHang)) << name;
      }
    };
  }
  absl::Notification* Gate(const std::string& name) {
    absl::MutexLock lock(&mu_);
    std::unique_ptr<absl::Notification>& gate = gates_[name];
    if (gate == nullptr) gate = std::make_unique<absl::Notification>();
    return gate.get();
  }
  void Release(const std::string& name) { Gate(name)->Notify(); }
  void Record(const std::string& name) {
    absl::MutexLock lock(&mu_);
    order_.push_back(name);
  }
  // True once `n` names were recorded.
  bool WaitForStarts(size_t n) {
    absl::MutexLock lock(&mu_);
    struct Arg {
      Lab* lab;
      size_t n;
    } arg{this, n};
    return mu_.AwaitWithTimeout(
        absl::Condition(
            +[](Arg* a) ABSL_EXCLUSIVE_LOCKS_REQUIRED(a->lab->mu_) {
              return a->lab->order_.size() >= a->n;
            },
            &arg),
        kHang);
  }
  std::vector<std::string> Order() {
    absl::MutexLock lock(&mu_);
    return order_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> order_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::unique_ptr<absl::Notification>> gates_
      ABSL_GUARDED_BY(mu_);
};

FairQueueStats StatsOf(const FairScheduler& scheduler, const std::string& key) {
  for (FairQueueStats& s : scheduler.Stats()) {
    if (s.key == key) return s;
  }
  ADD_FAILURE() << "no queue " << key;
  return FairQueueStats();
}

// One worker and no extra slots or threads: the start order is exactly the
// pick order.
FairSchedulerOptions OneWorker() {
  FairSchedulerOptions options;
  options.workers = 1;
  options.spare_workers = 0;
  options.yield_threads = 0;
  return options;
}

std::vector<std::string> Names(const std::string& prefix, int first, int last) {
  std::vector<std::string> names;
  for (int i = first; i <= last; ++i) names.push_back(absl::StrCat(prefix, i));
  return names;
}

std::vector<std::string> Concat(
    std::initializer_list<std::vector<std::string>> parts) {
  std::vector<std::string> all;
  for (const auto& part : parts)
    all.insert(all.end(), part.begin(), part.end());
  return all;
}

// The baseline the scheduler replaces: one pool in arrival order serves A's
// whole flood before B's one small task.
TEST(FairSchedulerTest, FifoPoolServesTheWholeFloodFirst) {
  Lab lab;
  {
    ThreadPool pool;
    ASSERT_TRUE(pool.Start(1).ok());
    pool.Schedule(lab.Task("A0", /*hold=*/true));
    ASSERT_TRUE(lab.WaitForStarts(1));
    for (int i = 1; i <= 9; ++i) pool.Schedule(lab.Task(absl::StrCat("A", i)));
    pool.Schedule(lab.Task("B0"));
    lab.Release("A0");
    ASSERT_TRUE(lab.WaitForStarts(11));
  }
  EXPECT_EQ(lab.Order(), Concat({Names("A", 0, 9), {"B0"}}));
}

TEST(FairSchedulerTest, SmallTaskOfAnotherTenantStartsRightAfterTheRunningOne) {
  Lab lab;
  FairScheduler scheduler;
  ASSERT_TRUE(scheduler.Start(OneWorker()).ok());
  scheduler.Schedule("A", 1, k256MiB, lab.Task("A0", /*hold=*/true));
  ASSERT_TRUE(lab.WaitForStarts(1));
  for (int i = 1; i <= 9; ++i) {
    scheduler.Schedule("A", 1, k256MiB, lab.Task(absl::StrCat("A", i)));
  }
  scheduler.Schedule("B", 1, 1, lab.Task("B0"));
  EXPECT_EQ(StatsOf(scheduler, "A").queued, 9u);
  EXPECT_EQ(StatsOf(scheduler, "A").running, 1u);
  EXPECT_EQ(StatsOf(scheduler, "B").queued, 1u);
  lab.Release("A0");
  ASSERT_TRUE(lab.WaitForStarts(11));
  // A's 256 MiB needs four grants; B's 4 KiB fits in its first.
  EXPECT_EQ(lab.Order(), Concat({{"A0", "B0"}, Names("A", 1, 9)}));
}

TEST(FairSchedulerTest, CheapTasksGoAheadOfCostlyOnesByDeficit) {
  Lab lab;
  FairScheduler scheduler;
  ASSERT_TRUE(scheduler.Start(OneWorker()).ok());
  scheduler.Schedule("A", 1, k256MiB, lab.Task("A0", /*hold=*/true));
  ASSERT_TRUE(lab.WaitForStarts(1));
  for (int i = 1; i <= 3; ++i) {
    scheduler.Schedule("A", 1, k256MiB, lab.Task(absl::StrCat("A", i)));
  }
  for (int i = 0; i <= 19; ++i) {
    scheduler.Schedule("B", 1, k64MiB / 2, lab.Task(absl::StrCat("B", i)));
  }
  lab.Release("A0");
  ASSERT_TRUE(lab.WaitForStarts(24));
  // Each round grants both 16384: B starts two of its 8192, A one of its
  // 65536 every fourth round; once B is empty A goes on alone.
  EXPECT_EQ(lab.Order(), Concat({{"A0"},
                                 Names("B", 0, 5),
                                 {"A1"},
                                 Names("B", 6, 13),
                                 {"A2"},
                                 Names("B", 14, 19),
                                 {"A3"}}));
}

TEST(FairSchedulerTest,
     CostlierThanEveryGrantStillStartsWhileOthersKeepComing) {
  Lab lab;
  FairScheduler scheduler;
  ASSERT_TRUE(scheduler.Start(OneWorker()).ok());
  // B never runs dry: each of its tasks schedules the next, 200 in all.
  constexpr int kStream = 200;
  struct Stream {
    static void Next(FairScheduler* s, Lab* lab, int i) {
      s->Schedule("B", 1, k64MiB, [s, lab, i] {
        lab->Record(absl::StrCat("B", i));
        if (i == 0) {
          EXPECT_TRUE(lab->Gate("B0")->WaitForNotificationWithTimeout(kHang));
        }
        if (i + 1 < kStream) Next(s, lab, i + 1);
      });
    }
  };
  Stream::Next(&scheduler, &lab, 0);
  ASSERT_TRUE(lab.WaitForStarts(1));
  scheduler.Schedule("C", 1, 50 * k64MiB, lab.Task("C0"));
  lab.Release("B0");
  ASSERT_TRUE(lab.WaitForStarts(kStream + 1));
  // C's deficit grows by one grant per round and B takes one task a round:
  // C starts after B's fiftieth (B0 was running already), not never.
  const std::vector<std::string> order = lab.Order();
  EXPECT_EQ(order[50], "C0");
  EXPECT_EQ(order,
            Concat({Names("B", 0, 49), {"C0"}, Names("B", 50, kStream - 1)}));
}

TEST(FairSchedulerTest, LargestCostStartsAtOnceWhenAlone) {
  Lab lab;
  FairScheduler scheduler;
  ASSERT_TRUE(scheduler.Start(OneWorker()).ok());
  // Rounds that cannot start anything are granted at once, not looped over.
  scheduler.Schedule("A", std::numeric_limits<uint32_t>::max(),
                     std::numeric_limits<uint64_t>::max(), lab.Task("A0"));
  scheduler.Schedule("B", 1, std::numeric_limits<uint64_t>::max() - 1,
                     lab.Task("B0"));
  scheduler.Schedule("C", 1, 0, lab.Task("C0"));  // taken as cost 1
  ASSERT_TRUE(lab.WaitForStarts(3));
  EXPECT_EQ(StatsOf(scheduler, "C").cost_total, 1u);
}

TEST(FairSchedulerTest, TenantHoldsNoMoreThanItsShareWhileAnotherWaits) {
  Lab lab;
  FairScheduler scheduler;
  FairSchedulerOptions options;
  options.workers = 4;
  options.spare_workers = 0;
  options.yield_threads = 0;
  ASSERT_TRUE(scheduler.Start(options).ok());
  for (int i = 0; i <= 11; ++i) {
    scheduler.Schedule("A", 1, 1, lab.Task(absl::StrCat("A", i), true));
  }
  // Alone, A is work-conserving: all four workers run its tasks at once.
  ASSERT_TRUE(lab.WaitForStarts(4));
  EXPECT_EQ(StatsOf(scheduler, "A").running, 4u);
  EXPECT_EQ(StatsOf(scheduler, "A").queued, 8u);
  for (int i = 0; i <= 2; ++i) {
    scheduler.Schedule("B", 1, 1, lab.Task(absl::StrCat("B", i), true));
  }
  EXPECT_EQ(StatsOf(scheduler, "B").running, 0u);
  EXPECT_EQ(StatsOf(scheduler, "B").queued, 3u);

  // Each step releases one running task; the freed worker goes to the next
  // task the rules pick, and the running counts follow (share = 2 each while
  // both are active).
  struct Step {
    const char* release;
    const char* starts;
    uint64_t a_running, b_running;
  };
  const Step steps[] = {
      {"A0", "B0", 3, 1},  // B below its share, A over it
      {"A1", "B1", 2, 2},  //
      {"A2", "A4", 2, 2},  // B at its share: A takes its own back
      {"A3", "A5", 2, 2},  //
      {"B0", "B2", 2, 2},  //
      {"B1", "A6", 3, 1},  // nothing of B waits: A may go over its share
      {"B2", "A7", 4, 0},  // B inactive: A has every worker again
  };
  size_t started = 4;
  for (const Step& step : steps) {
    SCOPED_TRACE(step.release);
    lab.Release(step.release);
    ASSERT_TRUE(lab.WaitForStarts(++started));
    EXPECT_EQ(lab.Order().back(), step.starts);
    EXPECT_EQ(StatsOf(scheduler, "A").running, step.a_running);
    EXPECT_EQ(StatsOf(scheduler, "B").running, step.b_running);
  }
  for (int i = 4; i <= 11; ++i) lab.Release(absl::StrCat("A", i));
  ASSERT_TRUE(lab.WaitForStarts(15));
}

TEST(FairSchedulerTest, SpareWorkerStartsATenantBelowItsShare) {
  Lab lab;
  FairScheduler scheduler;
  FairSchedulerOptions options;
  options.workers = 4;  // and 4 spare slots
  options.yield_threads = 0;
  ASSERT_TRUE(scheduler.Start(options).ok());
  for (int i = 0; i <= 5; ++i) {
    scheduler.Schedule("A", 1, k256MiB, lab.Task(absl::StrCat("A", i), true));
  }
  ASSERT_TRUE(lab.WaitForStarts(4));
  // A holds its whole share: the spare slots are not for it.
  EXPECT_EQ(StatsOf(scheduler, "A").running, 4u);
  EXPECT_EQ(StatsOf(scheduler, "A").queued, 2u);
  // B starts at once on spare slots, while every A task is still held, up to
  // its share (2 of 4 workers).
  scheduler.Schedule("B", 1, 1, lab.Task("B0", true));
  ASSERT_TRUE(lab.WaitForStarts(5));
  scheduler.Schedule("B", 1, 1, lab.Task("B1", true));
  ASSERT_TRUE(lab.WaitForStarts(6));
  scheduler.Schedule("B", 1, 1, lab.Task("B2", true));
  EXPECT_EQ(StatsOf(scheduler, "B").running, 2u);
  EXPECT_EQ(StatsOf(scheduler, "B").queued, 1u);
  // C's share is 1 of 4 now; one spare slot is left for it.
  scheduler.Schedule("C", 1, 1, lab.Task("C0", true));
  ASSERT_TRUE(lab.WaitForStarts(7));
  const std::vector<std::string> order = lab.Order();
  EXPECT_EQ(std::vector<std::string>(order.begin() + 4, order.end()),
            (std::vector<std::string>{"B0", "B1", "C0"}));
  EXPECT_EQ(StatsOf(scheduler, "A").running, 4u);
  EXPECT_EQ(StatsOf(scheduler, "B").queued, 1u);
  for (const std::string& name :
       Concat({Names("A", 0, 5), Names("B", 0, 2), {"C0"}})) {
    lab.Release(name);
  }
  ASSERT_TRUE(lab.WaitForStarts(10));
}

TEST(FairSchedulerTest, WeightThreeAgainstOneStartsThreeToOne) {
  Lab lab;
  FairScheduler scheduler;
  ASSERT_TRUE(scheduler.Start(OneWorker()).ok());
  scheduler.Schedule("A", 3, k64MiB, lab.Task("A0", /*hold=*/true));
  ASSERT_TRUE(lab.WaitForStarts(1));
  for (int i = 1; i <= 30; ++i) {
    scheduler.Schedule("A", 3, k64MiB, lab.Task(absl::StrCat("A", i)));
  }
  for (int i = 0; i <= 9; ++i) {
    scheduler.Schedule("B", 1, k64MiB, lab.Task(absl::StrCat("B", i)));
  }
  lab.Release("A0");
  ASSERT_TRUE(lab.WaitForStarts(41));
  std::vector<std::string> expected = {"A0"};
  for (int round = 0; round < 10; ++round) {
    for (int i = 1; i <= 3; ++i)
      expected.push_back(absl::StrCat("A", 3 * round + i));
    expected.push_back(absl::StrCat("B", round));
  }
  EXPECT_EQ(lab.Order(), expected);
  EXPECT_EQ(StatsOf(scheduler, "A").weight, 3u);
}

TEST(FairSchedulerTest, LatestWeightForAKeyWins) {
  Lab lab;
  FairScheduler scheduler;
  ASSERT_TRUE(scheduler.Start(OneWorker()).ok());
  scheduler.Schedule("H", 1, 1, lab.Task("H0", /*hold=*/true));
  ASSERT_TRUE(lab.WaitForStarts(1));
  // A's tasks came with weight 1, its last with 2: all of A is weighted 2.
  for (int i = 0; i <= 3; ++i) {
    scheduler.Schedule("A", i == 3 ? 2 : 1, k64MiB,
                       lab.Task(absl::StrCat("A", i)));
  }
  for (int i = 0; i <= 1; ++i) {
    scheduler.Schedule("B", 1, k64MiB, lab.Task(absl::StrCat("B", i)));
  }
  EXPECT_EQ(StatsOf(scheduler, "A").weight, 2u);
  lab.Release("H0");
  ASSERT_TRUE(lab.WaitForStarts(7));
  EXPECT_EQ(lab.Order(), (std::vector<std::string>{"H0", "A0", "A1", "B0", "A2",
                                                   "A3", "B1"}));
}

TEST(FairSchedulerTest, YieldHandsTheSlotToAWaitingTenant) {
  Lab lab;
  FairScheduler scheduler;
  FairSchedulerOptions options = OneWorker();
  options.yield_threads = 1;
  ASSERT_TRUE(scheduler.Start(options).ok());
  absl::Notification b_waits;
  std::string key_after;
  scheduler.Schedule("A", 1, k64MiB, [&] {
    lab.Record("A0");
    EXPECT_TRUE(b_waits.WaitForNotificationWithTimeout(kHang));
    FairScheduler::YieldCurrent(k64MiB);  // between two 64 MiB steps
    key_after = std::string(FairScheduler::CurrentKey());  // before Record
    lab.Record("A0-after-yield");
  });
  ASSERT_TRUE(lab.WaitForStarts(1));
  scheduler.Schedule("B", 1, 1, lab.Task("B0"));
  EXPECT_EQ(StatsOf(scheduler, "B").queued, 1u);  // no slot for it
  b_waits.Notify();
  ASSERT_TRUE(lab.WaitForStarts(3));
  EXPECT_EQ(lab.Order(),
            (std::vector<std::string>{"A0", "B0", "A0-after-yield"}));
  EXPECT_EQ(key_after, "A");
  const FairQueueStats a = StatsOf(scheduler, "A");
  EXPECT_EQ(a.yields_total, 1u);
  EXPECT_EQ(a.started_total, 1u);  // a resumed yielder is not a new start
  EXPECT_EQ(a.cost_total, 2 * k64MiB);
}

TEST(FairSchedulerTest, YieldOutsideASchedulerThreadReturnsAtOnce) {
  FairScheduler::YieldCurrent(k64MiB);
  EXPECT_EQ(FairScheduler::CurrentKey(), "");
  // Nor on a thread of another pool.
  Lab lab;
  {
    ThreadPool pool;
    ASSERT_TRUE(pool.Start(1).ok());
    pool.Schedule([&] {
      FairScheduler::YieldCurrent(1);
      lab.Record(std::string(FairScheduler::CurrentKey()));
    });
  }
  EXPECT_EQ(lab.Order(), (std::vector<std::string>{""}));
}

TEST(FairSchedulerTest, YieldWhenAloneReturnsAtOnce) {
  Lab lab;
  FairScheduler scheduler;
  FairSchedulerOptions options = OneWorker();
  options.yield_threads = 1;
  ASSERT_TRUE(scheduler.Start(options).ok());
  absl::Notification more_of_a;
  scheduler.Schedule("A", 1, k64MiB, [&] {
    lab.Record("A0");
    EXPECT_TRUE(more_of_a.WaitForNotificationWithTimeout(kHang));
    FairScheduler::YieldCurrent(k64MiB);  // only A's own task waits
    lab.Record("A0-after-yield");
  });
  ASSERT_TRUE(lab.WaitForStarts(1));
  scheduler.Schedule("A", 1, 1, lab.Task("A1"));
  more_of_a.Notify();
  ASSERT_TRUE(lab.WaitForStarts(3));
  EXPECT_EQ(lab.Order(),
            (std::vector<std::string>{"A0", "A0-after-yield", "A1"}));
  EXPECT_EQ(StatsOf(scheduler, "A").yields_total, 0u);
}

TEST(FairSchedulerTest, YieldKeepsTheSlotWhenTheWaitingTenantHoldsItsShare) {
  Lab lab;
  FairScheduler scheduler;
  FairSchedulerOptions options;
  options.workers = 2;
  options.spare_workers = 0;
  options.yield_threads = 2;
  ASSERT_TRUE(scheduler.Start(options).ok());
  absl::Notification b_waits;
  scheduler.Schedule("A", 1, k64MiB, [&] {
    lab.Record("A0");
    EXPECT_TRUE(b_waits.WaitForNotificationWithTimeout(kHang));
    FairScheduler::YieldCurrent(k64MiB);
    lab.Record("A0-after-yield");
  });
  ASSERT_TRUE(lab.WaitForStarts(1));
  scheduler.Schedule("B", 1, 1, lab.Task("B0", /*hold=*/true));
  ASSERT_TRUE(lab.WaitForStarts(2));
  scheduler.Schedule("B", 1, 1, lab.Task("B1"));
  EXPECT_EQ(StatsOf(scheduler, "B").queued, 1u);
  // B holds its share (1 of 2): A's slot would only go back to A.
  b_waits.Notify();
  ASSERT_TRUE(lab.WaitForStarts(4));
  EXPECT_EQ(lab.Order(),
            (std::vector<std::string>{"A0", "B0", "A0-after-yield", "B1"}));
  EXPECT_EQ(StatsOf(scheduler, "A").yields_total, 0u);
  lab.Release("B0");
}

// The nice value and bulk class each task ran at, one task after the other.
struct Ran {
  int nice = 0;
  bool bulk = false;
};
std::vector<Ran> RunOneByOne(FairScheduler& scheduler,
                             std::initializer_list<uint64_t> costs) {
  std::vector<Ran> ran;
  for (uint64_t cost : costs) {
    absl::Notification done;
    Ran r;
    scheduler.Schedule("t", 1, cost, [&] {
      errno = 0;
      r.nice = ::getpriority(PRIO_PROCESS, 0);
      r.bulk = FairScheduler::CurrentIsBulk();
      done.Notify();
    });
    EXPECT_TRUE(done.WaitForNotificationWithTimeout(kHang));
    ran.push_back(r);
  }
  return ran;
}

// Issue 24: bulk work (cost >= bulk_cost) runs bulk_nice steps below the
// workers' own priority, the rest at it: per task where a thread may raise
// its priority back (as root), else on threads of their own.
TEST(FairSchedulerTest, BulkWorkRunsBelowTheWorkersOwnPriority) {
  errno = 0;
  const int base = ::getpriority(PRIO_PROCESS, 0);
  ASSERT_EQ(errno, 0);
  if (base > 9) GTEST_SKIP() << "the test runs at nice " << base;
  for (BulkPriority mode :
       {BulkPriority::kPerTask, BulkPriority::kFixedThreads}) {
    SCOPED_TRACE(static_cast<int>(mode));
    FairScheduler scheduler;
    FairSchedulerOptions options;
    options.workers = 1;
    options.bulk_cost = 256;
    options.bulk_nice = 10;
    options.bulk_priority = mode;
    absl::Status started = scheduler.Start(options);
    if (mode == BulkPriority::kPerTask && !started.ok()) {
      // An unprivileged run: refused, by name.
      EXPECT_EQ(GetErrorDetail(started).reason(), "NICE_NOT_PERMITTED")
          << started;
      continue;
    }
    ASSERT_TRUE(started.ok()) << started;
    EXPECT_EQ(scheduler.bulk_priority(), mode);
    std::vector<Ran> ran = RunOneByOne(scheduler, {1, 256, 255, 4096, 1});
    ASSERT_EQ(ran.size(), 5u);
    for (size_t i : {0, 2, 4}) {
      EXPECT_EQ(ran[i].nice, base) << i;
      EXPECT_FALSE(ran[i].bulk) << i;
    }
    for (size_t i : {1, 3}) {
      EXPECT_EQ(ran[i].nice, base + 10) << i;
      EXPECT_TRUE(ran[i].bulk) << i;
    }
  }
  // bulk_nice 0: no bulk class.
  FairScheduler scheduler;
  FairSchedulerOptions options;
  options.workers = 1;
  options.bulk_nice = 0;
  ASSERT_TRUE(scheduler.Start(options).ok());
  EXPECT_EQ(scheduler.bulk_priority(), BulkPriority::kAuto);
  for (const Ran& r : RunOneByOne(scheduler, {1, 1u << 20})) {
    EXPECT_EQ(r.nice, base);
    EXPECT_FALSE(r.bulk);
  }
}

// An mrd that may not raise a thread's priority back (the DaemonSet's: no
// CAP_SYS_NICE, RLIMIT_NICE 0): kPerTask is refused by name, and kAuto
// keeps the first `workers` threads for bulk work. Run on a thread that
// drops CAP_SYS_NICE from its effective set (the scheduler's threads
// inherit that), with RLIMIT_NICE 0 for the time of the test.
// Runs `body(base)` on a thread without CAP_SYS_NICE in its effective set,
// with RLIMIT_NICE 0 meanwhile; `base` is the nice value before. False if
// the capability could not be dropped (body did not run).
bool WithoutTheRightToRaisePriority(const std::function<void(int)>& body) {
  struct rlimit saved;
  if (::getrlimit(RLIMIT_NICE, &saved) != 0) return false;
  struct rlimit none = saved;
  none.rlim_cur = 0;
  if (::setrlimit(RLIMIT_NICE, &none) != 0) return false;
  errno = 0;
  const int base = ::getpriority(PRIO_PROCESS, 0);
  bool dropped = false;
  std::thread unprivileged([base, &body, &dropped] {
    __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct caps[2] = {};
    if (::syscall(SYS_capget, &header, caps) != 0) return;
    caps[CAP_TO_INDEX(CAP_SYS_NICE)].effective &= ~CAP_TO_MASK(CAP_SYS_NICE);
    if (::syscall(SYS_capset, &header, caps) != 0) return;
    dropped = true;
    body(base);
  });
  unprivileged.join();
  EXPECT_EQ(::setrlimit(RLIMIT_NICE, &saved), 0);
  return dropped;
}

TEST(FairSchedulerTest, WithoutTheRightToRaisePriorityBulkWorkGetsThreads) {
  const bool dropped = WithoutTheRightToRaisePriority([](int base) {
    {
      FairScheduler scheduler;
      FairSchedulerOptions options;
      options.workers = 1;
      options.bulk_priority = BulkPriority::kPerTask;
      EXPECT_EQ(GetErrorDetail(scheduler.Start(options)).reason(),
                "NICE_NOT_PERMITTED");
    }
    if (base > 9) return;
    FairScheduler scheduler;
    FairSchedulerOptions options;
    options.workers = 1;
    ASSERT_TRUE(scheduler.Start(options).ok());
    EXPECT_EQ(scheduler.bulk_priority(), BulkPriority::kFixedThreads);
    std::vector<Ran> ran = RunOneByOne(scheduler, {1, 4096, 1});
    ASSERT_EQ(ran.size(), 3u);
    EXPECT_EQ(ran[0].nice, base);
    EXPECT_EQ(ran[1].nice, base + 10);
    EXPECT_TRUE(ran[1].bulk);
    EXPECT_EQ(ran[2].nice, base);
  });
  if (!dropped) GTEST_SKIP() << "capget/capset refused here";
}

TEST(FairSchedulerTest, BulkOptionsOutOfRangeAreRefused) {
  for (auto [cost, nice] :
       {std::pair<uint64_t, int>{0, 10}, {256, -1}, {256, 20}}) {
    FairScheduler scheduler;
    FairSchedulerOptions options;
    options.bulk_cost = cost;
    options.bulk_nice = nice;
    absl::Status started = scheduler.Start(options);
    EXPECT_EQ(GetErrorDetail(started).reason(), "BAD_OPTIONS") << started;
  }
}

// `workers` workers, no spare ones, one bulk slot (bulk: 256 or more).
FairSchedulerOptions OneBulkSlot(int workers, int yield_threads) {
  FairSchedulerOptions options;
  options.workers = workers;
  options.spare_workers = 0;
  options.yield_threads = yield_threads;
  options.bulk_nice = 0;
  options.bulk_cost = 256;
  options.bulk_slots = 1;
  return options;
}

// Bulk slots: with one, a second bulk task waits for the first, whoever's,
// while a small task starts on another worker.
TEST(FairSchedulerTest, OneBulkSlotHoldsBulkWorkBackButNotSmallWork) {
  Lab lab;
  FairScheduler scheduler;
  ASSERT_TRUE(scheduler.Start(OneBulkSlot(4, 0)).ok());
  scheduler.Schedule("A", 1, k64MiB, lab.Task("A-bulk0", true));
  ASSERT_TRUE(lab.WaitForStarts(1));
  scheduler.Schedule("A", 1, k64MiB, lab.Task("A-bulk1", true));
  scheduler.Schedule("B", 1, k64MiB, lab.Task("B-bulk0", true));
  scheduler.Schedule("C", 1, 255, lab.Task("C-small0"));  // under bulk_cost
  ASSERT_TRUE(lab.WaitForStarts(2));
  EXPECT_EQ(lab.Order(), (std::vector<std::string>{"A-bulk0", "C-small0"}));
  EXPECT_EQ(StatsOf(scheduler, "A").queued, 1u);
  EXPECT_EQ(StatsOf(scheduler, "B").queued, 1u);
  // The slot freed goes to one bulk task; the other waits for it.
  lab.Release("A-bulk0");
  ASSERT_TRUE(lab.WaitForStarts(3));
  const std::string next = lab.Order()[2];
  ASSERT_TRUE(next == "A-bulk1" || next == "B-bulk0") << next;
  const std::string last = next == "A-bulk1" ? "B-bulk0" : "A-bulk1";
  std::vector<std::string> started = lab.Order();
  EXPECT_EQ(std::find(started.begin(), started.end(), last), started.end());
  lab.Release(next);
  ASSERT_TRUE(lab.WaitForStarts(4));
  EXPECT_EQ(lab.Order().back(), last);
  lab.Release(last);
}

// A parked yielder of bulk work resumes past the bulk slots: the bulk task
// that took its slot may wait for it (as a registration waits for the one
// making the same cache entry), and the two would wait for each other.
TEST(FairSchedulerTest, AParkedBulkYielderResumesPastTheBulkSlots) {
  Lab lab;
  FairScheduler scheduler;
  ASSERT_TRUE(scheduler.Start(OneBulkSlot(2, 1)).ok());
  absl::Notification b_queued;
  absl::Notification a_done;
  scheduler.Schedule("A", 1, k64MiB, [&] {
    lab.Record("A-step1");
    EXPECT_TRUE(b_queued.WaitForNotificationWithTimeout(kHang));
    FairScheduler::YieldCurrent(k64MiB);  // B's bulk task takes the slot
    lab.Record("A-step2");
    a_done.Notify();
  });
  ASSERT_TRUE(lab.WaitForStarts(1));
  scheduler.Schedule("B", 1, k64MiB, [&] {
    lab.Record("B-waits-for-A");
    EXPECT_TRUE(a_done.WaitForNotificationWithTimeout(kHang));
    lab.Record("B-done");
  });
  b_queued.Notify();
  ASSERT_TRUE(lab.WaitForStarts(4));
  // B and the resumed A run side by side: only these orders hold.
  const std::vector<std::string> order = lab.Order();
  EXPECT_EQ(order.front(), "A-step1");
  EXPECT_EQ(order.back(), "B-done");
  EXPECT_EQ(StatsOf(scheduler, "A").yields_total, 1u);
}

TEST(FairSchedulerTest, BulkSlotsBelowMinusOneAreRefused) {
  FairScheduler scheduler;
  FairSchedulerOptions options;
  options.bulk_slots = -2;
  absl::Status started = scheduler.Start(options);
  EXPECT_EQ(GetErrorDetail(started).reason(), "BAD_OPTIONS") << started;
}

TEST(FairSchedulerTest, DestructorRunsEveryQueuedTask) {
  Lab lab;
  {
    FairScheduler scheduler;
    ASSERT_TRUE(scheduler.Start(OneWorker()).ok());
    scheduler.Schedule("H", 1, 1, lab.Task("H0", /*hold=*/true));
    ASSERT_TRUE(lab.WaitForStarts(1));
    for (int i = 0; i < 20; ++i) {
      scheduler.Schedule(absl::StrCat("T", i % 3), 1, k64MiB,
                         lab.Task(absl::StrCat("T", i)));
    }
    // A task scheduled by a task while the destructor waits runs too.
    scheduler.Schedule("C", 1, 1, [&] {
      lab.Record("C0");
      scheduler.Schedule("C", 1, 1, lab.Task("C1"));
    });
    lab.Release("H0");
  }
  EXPECT_EQ(lab.Order().size(), 23u);
}

TEST(FairSchedulerTest, DestructorRunsTasksOfASchedulerNeverStarted) {
  Lab lab;
  {
    FairScheduler scheduler;
    scheduler.Schedule("A", 1, 1, lab.Task("A0"));
    scheduler.Schedule("B", 1, 1, lab.Task("B0"));
  }
  EXPECT_EQ(lab.Order().size(), 2u);
}

TEST(FairSchedulerTest, StatsCountTasksCostsAndWaits) {
  Lab lab;
  FakeClock clock;
  FairScheduler scheduler;
  FairSchedulerOptions options = OneWorker();
  options.clock = &clock;
  ASSERT_TRUE(scheduler.Start(options).ok());
  scheduler.Schedule("A", 1, 5, lab.Task("A0", /*hold=*/true));
  ASSERT_TRUE(lab.WaitForStarts(1));
  scheduler.Schedule("A", 1, 7, lab.Task("A1"));
  scheduler.Schedule("B", 2, 3, lab.Task("B0"));
  scheduler.Schedule("B", 2, 2, lab.Task("B1", /*hold=*/true));
  {
    const FairQueueStats a = StatsOf(scheduler, "A");
    EXPECT_EQ(a.queued, 1u);
    EXPECT_EQ(a.running, 1u);
    EXPECT_EQ(a.started_total, 1u);
    EXPECT_EQ(a.finished_total, 0u);
    EXPECT_EQ(a.cost_total, 5u);
    const FairQueueStats b = StatsOf(scheduler, "B");
    EXPECT_EQ(b.queued, 2u);
    EXPECT_EQ(b.running, 0u);
    EXPECT_EQ(b.weight, 2u);
  }
  clock.Advance(absl::Milliseconds(2));
  lab.Release("A0");
  ASSERT_TRUE(lab.WaitForStarts(4));  // B1 holds the worker now
  EXPECT_EQ(lab.Order(), (std::vector<std::string>{"A0", "A1", "B0", "B1"}));

  const FairQueueStats a = StatsOf(scheduler, "A");
  EXPECT_EQ(a.key, "A");
  EXPECT_EQ(a.queued, 0u);
  EXPECT_EQ(a.running, 0u);
  EXPECT_EQ(a.started_total, 2u);
  EXPECT_EQ(a.finished_total, 2u);
  EXPECT_EQ(a.yields_total, 0u);
  EXPECT_EQ(a.cost_total, 12u);
  // A0 waited 0, A1 2 ms; A0 held the worker 2 ms, A1 no time (the clock
  // stood still).
  EXPECT_DOUBLE_EQ(a.wait_seconds_total, 0.002);
  EXPECT_DOUBLE_EQ(a.service_seconds_total, 0.002);
  EXPECT_EQ(a.wait_bucket_counts,
            (std::vector<uint64_t>{1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2}));

  const FairQueueStats b = StatsOf(scheduler, "B");
  EXPECT_EQ(b.queued, 0u);
  EXPECT_EQ(b.running, 1u);
  EXPECT_EQ(b.started_total, 2u);
  EXPECT_EQ(b.finished_total, 1u);
  EXPECT_EQ(b.cost_total, 5u);
  EXPECT_EQ(b.wait_bucket_counts,
            (std::vector<uint64_t>{0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2}));
  for (const FairQueueStats& s : {a, b}) {
    ASSERT_EQ(s.wait_bucket_counts.size(),
              std::size(kFairWaitBucketsSeconds) + 1);
    for (size_t i = 1; i < s.wait_bucket_counts.size(); ++i) {
      EXPECT_LE(s.wait_bucket_counts[i - 1], s.wait_bucket_counts[i]);
    }
    EXPECT_EQ(s.wait_bucket_counts.back(), s.started_total);
  }
  EXPECT_EQ(a.wait_bucket_counts.back(), a.finished_total);
  lab.Release("B1");
}

TEST(FairSchedulerTest, CurrentKeyNamesTheRunningTasksQueue) {
  Lab lab;
  {
    FairScheduler scheduler;
    ASSERT_TRUE(scheduler.Start(FairSchedulerOptions()).ok());
    scheduler.Schedule("tenant-7", 1, 1, [&] {
      lab.Record(std::string(FairScheduler::CurrentKey()));
    });
  }
  EXPECT_EQ(lab.Order(), (std::vector<std::string>{"tenant-7"}));
}

TEST(FairSchedulerTest, StartRefusesBadOptionsAndASecondStart) {
  const auto refused = [](FairSchedulerOptions options) {
    FairScheduler scheduler;
    return scheduler.Start(options);
  };
  FairSchedulerOptions options;
  options.workers = 0;
  absl::Status status = refused(options);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GetErrorDetail(status).reason(), "BAD_OPTIONS");
  options = FairSchedulerOptions();
  options.spare_workers = -2;
  EXPECT_EQ(refused(options).code(), absl::StatusCode::kInvalidArgument);
  options = FairSchedulerOptions();
  options.quantum = 0;
  EXPECT_EQ(refused(options).code(), absl::StatusCode::kInvalidArgument);
  options = FairSchedulerOptions();
  options.workers = 40000;
  EXPECT_EQ(refused(options).code(), absl::StatusCode::kInvalidArgument);

  FairScheduler scheduler;
  ASSERT_TRUE(scheduler.Start(OneWorker()).ok());
  status = scheduler.Start(OneWorker());
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(GetErrorDetail(status).reason(), "ALREADY_STARTED");
}

// SetProcessNice (mrd's --nice): every thread of the process takes the
// value, the ones that exist and the ones started after.
TEST(ProcessNiceTest, EveryThreadTakesTheValueAndLaterThreadsInheritIt) {
  errno = 0;
  const int base = ::getpriority(PRIO_PROCESS, 0);
  ASSERT_EQ(errno, 0);
  if (base >= 19) GTEST_SKIP() << "already at nice 19";
  absl::Notification started;
  absl::Notification done;
  pid_t existing = 0;
  std::thread before([&] {
    existing = static_cast<pid_t>(::syscall(SYS_gettid));
    started.Notify();
    done.WaitForNotification();
  });
  started.WaitForNotification();
  ASSERT_TRUE(SetProcessNice(base + 1).ok());
  EXPECT_EQ(::getpriority(PRIO_PROCESS, 0), base + 1);
  EXPECT_EQ(::getpriority(PRIO_PROCESS, static_cast<id_t>(existing)), base + 1);
  int inherited = 0;
  std::thread after(
      [&inherited] { inherited = ::getpriority(PRIO_PROCESS, 0); });
  after.join();
  EXPECT_EQ(inherited, base + 1);
  done.Notify();
  before.join();
  // Back, where the process may raise its priority (root here).
  (void)SetProcessNice(base);
}

TEST(ProcessNiceTest, ValuesOutsideMinus20To19AreRefused) {
  for (int nice : {-21, 20}) {
    absl::Status status = SetProcessNice(nice);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(GetErrorDetail(status).reason(), "BAD_NICE") << status;
  }
}

// Without CAP_SYS_NICE and with RLIMIT_NICE 0 (mrd in the DaemonSet without
// SYS_NICE): a higher priority is refused by name and no thread changes.
TEST(ProcessNiceTest, AHigherPriorityWithoutTheRightChangesNoThread) {
  const pid_t main_thread = static_cast<pid_t>(::syscall(SYS_gettid));
  const bool dropped = WithoutTheRightToRaisePriority([main_thread](int base) {
    absl::Status status = SetProcessNice(base - 1);
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(GetErrorDetail(status).reason(), "NICE_NOT_PERMITTED") << status;
    EXPECT_TRUE(absl::StrContains(status.message(), "CAP_SYS_NICE")) << status;
    EXPECT_EQ(::getpriority(PRIO_PROCESS, 0), base);
    EXPECT_EQ(::getpriority(PRIO_PROCESS, static_cast<id_t>(main_thread)),
              base);
  });
  if (!dropped) GTEST_SKIP() << "capget/capset refused here";
}

}  // namespace
}  // namespace mrd
