// Tenants: who owns a session, and what each owner may hold.
//
// Limits per session and in total do not stop one workload from taking
// everything: it opens more sessions. A tenant is the principal behind a
// session: a uid (SO_PEERCRED on the fd socket, or the verified identity a
// lease session was vouched for with), optionally mapped to a named tenant
// by the tenants file (--tenants_file). Lease sessions that nobody vouched
// for belong to one tenant, "anonymous". Every tenant has a quota per
// resource; by default a share (--tenant_default_percent) of the server's
// total, so that one tenant always leaves room for the others. The server's
// total limits stay, and are checked by the core as before.
//
// Thread safety: TenantTable and Tenant are thread-safe. A Tenant's mutex is
// a leaf: nothing is called while it is held.
#ifndef MRD_SERVER_CORE_TENANTS_H_
#define MRD_SERVER_CORE_TENANTS_H_

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace mrd::core {

enum class TenantResource : int {
  kSessions = 0,
  kBuffers,
  kRegistrations,
  kPinnedBytes,
  kLams,
  kMrs,
  kPeerConnections,
};
inline constexpr int kTenantResourceCount = 7;

// "sessions", "buffers", ... (the tenants file's keys and the metric label).
absl::string_view TenantResourceName(TenantResource resource);

using TenantQuota = std::array<uint64_t, kTenantResourceCount>;

// What a session's owner was proven to be.
struct Identity {
  // False for a lease session that nobody vouched for: its caller is anyone
  // who can reach the gRPC socket.
  bool verified = false;
  uint32_t uid = 0;
  uint32_t gid = 0;
};

class Tenant {
 public:
  Tenant(std::string name, TenantQuota quota)
      : name_(std::move(name)), quota_(quota) {}

  const std::string& name() const { return name_; }
  uint64_t quota(TenantResource r) const { return quota_[static_cast<int>(r)]; }

  // Takes `amount` of `resource`, or refuses with RESOURCE_EXHAUSTED
  // (STATUS_INSUFFICIENT_RESOURCES) and reason "LIMIT_TENANT_<RESOURCE>",
  // naming the tenant, its quota and its use.
  absl::Status Reserve(TenantResource resource, uint64_t amount)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Takes it whatever the quota says (memory a device failed to release).
  void Force(TenantResource resource, uint64_t amount) ABSL_LOCKS_EXCLUDED(mu_);
  void Release(TenantResource resource, uint64_t amount)
      ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t Used(TenantResource resource) const ABSL_LOCKS_EXCLUDED(mu_);
  // Refusals per resource since start.
  uint64_t Refused(TenantResource resource) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const std::string name_;
  const TenantQuota quota_;
  mutable absl::Mutex mu_;
  TenantQuota used_ ABSL_GUARDED_BY(mu_) = {};
  TenantQuota refused_ ABSL_GUARDED_BY(mu_) = {};
};

// A reservation that gives itself back unless committed: for code paths
// that take a resource before a device call that may fail.
class TenantCharge {
 public:
  TenantCharge() = default;
  TenantCharge(std::shared_ptr<Tenant> tenant, TenantResource resource,
               uint64_t amount)
      : tenant_(std::move(tenant)), resource_(resource), amount_(amount) {}
  TenantCharge(TenantCharge&& other) noexcept { *this = std::move(other); }
  TenantCharge& operator=(TenantCharge&& other) noexcept;
  TenantCharge(const TenantCharge&) = delete;
  TenantCharge& operator=(const TenantCharge&) = delete;
  ~TenantCharge() { Cancel(); }

  // Keeps the reservation: whoever owns the resource now releases it.
  void Commit() { tenant_.reset(); }
  void Cancel();

 private:
  std::shared_ptr<Tenant> tenant_;
  TenantResource resource_ = TenantResource::kSessions;
  uint64_t amount_ = 0;
};

struct TenantTableOptions {
  // The default quota: this percentage of each total (rounded up, at least
  // 1). 100 = a tenant may use everything, as without tenants.
  uint32_t default_percent = 100;
  // The server's totals the default quotas are shares of.
  TenantQuota totals = {};
};

class TenantTable {
 public:
  // Parses a tenants file's text. One tenant per line:
  //   tenant <name> uids=<uid>[,<uid>...] [<resource>=<amount>]...
  // resources: sessions, buffers, registrations, pinned_bytes (suffixes
  // K, M, G, T = KiB..TiB), lams, mrs, peer_connections; an unset resource
  // gets the default quota. '#' starts a comment. Errors: INVALID_ARGUMENT
  // naming the line.
  static absl::StatusOr<std::unique_ptr<TenantTable>> Create(
      TenantTableOptions options, absl::string_view tenants_file_text = "");

  // The tenant of `identity`: a named tenant listing its uid, else
  // "uid:<uid>", else (unverified) "anonymous". Created on first use.
  std::shared_ptr<Tenant> Resolve(const Identity& identity)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Every tenant seen so far (named ones from the start).
  std::vector<std::shared_ptr<Tenant>> All() const ABSL_LOCKS_EXCLUDED(mu_);

  const TenantQuota& default_quota() const { return default_quota_; }

 private:
  struct Named {
    std::string name;
    std::vector<uint32_t> uids;
    std::array<std::optional<uint64_t>, kTenantResourceCount> quota;
  };
  TenantTable(TenantQuota default_quota, std::vector<Named> named);
  std::shared_ptr<Tenant> GetLocked(const std::string& name,
                                    const TenantQuota& quota)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const TenantQuota default_quota_;
  absl::flat_hash_map<uint32_t, std::pair<std::string, TenantQuota>>
      named_by_uid_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Tenant>> tenants_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace mrd::core

#endif  // MRD_SERVER_CORE_TENANTS_H_
