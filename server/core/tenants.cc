#include "server/core/tenants.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "mrd/byte_size.h"
#include "mrd/status.h"
#include "server/common/log.h"

namespace mrd::core {
namespace {

constexpr absl::string_view kResourceNames[kTenantResourceCount] = {
    "sessions", "buffers",          "registrations", "pinned_bytes", "lams",
    "mrs",      "peer_connections", "memory_maps",   "published"};

std::optional<TenantResource> ResourceByName(absl::string_view name) {
  for (int i = 0; i < kTenantResourceCount; ++i) {
    if (kResourceNames[i] == name) return static_cast<TenantResource>(i);
  }
  return std::nullopt;
}

// A pod as the tenants file and the cgroup name it: a Kubernetes pod UID
// (8-4-4-4-12 hex digits, any case) or a podman pod id (64 hex digits).
// Returns it in lower case, or nullopt.
std::optional<std::string> CanonicalPod(absl::string_view text) {
  std::string pod = absl::AsciiStrToLower(text);
  auto hex = [](char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
  };
  if (pod.size() == 64) {
    for (char c : pod) {
      if (!hex(c)) return std::nullopt;
    }
    return pod;
  }
  if (pod.size() != 36) return std::nullopt;
  for (size_t i = 0; i < pod.size(); ++i) {
    const bool dash = i == 8 || i == 13 || i == 18 || i == 23;
    if (dash ? pod[i] != '-' : !hex(pod[i])) return std::nullopt;
  }
  return pod;
}

// "<namespace>/<name>": a Kubernetes namespace (a DNS label) and pod name
// (a DNS subdomain): lower-case letters, digits, '-' and '.'.
bool IsPodName(absl::string_view text) {
  const size_t slash = text.find('/');
  if (slash == 0 || slash == absl::string_view::npos ||
      slash + 1 == text.size() || text.size() > 64 + 253) {
    return false;
  }
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (i == slash) continue;
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' ||
          (c == '.' && i > slash))) {
      return false;
    }
  }
  return true;
}

constexpr size_t kMaxTenantNameBytes = 256;
constexpr size_t kMaxTenantSettings = 65536;

}  // namespace

absl::string_view TenantResourceName(TenantResource resource) {
  return kResourceNames[static_cast<int>(resource)];
}

std::optional<TenantResource> TenantResourceByName(absl::string_view name) {
  return ResourceByName(name);
}

std::string TenantKeyOf(const Identity& identity) {
  if (!identity.tenant_key.empty()) return identity.tenant_key;
  return absl::StrCat("uid:", identity.uid);
}

uint64_t Tenant::quota(TenantResource r) const {
  absl::MutexLock lock(&mu_);
  return quota_[static_cast<int>(r)];
}

TenantQuota Tenant::quotas() const {
  absl::MutexLock lock(&mu_);
  return quota_;
}

void Tenant::Configure(const TenantQuota& quota, uint32_t weight) {
  absl::MutexLock lock(&mu_);
  quota_ = quota;
  weight_.store(weight, std::memory_order_relaxed);
}

absl::Status Tenant::Reserve(TenantResource resource, uint64_t amount) {
  const int i = static_cast<int>(resource);
  absl::MutexLock lock(&mu_);
  if (amount > quota_[i] || used_[i] > quota_[i] - amount) {
    ++refused_[i];
    std::string upper = absl::AsciiStrToUpper(kResourceNames[i]);
    return SeedError(
        STATUS_INSUFFICIENT_RESOURCES, absl::StrCat("LIMIT_TENANT_", upper),
        absl::StrCat("tenant ", name_, " holds ", used_[i], " ",
                     kResourceNames[i], " of its quota of ", quota_[i],
                     "; taking ", amount, " more would exceed it"));
  }
  used_[i] += amount;
  return absl::OkStatus();
}

void Tenant::Force(TenantResource resource, uint64_t amount) {
  absl::MutexLock lock(&mu_);
  used_[static_cast<int>(resource)] += amount;
}

void Tenant::Release(TenantResource resource, uint64_t amount) {
  const int i = static_cast<int>(resource);
  absl::MutexLock lock(&mu_);
  used_[i] -= std::min(amount, used_[i]);
}

