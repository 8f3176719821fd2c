// RegistrationCache: the reference-counted registration cache of
// WSPRegisterRdmaMemory (W5) applied to RegisterMr. The same session, file,
// range, access and base address registered again returns the same entry with
// one more reference; each Release takes one away; the last one hands the
// entry back to the caller, who deregisters it before replying.
//
// The cache never calls the device: the caller passes a `create` function that
// performs the registration. Creation runs WITHOUT the cache lock held; a
// concurrent Acquire of the same key waits for that creation and then shares
// its result (or its failure; but a creation that failed with CANCELLED, its
// caller having given up, is made again by a waiter). An entry whose last
// reference is gone is removed from the key map before Release returns, so
// no later Acquire can ever be handed a registration that is being torn
// down: it gets a fresh one, with fresh keys.
//
// What is shared, and what is not. A remote token is shared only between
// requests with the same key: session, buffer, file, offset, length, access
// and base address (W5). A request for a range inside an existing
// registration (same session, file and access) is NOT served with the
// container's token, because that token would let a peer reach the whole
// container — bytes this request did not ask to expose — and would keep the
// container reachable after the container's own last DeregisterMr for as
// long as the inner request held it. A contained range instead gets its own
// registration, bounded to exactly the bytes asked for, with its own key;
// what it reuses is the container's PIN: the device pins per page with a
// reference count (software device) or finds the pages resident (verbs), so
// no page is faulted in or locked anew. The same holds for a range inside a
// warm pin (warm_pins.h), and an exact range taken from a warm pin reuses the
// pin's accounting as well. A contained registration is counted against the
// pinned-bytes limits on its own: the limits never under-count.
//
// Thread-safe. Every operation is O(log n) in the number of entries (two
// B-trees); a hit copies no shared pointer and takes the lock once. Memory:
// an entry is one allocation, indexed by id and by key with one pointer
// each; no shared-pointer block (a million registrations pay for each byte
// here, docs/PERFORMANCE.md).
#ifndef MRD_SERVER_CACHE_REGISTRATION_CACHE_H_
#define MRD_SERVER_CACHE_REGISTRATION_CACHE_H_

#include <compare>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_set.h"
#include "absl/functional/function_ref.h"
#include "absl/hash/hash.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace mrd::cache {

// What identifies a registration: memory is named by the session's buffer
// (one imported memfd, its id never reused) and a range of it, never by a
// virtual address of the client. The buffer names the file too, so the
// file's identity is not repeated here: two imports of one file are two
// buffers and never share a registration (each keeps its own mapping in use).
struct CacheKey {
  uint64_t session = 0;
  uint64_t buffer = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint32_t access = 0;        // device::AccessBits
  uint64_t base_address = 0;  // the region's address on the wire
  auto operator<=>(const CacheKey&) const = default;
  template <typename H>
  friend H AbslHashValue(H h, const CacheKey& k) {
    return H::combine(std::move(h), k.session, k.buffer, k.offset, k.length,
                      k.access, k.base_address);
  }
};

// The device-side result of a registration, opaque to the cache.
struct CachedRegistration {
  uint64_t device_mr = 0;
  uint32_t lkey = 0;
  uint32_t rkey = 0;
  uint64_t pinned_bytes = 0;  // what it counts against limits
  // Keeps the memory the device MR points into (the buffer's mapping and
  // file) alive until whoever deregisters it drops this copy: a buffer
  // released concurrently never unmaps pages still registered.
  std::shared_ptr<const void> memory;
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

// What an entry says, for listing it.
struct EntryView {
  CacheKey key;
  uint32_t lkey = 0;
  uint32_t rkey = 0;
  uint32_t references = 0;
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
  ~RegistrationCache();
  RegistrationCache(const RegistrationCache&) = delete;
  RegistrationCache& operator=(const RegistrationCache&) = delete;

  // Returns the entry for `key`, creating it with `create` on a miss.
  // Errors: whatever `create` returned (also to concurrent waiters).
  absl::StatusOr<AcquireResult> Acquire(const CacheKey& key, CreateFn create);

