#include "server/common/fd_budget.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "mrd/status.h"
#include "server/common/log.h"

namespace mrd {
namespace {

// Warnings about the reserve are logged at most this often.
constexpr absl::Duration kWarningInterval = absl::Seconds(10);
// Charges between two samples of the real fd count.
constexpr uint64_t kChargesPerSample = 64;

// fs.nr_open: the largest RLIMIT_NOFILE the kernel accepts.
uint64_t KernelNrOpen() {
  std::ifstream in("/proc/sys/fs/nr_open");
  std::string text;
  uint64_t value = 0;
  if (in >> text && absl::SimpleAtoi(text, &value) && value > 0) return value;
  return 1024 * 1024;
}

std::string LimitText(rlim_t value) {
  return value == RLIM_INFINITY ? std::string("unlimited")
                                : absl::StrCat(value);
}

}  // namespace

absl::StatusOr<NofileLimits> RaiseNofileLimit() {
  struct rlimit rl;
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) {
    const int err = errno;
    return ErrnoError(err, "getrlimit(RLIMIT_NOFILE)", "RLIMIT_FAILED");
  }
  NofileLimits out;
  out.soft_before = rl.rlim_cur == RLIM_INFINITY ? KernelNrOpen() : rl.rlim_cur;
  const rlim_t target =
      rl.rlim_max == RLIM_INFINITY ? KernelNrOpen() : rl.rlim_max;
  if (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= target) {
    out.soft = out.soft_before;
  } else {
    struct rlimit raised = rl;
    raised.rlim_cur = target;
    if (::setrlimit(RLIMIT_NOFILE, &raised) != 0) {
      const int err = errno;
      LogWarning("open-file limit: cannot raise the soft limit ", rl.rlim_cur,
                 " to the hard limit ", LimitText(rl.rlim_max), ": ",
                 std::strerror(err), "; keeping ", rl.rlim_cur);
      out.soft = rl.rlim_cur;
    } else {
      out.soft = target;
    }
  }
  out.hard = rl.rlim_max == RLIM_INFINITY ? KernelNrOpen() : rl.rlim_max;
  LogInfo("open-file limit (RLIMIT_NOFILE): soft ", out.soft_before, " -> ",
          out.soft, ", hard ", LimitText(rl.rlim_max));
  return out;
}

int64_t CountOpenFds() {
  const int dir = ::open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) return -1;
  alignas(8) char buffer[8192];
  int64_t count = 0;
  while (true) {
    const long n = ::syscall(SYS_getdents64, dir, buffer, sizeof(buffer));
    if (n < 0) {
      ::close(dir);
      return -1;
    }
    if (n == 0) break;
    for (long offset = 0; offset < n;) {
      // struct linux_dirent64: d_ino, d_off, d_reclen, d_type, d_name.
      unsigned short reclen;
      std::memcpy(&reclen, buffer + offset + 16, sizeof(reclen));
      const char* name = buffer + offset + 19;
      if (name[0] != '.') ++count;
      if (reclen == 0) break;
      offset += reclen;
    }
  }
  ::close(dir);
  return count > 0 ? count - 1 : 0;  // not the directory's own fd
}

void FdCharge::Release() {
  if (budget_ == nullptr) return;
  std::exchange(budget_, nullptr)->Uncharge(owner_);
}

uint64_t FdBudget::DefaultReserve(uint64_t limit) {
  return std::min(std::max<uint64_t>(256, limit / 8), limit / 4 * 3);
}

absl::StatusOr<std::unique_ptr<FdBudget>> FdBudget::Create(
    const FdBudgetOptions& options) {
  FdBudgetOptions o = options;
  if (o.reserve == 0) o.reserve = DefaultReserve(o.limit);
  if (o.reserve >= o.limit) {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "BAD_FD_BUDGET",
        absl::StrCat("the fd reserve (", o.reserve,
                     ") must be below the open-file limit (", o.limit, ")"));
  }
  return std::unique_ptr<FdBudget>(new FdBudget(o));
}

