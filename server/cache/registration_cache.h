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
// Thread-safe. Every operation is O(log n) in the number of entries (a
// B-tree by key; an id names its entry's slot); a hit copies no shared
// pointer but the memory's and takes the lock once. Memory: an entry is a
// 72-byte slot of a slab (no allocator header, no shared-pointer block),
// indexed by key with 4 bytes in a B-tree; its session and buffer and its
// memory's shared pointer are kept once for all the entries of a buffer (a
// million registrations pay for each byte here, docs/PERFORMANCE.md). At
// most 2^24 entries at once, as many as the device has MRs.
#ifndef MRD_SERVER_CACHE_REGISTRATION_CACHE_H_
#define MRD_SERVER_CACHE_REGISTRATION_CACHE_H_

#include <compare>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/btree_set.h"
#include "absl/functional/function_ref.h"
#include "absl/hash/hash.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/common/log.h"
#include "server/common/slab.h"

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
  // The devices it is registered on: bit i is the core's device i. The
  // same range on another set of devices is another registration.
  uint32_t devices = 1;
  auto operator<=>(const CacheKey&) const = default;
  template <typename H>
  friend H AbslHashValue(H h, const CacheKey& k) {
    return H::combine(std::move(h), k.session, k.buffer, k.offset, k.length,
                      k.access, k.base_address, k.devices);
  }
};

// At most this many devices (the bits of CacheKey::devices an entry keeps).
inline constexpr int kMaxCacheDevices = 24;

// The device-side result of a registration, opaque to the cache.
struct CachedRegistration {
  // The MR and keys on the first device of the entry's key's `devices`
  // (the caller keeps the others' where it needs them: one device's suffice
  // for most registrations, and an entry stays small).
  uint64_t device_mr = 0;
  uint32_t lkey = 0;
  uint32_t rkey = 0;
  uint32_t devices = 1;       // the key's devices (set by the cache)
  uint64_t pinned_bytes = 0;  // what it counts against limits
  // Keeps the memory the device MR points into (the buffer's mapping and
  // file) alive until whoever deregisters it drops this copy: a buffer
  // released concurrently never unmaps pages still registered.
  std::shared_ptr<const void> memory;
};

struct AcquireResult {
  // Registration id, unique for the cache's lifetime (its first 2^40
  // registrations; never 0).
  uint64_t entry = 0;
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
  uint64_t device_mr = 0;  // on the first of key.devices
  uint32_t lkey = 0;
  uint32_t rkey = 0;
  uint32_t references = 0;
  uint64_t pinned_bytes = 0;
  bool restored = false;  // put back by Restore: reachable by id only
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
  // Errors: whatever `create` returned (also to concurrent waiters);
  // RESOURCE_EXHAUSTED (LIMIT_CACHE_ENTRIES) on a miss when 2^24 entries
  // exist, before `create` is called.
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
  // caller can retry its release. FAILED_PRECONDITION if the id is in use;
  // RESOURCE_EXHAUSTED if 2^20 restored entries exist.
  absl::Status Restore(uint64_t entry, const CacheKey& key,
                       const CachedRegistration& registration);

  // Handover (a new mrd process takes over from another): puts in the
  // entry the other process had, with its id, key, registration (made on
  // this process's device with the same keys) and references; `restored`
  // as Restore leaves an entry. Errors: INVALID_ARGUMENT BAD_ENTRY (no
  // references), FAILED_PRECONDITION ENTRY_IN_USE (its id or key is taken
  // here), RESOURCE_EXHAUSTED LIMIT_CACHE_ENTRIES (no memory).
  absl::Status Adopt(uint64_t entry, const CacheKey& key,
                     const CachedRegistration& registration,
                     uint32_t references, bool restored);
  // The id sequence: where the next id's is, for the process taking over,
  // and going on from the handing process's (so no id is made twice).
  uint64_t NextSequence() const;
  void ContinueSequence(uint64_t next);

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
  enum State : uint8_t { kCreating, kReady, kFailed };

