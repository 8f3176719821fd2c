// FdBudget and Thread: the open-file limit, per-owner and total charges, the
// refusals' codes and reasons, the real fd count, and thread start failures
// as a Status.

#include "server/common/fd_budget.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "mrd/status.h"
#include "server/common/thread.h"
#include "server/common/thread_pool.h"

namespace mrd {
namespace {

std::unique_ptr<FdBudget> MakeBudget(uint64_t limit, uint64_t reserve,
                                     uint64_t per_owner) {
  FdBudgetOptions o;
  o.limit = limit;
  o.reserve = reserve;
  o.per_owner = per_owner;
  auto b = FdBudget::Create(o);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

TEST(FdBudgetTest, DefaultsAtTheCommonLimit) {
  EXPECT_EQ(FdBudget::DefaultReserve(1024), 256u);
  EXPECT_EQ(FdBudget::DefaultReserve(1 << 20), (1u << 20) / 8);
  EXPECT_EQ(FdBudget::DefaultReserve(256), 192u);  // at most 3/4
  auto b = MakeBudget(1024, 0, 0);
  ASSERT_NE(b, nullptr);
  FdBudgetStats s = b->Stats();
  EXPECT_EQ(s.limit, 1024u);
  EXPECT_EQ(s.reserve, 256u);
  EXPECT_EQ(s.budget, 768u);
  EXPECT_EQ(s.per_owner, 192u);  // a quarter of the budget
  auto big = MakeBudget(uint64_t{1} << 20, 0, 0);
  EXPECT_EQ(big->Stats().per_owner, 4096u);  // the per-session buffer cap
}

TEST(FdBudgetTest, ReserveMustBeBelowTheLimit) {
  FdBudgetOptions o;
  o.limit = 100;
  o.reserve = 100;
  auto b = FdBudget::Create(o);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GetErrorDetail(b.status()).reason(), "BAD_FD_BUDGET");
}

TEST(FdBudgetTest, PerOwnerLimitIsRefusedWithItsNameAndValue) {
  auto b = MakeBudget(100, 50, 3);
  std::vector<FdCharge> held;
  for (int i = 0; i < 3; ++i) {
    auto c = b->Charge(7, "a test fd");
    ASSERT_TRUE(c.ok()) << c.status();
    held.push_back(std::move(*c));
  }
  auto refused = b->Charge(7, "a test fd");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetErrorDetail(refused.status()).reason(), "LIMIT_SESSION_FDS");
  EXPECT_EQ(GetErrorDetail(refused.status()).seed_status(),
            ::mrd::STATUS_INSUFFICIENT_RESOURCES);
  EXPECT_TRUE(
      absl::StrContains(refused.status().message(), "--max_session_fds=3"))
      << refused.status();
  // Another owner is not affected.
  EXPECT_TRUE(b->Charge(8, "a test fd").ok());
  // Releasing one makes room again.
  held.pop_back();
  EXPECT_TRUE(b->Charge(7, "a test fd").ok());
  EXPECT_EQ(b->Stats().refused_owner_total, 1u);
}

TEST(FdBudgetTest, TotalBudgetIsSharedAndSharedOwnerHasNoPerOwnerLimit) {
  auto b = MakeBudget(20, 10, 4);
  std::vector<FdCharge> held;
  for (uint64_t owner = 1; owner <= 2; ++owner) {
    for (int i = 0; i < 4; ++i) {
      auto c = b->Charge(owner, "x");
      ASSERT_TRUE(c.ok());
      held.push_back(std::move(*c));
    }
  }
  // Owner 0 (fd socket connections) is held to the total only.
  for (int i = 0; i < 2; ++i) {
    auto c = b->Charge(0, "x");
    ASSERT_TRUE(c.ok()) << c.status();
    held.push_back(std::move(*c));
  }
  EXPECT_EQ(b->Stats().charged, 10u);
  for (uint64_t owner : {uint64_t{0}, uint64_t{3}}) {
    auto refused = b->Charge(owner, "an imported memfd");
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(GetErrorDetail(refused.status()).reason(), "LIMIT_TOTAL_FDS");
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "limit 20"));
    EXPECT_TRUE(
        absl::StrContains(refused.status().message(), "--fd_reserve=10"));
  }
  EXPECT_EQ(b->Stats().refused_budget_total, 2u);
  held.clear();
  EXPECT_EQ(b->Stats().charged, 0u);
}

TEST(FdBudgetTest, ChargesMoveAndReleaseOnce) {
  auto b = MakeBudget(20, 10, 4);
  auto c = b->Charge(1, "x");
  ASSERT_TRUE(c.ok());
  FdCharge moved = std::move(*c);
  EXPECT_FALSE(c->held());
  EXPECT_TRUE(moved.held());
  EXPECT_EQ(b->Stats().charged, 1u);
  FdCharge other;
  other = std::move(moved);
  EXPECT_EQ(b->Stats().charged, 1u);
  other.Release();
  other.Release();
  EXPECT_EQ(b->Stats().charged, 0u);
  EXPECT_FALSE(ChargeFd(nullptr, 1, "x")->held());
}