void Tenant::ReleaseRegistration(uint64_t registrations, uint64_t map_splits,
                                 uint64_t pinned_bytes) {
  absl::MutexLock lock(&mu_);
  auto release = [this](TenantResource resource, uint64_t amount)
                     ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                       const int i = static_cast<int>(resource);
                       used_[i] -= std::min(amount, used_[i]);
                     };
  release(TenantResource::kRegistrations, registrations);
  release(TenantResource::kMemoryMaps, map_splits);
  release(TenantResource::kPinnedBytes, pinned_bytes);
}

uint64_t Tenant::Used(TenantResource resource) const {
  absl::MutexLock lock(&mu_);
  return used_[static_cast<int>(resource)];
}

uint64_t Tenant::Refused(TenantResource resource) const {
  absl::MutexLock lock(&mu_);
  return refused_[static_cast<int>(resource)];
}

TenantCharge& TenantCharge::operator=(TenantCharge&& other) noexcept {
  if (this != &other) {
    Cancel();
    tenant_ = std::move(other.tenant_);
    resource_ = other.resource_;
    amount_ = other.amount_;
    other.tenant_.reset();
  }
  return *this;
}

void TenantCharge::Cancel() {
  if (tenant_ != nullptr) tenant_->Release(resource_, amount_);
  tenant_.reset();
}

absl::StatusOr<std::unique_ptr<TenantTable>> TenantTable::Create(
    TenantTableOptions options, absl::string_view tenants_file_text) {
  if (options.default_percent == 0 || options.default_percent > 100) {
    return absl::InvalidArgumentError(
        absl::StrCat("the default tenant share must be in [1, 100] percent, "
                     "not ",
                     options.default_percent));
  }
  TenantQuota defaults;
  for (int i = 0; i < kTenantResourceCount; ++i) {
    const uint64_t total = options.totals[i];
    // Rounded up, without overflowing on huge totals.
    uint64_t share = total / 100 * options.default_percent +
                     ((total % 100) * options.default_percent + 99) / 100;
    defaults[i] = std::max<uint64_t>(1, std::min(share, total));
  }
  std::vector<Named> named;
  absl::flat_hash_map<uint32_t, std::string> seen_uids;
  absl::flat_hash_map<std::string, std::string> seen_pods;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(tenants_file_text, '\n')) {
    ++line_number;
    line = line.substr(0, line.find('#'));
    std::vector<absl::string_view> words =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (words.empty()) continue;
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(
          absl::StrCat("tenants file line ", line_number, ": ", why));
    };
    if (words[0] != "tenant" || words.size() < 3) {
      return bad(
          "expected: tenant <name> uids=<uid>[,...] | pods=<pod uid>[,...] "
          "[weight=N] [resource=amount]");
    }
    Named tenant;
    tenant.name = std::string(words[1]);
    if (tenant.name == "anonymous" || absl::StartsWith(tenant.name, "uid:") ||
        absl::StartsWith(tenant.name, "pod:") ||
        absl::StartsWith(tenant.name, "container:")) {
      return bad(absl::StrCat("the name '", tenant.name, "' is reserved"));
    }
    for (const Named& other : named) {
      if (other.name == tenant.name) {
        return bad(absl::StrCat("tenant '", tenant.name, "' defined twice"));
      }
    }
    for (size_t w = 2; w < words.size(); ++w) {
      std::pair<absl::string_view, absl::string_view> kv =
          absl::StrSplit(words[w], absl::MaxSplits('=', 1));
      if (kv.first == "uids") {
        for (absl::string_view u : absl::StrSplit(kv.second, ',')) {
          uint32_t uid;
          if (!absl::SimpleAtoi(u, &uid)) {
            return bad(absl::StrCat("'", u, "' is not a numeric uid"));
          }
          auto [it, fresh] = seen_uids.emplace(uid, tenant.name);
          if (!fresh) {
            return bad(absl::StrCat("uid ", uid, " already belongs to tenant ",
                                    it->second));
          }
          tenant.uids.push_back(uid);
        }
        continue;
      }
      if (kv.first == "pods") {
        for (absl::string_view p : absl::StrSplit(kv.second, ',')) {
          if (IsPodName(p)) {
            auto [it, fresh] = seen_pods.emplace(std::string(p), tenant.name);
            if (!fresh) {
              return bad(absl::StrCat("pod ", p, " already belongs to tenant ",
                                      it->second));
            }
            tenant.pod_names.push_back(std::string(p));
            continue;
          }
          std::optional<std::string> pod = CanonicalPod(p);
          if (!pod.has_value()) {
            return bad(absl::StrCat("'", p,
                                    "' is not a pod UID (8-4-4-4-12 hex "
                                    "digits), a podman pod id (64 hex) or "
                                    "<namespace>/<name>"));
          }
          auto [it, fresh] = seen_pods.emplace(*pod, tenant.name);
          if (!fresh) {
            return bad(absl::StrCat("pod ", *pod, " already belongs to tenant ",
                                    it->second));
          }
          tenant.pods.push_back(*pod);
        }
        continue;
      }
      if (kv.first == "weight") {
        uint32_t weight = 0;
        if (!absl::SimpleAtoi(kv.second, &weight) || weight == 0 ||
            weight > kMaxTenantWeight) {
          return bad(absl::StrCat("weight '", kv.second, "' is not in [1, ",
                                  kMaxTenantWeight, "]"));
        }
        tenant.weight = weight;
        continue;
      }
      std::optional<TenantResource> resource = ResourceByName(kv.first);
      if (!resource.has_value()) {
        return bad(absl::StrCat("unknown key '", kv.first, "'"));
      }
      absl::StatusOr<uint64_t> amount = ParseByteSize(kv.second);
      if (!amount.ok()) {
        return bad(absl::StrCat("'", kv.second, "' is not an amount"));
      }
      tenant.quota[static_cast<int>(*resource)] = *amount;
    }
    if (tenant.uids.empty() && tenant.pods.empty() &&
        tenant.pod_names.empty()) {
      return bad("a tenant needs uids= or pods=");
    }
    named.push_back(std::move(tenant));
  }
  return std::unique_ptr<TenantTable>(
      new TenantTable(defaults, std::move(named)));
}

