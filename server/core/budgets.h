// Budgets: the core's server-wide and per-session limits on what clients
// hold — pinned bytes, device registrations, buffers, LAMs and MR objects —
// and the tenant quotas each of them is also charged to (tenants.h). Kept
// apart from the objects they count, so that every refusal of a limit is
// made in one place, with one reason vocabulary (LIMIT_SESSION_*,
// LIMIT_TOTAL_*, and the tenant's LIMIT_TENANT_*).
//
// Warm pins give way before a pinned-bytes limit refuses; that eviction is
// the caller's (it owns the warm pins): TryReservePinned says which limit
// was hit and by how much.
//
// Thread safety: thread-safe. Lock order: a session's `mu` before the
// budgets' own mutex; nothing is called while holding the latter.
#ifndef MRD_SERVER_CORE_BUDGETS_H_
#define MRD_SERVER_CORE_BUDGETS_H_

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/core/session.h"
#include "server/core/tenants.h"

namespace mrd::core {

struct BudgetLimits {
  uint64_t max_session_pinned_bytes = 0;
  uint64_t max_total_pinned_bytes = 0;
  uint64_t max_session_registrations = 0;
  uint64_t max_total_registrations = 0;
  uint64_t max_total_buffers = 0;
  uint64_t max_total_lams = 0;
  uint64_t max_total_mrs = 0;
};

// What is held server-wide right now.
struct BudgetTotals {
  uint64_t pinned_bytes = 0;  // page-rounded, as the limits see them
  uint64_t registrations = 0;
  uint64_t buffers = 0;
  uint64_t lams = 0;
  uint64_t mrs = 0;
};

// The bytes the pages under [address, address + length) count for: what
// pinning them costs against the limits. `length` > 0.
inline uint64_t PageRound(uint64_t page_size, uint64_t address,
                          uint64_t length) {
  const uint64_t first = address / page_size;
  const uint64_t last = (address + length - 1) / page_size;
  return (last - first + 1) * page_size;
}

class Budgets {
 public:
  explicit Budgets(const BudgetLimits& limits) : limits_(limits) {}
  Budgets(const Budgets&) = delete;
  Budgets& operator=(const Budgets&) = delete;

  // Which pinned-bytes limit a refused reservation hit.
  enum class PinLimit { kNone, kSession, kTotal };
  // `bytes` more pinned bytes for `session`, against its limit, the total
  // and its tenant's quota. On refusal `hit` names the limit (a tenant's
  // quota counts as the session's: its own warm pins are what can give
  // way) and `over` by how much it would be exceeded. WSAENOTCONN when the
  // session is closing.
  absl::Status TryReservePinned(Session& session, uint64_t bytes, PinLimit* hit,
                                uint64_t* over)
      ABSL_LOCKS_EXCLUDED(mu_, session.mu);
  // Bytes that are pinned whatever the limits say (a LAM the device failed
  // to release).
  void ForceReservePinned(Session& session, uint64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_, session.mu);
  void UnreservePinned(Session& session, uint64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_, session.mu);

  // One buffer, LAM or MR object (kBuffers, kLams, kMrs) for `session`:
  // against the server's total and the session's tenant's quota.
  absl::Status TakeObject(Session& session, TenantResource resource)
      ABSL_LOCKS_EXCLUDED(mu_);
  void ReturnObjects(Session& session, TenantResource resource, uint64_t n)
      ABSL_LOCKS_EXCLUDED(mu_);

  // One registration made on the device, against the session's limit, the
  // total and the tenant's quota, with the memory maps its pin may cost
  // (Registrations::MapSplitsOf) against the tenant's share of them.
  // WSAENOTCONN when the session is closing.
  // `devices`: the devices it is registered on, each of which holds an MR
  // and a key of it, so that it counts once per device.
  absl::Status ReserveRegistration(Session& session, uint64_t map_splits = 0,
                                   uint32_t devices = 1)
      ABSL_LOCKS_EXCLUDED(mu_, session.mu);
  void UnreserveRegistration(Session& session, uint64_t map_splits = 0,
                             uint32_t devices = 1)
      ABSL_LOCKS_EXCLUDED(mu_, session.mu);
  // UnreserveRegistration and UnreservePinned(pinned_bytes) in one go (a
  // registration that ends).
  void UnreserveRegistrationAndPinned(Session& session, uint64_t map_splits,
                                      uint32_t devices, uint64_t pinned_bytes)
      ABSL_LOCKS_EXCLUDED(mu_, session.mu);

  // Handover: what a session brings from the mrd process it came from
  // (its pinned bytes and device registrations, its buffers), charged to
  // the session, the totals and its tenant whatever the limits say: they
  // refuse new work, never what clients already hold.
  void Adopt(Session& session, uint64_t pinned_bytes, uint64_t registrations,
             uint64_t buffers, uint64_t map_splits = 0)
      ABSL_LOCKS_EXCLUDED(mu_, session.mu);
  // The same for `n` objects of `resource` (kLams, kMrs, kBuffers): what
  // TakeObject would have taken, whatever the limits say.
  void AdoptObjects(Session& session, TenantResource resource, uint64_t n)
      ABSL_LOCKS_EXCLUDED(mu_);

  BudgetTotals Totals() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The total counter and limit of an object resource.
  // Adds `n` to (or takes it from, never below 0) the total of `resource`.
  void ChangeObjectTotal(TenantResource resource, uint64_t n, bool add)
      ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t* ObjectTotalLocked(TenantResource resource, uint64_t* limit)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const BudgetLimits limits_;
  mutable absl::Mutex mu_;
  BudgetTotals totals_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mrd::core

#endif  // MRD_SERVER_CORE_BUDGETS_H_
