// TSan builds only (linked into every executable when MRD_SANITIZE=thread,
// see cmake/MrdOptions.cmake). Debian's libabsl is not
// built with -fsanitize=thread, so ThreadSanitizer cannot see absl::Mutex or
// absl::Notification synchronize anything and reports every access guarded by
// them as a data race. The linker's --wrap (see CMakeLists.txt) sends our
// calls of the entry points below through these wrappers, which tell TSan
// about the happens-before edge each of them creates: acquire after locking
// or waiting, release before unlocking or notifying.
//
// Mutex::Await, LockWhen and CondVar::Wait, with or without a timeout or a
// deadline, release the lock inside the library while they block: their
// wrappers release before the call and acquire after it. A Condition may be
// evaluated by the thread that unlocks; that thread holds the lock then, so its
// reads are ordered too.
//
// The symbol names carry Debian's inline namespace (absl::debian3). If that
// changes, the link fails on an undefined __real_ symbol instead of silently
// doing nothing.
#include <sanitizer/tsan_interface.h>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace {
// Conditions are evaluated inside the uninstrumented library, by the waiter
// or by an unlocking thread, always with the lock held: bracket each
// evaluation with acquire/release so that TSan orders its reads.
struct TsanCondition {
  absl::Mutex* mu;
  const absl::Condition* cond;
};
bool EvalForTsan(TsanCondition* c) {
  __tsan_acquire(c->mu);
  const bool result = c->cond->Eval();
  __tsan_release(c->mu);
  return result;
}
}  // namespace