TenantTable::TenantTable(TenantQuota default_quota, std::vector<Named> named)
    : default_quota_(default_quota) {
  for (const Named& tenant : named) {
    Base base;
    base.quota = default_quota_;
    for (int i = 0; i < kTenantResourceCount; ++i) {
      if (tenant.quota[i].has_value()) base.quota[i] = *tenant.quota[i];
    }
    base.weight = tenant.weight.value_or(kDefaultTenantWeight);
    named_.emplace(tenant.name, base);
    for (uint32_t uid : tenant.uids) named_by_uid_.emplace(uid, tenant.name);
    for (const std::string& pod : tenant.pods) {
      named_by_pod_.emplace(pod, tenant.name);
    }
    for (const std::string& pod : tenant.pod_names) {
      named_by_pod_name_.emplace(pod, tenant.name);
    }
  }
  absl::MutexLock lock(&mu_);
  for (const Named& tenant : named) GetLocked(tenant.name);
}

TenantTable::Base TenantTable::BaseOf(const std::string& name) const {
  auto it = named_.find(name);
  if (it != named_.end()) return it->second;
  Base base;
  base.quota = default_quota_;
  return base;
}

void TenantTable::EffectiveLocked(const std::string& name, TenantQuota* quota,
                                  uint32_t* weight) const {
  const Base base = BaseOf(name);
  *quota = base.quota;
  *weight = base.weight;
  auto it = settings_.find(name);
  if (it == settings_.end()) return;
  for (int i = 0; i < kTenantResourceCount; ++i) {
    if (it->second.quota[i].has_value()) (*quota)[i] = *it->second.quota[i];
  }
  if (it->second.weight.has_value()) *weight = *it->second.weight;
}

std::shared_ptr<Tenant> TenantTable::GetLocked(const std::string& name) {
  auto it = tenants_.find(name);
  if (it != tenants_.end()) return it->second;
  TenantQuota quota;
  uint32_t weight;
  EffectiveLocked(name, &quota, &weight);
  auto tenant = std::make_shared<Tenant>(name, quota, weight);
  tenants_.emplace(name, tenant);
  return tenant;
}

std::shared_ptr<Tenant> TenantTable::Resolve(const Identity& identity) {
  if (!identity.verified) {
    absl::MutexLock lock(&mu_);
    return GetLocked("anonymous");
  }
  const std::string key = TenantKeyOf(identity);
  std::string name = key;
  if (absl::StartsWith(key, "pod:")) {
    auto named = named_by_pod_.find(key.substr(4));
    if (named != named_by_pod_.end()) {
      name = named->second;
    } else if (!identity.pod_name.empty()) {
      auto by_name = named_by_pod_name_.find(identity.pod_name);
      if (by_name != named_by_pod_name_.end()) name = by_name->second;
    }
  } else if (absl::StartsWith(key, "uid:")) {
    auto named = named_by_uid_.find(identity.uid);
    if (named != named_by_uid_.end()) name = named->second;
  }
  absl::MutexLock lock(&mu_);
  return GetLocked(name);
}

