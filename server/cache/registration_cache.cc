#include "server/cache/registration_cache.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/common/status.h"

namespace mrd::cache {

absl::StatusOr<AcquireResult> RegistrationCache::Acquire(const CacheKey& key,
                                                         CreateFn create) {
  std::shared_ptr<Entry> entry;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = by_key_.find(key); it != by_key_.end();
         it = by_key_.find(key)) {
      entry = it->second;
      if (entry->state == State::kCreating) {
        ++entry->waiters;
        Entry* raw = entry.get();
        mu_.Await(absl::Condition(
            +[](Entry* e) { return e->state != State::kCreating; }, raw));
        --entry->waiters;
      }
      if (entry->state == State::kFailed) return entry->failure;
      // Released (or invalidated) while we waited: look again, so that a
      // registration being torn down is never handed out.
      if (entry->removed) continue;
      ++entry->references;
      ++stats_.hits;
      return AcquireResult{entry->id, entry->registration, entry->references,
                           /*hit=*/true};
    }
    entry = std::make_shared<Entry>();
    entry->id = next_id_++;
    entry->key = key;
    by_key_.emplace(key, entry);
    ++stats_.misses;
  }

  // The device call runs without the cache lock.
  absl::StatusOr<CachedRegistration> created = create();

  absl::MutexLock lock(&mu_);
  if (!created.ok()) {
    entry->state = State::kFailed;
    entry->removed = true;
    entry->failure = created.status();
    by_key_.erase(key);
    return created.status();
  }
  entry->state = State::kReady;
  entry->registration = *created;
  entry->references = 1;
  by_id_.emplace(entry->id, entry);
  return AcquireResult{entry->id, entry->registration, 1, /*hit=*/false};
}

absl::StatusOr<ReleaseResult> RegistrationCache::Release(uint64_t entry_id) {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(entry_id);
  if (it == by_id_.end()) {
    return MrdError(absl::StatusCode::kNotFound, "UNKNOWN_REGISTRATION",
                    absl::StrCat("registration ", entry_id, " does not exist"));
  }
  std::shared_ptr<Entry> entry = it->second;
  ReleaseResult result;
  result.key = entry->key;
  result.references = --entry->references;
  if (entry->references == 0) {
    by_id_.erase(it);
    by_key_.erase(entry->key);
    entry->removed = true;
    result.released = entry->registration;
    ++stats_.releases;
  }
  return result;
}

absl::StatusOr<CachedRegistration> RegistrationCache::Invalidate(
    uint64_t entry_id) {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(entry_id);
  if (it == by_id_.end()) {
    return MrdError(absl::StatusCode::kNotFound, "UNKNOWN_REGISTRATION",
                    absl::StrCat("registration ", entry_id, " does not exist"));
  }
  std::shared_ptr<Entry> entry = it->second;
  by_id_.erase(it);
  by_key_.erase(entry->key);
  entry->references = 0;
  entry->removed = true;
  ++stats_.invalidations;
  return entry->registration;
}

uint32_t RegistrationCache::References(uint64_t entry_id) const {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(entry_id);
  return it == by_id_.end() ? 0 : it->second->references;
}

std::optional<CacheKey> RegistrationCache::KeyOf(uint64_t entry_id) const {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(entry_id);
  if (it == by_id_.end()) return std::nullopt;
  return it->second->key;
}

CacheStats RegistrationCache::Stats() const {
  absl::MutexLock lock(&mu_);
  CacheStats stats = stats_;
  stats.entries = by_id_.size();
  return stats;
}

}  // namespace mrd::cache
