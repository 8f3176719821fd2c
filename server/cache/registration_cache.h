// RegistrationCache: the reference-counted registration cache of
// WSPRegisterRdmaMemory (W5) applied to RegisterMr. The same session, file,
// range, access and base address registered again returns the same entry with
// one more reference; each Release takes one away; the last one hands the
// entry back to the caller, who deregisters it before replying.
//
// The cache never calls the device: the caller passes a `create` function that
// performs the registration. Creation runs WITHOUT the cache lock held; a
// concurrent Acquire of the same key waits for that creation and then shares
// its result (or its failure). An entry whose last reference is gone is
// removed from the key map before Release returns, so no later Acquire can
// ever be handed a registration that is being torn down: it gets a fresh one,
// with fresh keys.
//
// Thread-safe. Every operation is O(log n) in the number of entries.
#ifndef MRD_SERVER_CACHE_REGISTRATION_CACHE_H_
#define MRD_SERVER_CACHE_REGISTRATION_CACHE_H_

#include <compare>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace mrd::cache {

// What identifies a registration: memfd memory is named by its file identity
// (st_dev, st_ino) and range, never by a virtual address of the client.
struct CacheKey {
  uint64_t session = 0;
  // The session-visible buffer: a registration keeps that buffer's mapping
  // in use, so two imports of one file never share a registration.
  uint64_t buffer = 0;
  uint64_t file_device = 0;
  uint64_t file_inode = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint32_t access = 0;        // device::AccessBits
  uint64_t base_address = 0;  // the region's address on the wire
  auto operator<=>(const CacheKey&) const = default;
};

// The device-side result of a registration, opaque to the cache.
struct CachedRegistration {
  uint64_t device_mr = 0;
  uint32_t lkey = 0;
  uint32_t rkey = 0;
  uint64_t buffer = 0;       // the session buffer it was made through
  uint64_t pinned_bytes = 0; // what it counts against limits
};

struct AcquireResult {
  uint64_t entry = 0;  // registration id, unique for the cache's lifetime
  CachedRegistration registration;
  uint32_t references = 0;  // after this Acquire
  bool hit = false;
};

struct ReleaseResult {
  uint32_t references = 0;  // left
  // Set when that was the last reference: the caller must deregister it.
  std::optional<CachedRegistration> released;
  CacheKey key;
};

struct CacheStats {
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t releases = 0;       // last references dropped
  uint64_t invalidations = 0;  // entries dropped by Invalidate*
  uint64_t entries = 0;
};

class RegistrationCache {
 public:
  using CreateFn = absl::FunctionRef<absl::StatusOr<CachedRegistration>()>;

  RegistrationCache() = default;
  RegistrationCache(const RegistrationCache&) = delete;
  RegistrationCache& operator=(const RegistrationCache&) = delete;

  // Returns the entry for `key`, creating it with `create` on a miss.
  // Errors: whatever `create` returned (also to concurrent waiters).
  absl::StatusOr<AcquireResult> Acquire(const CacheKey& key, CreateFn create);

  // Takes one reference of `entry` away. NOT_FOUND if unknown.
  absl::StatusOr<ReleaseResult> Release(uint64_t entry);

  // Removes `entry` whatever its reference count (W11: the memory went away)
  // and returns it for deregistration. NOT_FOUND if unknown.
  absl::StatusOr<CachedRegistration> Invalidate(uint64_t entry);

  // References of an entry; 0 if unknown.
  uint32_t References(uint64_t entry) const;
  std::optional<CacheKey> KeyOf(uint64_t entry) const;

  CacheStats Stats() const;

 private:
  enum class State { kCreating, kReady, kFailed };
  struct Entry {
    uint64_t id = 0;
    CacheKey key;
    State state = State::kCreating;
    absl::Status failure;
    CachedRegistration registration;
    uint32_t references = 0;
    uint32_t waiters = 0;
    bool removed = false;  // out of the maps: never hand it out again
  };

  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<CacheKey, std::shared_ptr<Entry>> by_key_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::shared_ptr<Entry>> by_id_ ABSL_GUARDED_BY(mu_);
  CacheStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mrd::cache

#endif  // MRD_SERVER_CACHE_REGISTRATION_CACHE_H_