  // An entry's id is its slot in entries_ (the low kSlotBits) under a
  // sequence number that grows with every entry made (the high 40 bits): an
  // id finds its entry without an index, and is not reused before 2^40
  // entries were made. A restored entry keeps the id it had (its slot may be
  // taken by then) and lives in restored_ instead.
  static constexpr int kSlotBits = SlabIds::kSlotBits;
  static constexpr uint32_t kMaxEntries = SlabIds::kMaxSlots;
  // At most this many restored entries at once (each still holds a device
  // MR, so the device refuses long before).
  static constexpr uint32_t kMaxRestored = uint32_t{1} << 20;
  // Each entry uses one source and at most one memory.
  static constexpr uint32_t kMaxShared = kMaxEntries + kMaxRestored;

  // Values that many entries share (a buffer's session and id, its
  // memory), each kept once with a count of its users and named by its slot
  // (4 bytes in an entry). Not thread-safe.
  template <typename V, typename Less>
  class Shared {
   public:
    explicit Shared(uint32_t max_slots)
        : slots_(max_slots), index_(SlotLess{&slots_}) {}
    // The slot of `value`, or nullopt.
    std::optional<uint32_t> Find(const V& value) const {
      auto it = index_.find(value);
      if (it == index_.end()) return std::nullopt;
      return *it;
    }
    // The slot of `value`, kept from now on if new, with one user more.
    uint32_t Ref(const V& value) {
      std::optional<uint32_t> slot = Find(value);
      if (!slot.has_value()) {
        // Never full (as many slots as users can be): out of memory only,
        // as fatal here as in the B-trees' allocations.
        slot = slots_.Allocate();
        MRD_CHECK(slot.has_value());
        slots_.Get(*slot)->value = value;
        index_.insert(*slot);
      }
      ++slots_.Get(*slot)->users;
      return *slot;
    }
    // One user fewer; the value goes with its last.
    void Unref(uint32_t slot) {
      if (--slots_.Get(slot)->users > 0) return;
      index_.erase(slot);
      slots_.Free(slot);
    }
    const V& Get(uint32_t slot) const { return slots_.Get(slot)->value; }

   private:
    struct Slot {
      V value{};
      uint32_t users = 0;
    };
    struct SlotLess {
      using is_transparent = void;
      const Slab<Slot>* slots;
      static const V& Of(const V& value) { return value; }
      const V& Of(uint32_t slot) const { return slots->Get(slot)->value; }
      template <typename A, typename B>
      bool operator()(const A& a, const B& b) const {
        return Less()(Of(a), Of(b));
      }
    };
    Slab<Slot> slots_;
    absl::btree_set<uint32_t, SlotLess> index_;
  };
  // Two copies of one shared pointer are one memory: ordered by address,
  // then owner.
  struct MemoryLess {
    bool operator()(const std::shared_ptr<const void>& a,
                    const std::shared_ptr<const void>& b) const {
      if (a.get() != b.get()) return std::less<const void*>()(a.get(), b.get());
      return a.owner_before(b);
    }
  };
  using Source = std::pair<uint64_t, uint64_t>;  // session, buffer

  // 72 bytes, in a slab slot (no allocator header). The registration's
  // fields and the key's side by side, without padding; the key's session
  // and buffer, and the registration's memory, as slots of sources_ and
  // memories_ (the entries of one buffer share them). Kept apart, only
  // while there are any: the Acquires waiting for its creation (waiters_)
  // and the status of a failed creation they are to read (failures_). An
  // entry that left the tables (`removed`) while callers wait on it is freed
  // by the last of them.
  struct Entry {
    uint64_t id = 0;
    // The key: its offset, length and base address here, ...
    uint64_t offset = 0;
    uint64_t length = 0;
    uint64_t base_address = 0;
    // The registration, its memory aside.
    uint64_t device_mr = 0;
    uint64_t pinned_bytes = 0;
    uint32_t source = 0;  // ... its session and buffer: a slot of sources_
    uint32_t access : 32 - kMaxCacheDevices = 0;  // ... its access bits
    uint32_t devices : kMaxCacheDevices = 1;      // ... and devices.
    uint32_t lkey = 0;
    uint32_t rkey = 0;
    uint32_t references = 0;
    // 1 + the memory's slot in memories_; 0 for none.
    uint32_t memory : kSlotBits + 1 = 0;
    uint32_t state : 2 = kCreating;  // a State
    uint32_t removed : 1 = 0;   // out of the tables: never hand it out again
    uint32_t restored : 1 = 0;  // in restored_ (not in entries_, by_key_)
    uint32_t waited : 1 = 0;    // in waiters_
  };
  static_assert(sizeof(Entry) == 72,
                "was 120 with CacheKey, CachedRegistration and a Status "
                "embedded");

