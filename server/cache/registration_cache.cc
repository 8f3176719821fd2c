#include "server/cache/registration_cache.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"
#include "server/common/memory.h"

namespace mrd::cache {

absl::StatusOr<AcquireResult> RegistrationCache::Acquire(const CacheKey& key,
                                                         CreateFn create) {
  std::shared_ptr<Entry> entry;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = by_key_.find(key); it != by_key_.end();
         it = by_key_.find(key)) {
      Entry* found = *it;
      if (found->state == State::kReady) {
        // The hit: a ready entry in by_key_ is never being torn down.
        ++found->references;
        ++stats_.hits;
        return AcquireResult{found->id, found->registration, found->references,
                             /*hit=*/true};
      }
      // Being created: wait for it, holding it alive meanwhile.
      entry = by_id_.find(found->id)->second;
      ++entry->waiters;
      mu_.Await(absl::Condition(
          +[](Entry* e) { return e->state != State::kCreating; }, entry.get()));
      --entry->waiters;
      // Its maker's caller gave up: that says nothing about this call,
      // which makes the registration itself.
      if (entry->state == State::kFailed &&
          entry->failure.code() != absl::StatusCode::kCancelled) {
        return entry->failure;
      }
      // Failed, released (or invalidated) while we waited: look again, so
      // that a registration being torn down is never handed out.
      if (entry->removed) continue;
      ++entry->references;
      ++stats_.hits;
      return AcquireResult{entry->id, entry->registration, entry->references,
                           /*hit=*/true};
    }
    entry = std::make_shared<Entry>();
    entry->id = next_id_++;
    entry->key = key;
    by_id_.emplace(entry->id, entry);
    by_key_.insert(entry.get());
    ++creating_;
    ++stats_.misses;
  }

  // The device call runs without the cache lock.
  absl::StatusOr<CachedRegistration> created = create();

  absl::MutexLock lock(&mu_);
  --creating_;
  if (!created.ok()) {
    entry->state = State::kFailed;
    entry->failure = created.status();
    EraseKeyOf(*entry);
    entry->removed = true;
    EraseIdLocked(entry->id);
    return created.status();
  }
  entry->state = State::kReady;
  entry->registration = *created;
  entry->references = 1;
  return AcquireResult{entry->id, entry->registration, 1, /*hit=*/false};
}

RegistrationCache::Entry* RegistrationCache::FindReadyLocked(
    uint64_t entry_id) const {
  auto it = by_id_.find(entry_id);
  if (it == by_id_.end() || it->second->state != State::kReady) return nullptr;
  return it->second.get();
}

void RegistrationCache::EraseIdLocked(uint64_t entry_id) {
  by_id_.erase(entry_id);
  ShrinkIfSparse(by_id_);
}

absl::StatusOr<ReleaseResult> RegistrationCache::Release(uint64_t entry_id) {
  absl::MutexLock lock(&mu_);
  Entry* entry = FindReadyLocked(entry_id);
  if (entry == nullptr) {
    return MrdError(absl::StatusCode::kNotFound, "UNKNOWN_REGISTRATION",
                    absl::StrCat("registration ", entry_id, " does not exist"));
  }
  ReleaseResult result;
  result.key = entry->key;
  result.references = --entry->references;
  if (entry->references == 0) {
    result.released = entry->registration;
    EraseKeyOf(*entry);
    entry->removed = true;
    ++stats_.releases;
    EraseIdLocked(entry_id);  // may destroy the entry: last
  }
  return result;
}

std::optional<AcquireResult> RegistrationCache::TryAcquireReady(
    const CacheKey& key) {
  absl::MutexLock lock(&mu_);
  auto it = by_key_.find(key);
  if (it == by_key_.end() || (*it)->state != State::kReady) {
    return std::nullopt;
  }
  Entry& found = **it;
  ++found.references;
  ++stats_.hits;
  return AcquireResult{found.id, found.registration, found.references,
                       /*hit=*/true};
}

bool RegistrationCache::ReleaseIfNotLast(uint64_t entry_id, uint32_t* left) {
  absl::MutexLock lock(&mu_);
  Entry* entry = FindReadyLocked(entry_id);
  if (entry == nullptr || entry->references < 2) return false;
  *left = --entry->references;
  return true;
}

void RegistrationCache::EraseKeyOf(const Entry& entry) {
  // A restored entry is out of the key set, and its key may name a newer
  // entry by now: only the entry itself is erased.
  if (entry.removed) return;
  auto it = by_key_.find(entry.key);
  if (it != by_key_.end() && *it == &entry) {
    by_key_.erase(it);
    ShrinkIfSparse(by_key_);
  }
}

absl::Status RegistrationCache::Restore(
    uint64_t entry_id, const CacheKey& key,
    const CachedRegistration& registration) {
  absl::MutexLock lock(&mu_);
  if (by_id_.contains(entry_id)) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "ENTRY_IN_USE",
                    absl::StrCat("registration ", entry_id, " exists"));
  }
  auto entry = std::make_shared<Entry>();
  entry->id = entry_id;
  entry->key = key;
  entry->state = State::kReady;
  entry->registration = registration;
  entry->references = 1;
  entry->removed = true;  // by id only: a new Acquire of the key gets anew
  by_id_.emplace(entry_id, std::move(entry));
  if (stats_.releases > 0) --stats_.releases;
  return absl::OkStatus();
}

absl::StatusOr<CachedRegistration> RegistrationCache::Invalidate(
    uint64_t entry_id) {
  absl::MutexLock lock(&mu_);
  Entry* entry = FindReadyLocked(entry_id);
  if (entry == nullptr) {
    return MrdError(absl::StatusCode::kNotFound, "UNKNOWN_REGISTRATION",
                    absl::StrCat("registration ", entry_id, " does not exist"));
  }
  CachedRegistration registration = entry->registration;
  EraseKeyOf(*entry);
  entry->references = 0;
  entry->removed = true;
  ++stats_.invalidations;
  EraseIdLocked(entry_id);
  return registration;
}

uint32_t RegistrationCache::References(uint64_t entry_id) const {
  absl::MutexLock lock(&mu_);
  const Entry* entry = FindReadyLocked(entry_id);
  return entry == nullptr ? 0 : entry->references;
}

std::optional<CacheKey> RegistrationCache::KeyOf(uint64_t entry_id) const {
  absl::MutexLock lock(&mu_);
  const Entry* entry = FindReadyLocked(entry_id);
  if (entry == nullptr) return std::nullopt;
  return entry->key;
}

CacheStats RegistrationCache::Stats() const {
  absl::MutexLock lock(&mu_);
  CacheStats stats = stats_;
  stats.entries = by_id_.size() - creating_;
  return stats;
}

}  // namespace mrd::cache
