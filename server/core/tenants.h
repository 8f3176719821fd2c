// Tenants: who owns a session, and what each owner may hold.
//
// Limits per session and in total do not stop one workload from taking
// everything: it opens more sessions. A tenant is the principal behind a
// session, named by its key: the Kubernetes pod of the caller's process
// ("pod:<pod uid>"), its container outside Kubernetes ("container:<id>"),
// or its uid ("uid:<uid>"), as --tenant_key chooses and the caller's cgroup
// tells (server/common/cgroup_identity.h); lease sessions carry the key of
// the fd session that vouched for them. The tenants file (--tenants_file)
// maps uids and pods to named tenants. Lease sessions that nobody vouched
// for belong to one tenant, "anonymous". Every tenant has a quota per
// resource; by default a share (--tenant_default_percent) of the server's
// total, so that one tenant always leaves room for the others, and a weight:
// its share of mrd's workers when tenants compete for them. Quotas and
// weights can be set while mrd runs (TenantTable::Set, the administrative
// call); lowering a quota below what a tenant holds refuses its new work and
// revokes nothing. The server's total limits stay, and are checked by the
// core as before.
//
// Thread safety: TenantTable and Tenant are thread-safe. A Tenant's mutex is
// a leaf: nothing is called while it is held.
#ifndef MRD_SERVER_CORE_TENANTS_H_
#define MRD_SERVER_CORE_TENANTS_H_

#include <array>
#include <atomic>
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
  // Memory maps (VMA splits) its pins may cost mrd: two for each
  // registration the device pins with mlock (software device: read-only
  // memory), a share of --pin_max_map_splits.
  kMemoryMaps,
  // Names published in the directory (--directory_max_entries is the
  // total): a tenant publishing without end leaves the others room.
  kPublished,
};
inline constexpr int kTenantResourceCount = 9;

// "sessions", "buffers", ... (the tenants file's keys and the metric label).
absl::string_view TenantResourceName(TenantResource resource);
std::optional<TenantResource> TenantResourceByName(absl::string_view name);

using TenantQuota = std::array<uint64_t, kTenantResourceCount>;

// What a session's owner was proven to be.
struct Identity {
  // False for a lease session that nobody vouched for: its caller is anyone
  // who can reach the gRPC socket.
  bool verified = false;
  uint32_t uid = 0;
  uint32_t gid = 0;
  // What the tenant is keyed by: "pod:<uid>", "container:<id>" or
  // "uid:<uid>" (--tenant_key and the caller's cgroup). Empty: "uid:<uid>".
  std::string tenant_key;
  // The Kubernetes pod's "<namespace>/<name>", when known (the kubelet's
  // pod log directory: KubeletPodName); for tenants file entries by name.
  std::string pod_name;
};

// The key of a verified identity: its tenant_key, or "uid:<uid>".
std::string TenantKeyOf(const Identity& identity);

// A tenant's weight when none is set: its share of mrd's workers is
// proportional to it.
inline constexpr uint32_t kDefaultTenantWeight = 1;
inline constexpr uint32_t kMaxTenantWeight = 1000;

class Tenant {
 public:
  Tenant(std::string name, TenantQuota quota,
         uint32_t weight = kDefaultTenantWeight)
      : name_(std::move(name)), quota_(quota), weight_(weight) {}

