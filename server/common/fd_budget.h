// FdBudget: mrd's file descriptors, shared out so that no client can take the
// ones mrd itself needs.
//
// Every fd a client makes mrd hold (an imported buffer's memfd or file, an fd
// socket connection) is charged here before it is kept, and uncharged when it
// is closed. The budget is the open-file limit (RLIMIT_NOFILE, soft, raised to
// the hard limit at start) minus a reserve that no client can take: gRPC's
// connections and internal fds, the peer path, metrics, logs, the device.
// Charges have an owner (a session id; 0 = shared, e.g. fd socket
// connections) and are refused when the owner would pass its own limit
// (LIMIT_SESSION_FDS) or everyone together the budget (LIMIT_TOTAL_FDS), both
// RESOURCE_EXHAUSTED (STATUS_INSUFFICIENT_RESOURCES). Owner 0 is held to the
// total only.
//
// The process's real open-fd count is sampled (on each refusal, every few
// charges and whenever Sample() is called) and logged loudly, at most every
// 10 s, when less than half of the reserve is left: something uncharged is
// eating it.
//
// Thread safety: every method may be called from any thread. An FdCharge may
// be released on any thread; the FdBudget must outlive every charge.
#ifndef MRD_SERVER_COMMON_FD_BUDGET_H_
#define MRD_SERVER_COMMON_FD_BUDGET_H_

#include <cstdint>
#include <map>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace mrd {

struct NofileLimits {
  uint64_t soft_before = 0;  // the soft limit mrd was started with
  uint64_t soft = 0;         // the soft limit now
  uint64_t hard = 0;
};

// Raises the soft RLIMIT_NOFILE to the hard limit (capped at what the kernel
// accepts, fs.nr_open, when the hard limit is unlimited) and logs both.
absl::StatusOr<NofileLimits> RaiseNofileLimit();

// This process's open fds, counted in /proc/self/fd; -1 if it cannot be
// counted (e.g. no fd left to open the directory with).
int64_t CountOpenFds();

class FdBudget;

// One charged fd. Move-only; releases its charge when destroyed or Release()d.
// A default-constructed charge holds nothing.
class FdCharge {
 public:
  FdCharge() = default;
  ~FdCharge() { Release(); }
  FdCharge(FdCharge&& other) noexcept
      : budget_(std::exchange(other.budget_, nullptr)), owner_(other.owner_) {}
  FdCharge& operator=(FdCharge&& other) noexcept {
    if (this != &other) {
      Release();
      budget_ = std::exchange(other.budget_, nullptr);
      owner_ = other.owner_;
    }
    return *this;
  }
  FdCharge(const FdCharge&) = delete;
  FdCharge& operator=(const FdCharge&) = delete;

  bool held() const { return budget_ != nullptr; }
  void Release();

 private:
  friend class FdBudget;
  FdCharge(FdBudget* budget, uint64_t owner) : budget_(budget), owner_(owner) {}

  FdBudget* budget_ = nullptr;
  uint64_t owner_ = 0;
};

struct FdBudgetOptions {
  uint64_t limit = 1024;  // the open-file limit mrd runs with
  uint64_t reserve = 0;   // 0 = DefaultReserve(limit)
  // fds one owner may hold; 0 = DefaultPerOwner. Never more than the budget.
  uint64_t per_owner = 0;
  // The per-owner default is min(per_owner_cap, budget / 4).
  uint64_t per_owner_cap = 4096;
};

struct FdBudgetStats {
  uint64_t limit = 0;
  uint64_t reserve = 0;
  uint64_t budget = 0;     // limit - reserve: what all charges may hold
  uint64_t per_owner = 0;  // what one session may hold
  uint64_t charged = 0;    // fds charged right now
  int64_t open_fds = -1;   // last sampled real count (-1: never / unknown)
  uint64_t refused_owner_total = 0;   // LIMIT_SESSION_FDS refusals
  uint64_t refused_budget_total = 0;  // LIMIT_TOTAL_FDS refusals
  uint64_t reserve_low_total = 0;     // samples that found the reserve low
};

class FdBudget {
 public:
  // max(256, limit / 8), but at most three quarters of the limit.
  static uint64_t DefaultReserve(uint64_t limit);

  // INVALID_ARGUMENT BAD_FD_BUDGET when the reserve is not below the limit.
  static absl::StatusOr<std::unique_ptr<FdBudget>> Create(
      const FdBudgetOptions& options);

  FdBudget(const FdBudget&) = delete;
  FdBudget& operator=(const FdBudget&) = delete;

  // Charges one fd to `owner` (0 = shared: the total only). `what` names the
  // fd in the refusal ("an imported buffer").
  absl::StatusOr<FdCharge> Charge(uint64_t owner, absl::string_view what)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Counts the real open fds and warns (rate-limited) when the reserve is
  // being eaten. At most once per `min_interval` unless forced.
  void Sample(absl::Duration min_interval = absl::ZeroDuration())
      ABSL_LOCKS_EXCLUDED(mu_);

  FdBudgetStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class FdCharge;
  explicit FdBudget(const FdBudgetOptions& options);
  void Uncharge(uint64_t owner) ABSL_LOCKS_EXCLUDED(mu_);

  const uint64_t limit_;
  const uint64_t reserve_;
  const uint64_t budget_;
  const uint64_t per_owner_;

  mutable absl::Mutex mu_;
  uint64_t charged_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, uint64_t> per_owner_charged_ ABSL_GUARDED_BY(mu_);
  uint64_t charges_since_sample_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t open_fds_ ABSL_GUARDED_BY(mu_) = -1;
  uint64_t refused_owner_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t refused_budget_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reserve_low_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_sample_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time last_warning_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

// Charges one fd to `owner` of `budget`; an empty charge when `budget` is
// null (no budgeting).
inline absl::StatusOr<FdCharge> ChargeFd(FdBudget* budget, uint64_t owner,
                                         absl::string_view what) {
  if (budget == nullptr) return FdCharge();
  return budget->Charge(owner, what);
}

// Shares `object` so that `charge` is released only after the last owner
// has destroyed it (and with it, closed its fd).
template <typename T>
std::shared_ptr<T> ShareWithCharge(std::unique_ptr<T> object, FdCharge charge) {
  struct Holder {
    FdCharge charge;            // destroyed last
    std::unique_ptr<T> object;  // destroyed first: closes the fd
  };
  auto holder = std::make_shared<Holder>();
  holder->charge = std::move(charge);
  holder->object = std::move(object);
  T* raw = holder->object.get();
  return std::shared_ptr<T>(std::move(holder), raw);
}

}  // namespace mrd

#endif  // MRD_SERVER_COMMON_FD_BUDGET_H_
