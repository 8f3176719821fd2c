#include "server/core/tenants.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "mrd/status.h"

namespace mrd::core {
namespace {

constexpr absl::string_view kResourceNames[kTenantResourceCount] = {
    "sessions", "buffers", "registrations",   "pinned_bytes",
    "lams",     "mrs",     "peer_connections"};

std::optional<TenantResource> ResourceByName(absl::string_view name) {
  for (int i = 0; i < kTenantResourceCount; ++i) {
    if (kResourceNames[i] == name) return static_cast<TenantResource>(i);
  }
  return std::nullopt;
}

// "4096", "64K", "8G", "1T" (binary multiples).
std::optional<uint64_t> ParseAmount(absl::string_view text) {
  uint64_t shift = 0;
  if (!text.empty()) {
    switch (absl::ascii_toupper(text.back())) {
      case 'K':
        shift = 10;
        break;
      case 'M':
        shift = 20;
        break;
      case 'G':
        shift = 30;
        break;
      case 'T':
        shift = 40;
        break;
      default:
        break;
    }
  }
  if (shift != 0) text.remove_suffix(1);
  uint64_t value = 0;
  if (text.empty() || !absl::SimpleAtoi(text, &value)) return std::nullopt;
  if (shift != 0 && value > (~uint64_t{0} >> shift)) return std::nullopt;
  return value << shift;
}

}  // namespace

absl::string_view TenantResourceName(TenantResource resource) {
  return kResourceNames[static_cast<int>(resource)];
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
      return bad("expected: tenant <name> uids=<uid>[,...] [resource=amount]");
    }
    Named tenant;
    tenant.name = std::string(words[1]);
    if (tenant.name == "anonymous" || absl::StartsWith(tenant.name, "uid:")) {
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
      std::optional<TenantResource> resource = ResourceByName(kv.first);
      if (!resource.has_value()) {
        return bad(absl::StrCat("unknown key '", kv.first, "'"));
      }
      std::optional<uint64_t> amount = ParseAmount(kv.second);
      if (!amount.has_value()) {
        return bad(absl::StrCat("'", kv.second, "' is not an amount"));
      }
      tenant.quota[static_cast<int>(*resource)] = *amount;
    }
    if (tenant.uids.empty()) return bad("a tenant needs uids=");
    named.push_back(std::move(tenant));
  }
  return std::unique_ptr<TenantTable>(
      new TenantTable(defaults, std::move(named)));
}

TenantTable::TenantTable(TenantQuota default_quota, std::vector<Named> named)
    : default_quota_(default_quota) {
  absl::MutexLock lock(&mu_);
  for (const Named& tenant : named) {
    TenantQuota quota = default_quota_;
    for (int i = 0; i < kTenantResourceCount; ++i) {
      if (tenant.quota[i].has_value()) quota[i] = *tenant.quota[i];
    }
    for (uint32_t uid : tenant.uids) {
      named_by_uid_.emplace(uid, std::make_pair(tenant.name, quota));
    }
    GetLocked(tenant.name, quota);
  }
}

std::shared_ptr<Tenant> TenantTable::GetLocked(const std::string& name,
                                               const TenantQuota& quota) {
  auto it = tenants_.find(name);
  if (it != tenants_.end()) return it->second;
  auto tenant = std::make_shared<Tenant>(name, quota);
  tenants_.emplace(name, tenant);
  return tenant;
}

std::shared_ptr<Tenant> TenantTable::Resolve(const Identity& identity) {
  absl::MutexLock lock(&mu_);
  if (!identity.verified) return GetLocked("anonymous", default_quota_);
  auto named = named_by_uid_.find(identity.uid);
  if (named != named_by_uid_.end()) {
    return GetLocked(named->second.first, named->second.second);
  }
  return GetLocked(absl::StrCat("uid:", identity.uid), default_quota_);
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

}  // namespace mrd::core