extern "C" {

void __real__ZN4absl7debian35Mutex4LockEv(absl::Mutex* mu);
void __real__ZN4absl7debian35Mutex6UnlockEv(absl::Mutex* mu);
bool __real__ZN4absl7debian35Mutex7TryLockEv(absl::Mutex* mu);
void __real__ZN4absl7debian35Mutex10ReaderLockEv(absl::Mutex* mu);
void __real__ZN4absl7debian35Mutex12ReaderUnlockEv(absl::Mutex* mu);
void __real__ZN4absl7debian312Notification6NotifyEv(absl::Notification* n);
void __real__ZNK4absl7debian312Notification19WaitForNotificationEv(
    const absl::Notification* n);
bool __real__ZNK4absl7debian312Notification30WaitForNotificationWithTimeoutENS0_8DurationE(
    const absl::Notification* n, absl::Duration timeout);

void __wrap__ZN4absl7debian35Mutex4LockEv(absl::Mutex* mu) {
  __real__ZN4absl7debian35Mutex4LockEv(mu);
  __tsan_acquire(mu);
}

void __wrap__ZN4absl7debian35Mutex6UnlockEv(absl::Mutex* mu) {
  __tsan_release(mu);
  __real__ZN4absl7debian35Mutex6UnlockEv(mu);
}

bool __wrap__ZN4absl7debian35Mutex7TryLockEv(absl::Mutex* mu) {
  const bool locked = __real__ZN4absl7debian35Mutex7TryLockEv(mu);
  if (locked) __tsan_acquire(mu);
  return locked;
}

void __wrap__ZN4absl7debian35Mutex10ReaderLockEv(absl::Mutex* mu) {
  __real__ZN4absl7debian35Mutex10ReaderLockEv(mu);
  __tsan_acquire(mu);
}

void __wrap__ZN4absl7debian35Mutex12ReaderUnlockEv(absl::Mutex* mu) {
  __tsan_release(mu);
  __real__ZN4absl7debian35Mutex12ReaderUnlockEv(mu);
}

void __wrap__ZN4absl7debian312Notification6NotifyEv(absl::Notification* n) {
  __tsan_release(n);
  __real__ZN4absl7debian312Notification6NotifyEv(n);
}

void __wrap__ZNK4absl7debian312Notification19WaitForNotificationEv(
    const absl::Notification* n) {
  __real__ZNK4absl7debian312Notification19WaitForNotificationEv(n);
  __tsan_acquire(const_cast<absl::Notification*>(n));
}

bool __wrap__ZNK4absl7debian312Notification30WaitForNotificationWithTimeoutENS0_8DurationE(
    const absl::Notification* n, absl::Duration timeout) {
  const bool notified =
      __real__ZNK4absl7debian312Notification30WaitForNotificationWithTimeoutENS0_8DurationE(
          n, timeout);
  if (notified) __tsan_acquire(const_cast<absl::Notification*>(n));
  return notified;
}

void __real__ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE(
    absl::Mutex* mu, const absl::Condition& cond);
bool __real__ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE(
    absl::Mutex* mu, const absl::Condition& cond, absl::Duration timeout);
bool __real__ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE(
    absl::Mutex* mu, const absl::Condition& cond, absl::Time deadline);
void __real__ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE(
    absl::Mutex* mu, const absl::Condition& cond);
bool __real__ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE(
    absl::Mutex* mu, const absl::Condition& cond, absl::Duration timeout);
bool __real__ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE(
    absl::Mutex* mu, const absl::Condition& cond, absl::Time deadline);
void __real__ZN4absl7debian37CondVar4WaitEPNS0_5MutexE(absl::CondVar* cv,
                                                       absl::Mutex* mu);
bool __real__ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE(
    absl::CondVar* cv, absl::Mutex* mu, absl::Duration timeout);
bool __real__ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE(
    absl::CondVar* cv, absl::Mutex* mu, absl::Time deadline);

void __wrap__ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE(
    absl::Mutex* mu, const absl::Condition& cond) {
  TsanCondition ctx{mu, &cond};
  const absl::Condition wrapped(&EvalForTsan, &ctx);
  __tsan_release(mu);
  __real__ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE(mu, wrapped);
  __tsan_acquire(mu);
}

bool __wrap__ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE(
    absl::Mutex* mu, const absl::Condition& cond, absl::Duration timeout) {
  TsanCondition ctx{mu, &cond};
  const absl::Condition wrapped(&EvalForTsan, &ctx);
  __tsan_release(mu);
  const bool met =
      __real__ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE(
          mu, wrapped, timeout);
  __tsan_acquire(mu);
  return met;
}

bool __wrap__ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE(
    absl::Mutex* mu, const absl::Condition& cond, absl::Time deadline) {
  TsanCondition ctx{mu, &cond};
  const absl::Condition wrapped(&EvalForTsan, &ctx);
  __tsan_release(mu);
  const bool met =
      __real__ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE(
          mu, wrapped, deadline);
  __tsan_acquire(mu);
  return met;
}

bool __wrap__ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE(
    absl::Mutex* mu, const absl::Condition& cond, absl::Duration timeout) {
  TsanCondition ctx{mu, &cond};
  const absl::Condition wrapped(&EvalForTsan, &ctx);
  const bool met =
      __real__ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE(
          mu, wrapped, timeout);
  __tsan_acquire(mu);
  return met;
}

bool __wrap__ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE(
    absl::Mutex* mu, const absl::Condition& cond, absl::Time deadline) {
  TsanCondition ctx{mu, &cond};
  const absl::Condition wrapped(&EvalForTsan, &ctx);
  const bool met =
      __real__ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE(
          mu, wrapped, deadline);
  __tsan_acquire(mu);
  return met;
}

void __wrap__ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE(
    absl::Mutex* mu, const absl::Condition& cond) {
  TsanCondition ctx{mu, &cond};
  const absl::Condition wrapped(&EvalForTsan, &ctx);
  __real__ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE(mu, wrapped);
  __tsan_acquire(mu);
}

void __wrap__ZN4absl7debian37CondVar4WaitEPNS0_5MutexE(absl::CondVar* cv,
                                                       absl::Mutex* mu) {
  __tsan_release(mu);
  __real__ZN4absl7debian37CondVar4WaitEPNS0_5MutexE(cv, mu);
  __tsan_acquire(mu);
}

bool __wrap__ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE(
    absl::CondVar* cv, absl::Mutex* mu, absl::Duration timeout) {
  __tsan_release(mu);
  const bool timed_out =
      __real__ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE(
          cv, mu, timeout);
  __tsan_acquire(mu);
  return timed_out;
}

bool __wrap__ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE(
    absl::CondVar* cv, absl::Mutex* mu, absl::Time deadline) {
  __tsan_release(mu);
  const bool timed_out =
      __real__ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE(
          cv, mu, deadline);
  __tsan_acquire(mu);
  return timed_out;
}

}  // extern "C"