  // What by_key_ orders the entries by: the key, its session and buffer
  // given by their slot in sources_.
  struct EntryKey {
    uint32_t source = 0;
    uint32_t access = 0;
    uint64_t offset = 0;
    uint64_t length = 0;
    uint64_t base_address = 0;
    uint32_t devices = 1;
  };
  // by_key_ holds the slots of the entries in entries_: 4 bytes an entry.
  struct KeyLess {
    using is_transparent = void;
    const Slab<Entry>* entries;
    static auto Tie(const EntryKey& k) {
      return std::make_tuple(k.source, k.offset, k.length, k.access,
                             k.base_address, k.devices);
    }
    auto Tie(uint32_t slot) const {
      const Entry& e = *entries->Get(slot);
      return std::make_tuple(e.source, e.offset, e.length,
                             static_cast<uint32_t>(e.access), e.base_address,
                             static_cast<uint32_t>(e.devices));
    }
    template <typename A, typename B>
    bool operator()(const A& a, const B& b) const {
      return Tie(a) < Tie(b);
    }
  };

  CacheKey KeyOfLocked(const Entry& entry) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The slot of the entry being created or ready for `key`, or nullopt.
  std::optional<uint32_t> FindKeyLocked(const CacheKey& key) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Gives `entry` the key `key`, counted in sources_.
  void SetKeyLocked(Entry& entry, const CacheKey& key)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The entry `entry_id` in either table, in any state; nullptr if unknown
  // (or removed).
  Entry* FindLocked(uint64_t entry_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The ready entry `entry_id`, or nullptr (unknown, or being created).
  Entry* FindReadyLocked(uint64_t entry_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseKeyOf(const Entry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes `entry` out of the tables for good; frees it unless callers wait
  // on it (the last of them does).
  void RemoveLocked(Entry* entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeLocked(Entry* entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The registration of `entry` (a copy of its memory's shared pointer).
  CachedRegistration RegistrationOf(const Entry& entry) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SetRegistrationLocked(Entry& entry,
                             const CachedRegistration& registration)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The registration of `entry`, which lets go of its memory.
  CachedRegistration TakeRegistrationLocked(Entry& entry)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  SlabIds ids_ ABSL_GUARDED_BY(mu_);
  // Every entry being created or ready, and those removed that waiters still
  // hold, each in the slot its id names. An entry leaves the tables under
  // the lock the moment it is released or invalidated (`removed`; a waiter
  // may still hold its pointer: see RemoveLocked). Mutable: FindLocked.
  mutable Slab<Entry> entries_ ABSL_GUARDED_BY(mu_){kMaxEntries};
  // Restored entries, by id (few: each is a failed deregistration).
  absl::btree_map<uint64_t, std::unique_ptr<Entry>> restored_
      ABSL_GUARDED_BY(mu_);
  // The entries being created and the ready ones a key may still hand out.
  absl::btree_set<uint32_t, KeyLess> by_key_ ABSL_GUARDED_BY(mu_){
      KeyLess{&entries_}};
  // The sessions and buffers and the memories of the entries in both tables
  // and of those removed that waiters still hold.
  Shared<Source, std::less<Source>> sources_ ABSL_GUARDED_BY(mu_){kMaxShared};
  Shared<std::shared_ptr<const void>, MemoryLess> memories_
      ABSL_GUARDED_BY(mu_){kMaxShared};
  // How many Acquires wait for the creation of an entry (`waited`).
  absl::btree_map<const Entry*, uint32_t> waiters_ ABSL_GUARDED_BY(mu_);
  // The status of a failed creation, while Acquires that waited for it are
  // still to read it.
  absl::btree_map<const Entry*, absl::Status> failures_ ABSL_GUARDED_BY(mu_);
  uint64_t entries_in_tables_ ABSL_GUARDED_BY(mu_) = 0;  // not `removed`
  uint64_t creating_ ABSL_GUARDED_BY(mu_) = 0;           // entries in kCreating
  CacheStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mrd::cache

#endif  // MRD_SERVER_CACHE_REGISTRATION_CACHE_H_