  const std::string& name() const { return name_; }
  uint64_t quota(TenantResource r) const ABSL_LOCKS_EXCLUDED(mu_);
  TenantQuota quotas() const ABSL_LOCKS_EXCLUDED(mu_);
  // Its share of the workers, relative to the other tenants' (>= 1).
  uint32_t weight() const { return weight_.load(std::memory_order_relaxed); }
  // New quotas and weight (TenantTable::Set): what the tenant holds now is
  // kept even where it exceeds them; only new work is refused.
  void Configure(const TenantQuota& quota, uint32_t weight)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Takes `amount` of `resource`, or refuses with RESOURCE_EXHAUSTED
  // (STATUS_INSUFFICIENT_RESOURCES) and reason "LIMIT_TENANT_<RESOURCE>",
  // naming the tenant, its quota and its use.
  absl::Status Reserve(TenantResource resource, uint64_t amount)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Takes it whatever the quota says (memory a device failed to release).
  void Force(TenantResource resource, uint64_t amount) ABSL_LOCKS_EXCLUDED(mu_);
  void Release(TenantResource resource, uint64_t amount)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A registration's registrations, memory maps and pinned bytes at once.
  void ReleaseRegistration(uint64_t registrations, uint64_t map_splits,
                           uint64_t pinned_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t Used(TenantResource resource) const ABSL_LOCKS_EXCLUDED(mu_);
  // Refusals per resource since start.
  uint64_t Refused(TenantResource resource) const ABSL_LOCKS_EXCLUDED(mu_);

  // Small registrations and deregistrations made on gRPC's threads
  // (Core::TryRegisterMrSmall): at most `limit` of the tenant's at once.
  bool TryEnterInline(int limit) {
    int now = inline_.load(std::memory_order_relaxed);
    while (now < limit) {
      if (inline_.compare_exchange_weak(now, now + 1,
                                        std::memory_order_acquire)) {
        return true;
      }
    }
    return false;
  }
  void LeaveInline() { inline_.fetch_sub(1, std::memory_order_release); }

 private:
  std::atomic<int> inline_{0};
  const std::string name_;
  mutable absl::Mutex mu_;
  TenantQuota quota_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint32_t> weight_;
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

// Settings of one tenant made while mrd runs (the administrative call):
// each set quota replaces the file's or the default one; unset ones stay.
struct TenantSettings {
  std::array<std::optional<uint64_t>, kTenantResourceCount> quota;
  std::optional<uint32_t> weight;
};

class TenantTable {
 public:
  // Parses a tenants file's text. One tenant per line:
  //   tenant <name> [uids=<uid>[,<uid>...]] [pods=<pod uid>[,...]]
  //          [weight=N] [<resource>=<amount>]...
  // resources: sessions, buffers, registrations, pinned_bytes (suffixes
  // K, M, G, T = KiB..TiB), lams, mrs, peer_connections; an unset resource
  // gets the default quota. A tenant names at least one uid or pod; uids=
  // matches callers whose key is their uid (in no container, or
  // --tenant_key=uid), pods= the callers in that pod, named by its UID or
  // as "<namespace>/<name>". '#' starts a comment.
  // Errors: INVALID_ARGUMENT naming the line.
  static absl::StatusOr<std::unique_ptr<TenantTable>> Create(
      TenantTableOptions options, absl::string_view tenants_file_text = "");

  // The tenant of `identity`: the named tenant listing its pod (a "pod:"
  // key, by UID or by identity.pod_name) or its uid (a "uid:" key), else the
  // tenant named by its key, else (unverified) "anonymous". Created on first
  // use.
  std::shared_ptr<Tenant> Resolve(const Identity& identity)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Every tenant seen so far (named ones from the start, and those given
  // settings), sorted by name.
  std::vector<std::shared_ptr<Tenant>> All() const ABSL_LOCKS_EXCLUDED(mu_);

  // The administrative call. Set merges `settings` into the tenant's
  // settings (creating the tenant if nobody of it connected yet, so that a
  // pod's quota can be set before it starts) and applies them at once.
  // Clear drops them: the tenant's quotas and weight are the file's or the
  // defaults again. Errors: INVALID_ARGUMENT BAD_TENANT_NAME (empty, over
  // 256 bytes, not printable ASCII, or "anonymous" with nothing else),
  // BAD_TENANT_WEIGHT (0 or over kMaxTenantWeight); RESOURCE_EXHAUSTED
  // LIMIT_TENANT_SETTINGS past 65,536 tenants with settings; NOT_FOUND
  // NO_TENANT_SETTINGS (Clear of a tenant without any).
  absl::Status Set(const std::string& name, const TenantSettings& settings)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Clear(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  // The settings made at run time, by tenant name (a handover carries
  // them to the next process, which Restores them before it adopts any
  // session).
  std::vector<std::pair<std::string, TenantSettings>> Settings() const
      ABSL_LOCKS_EXCLUDED(mu_);
  void Restore(const std::vector<std::pair<std::string, TenantSettings>>& all)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets the tenants nobody refers to any more — no session, nothing
  // held, no settings, not named by the file — so that a node's churn of
  // pods does not grow the table (and the metrics) forever; a tenant that
  // comes back starts afresh (its refusal counts too). Returns their names.
  std::vector<std::string> Prune() ABSL_LOCKS_EXCLUDED(mu_);
  // Whether the tenant has settings made at run time.
  bool HasSettings(const std::string& name) const ABSL_LOCKS_EXCLUDED(mu_);

  const TenantQuota& default_quota() const { return default_quota_; }
  // Whether the file names pods by "<namespace>/<name>" (then callers' pod
  // names are worth looking up).
  bool names_pods_by_name() const { return !named_by_pod_name_.empty(); }

 private:
  struct Named {
    std::string name;
    std::vector<uint32_t> uids;
    std::vector<std::string> pods;
    std::vector<std::string> pod_names;  // "<namespace>/<name>"
    std::array<std::optional<uint64_t>, kTenantResourceCount> quota;
    std::optional<uint32_t> weight;
  };
  // What the file (or the defaults) give a tenant.
  struct Base {
    TenantQuota quota;
    uint32_t weight = kDefaultTenantWeight;
  };
  TenantTable(TenantQuota default_quota, std::vector<Named> named);
  // The file's settings of `name`, else the defaults.
  Base BaseOf(const std::string& name) const;
  // The base with the run-time settings of `name` on top.
  void EffectiveLocked(const std::string& name, TenantQuota* quota,
                       uint32_t* weight) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::shared_ptr<Tenant> GetLocked(const std::string& name)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const TenantQuota default_quota_;
  // Fixed after construction.
  absl::flat_hash_map<uint32_t, std::string> named_by_uid_;
  absl::flat_hash_map<std::string, std::string> named_by_pod_;
  absl::flat_hash_map<std::string, std::string> named_by_pod_name_;
  absl::flat_hash_map<std::string, Base> named_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Tenant>> tenants_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, TenantSettings> settings_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace mrd::core

#endif  // MRD_SERVER_CORE_TENANTS_H_
