#include "server/cache/registration_cache.h"

#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"

namespace mrd::cache {
namespace {

absl::Status UnknownRegistration(uint64_t entry_id) {
  return MrdError(absl::StatusCode::kNotFound, "UNKNOWN_REGISTRATION",
                  absl::StrCat("registration ", entry_id, " does not exist"));
}

}  // namespace

// No caller can be inside (or waiting in) the cache by now: the tables own
// every entry, and the slabs destroy them and the memories' shared pointers.
RegistrationCache::~RegistrationCache() = default;

CacheKey RegistrationCache::KeyOfLocked(const Entry& entry) const {
  const Source& source = sources_.Get(entry.source);
  CacheKey key;
  key.session = source.first;
  key.buffer = source.second;
  key.offset = entry.offset;
  key.length = entry.length;
  key.access = entry.access;
  key.base_address = entry.base_address;
  key.devices = entry.devices;
  return key;
}

std::optional<uint32_t> RegistrationCache::FindKeyLocked(
    const CacheKey& key) const {
  std::optional<uint32_t> source = sources_.Find({key.session, key.buffer});
  if (!source.has_value()) return std::nullopt;
  auto it = by_key_.find(EntryKey{*source, key.access, key.offset, key.length,
                                  key.base_address, key.devices});
  if (it == by_key_.end()) return std::nullopt;
  return *it;
}

void RegistrationCache::SetKeyLocked(Entry& entry, const CacheKey& key) {
  entry.source = sources_.Ref({key.session, key.buffer});
  entry.offset = key.offset;
  entry.length = key.length;
  entry.access = key.access;
  entry.base_address = key.base_address;
  entry.devices = key.devices;
}

absl::StatusOr<AcquireResult> RegistrationCache::Acquire(const CacheKey& key,
                                                         CreateFn create) {
  Entry* entry = nullptr;
  {
    absl::MutexLock lock(&mu_);
    for (std::optional<uint32_t> slot = FindKeyLocked(key); slot.has_value();
         slot = FindKeyLocked(key)) {
      Entry* found = entries_.Get(*slot);
      if (found->state == kReady) {
        // The hit: a ready entry in by_key_ is never being torn down.
        ++found->references;
        ++stats_.hits;
        return AcquireResult{found->id, RegistrationOf(*found),
                             found->references, /*hit=*/true};
      }
      // Being created: wait for it; counted in waiters_, which keeps it
      // alive meanwhile.
      ++waiters_[found];
      found->waited = true;
      mu_.Await(absl::Condition(
          +[](Entry* e) { return e->state != kCreating; }, found));
      auto waiting = waiters_.find(found);
      const bool last = --waiting->second == 0;
      if (last) {
        waiters_.erase(waiting);
        found->waited = false;
      }
      if (found->removed) {
        // Failed, released (or invalidated) while we waited: the last
        // waiter frees it, and its failure.
        absl::Status failure;
        if (found->state == kFailed) {
          auto f = failures_.find(found);
          if (f != failures_.end()) {
            failure = f->second;
            if (last) failures_.erase(f);
          }
        }
        if (last) FreeLocked(found);
        // Its maker's caller gave up: that says nothing about this call,
        // which makes the registration itself.
        if (!failure.ok() && failure.code() != absl::StatusCode::kCancelled) {
          return failure;
        }
        // Look again, so that a registration being torn down is never
        // handed out.
        continue;
      }
      ++found->references;
      ++stats_.hits;
      return AcquireResult{found->id, RegistrationOf(*found), found->references,
                           /*hit=*/true};
    }
    std::optional<uint32_t> slot = entries_.Allocate();
    if (!slot.has_value()) {
      return MrdError(
          absl::StatusCode::kResourceExhausted, "LIMIT_CACHE_ENTRIES",
          absl::StrCat("the registration cache is full (", entries_.size(),
                       " entries of at most ", entries_.capacity(),
                       ") or out of memory; release some first"));
    }
    entry = entries_.Get(*slot);
    entry->id = ids_.Next(*slot);
    SetKeyLocked(*entry, key);
    by_key_.insert(*slot);
    ++entries_in_tables_;
    ++creating_;
    ++stats_.misses;
  }

  // The device call runs without the cache lock; the entry stays in its
  // slot (nothing else removes an entry being created) until this thread
  // takes it out.
  absl::StatusOr<CachedRegistration> created = create();

  absl::MutexLock lock(&mu_);
  --creating_;
  if (!created.ok()) {
    entry->state = kFailed;
    if (entry->waited) failures_.emplace(entry, created.status());
    RemoveLocked(entry);
    return created.status();
  }
  entry->state = kReady;
  SetRegistrationLocked(*entry, *created);
  entry->references = 1;
  return AcquireResult{entry->id, *std::move(created), 1, /*hit=*/false};
}

RegistrationCache::Entry* RegistrationCache::FindLocked(
    uint64_t entry_id) const {
  Entry* entry = entries_.Get(SlabIds::SlotOf(entry_id));
  if (entry != nullptr && entry->id == entry_id && !entry->removed) {
    return entry;
  }
  if (restored_.empty()) return nullptr;
  auto it = restored_.find(entry_id);
  return it == restored_.end() ? nullptr : it->second.get();
}

RegistrationCache::Entry* RegistrationCache::FindReadyLocked(
    uint64_t entry_id) const {
  Entry* entry = FindLocked(entry_id);
  if (entry == nullptr || entry->state != kReady) return nullptr;
  return entry;
}

void RegistrationCache::RemoveLocked(Entry* entry) {
  EraseKeyOf(*entry);
  entry->removed = true;
  --entries_in_tables_;
  if (!entry->waited) FreeLocked(entry);
}

void RegistrationCache::FreeLocked(Entry* entry) {
  if (entry->memory != 0) memories_.Unref(entry->memory - 1);
  sources_.Unref(entry->source);
  if (entry->restored) {
    restored_.erase(entry->id);
  } else {
    entries_.Free(SlabIds::SlotOf(entry->id));
  }
}

CachedRegistration RegistrationCache::RegistrationOf(const Entry& entry) const {
  CachedRegistration registration;
  registration.device_mr = entry.device_mr;
  registration.lkey = entry.lkey;
  registration.rkey = entry.rkey;
  registration.devices = entry.devices;
  registration.pinned_bytes = entry.pinned_bytes;
  if (entry.memory != 0) registration.memory = memories_.Get(entry.memory - 1);
  return registration;
}

void RegistrationCache::SetRegistrationLocked(
    Entry& entry, const CachedRegistration& registration) {
  entry.device_mr = registration.device_mr;
  entry.lkey = registration.lkey;
  entry.rkey = registration.rkey;
  entry.pinned_bytes = registration.pinned_bytes;
  const std::shared_ptr<const void>& memory = registration.memory;
  if (memory == nullptr && memory.use_count() == 0) return;  // none
  entry.memory = memories_.Ref(memory) + 1;
}

CachedRegistration RegistrationCache::TakeRegistrationLocked(Entry& entry) {
  CachedRegistration registration = RegistrationOf(entry);
  if (entry.memory != 0) memories_.Unref(entry.memory - 1);
  entry.memory = 0;
  return registration;
}

absl::StatusOr<ReleaseResult> RegistrationCache::Release(uint64_t entry_id) {
  absl::MutexLock lock(&mu_);
  Entry* entry = FindReadyLocked(entry_id);
  if (entry == nullptr) return UnknownRegistration(entry_id);
  ReleaseResult result;
  result.key = KeyOfLocked(*entry);
  result.references = --entry->references;
  if (entry->references == 0) {
    result.released = TakeRegistrationLocked(*entry);
    ++stats_.releases;
    RemoveLocked(entry);
  }
  return result;
}

std::optional<AcquireResult> RegistrationCache::TryAcquireReady(
    const CacheKey& key) {
  absl::MutexLock lock(&mu_);
  std::optional<uint32_t> slot = FindKeyLocked(key);
  if (!slot.has_value()) return std::nullopt;
  Entry& found = *entries_.Get(*slot);
  if (found.state != kReady) return std::nullopt;
  ++found.references;
  ++stats_.hits;
  return AcquireResult{found.id, RegistrationOf(found), found.references,
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
  if (entry.removed || entry.restored) return;
  const uint32_t slot = SlabIds::SlotOf(entry.id);
  auto it = by_key_.find(slot);  // finds the entry of the same key
  if (it != by_key_.end() && *it == slot) by_key_.erase(it);
}

absl::Status RegistrationCache::Restore(
    uint64_t entry_id, const CacheKey& key,
    const CachedRegistration& registration) {
  absl::MutexLock lock(&mu_);
  if (FindLocked(entry_id) != nullptr) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "ENTRY_IN_USE",
                    absl::StrCat("registration ", entry_id, " exists"));
  }
  if (restored_.size() >= kMaxRestored) {
    return MrdError(absl::StatusCode::kResourceExhausted, "LIMIT_CACHE_ENTRIES",
                    absl::StrCat("registration ", entry_id,
                                 " cannot be restored: ", restored_.size(),
                                 " restored registrations already"));
  }
  auto entry = std::make_unique<Entry>();
  entry->id = entry_id;
  SetKeyLocked(*entry, key);
  entry->state = kReady;
  entry->restored = true;
  SetRegistrationLocked(*entry, registration);
  entry->references = 1;
  // Reachable by id only (out of by_key_): a new Acquire of the key makes
  // a new registration. Not `removed`: Release and Invalidate remove it.
  restored_.emplace(entry_id, std::move(entry));
  ++entries_in_tables_;
  if (stats_.releases > 0) --stats_.releases;
  return absl::OkStatus();
}