FdBudget::FdBudget(const FdBudgetOptions& options)
    : limit_(options.limit),
      reserve_(options.reserve),
      budget_(options.limit - options.reserve),
      per_owner_(std::min(budget_,
                          options.per_owner != 0
                              ? options.per_owner
                              : std::min(options.per_owner_cap,
                                         std::max<uint64_t>(1, budget_ / 4)))) {
  LogInfo("fd budget: limit ", limit_, ", reserve ", reserve_,
          " (never charged to clients), budget ", budget_, ", per session ",
          per_owner_);
}

absl::StatusOr<FdCharge> FdBudget::Charge(uint64_t owner,
                                          absl::string_view what) {
  absl::Status refusal;
  {
    absl::MutexLock lock(&mu_);
    uint64_t& mine = per_owner_charged_[owner];
    if (owner != 0 && mine >= per_owner_) {
      ++refused_owner_;
      refusal = SeedError(
          STATUS_INSUFFICIENT_RESOURCES, "LIMIT_SESSION_FDS",
          absl::StrCat("no fd for ", what, ": the session holds ", mine,
                       " fds, its limit (--max_session_fds=", per_owner_, ")"));
    } else if (charged_ >= budget_) {
      ++refused_budget_;
      refusal = SeedError(
          STATUS_INSUFFICIENT_RESOURCES, "LIMIT_TOTAL_FDS",
          absl::StrCat("no fd for ", what, ": clients hold ", charged_,
                       " fds, mrd's budget (open-file limit ", limit_,
                       " minus --fd_reserve=", reserve_, ")"));
    }
    if (refusal.ok()) {
      ++mine;
      ++charged_;
      if (++charges_since_sample_ < kChargesPerSample) {
        return FdCharge(this, owner);
      }
    } else if (mine == 0) {
      per_owner_charged_.erase(owner);
    }
  }
  Sample();
  if (!refusal.ok()) return refusal;
  return FdCharge(this, owner);
}

void FdBudget::Uncharge(uint64_t owner) {
  absl::MutexLock lock(&mu_);
  auto it = per_owner_charged_.find(owner);
  MRD_CHECK(it != per_owner_charged_.end() && it->second > 0 && charged_ > 0);
  if (--it->second == 0) per_owner_charged_.erase(it);
  --charged_;
}

void FdBudget::Sample(absl::Duration min_interval) {
  const absl::Time now = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    if (now - last_sample_ < min_interval) return;
    last_sample_ = now;
    charges_since_sample_ = 0;
  }
  const int64_t open = CountOpenFds();
  absl::MutexLock lock(&mu_);
  open_fds_ = open;
  // Unknown (no fd to count with) counts as the worst case.
  const uint64_t in_use = open < 0 ? limit_ : static_cast<uint64_t>(open);
  const uint64_t left = in_use >= limit_ ? 0 : limit_ - in_use;
  if (left >= reserve_ / 2) return;
  ++reserve_low_;
  if (now - last_warning_ < kWarningInterval) return;
  last_warning_ = now;
  LogError("FD RESERVE LOW: ",
           open < 0 ? std::string("cannot even count open fds")
                    : absl::StrCat(open, " fds open"),
           " of the open-file limit ", limit_, ", only ", left,
           " left of a reserve of ", reserve_, " (clients hold ", charged_,
           " charged fds, budget ", budget_,
           "); gRPC and the peer path fail when none is left. Raise the hard "
           "RLIMIT_NOFILE, or --fd_reserve");
}

FdBudgetStats FdBudget::Stats() const {
  absl::MutexLock lock(&mu_);
  FdBudgetStats s;
  s.limit = limit_;
  s.reserve = reserve_;
  s.budget = budget_;
  s.per_owner = per_owner_;
  s.charged = charged_;
  s.open_fds = open_fds_;
  s.refused_owner_total = refused_owner_;
  s.refused_budget_total = refused_budget_;
  s.reserve_low_total = reserve_low_;
  return s;
}

}  // namespace mrd