std::vector<std::shared_ptr<Tenant>> TenantTable::All() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Tenant>> all;
  all.reserve(tenants_.size());
  for (const auto& [name, tenant] : tenants_) all.push_back(tenant);
  std::sort(all.begin(), all.end(),
            [](const auto& a, const auto& b) { return a->name() < b->name(); });
  return all;
}

absl::Status TenantTable::Set(const std::string& name,
                              const TenantSettings& settings) {
  bool printable = !name.empty() && name.size() <= kMaxTenantNameBytes;
  for (char c : name) printable = printable && c > ' ' && c < 0x7f;
  if (!printable) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_TENANT_NAME",
                    absl::StrCat("a tenant name is 1 to ", kMaxTenantNameBytes,
                                 " printable ASCII characters without spaces "
                                 "(pod:<uid>, container:<id>, uid:<uid>, "
                                 "anonymous or a named tenant)"));
  }
  if (settings.weight.has_value() &&
      (*settings.weight == 0 || *settings.weight > kMaxTenantWeight)) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_TENANT_WEIGHT",
                    absl::StrCat("weight ", *settings.weight, " is not in [1, ",
                                 kMaxTenantWeight, "]"));
  }
  absl::MutexLock lock(&mu_);
  auto it = settings_.find(name);
  if (it == settings_.end()) {
    if (settings_.size() >= kMaxTenantSettings) {
      return MrdError(absl::StatusCode::kResourceExhausted,
                      "LIMIT_TENANT_SETTINGS",
                      absl::StrCat(settings_.size(),
                                   " tenants have settings, the most "
                                   "mrd keeps: clear some first"));
    }
    it = settings_.emplace(name, TenantSettings()).first;
  }
  for (int i = 0; i < kTenantResourceCount; ++i) {
    if (settings.quota[i].has_value()) it->second.quota[i] = settings.quota[i];
  }
  if (settings.weight.has_value()) it->second.weight = settings.weight;
  std::shared_ptr<Tenant> tenant = GetLocked(name);
  TenantQuota quota;
  uint32_t weight;
  EffectiveLocked(name, &quota, &weight);
  tenant->Configure(quota, weight);
  return absl::OkStatus();
}

absl::Status TenantTable::Clear(const std::string& name) {
  absl::MutexLock lock(&mu_);
  if (settings_.erase(name) == 0) {
    return MrdError(
        absl::StatusCode::kNotFound, "NO_TENANT_SETTINGS",
        absl::StrCat("tenant ", name, " has no settings made while mrd runs"));
  }
  auto it = tenants_.find(name);
  if (it != tenants_.end()) {
    TenantQuota quota;
    uint32_t weight;
    EffectiveLocked(name, &quota, &weight);
    it->second->Configure(quota, weight);
  }
  return absl::OkStatus();
}

std::vector<std::pair<std::string, TenantSettings>> TenantTable::Settings()
    const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<std::string, TenantSettings>> all(settings_.begin(),
                                                          settings_.end());
  std::sort(all.begin(), all.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  return all;
}

void TenantTable::Restore(
    const std::vector<std::pair<std::string, TenantSettings>>& all) {
  for (const auto& [name, settings] : all) {
    if (absl::Status s = Set(name, settings); !s.ok()) {
      LogWarning("tenant ", name, ": settings not restored: ", s.message());
    }
  }
}

std::vector<std::string> TenantTable::Prune() {
  std::vector<std::string> pruned;
  absl::MutexLock lock(&mu_);
  for (auto it = tenants_.begin(); it != tenants_.end();) {
    const std::shared_ptr<Tenant>& tenant = it->second;
    bool idle = tenant.use_count() == 1 && !named_.contains(it->first) &&
                !settings_.contains(it->first);
    for (int i = 0; idle && i < kTenantResourceCount; ++i) {
      idle = tenant->Used(static_cast<TenantResource>(i)) == 0;
    }
    if (!idle) {
      ++it;
      continue;
    }
    pruned.push_back(it->first);
    tenants_.erase(it++);
  }
  return pruned;
}

bool TenantTable::HasSettings(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  return settings_.contains(name);
}

}  // namespace mrd::core
