// Abseil's waits with a deadline or a timeout hand data written under the
// lock by one thread to the thread that waited. In the TSan build, whose
// Abseil is not instrumented, this holds only because every such entry
// point is wrapped (tests/support/tsan_absl_annotations.cc); a wait left
// unwrapped makes TSan report the plain int below as a data race, and this
// test fail. (Publisher's AwaitWithDeadline was one: mrd's directory tests
// against the TSan mrd failed on it.)
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace mrd {
namespace {

constexpr absl::Duration kLong = absl::Seconds(30);

// `wait` returns once another thread has set the value under `mu`; the
// waiter then reads it under the lock the wait took back.
struct Shared {
  absl::Mutex mu;
  absl::CondVar cv;
  bool waiting ABSL_GUARDED_BY(mu) = false;  // the waiter is in its wait
  bool ready ABSL_GUARDED_BY(mu) = false;
  int value ABSL_GUARDED_BY(mu) = 0;
};

// Writes once the waiter waits (`wait_first`), or at once.
void Produce(Shared* s, bool wait_first) {
  if (wait_first) {
    s->mu.LockWhen(absl::Condition(&s->waiting));
  } else {
    s->mu.Lock();
  }
  s->value = 42;
  s->ready = true;
  s->cv.Signal();
  s->mu.Unlock();
}

TEST(AbslWaitsTest, AwaitWithDeadline) {
  Shared s;
  std::thread producer(Produce, &s, true);
  s.mu.Lock();
  s.waiting = true;
  EXPECT_TRUE(
      s.mu.AwaitWithDeadline(absl::Condition(&s.ready), absl::Now() + kLong));
  EXPECT_EQ(s.value, 42);
  s.mu.Unlock();
  producer.join();
}

TEST(AbslWaitsTest, LockWhenWithTimeoutOrDeadline) {
  for (bool deadline : {false, true}) {
    Shared s;
    std::thread producer(Produce, &s, false);
    EXPECT_TRUE(
        deadline ? s.mu.LockWhenWithDeadline(absl::Condition(&s.ready),
                                             absl::Now() + kLong)
                 : s.mu.LockWhenWithTimeout(absl::Condition(&s.ready), kLong));
    EXPECT_EQ(s.value, 42);
    s.mu.Unlock();
    producer.join();
  }
}

TEST(AbslWaitsTest, CondVarWaitWithDeadline) {
  Shared s;
  std::thread producer(Produce, &s, true);
  {
    absl::MutexLock lock(&s.mu);
    s.waiting = true;
    const absl::Time deadline = absl::Now() + kLong;
    while (!s.ready) {
      if (s.cv.WaitWithDeadline(&s.mu, deadline)) break;
    }
    EXPECT_TRUE(s.ready);
    EXPECT_EQ(s.value, 42);
  }
  producer.join();
}

}  // namespace
}  // namespace mrd