  // Takes one reference of `entry` away. NOT_FOUND if unknown.
  absl::StatusOr<ReleaseResult> Release(uint64_t entry);

  // The two that never wait, for callers that must not block (a gRPC
  // thread): a hit on a ready entry for `key` (nullopt when there is none,
  // or it is still being created: then Acquire), and the release of a
  // reference that is not the last (false when it would be, or `entry` is
  // unknown: then Release, whose last reference the caller deregisters).
  std::optional<AcquireResult> TryAcquireReady(const CacheKey& key);
  bool ReleaseIfNotLast(uint64_t entry, uint32_t* left);

  // Puts back a released entry whose deregistration failed, with one
  // reference, reachable by id only (never handed out by key again), so the
  // caller can retry its release. FAILED_PRECONDITION if the id is in use.
  absl::Status Restore(uint64_t entry, const CacheKey& key,
                       const CachedRegistration& registration);

  // Removes `entry` whatever its reference count (W11: the memory went away)
  // and returns it for deregistration. NOT_FOUND if unknown.
  absl::StatusOr<CachedRegistration> Invalidate(uint64_t entry);

  // References of an entry; 0 if unknown.
  uint32_t References(uint64_t entry) const;
  std::optional<CacheKey> KeyOf(uint64_t entry) const;
  // A ready entry's key, keys and references; nullopt if unknown.
  std::optional<EntryView> View(uint64_t entry) const;

  CacheStats Stats() const;

 private:
  enum class State : uint8_t { kCreating, kReady, kFailed };
  // Owned by by_id_ while in it. An entry that left both tables
  // (`removed`) while callers wait on it is deleted by the last of them.
  struct Entry {
    uint64_t id = 0;
    CacheKey key;
    CachedRegistration registration;
    absl::Status failure;  // kFailed only
    uint32_t references = 0;
    uint32_t waiters = 0;  // Acquires waiting for its creation
    State state = State::kCreating;
    bool removed = false;  // out of the maps: never hand it out again
  };

  // Both tables hold pointers to the entries, ordered: by_id_ by id (a
  // uint64_t finds them), by_key_ by key (a CacheKey finds them). B-trees of
  // pointers cost about 9-12 bytes an entry; flat hash sets cost 9 to 19
  // (their slots double with the size and stay at most 7/8 full).
  struct IdLess {
    using is_transparent = void;
    static uint64_t Id(uint64_t id) { return id; }
    static uint64_t Id(const Entry* entry) { return entry->id; }
    template <typename A, typename B>
    bool operator()(const A& a, const B& b) const {
      return Id(a) < Id(b);
    }
  };
  struct KeyLess {
    using is_transparent = void;
    static const CacheKey& Key(const CacheKey& key) { return key; }
    static const CacheKey& Key(const Entry* entry) { return entry->key; }
    template <typename A, typename B>
    bool operator()(const A& a, const B& b) const {
      return Key(a) < Key(b);
    }
  };

  void EraseKeyOf(const Entry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The ready entry `entry_id`, or nullptr (unknown, or being created).
  Entry* FindReadyLocked(uint64_t entry_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes `entry` out of both tables for good; deletes it unless callers
  // wait on it (the last of them does).
  void RemoveLocked(Entry* entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Every entry being created, ready, or restored, by id: the owner. An
  // entry leaves both tables under the lock the moment it is released or
  // invalidated (a waiter may still hold its pointer: see RemoveLocked).
  absl::btree_set<Entry*, IdLess> by_id_ ABSL_GUARDED_BY(mu_);
  // The entries being created and the ready ones a key may still hand out.
  absl::btree_set<Entry*, KeyLess> by_key_ ABSL_GUARDED_BY(mu_);
  uint64_t creating_ ABSL_GUARDED_BY(mu_) = 0;  // entries in kCreating
  CacheStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mrd::cache

#endif  // MRD_SERVER_CACHE_REGISTRATION_CACHE_H_
