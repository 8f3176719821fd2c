#include "server/core/budgets.h"

#include <algorithm>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "mrd/status.h"
#include "server/common/log.h"

namespace mrd::core {
namespace {

absl::Status Closing() {
  return SeedError(WSAENOTCONN, "SESSION_NOT_CONNECTED",
                   "the session is closing");
}

}  // namespace

absl::Status Budgets::TryReservePinned(Session& session, uint64_t bytes,
                                       PinLimit* hit, uint64_t* over) {
  *hit = PinLimit::kNone;
  *over = 0;
  absl::MutexLock session_lock(&session.mu);
  if (session.closing) return Closing();
  const uint64_t session_limit = limits_.max_session_pinned_bytes;
  if (session.pinned_bytes + bytes > session_limit) {
    *hit = PinLimit::kSession;
    *over = session.pinned_bytes + bytes - session_limit;
    return SeedError(STATUS_INSUFFICIENT_RESOURCES,
                     "LIMIT_SESSION_PINNED_BYTES",
                     absl::StrCat("pinning ", bytes,
                                  " more bytes would exceed the "
                                  "session's limit of ",
                                  session_limit, " (", session.pinned_bytes,
                                  " pinned now)"));
  }
  absl::MutexLock lock(&mu_);
  const uint64_t total_limit = limits_.max_total_pinned_bytes;
  if (totals_.pinned_bytes + bytes > total_limit) {
    *hit = PinLimit::kTotal;
    *over = totals_.pinned_bytes + bytes - total_limit;
    return SeedError(
        STATUS_INSUFFICIENT_RESOURCES, "LIMIT_TOTAL_PINNED_BYTES",
        absl::StrCat("pinning ", bytes,
                     " more bytes would exceed the "
                     "server's limit of ",
                     total_limit, " (", totals_.pinned_bytes, " pinned now)"));
  }
  Tenant& tenant = *session.tenant();
  if (absl::Status status = tenant.Reserve(TenantResource::kPinnedBytes, bytes);
      !status.ok()) {
    *hit = PinLimit::kSession;
    const uint64_t quota = tenant.quota(TenantResource::kPinnedBytes);
    const uint64_t used = tenant.Used(TenantResource::kPinnedBytes);
    *over = used + bytes > quota ? used + bytes - quota : 1;
    return status;
  }
  session.pinned_bytes += bytes;
  totals_.pinned_bytes += bytes;
  return absl::OkStatus();
}

void Budgets::ForceReservePinned(Session& session, uint64_t bytes) {
  session.tenant()->Force(TenantResource::kPinnedBytes, bytes);
  absl::MutexLock session_lock(&session.mu);
  session.pinned_bytes += bytes;
  absl::MutexLock lock(&mu_);
  totals_.pinned_bytes += bytes;
}

void Budgets::UnreservePinned(Session& session, uint64_t bytes) {
  absl::MutexLock session_lock(&session.mu);
  bytes = std::min(bytes, session.pinned_bytes);
  session.pinned_bytes -= bytes;
  session.tenant()->Release(TenantResource::kPinnedBytes, bytes);
  absl::MutexLock lock(&mu_);
  totals_.pinned_bytes -= std::min(bytes, totals_.pinned_bytes);
}

uint64_t* Budgets::ObjectTotalLocked(TenantResource resource, uint64_t* limit) {
  switch (resource) {
    case TenantResource::kBuffers:
      *limit = limits_.max_total_buffers;
      return &totals_.buffers;
    case TenantResource::kLams:
      *limit = limits_.max_total_lams;
      return &totals_.lams;
    case TenantResource::kMrs:
      *limit = limits_.max_total_mrs;
      return &totals_.mrs;
    default:
      MRD_CHECK(false);
      return nullptr;
  }
}

absl::Status Budgets::TakeObject(Session& session, TenantResource resource) {
  absl::MutexLock lock(&mu_);
  uint64_t limit = 0;
  uint64_t* total = ObjectTotalLocked(resource, &limit);
  if (*total >= limit) {
    const std::string name(TenantResourceName(resource));
    return SeedError(
        STATUS_INSUFFICIENT_RESOURCES,
        absl::StrCat("LIMIT_TOTAL_", absl::AsciiStrToUpper(name)),
        absl::StrCat("the server holds its maximum of ", limit, " ", name));
  }
  MRD_RETURN_IF_ERROR(session.tenant()->Reserve(resource, 1));
  ++*total;
  return absl::OkStatus();
}

void Budgets::ReturnObjects(Session& session, TenantResource resource,
                            uint64_t n) {
  if (n == 0) return;
  session.tenant()->Release(resource, n);
  ChangeObjectTotal(resource, n, /*add=*/false);
}

void Budgets::ChangeObjectTotal(TenantResource resource, uint64_t n, bool add) {
  absl::MutexLock lock(&mu_);
  uint64_t limit = 0;
  uint64_t* total = ObjectTotalLocked(resource, &limit);
  *total = add ? *total + n : *total - std::min(n, *total);
}

absl::Status Budgets::ReserveRegistration(Session& session, uint64_t map_splits,
                                          uint32_t devices) {
  absl::MutexLock session_lock(&session.mu);
  if (session.closing) return Closing();
  if (session.device_registrations + devices >
      limits_.max_session_registrations) {
    return SeedError(
        STATUS_INSUFFICIENT_RESOURCES, "LIMIT_SESSION_REGISTRATIONS",
        absl::StrCat("the session holds its maximum of ",
                     limits_.max_session_registrations, " registrations"));
  }
  absl::MutexLock lock(&mu_);
  if (totals_.registrations + devices > limits_.max_total_registrations) {
    return SeedError(
        STATUS_INSUFFICIENT_RESOURCES, "LIMIT_TOTAL_REGISTRATIONS",
        absl::StrCat("the server holds its maximum of ",
                     limits_.max_total_registrations, " registrations"));
  }
  MRD_RETURN_IF_ERROR(
      session.tenant()->Reserve(TenantResource::kRegistrations, devices));
  if (map_splits != 0) {
    if (absl::Status s =
            session.tenant()->Reserve(TenantResource::kMemoryMaps, map_splits);
        !s.ok()) {
      session.tenant()->Release(TenantResource::kRegistrations, devices);
      return s;
    }
  }
  session.device_registrations += devices;
  totals_.registrations += devices;
  return absl::OkStatus();
}

void Budgets::UnreserveRegistration(Session& session, uint64_t map_splits,
                                    uint32_t devices) {
  absl::MutexLock session_lock(&session.mu);
  if (session.device_registrations > 0) {
    const uint64_t n =
        std::min<uint64_t>(devices, session.device_registrations);
    session.device_registrations -= n;
    session.tenant()->Release(TenantResource::kRegistrations, n);
    session.tenant()->Release(TenantResource::kMemoryMaps, map_splits);
  }
  absl::MutexLock lock(&mu_);
  totals_.registrations -= std::min<uint64_t>(devices, totals_.registrations);
}

void Budgets::UnreserveRegistrationAndPinned(Session& session,
                                             uint64_t map_splits,
                                             uint32_t devices,
                                             uint64_t pinned_bytes) {
  absl::MutexLock session_lock(&session.mu);
  uint64_t registrations = 0;
  if (session.device_registrations > 0) {
    registrations = std::min<uint64_t>(devices, session.device_registrations);
    session.device_registrations -= registrations;
  } else {
    map_splits = 0;  // as UnreserveRegistration: nothing was held
  }
  pinned_bytes = std::min(pinned_bytes, session.pinned_bytes);
  session.pinned_bytes -= pinned_bytes;
  session.tenant()->ReleaseRegistration(registrations, map_splits,
                                        pinned_bytes);
  absl::MutexLock lock(&mu_);
  totals_.registrations -= std::min<uint64_t>(devices, totals_.registrations);
  totals_.pinned_bytes -= std::min(pinned_bytes, totals_.pinned_bytes);
}

void Budgets::Adopt(Session& session, uint64_t pinned_bytes,
                    uint64_t registrations, uint64_t buffers,
                    uint64_t map_splits) {
  Tenant& tenant = *session.tenant();
  tenant.Force(TenantResource::kMemoryMaps, map_splits);
  tenant.Force(TenantResource::kPinnedBytes, pinned_bytes);
  tenant.Force(TenantResource::kRegistrations, registrations);
  tenant.Force(TenantResource::kBuffers, buffers);
  absl::MutexLock session_lock(&session.mu);
  session.pinned_bytes += pinned_bytes;
  session.device_registrations += registrations;
  absl::MutexLock lock(&mu_);
  totals_.pinned_bytes += pinned_bytes;
  totals_.registrations += registrations;
  totals_.buffers += buffers;
}

void Budgets::AdoptObjects(Session& session, TenantResource resource,
                           uint64_t n) {
  if (n == 0) return;
  session.tenant()->Force(resource, n);
  ChangeObjectTotal(resource, n, /*add=*/true);
}

BudgetTotals Budgets::Totals() const {
  absl::MutexLock lock(&mu_);
  return totals_;
}

}  // namespace mrd::core
