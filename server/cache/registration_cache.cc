#include "server/cache/registration_cache.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"

namespace mrd::cache {

RegistrationCache::~RegistrationCache() {
  absl::MutexLock lock(&mu_);
  // No caller can be inside (or waiting in) the cache by now: every entry
  // is in by_id_.
  for (Entry* entry : by_id_) delete entry;
  by_id_.clear();
  by_key_.clear();
}

absl::StatusOr<AcquireResult> RegistrationCache::Acquire(const CacheKey& key,
                                                         CreateFn create) {
  Entry* entry = nullptr;
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
      // Being created: wait for it; `waiters` keeps it alive meanwhile.
      ++found->waiters;
      mu_.Await(absl::Condition(
          +[](Entry* e) { return e->state != State::kCreating; }, found));
      --found->waiters;
      if (found->removed) {
        // Failed, released (or invalidated) while we waited: the last
        // waiter deletes it.
        const bool failed = found->state == State::kFailed;
        absl::Status failure = found->failure;
        if (found->waiters == 0) delete found;
        // Its maker's caller gave up: that says nothing about this call,
        // which makes the registration itself.
        if (failed && failure.code() != absl::StatusCode::kCancelled) {
          return failure;
        }
        // Look again, so that a registration being torn down is never
        // handed out.
        continue;
      }
      ++found->references;
      ++stats_.hits;
      return AcquireResult{found->id, found->registration, found->references,
                           /*hit=*/true};
    }
    auto fresh = std::make_unique<Entry>();
    fresh->id = next_id_++;
    fresh->key = key;
    entry = fresh.release();
    by_id_.insert(entry);
    by_key_.insert(entry);
    ++creating_;
    ++stats_.misses;
  }

  // The device call runs without the cache lock; the entry stays in by_id_
  // (nothing else removes an entry being created) until this thread does.
  absl::StatusOr<CachedRegistration> created = create();

  absl::MutexLock lock(&mu_);
  --creating_;
  if (!created.ok()) {
    entry->state = State::kFailed;
    entry->failure = created.status();
    RemoveLocked(entry);
    return created.status();
  }
  entry->state = State::kReady;
  entry->registration = *std::move(created);
  entry->references = 1;
  return AcquireResult{entry->id, entry->registration, 1, /*hit=*/false};
}

RegistrationCache::Entry* RegistrationCache::FindReadyLocked(
    uint64_t entry_id) const {
  auto it = by_id_.find(entry_id);
  if (it == by_id_.end() || (*it)->state != State::kReady) return nullptr;
  return *it;
}

void RegistrationCache::RemoveLocked(Entry* entry) {
  EraseKeyOf(*entry);
  entry->removed = true;
  by_id_.erase(entry->id);
  if (entry->waiters == 0) delete entry;
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
    result.released = std::move(entry->registration);
    ++stats_.releases;
    RemoveLocked(entry);
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
  auto entry = std::make_unique<Entry>();
  entry->id = entry_id;
  entry->key = key;
  entry->state = State::kReady;
  entry->registration = registration;
  entry->references = 1;
  // Reachable by id only (out of by_key_): a new Acquire of the key makes
  // a new registration. Not `removed`: Release and Invalidate remove it.
  by_id_.insert(entry.release());
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
  CachedRegistration registration = std::move(entry->registration);
  entry->references = 0;
  ++stats_.invalidations;
  RemoveLocked(entry);
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

std::optional<EntryView> RegistrationCache::View(uint64_t entry_id) const {
  absl::MutexLock lock(&mu_);
  const Entry* entry = FindReadyLocked(entry_id);
  if (entry == nullptr) return std::nullopt;
  return EntryView{entry->key, entry->registration.lkey,
                   entry->registration.rkey, entry->references};
}

CacheStats RegistrationCache::Stats() const {
  absl::MutexLock lock(&mu_);
  CacheStats stats = stats_;
  stats.entries = by_id_.size() - creating_;
  return stats;
}

}  // namespace mrd::cache