TEST(FdBudgetTest, ShareWithChargeReleasesAfterTheLastOwner) {
  auto b = MakeBudget(20, 10, 4);
  auto c = b->Charge(1, "x");
  ASSERT_TRUE(c.ok());
  std::shared_ptr<int> shared =
      ShareWithCharge(std::make_unique<int>(42), std::move(*c));
  std::shared_ptr<int> copy = shared;
  shared.reset();
  EXPECT_EQ(*copy, 42);
  EXPECT_EQ(b->Stats().charged, 1u);
  copy.reset();
  EXPECT_EQ(b->Stats().charged, 0u);
}

TEST(FdBudgetTest, ConcurrentChargesNeverExceedTheBudget) {
  auto b = MakeBudget(1000, 100, 1000);
  std::atomic<int> granted{0};
  std::vector<Thread> threads;
  for (int t = 0; t < 8; ++t) {
    auto th = Thread::Start("charger", [&, t] {
      std::vector<FdCharge> mine;
      for (int i = 0; i < 500; ++i) {
        auto c = b->Charge(static_cast<uint64_t>(t % 2), "x");
        if (c.ok()) mine.push_back(std::move(*c));
      }
      granted += static_cast<int>(mine.size());
      EXPECT_LE(b->Stats().charged, 900u);
    });
    ASSERT_TRUE(th.ok());
    threads.push_back(std::move(*th));
  }
  for (auto& t : threads) t.Join();
  EXPECT_GE(granted.load(), 900);
  EXPECT_EQ(b->Stats().charged, 0u);
}

TEST(FdBudgetTest, CountOpenFdsSeesNewFds) {
  const int64_t before = CountOpenFds();
  ASSERT_GT(before, 0);
  int fds[2];
  ASSERT_EQ(pipe2(fds, O_CLOEXEC), 0);
  EXPECT_EQ(CountOpenFds(), before + 2);
  close(fds[0]);
  close(fds[1]);
  EXPECT_EQ(CountOpenFds(), before);
}

TEST(FdBudgetTest, SampleFindsTheReserveLowWhenLessThanHalfIsLeft) {
  std::vector<int> pipes(20);
  for (size_t i = 0; i < pipes.size(); i += 2) {
    ASSERT_EQ(pipe2(&pipes[i], O_CLOEXEC), 0);
  }
  // Limits just above what is open now: 4 fds left.
  const int64_t open = CountOpenFds();
  const uint64_t limit = static_cast<uint64_t>(open) + 4;
  auto fine = MakeBudget(limit, 8, 0);  // 4 left of 8: half, not less
  ASSERT_NE(fine, nullptr);
  fine->Sample();
  EXPECT_EQ(fine->Stats().open_fds, open);
  EXPECT_EQ(fine->Stats().reserve_low_total, 0u);
  auto tight = MakeBudget(limit, 12, 0);  // 4 left of 12
  ASSERT_NE(tight, nullptr);
  tight->Sample();
  EXPECT_EQ(tight->Stats().reserve_low_total, 1u);
  // Sample's own rate limit.
  tight->Sample(absl::Hours(1));
  EXPECT_EQ(tight->Stats().reserve_low_total, 1u);
  for (int fd : pipes) close(fd);
}

TEST(FdBudgetTest, RaiseNofileLimitRaisesSoftToHard) {
  rlimit rl{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &rl), 0);
  if (rl.rlim_max == RLIM_INFINITY || rl.rlim_max < 64) GTEST_SKIP();
  rlimit lowered = rl;
  lowered.rlim_cur = 64;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lowered), 0);
  auto raised = RaiseNofileLimit();
  ASSERT_TRUE(raised.ok()) << raised.status();
  EXPECT_EQ(raised->soft_before, 64u);
  EXPECT_EQ(raised->soft, rl.rlim_max);
  EXPECT_EQ(raised->hard, rl.rlim_max);
  rlimit now{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &now), 0);
  EXPECT_EQ(now.rlim_cur, rl.rlim_max);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &rl), 0);
}

TEST(ThreadTest, RunsAndJoins) {
  std::atomic<int> ran{0};
  auto t = Thread::Start("test", [&] { ran = 1; });
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->joinable());
  t->Join();
  EXPECT_FALSE(t->joinable());
  EXPECT_EQ(ran.load(), 1);
}

// With RLIMIT_NPROC at 0 (in a child process, as a uid other than root,
// which ignores it), pthread_create fails with EAGAIN: Thread::Start and
// ThreadPool::Start return RESOURCE_EXHAUSTED instead of aborting, which is
// what std::thread did (std::system_error, uncaught).
void StartThreadsWithoutAnyLeft() {
  rlimit none{};
  if (setrlimit(RLIMIT_NPROC, &none) != 0) _exit(5);
  if (geteuid() == 0 && setuid(65534) != 0) _exit(6);
  auto t = Thread::Start("none", [] {});
  if (t.ok()) _exit(2);
  if (t.status().code() != absl::StatusCode::kResourceExhausted) _exit(3);
  ThreadPool pool;
  absl::Status s = pool.Start(2);
  _exit(s.ok() ? 4 : 0);
}

TEST(ThreadTest, NoThreadLeftIsAStatusNotAnAbort) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(StartThreadsWithoutAnyLeft(), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace mrd