absl::Status RegistrationCache::Adopt(uint64_t entry_id, const CacheKey& key,
                                      const CachedRegistration& registration,
                                      uint32_t references, bool restored) {
  if (references == 0 || entry_id == 0) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_ENTRY",
                    absl::StrCat("registration ", entry_id,
                                 " handed over without references"));
  }
  absl::MutexLock lock(&mu_);
  if (FindLocked(entry_id) != nullptr ||
      (!restored && FindKeyLocked(key).has_value())) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "ENTRY_IN_USE",
                    absl::StrCat("registration ", entry_id,
                                 " (or its key) exists already"));
  }
  Entry* entry = nullptr;
  std::unique_ptr<Entry> restored_entry;
  const uint32_t slot = SlabIds::SlotOf(entry_id);
  if (restored) {
    restored_entry.reset(new (std::nothrow) Entry);
    entry = restored_entry.get();
  } else if (entries_.AllocateAt(slot)) {
    entry = entries_.Get(slot);
  }
  if (entry == nullptr) {
    return MrdError(absl::StatusCode::kResourceExhausted, "LIMIT_CACHE_ENTRIES",
                    absl::StrCat("registration ", entry_id,
                                 " cannot be kept: its slot is taken or "
                                 "memory ran out"));
  }
  entry->id = entry_id;
  SetKeyLocked(*entry, key);
  entry->state = kReady;
  SetRegistrationLocked(*entry, registration);
  entry->references = references;
  if (restored) {
    entry->restored = true;
    restored_.emplace(entry_id, std::move(restored_entry));
  } else {
    by_key_.insert(slot);
  }
  ++entries_in_tables_;
  return absl::OkStatus();
}

