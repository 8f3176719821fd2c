// WarmPinSet: pages kept pinned after the last reference of a registration
// went, so that registering the same range again does not pin it again.
//
// What a warm pin is, and what it is not. When the last DeregisterMr of a
// registration arrives, the core first pins the same pages with a logical
// address mapping of its own (Device::BuildLam: pins, exposes nothing to any
// peer, and the client never learns of it), then deregisters the MR — whose
// key is dead before DeregisterMr replies — and hands the LAM to this set.
// No remote token survives: a warm pin holds pages, never a key. A later
// RegisterMr of the same session, buffer, file and range (any access, any
// base address) takes the pin out of the set, registers (the pages are
// already pinned, so no page is pinned anew) and gets a new key, then
// releases the LAM. That is the difference from UCX's rcache and libfabric's
// MR cache, which keep the released region registered with its key valid.
//
// The set keeps pins under two byte caps, one per session and one in total,
// and evicts least-recently-kept first to stay under them. The core also
// evicts from it before refusing anything for a pinned-bytes limit (warm
// bytes count towards the pinned-bytes limits), and drops a buffer's pins
// when the buffer is released (W11) and a session's when it ends.
//
// The set never calls the device: every pin that leaves it (taken, evicted,
// dropped, refused) is returned to the caller, who releases its LAM. Each pin
// carries an opaque `owner` that the core uses to keep the buffer's mapping
// alive for as long as the pin exists and to find the session to credit.
//
// Thread-safe; its lock is a leaf (nothing else is locked while it is held,
// so callers may hold their own locks when calling in). Every operation is
// O(log n) in the number of pins, plus O(k log n) for the k pins it returns.
#ifndef MRD_SERVER_CACHE_WARM_PINS_H_
#define MRD_SERVER_CACHE_WARM_PINS_H_

#include <compare>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace mrd::cache {

// The pages a warm pin holds: access and base address are not part of it,
// since they describe a key, and a warm pin has none.
struct WarmKey {
  uint64_t session = 0;
  uint64_t buffer = 0;  // names the file too (see CacheKey)
  uint64_t offset = 0;
  uint64_t length = 0;
  auto operator<=>(const WarmKey&) const = default;
};

struct WarmPin {
  WarmKey key;
  uint64_t device_lam = 0;      // the device LAM holding the pages
  uint64_t pinned_bytes = 0;    // page-rounded, counted against the limits
  std::shared_ptr<void> owner;  // opaque: kept alive while the pin exists
};

struct WarmPinLimits {
  uint64_t per_session_bytes = 0;  // 0 = no warm pins
  uint64_t total_bytes = 0;        // 0 = no warm pins
};

struct WarmPinStats {
  uint64_t pins = 0;       // kept now
  uint64_t bytes = 0;      // kept now
  uint64_t kept = 0;       // pins ever put in the set
  uint64_t hits = 0;       // registrations served from a warm pin
  uint64_t evictions = 0;  // removed least-recently-kept first: cap or limit
  uint64_t drops = 0;      // removed because their buffer or session went,
                           // or refused (duplicate range, closing session)
};

class WarmPinSet {
 public:
  explicit WarmPinSet(WarmPinLimits limits) : limits_(limits) {}
  WarmPinSet(const WarmPinSet&) = delete;
  WarmPinSet& operator=(const WarmPinSet&) = delete;

  // Whether a pin of `bytes` can be kept at all (fits both caps on its own).
  bool Admissible(uint64_t bytes) const;

  // Keeps `pin` as the most recently used. Returns the pins the caller must
  // release: those evicted (least recently kept first) to bring the session
  // and the total under their caps, and `pin` itself if it is not kept
  // (not admissible, or its range is already warm: the older one stays and
  // becomes the most recently used).
  std::vector<WarmPin> Put(WarmPin pin);

  // A warm hit: removes and returns the pin of exactly `key`, if any.
  std::optional<WarmPin> Take(const WarmKey& key);

  // Removes and returns the least recently kept pin of `session`, or of any
  // session when `session` is nullopt; counted as an eviction.
  std::optional<WarmPin> EvictOldest(std::optional<uint64_t> session);

  // Removes and returns every pin of `buffer` in `session` / of `session`.
  std::vector<WarmPin> DropBuffer(uint64_t session, uint64_t buffer);
  std::vector<WarmPin> DropSession(uint64_t session);
  // Counts a pin the caller refused to keep (session closing, buffer gone).
  void CountDrop();

  WarmPinStats Stats() const;
  uint64_t SessionBytes(uint64_t session) const;
  // Every pin kept, least recently kept first, as (key, pinned bytes): what
  // a live handover re-creates in the next process, in the same order.
  std::vector<std::pair<WarmKey, uint64_t>> Kept() const;

 private:
  struct Node {
    WarmPin pin;
    uint64_t age = 0;  // larger = more recently kept
  };

  // Removes the pin of `it` from every index and returns it.
  WarmPin RemoveLocked(std::map<WarmKey, Node>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::optional<WarmPin> EvictOldestLocked(std::optional<uint64_t> session)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const WarmPinLimits limits_;
  mutable absl::Mutex mu_;
  uint64_t next_age_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<WarmKey, Node> by_key_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, WarmKey> by_age_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<uint64_t, uint64_t>, WarmKey> by_session_age_
      ABSL_GUARDED_BY(mu_);  // (session, age)
  std::map<uint64_t, uint64_t> session_bytes_ ABSL_GUARDED_BY(mu_);
  WarmPinStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mrd::cache

#endif  // MRD_SERVER_CACHE_WARM_PINS_H_