uint64_t RegistrationCache::NextSequence() const {
  absl::MutexLock lock(&mu_);
  return ids_.next_sequence();
}

void RegistrationCache::ContinueSequence(uint64_t next) {
  absl::MutexLock lock(&mu_);
  ids_.ContinueFrom(next);
}

absl::StatusOr<CachedRegistration> RegistrationCache::Invalidate(
    uint64_t entry_id) {
  absl::MutexLock lock(&mu_);
  Entry* entry = FindReadyLocked(entry_id);
  if (entry == nullptr) return UnknownRegistration(entry_id);
  CachedRegistration registration = TakeRegistrationLocked(*entry);
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
  return KeyOfLocked(*entry);
}

std::optional<EntryView> RegistrationCache::View(uint64_t entry_id) const {
  absl::MutexLock lock(&mu_);
  const Entry* entry = FindReadyLocked(entry_id);
  if (entry == nullptr) return std::nullopt;
  EntryView view;
  view.key = KeyOfLocked(*entry);
  view.device_mr = entry->device_mr;
  view.lkey = entry->lkey;
  view.rkey = entry->rkey;
  view.references = entry->references;
  view.pinned_bytes = entry->pinned_bytes;
  view.restored = entry->restored != 0;
  return view;
}

CacheStats RegistrationCache::Stats() const {
  absl::MutexLock lock(&mu_);
  CacheStats stats = stats_;
  stats.entries = entries_in_tables_ - creating_;
  return stats;
}

}  // namespace mrd::cache
