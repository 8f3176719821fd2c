// Registrations: RegisterMr and DeregisterMr of sessions' buffers, through
// the reference-counted registration cache (W5) and the warm pins, with the
// pinned-bytes and registration budgets charged on every miss.
//
// It owns the cache and the warm pins, and so also the one way pinned bytes
// are reserved: warm pins give way before a pinned-bytes limit refuses
// anything (ReservePinned), for LAMs (fast_registration.h) as well as for
// registrations.
//
// Thread safety: thread-safe. Lock order: a session's `mu`, then the
// cache's or the warm set's own lock (never held across a device call),
// then the budgets' lock. No lock is held while calling the device.
#ifndef MRD_SERVER_CORE_REGISTRATIONS_H_
#define MRD_SERVER_CORE_REGISTRATIONS_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "mrd/v1/handover.pb.h"
#include "mrd/v1/mrd.pb.h"
#include "server/cache/registration_cache.h"
#include "server/cache/warm_pins.h"
#include "server/common/progress.h"
#include "server/common/thread.h"
#include "server/core/budgets.h"
#include "server/core/progress_reporter.h"
#include "server/core/session.h"
#include "server/device/device.h"
#include "server/fd_socket/memory_file.h"

namespace mrd::core {

struct RegistrationOptions {
  size_t request_id_memory = 4096;  // idempotency keys remembered per session
  cache::WarmPinLimits warm;        // 0 in either field: no warm pins
  // Reports the progress of long registrations (not owned; null: none).
  ProgressReporter* progress = nullptr;
  // A registration on several devices of at least this many bytes is made
  // on the devices after the first on threads of their own, beside the
  // first's (a NIC pins per registration: together the pins take the time
  // of one); smaller ones go device after device.
  uint64_t parallel_devices_min_bytes = uint64_t{64} << 20;
};

// A registration's MR on one of the core's devices.
struct DeviceMr {
  uint32_t device = 0;  // the core's device index
  device::MrId mr = 0;
  uint32_t lkey = 0;
  uint32_t rkey = 0;
};

class Registrations {
 public:
  // While one is open on the calling thread, the MRs on the devices after
  // the first that this thread's deregistrations release (registrations on
  // several devices) are deregistered on a thread of the batch's own,
  // beside the caller's work on the first device, and their share of the
  // registration budget comes back as each goes; destroying the batch waits
  // for all of them. DeregisterMrBatch and a session's end open one: a
  // NIC's deregistration is a system call of its own, and the second
  // device's then overlap the first's. The thread starts at the first MR
  // queued (none: no thread); one that cannot start leaves the work to the
  // caller, as without a batch. A batch opened while another of the same
  // Registrations is open on the thread does nothing. Not movable; destroy
  // it on its thread, before the session's PDs go.
  class OthersBatch {
   public:
    OthersBatch(Registrations* registrations, std::shared_ptr<Session> session);
    ~OthersBatch();
    OthersBatch(const OthersBatch&) = delete;
    OthersBatch& operator=(const OthersBatch&) = delete;

    // Queues `mrs` (of a registration whose pages `memory` maps); false when
    // the batch takes nothing (none open, or no thread).
    bool Add(absl::InlinedVector<DeviceMr, 1> mrs,
             std::shared_ptr<const void> memory);
    // Whether it was opened for `registrations` and `session`.
    bool For(const Registrations* registrations, const Session* session) const {
      return registrations == registrations_ && session == session_.get();
    }

   private:
    struct Item {
      absl::InlinedVector<DeviceMr, 1> mrs;
      std::shared_ptr<const void> memory;
    };
    void Run();
    // The thread wakes for this many MRs at a time (or the batch's end):
    // not once per item.
    static constexpr size_t kWakeItems = 32;
    bool HasWorkOrDone() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return queue_.size() >= kWakeItems || done_;
    }

    Registrations* const registrations_ = nullptr;  // null: does nothing
    const std::shared_ptr<Session> session_;
    bool open_ = false;       // this batch is the thread's open one
    bool no_thread_ = false;  // the thread could not start
    Thread thread_;
    absl::Mutex mu_;
    std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
    bool done_ ABSL_GUARDED_BY(mu_) = false;
  };

  // A batch's adjacent small ranges of one buffer, pinned on the session's
  // devices ahead of the items that register them (Device::PinForBatch),
  // under the session's pinned-bytes budget: while it is open on the
  // calling thread, the pinned bytes that this thread's registrations of
  // its pages reserve come out of what it reserved (and their pages, in
  // memory already, need no prefault), and when it ends, what no item took
  // goes back, and so do the pages that no registration holds.
  // Each item keeps its own result and limits: an item refused for its own
  // reasons is refused as without it. Nothing is pinned ahead (and the
  // items pin their own pages) when the range is not one the devices can
  // pin ahead, or the budget has no room for all of it. One open per
  // thread; not movable; destroy it on its thread.
  class PinAhead {
   public:
    // [offset, offset + length) of `buffer`, a writable buffer of the
    // session in pages of the base size.
    PinAhead(Registrations* registrations, std::shared_ptr<Session> session,
             uint64_t buffer, uint64_t offset, uint64_t length);
    ~PinAhead();
    PinAhead(const PinAhead&) = delete;
    PinAhead& operator=(const PinAhead&) = delete;

    // Whether anything was pinned ahead.
    bool active() const { return !pins_.empty(); }
    // Takes `bytes` of the reservation for a registration of `span` for
    // `session`; false when the span is not within this pin or not that
    // much is left.
    bool Take(const Session& session, const device::MemorySpan& span,
              uint64_t bytes);

   private:
    Registrations* const registrations_;
    const std::shared_ptr<Session> session_;
    uint64_t start_ = 0;  // the host addresses pinned
    uint64_t end_ = 0;
    std::vector<std::unique_ptr<device::BatchPin>> pins_;
    uint64_t reserved_ = 0;  // of the budget, not yet taken by an item
  };

  // `devices` (one at least; the first is where warm pins, LAMs and MR
  // objects live) and `budgets` must outlive this.
  Registrations(std::vector<device::Device*> devices, Budgets* budgets,
                const RegistrationOptions& options);
  Registrations(const Registrations&) = delete;
  Registrations& operator=(const Registrations&) = delete;

  // RegisterMr for a live session: a cache hit takes one more reference; a
  // miss reserves budgets and registers on the device. Either the
  // registration exists and the session owns it, or nothing of it does.
  // `cancelled` (optional): the caller gave up. Checked while pinning (a
  // registration of kProgressMinBytes or more stops between steps and is
  // undone) and once more before the answer, when a registration made or
  // shared meanwhile is given back: CANCELLED, and the session holds
  // nothing of it.
  absl::Status Register(const std::shared_ptr<Session>& session,
                        const v1::RegisterMrRequest& req,
                        v1::RegisterMrResponse* out,
                        const CancelCheck& cancelled = nullptr);
  // DeregisterMr: one reference (the caller's own or the MR object's) goes;
  // the last one deregisters (its pages may stay as a warm pin). A device
  // that cannot deregister leaves everything as it was.
  absl::Status Deregister(const std::shared_ptr<Session>& session,
                          const v1::DeregisterMrRequest& req,
                          v1::DeregisterMrResponse* out);
  // The forms that never block, for a caller on a thread that must not (a
  // gRPC thread): Register when the answer is a cache hit (or the replay of
  // a request id, or an error found before anything is pinned), and
  // Deregister of a reference that is not the registration's last. nullopt
  // when the call would pin, register, wait for a registration being made,
  // or deregister: then Register / Deregister must run (on a worker). When
  // the reference is the registration's last, `last_bytes` (if given) gets
  // the registration's length: the work the worker's Deregister will do.
  std::optional<absl::Status> TryRegisterHit(
      const std::shared_ptr<Session>& session, const v1::RegisterMrRequest& req,
      v1::RegisterMrResponse* out);
  std::optional<absl::Status> TryDeregisterNotLast(
      const std::shared_ptr<Session>& session,
      const v1::DeregisterMrRequest& req, v1::DeregisterMrResponse* out,
      uint64_t* last_bytes = nullptr);

  // Drops one cache reference (an MR object that held it was closed);
  // deregisters on the last. Returns the references left.
  absl::StatusOr<uint32_t> DropReference(
      const std::shared_ptr<Session>& session, uint64_t entry);

  // W11 / session end: the session's records of registrations on `buffer`
  // (every buffer when `buffer` is 0) leave it; returns their entries, to
  // pass to Invalidate once the session's lock is released.
  std::vector<uint64_t> DetachLocked(Session& session, uint64_t buffer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu);
  // Deregisters these entries whatever their references. Returns how many
  // were still registered.
  uint32_t Invalidate(Session& session, const std::vector<uint64_t>& entries);
  // Releases the warm pins of a buffer that left its session, or of every
  // buffer of a session (buffer = 0) that is closing.
  void DropWarm(uint64_t session, uint64_t buffer);

  // Pinned bytes for `session`, against its limit, the total and its
  // tenant's quota. A reservation that would exceed one first evicts warm
  // pins (the session's own for its limit, anyone's for the total), least
  // recently kept first, and is refused only when evicting all of them
  // would not make room.
  absl::Status ReservePinned(Session& session, uint64_t bytes);
  // Evicts the least recently kept warm pin of anyone, for a device that
  // ran out of pinnable memory or keys. False if there was none.
  bool EvictWarmForDevice();

  // What the cache entry `entry` says (range, base address, keys): the
  // session's record holds only its references. nullopt if it is gone.
  std::optional<cache::EntryView> Describe(uint64_t entry) const {
    return cache_.View(entry);
  }
  // A registration's MR on each of its devices, in device order.
  using DeviceMrs = absl::InlinedVector<DeviceMr, 2>;
  DeviceMrs MrsOf(const cache::EntryView& view) const;
  // The same as tokens for the wire: device names, keys, peer addresses.
  void AddTokens(
      const cache::EntryView& view,
      google::protobuf::RepeatedPtrField<v1::DeviceToken>* out) const;

  // The devices, and a device's index by name. Errors: INVALID_ARGUMENT
  // UNKNOWN_DEVICE.
  const std::vector<device::Device*>& devices() const { return devices_; }
  // The first device's page size.
  uint64_t page_size() const { return page_size_; }
  absl::StatusOr<size_t> DeviceIndex(absl::string_view name) const;
  // The devices a selection names, as CacheKey::devices bits: none named,
  // the first device; `nearest` is left to NearestDevices (0 here).
  // Errors: INVALID_ARGUMENT UNKNOWN_DEVICE, BAD_DEVICE_SELECTION (more
  // than one of names, all and nearest).
  absl::StatusOr<uint32_t> DeviceBits(
      const v1::DeviceSelection& selection) const;
  // The devices on the NUMA node of the memory at `address` (mrd's
  // mapping), as bits; every device when none is on that node or the node
  // is unknown.
  uint32_t NearestDevices(const void* address) const;

  // Handover (core/handover.cc): registers `r`, a registration another mrd
  // process handed over, on each of its devices (in the session's PD there,
  // `pds` by device) with the keys it had there, and puts it in the cache
  // and in `session` with its references, its pinned bytes and device
  // registrations charged whatever the limits say. Errors: the device's
  // (KEY_IN_USE, pinning; naming the device when there are several),
  // INVALID_ARGUMENT HANDOVER_UNKNOWN_DEVICE (a device this core does not
  // have, or one whose keys are missing), the cache's; nothing of it stays
  // then.
  absl::Status Adopt(Session& session, const std::vector<device::PdId>& pds,
                     const std::shared_ptr<fd_socket::MappedFile>& file,
                     const v1::HandedOverRegistration& r)
      ABSL_LOCKS_EXCLUDED(session.mu);
  uint64_t NextRegistrationSequence() const { return cache_.NextSequence(); }
  void ContinueRegistrationSequence(uint64_t next) {
    cache_.ContinueSequence(next);
  }

  cache::CacheStats CacheStats() const { return cache_.Stats(); }
  cache::WarmPinStats WarmStats() const { return warm_.Stats(); }
  // Handover: the warm pins kept (WarmPinSet::Kept), and one of another
  // process pinned again here (its bytes charged to the session whatever
  // the limits say, as a registration's are). One that cannot be pinned or
  // kept here is dropped: a warm pin holds no key, nothing depends on it.
  std::vector<std::pair<cache::WarmKey, uint64_t>> WarmKept() const {
    return warm_.Kept();
  }
  void AdoptWarm(const std::shared_ptr<Session>& session,
                 const cache::WarmKey& key, uint64_t pinned_bytes);

 private:
  // What a registration needs once its request is checked: the buffer's
  // mapping, the cache key, the PD, the span and the pinned bytes it counts
  // for.
  struct Plan {
    std::shared_ptr<fd_socket::MappedFile> file;
    cache::CacheKey key;
    absl::InlinedVector<device::PdId, 2> pds;  // the session's, by device
    bool nearest = false;  // key.devices: NearestDevices of the span
    // Through a normal MR object: the device it belongs to, where the
    // registration is made (NDK's MR object is one adapter's).
    std::optional<uint32_t> mr_device;
    device::MemorySpan span;
    uint64_t pin_bytes = 0;
    CancelCheck cancelled;  // the caller's, may be empty
  };
  // A retried request id: fills `out` with the first answer.
  bool ReplayLocked(Session& session, const v1::RegisterMrRequest& req,
                    v1::RegisterMrResponse* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu);
  // The buffer and MR object the request names, and the access they allow.
  absl::Status CheckTargetsLocked(Session& session,
                                  const v1::RegisterMrRequest& req,
                                  uint32_t access, Plan* plan)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu);
  // The span (R2), the base address (R8) and the cache key.
  absl::Status PlanRegistration(Session& session,
                                const v1::RegisterMrRequest& req,
                                uint32_t access, Plan* plan) const;
  // A cache miss: limits, then the device (through a warm pin of the same
  // pages when there is one).
  absl::StatusOr<cache::CachedRegistration> RegisterOnDevice(
      const std::shared_ptr<Session>& session, const Plan& plan,
      const v1::RegisterMrRequest& req);
  // Records the registration in the session and fills `out`; an error when
  // the session, buffer or MR object went meanwhile.
  absl::Status CommitLocked(Session& session, const v1::RegisterMrRequest& req,
                            const Plan& plan,
                            const cache::AcquireResult& acquired,
                            v1::RegisterMrResponse* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu);

  // DeregisterMr, in steps: one reference taken out of the session (and
  // the record, when it was the last), put back if the device refused.
  struct TakenReference {
    uint64_t entry = 0;
    uint64_t mr_object = 0;  // the MR object it was taken through, or 0
    bool erased = false;     // the record left the session: `record`
    RegistrationRecord record;
  };
  absl::Status TakeReferenceLocked(Session& session,
                                   const v1::DeregisterMrRequest& req,
                                   TakenReference* taken)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu);
  void PutReferenceBack(Session& session, const TakenReference& taken);
  // The record leaves the session when no reference is left: `taken` keeps
  // it, to put back.
  void EraseIfUnreferencedLocked(
      Session& session,
      absl::btree_map<uint64_t, RegistrationRecord>::iterator r,
      TakenReference* taken) ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu);

  void DeregisterCached(Session& session, const cache::CachedRegistration& reg);
  // Registers `span` on the core's device `index`, evicting warm pins while
  // the device runs out of pinnable memory or keys.
  absl::StatusOr<device::MrKeys> RegisterOn(uint32_t index, const Plan& plan,
                                            const device::MemorySpan& span);
  // The MRs of a registration on its devices after the first, made by
  // RegisterOnDevice (none for a registration on one device): deregistered
  // (through the thread's OthersBatch when one is open) and forgotten, and
  // their share of the registration budget returned (the caller returns
  // the first device's: UnreserveRegistration of one). A device that cannot
  // deregister one keeps it until the session's PD there goes (and so do
  // the pages: `reg.memory` stays with the session); logged.
  void DeregisterOthers(Session& session, const cache::CachedRegistration& reg);
  // DeregisterOthers' work on `mrs`, now, on this thread.
  void DeregisterNow(Session& session,
                     const absl::InlinedVector<DeviceMr, 1>& mrs,
                     const std::shared_ptr<const void>& memory);
  // The index of the first device in `bits` (CacheKey::devices).
  static uint32_t FirstDevice(uint32_t bits);
  // Where the MRs on the devices after the first are kept: by the first
  // device's index and MR id.
  static uint64_t OthersKey(uint32_t device, device::MrId mr) {
    return (uint64_t{device} << 48) | mr;
  }
  // The memory maps a pin of `file`'s memory may cost (the device's
  // attributes: read-only memory is mlocked on the software device), charged
  // to the tenant with each registration.
  uint64_t MapSplitsOf(const fd_socket::MappedFile& file) const;
  // The same for a registration made: its memory is its buffer's file.
  uint64_t MapSplitsOf(const cache::CachedRegistration& reg) const;
  // Pins the pages of a registration about to be deregistered as a warm
  // pin; nullopt when warm pins are off, the pin would not fit, the buffer
  // or session is going, or the device refused.
  std::optional<cache::WarmPin> MakeWarmPin(
      const std::shared_ptr<Session>& session, const cache::WarmKey& key,
      uint64_t pinned_bytes);
  // Puts a warm pin in the set (its bytes stay reserved), or releases it
  // when its buffer or session went meanwhile; releases what the set evicts.
  void KeepWarm(const std::shared_ptr<Session>& session, cache::WarmPin pin);
  // After a warm hit: the warm pin's LAM is no longer needed.
  void ReleaseWarmAfterHit(const std::shared_ptr<Session>& session,
                           cache::WarmPin warm);
  // Releases warm pins: their LAMs on the device, then their reservations.
  void ReleaseWarm(std::vector<cache::WarmPin> pins);

  const std::vector<device::Device*> devices_;
  device::Device* const device_;  // devices_[0]
  Budgets* const budgets_;
  const RegistrationOptions options_;
  const uint64_t page_size_;
  cache::RegistrationCache cache_;
  cache::WarmPinSet warm_;
  // Registrations on several devices: the MRs after the first device's
  // (which the cache keeps), by OthersKey of the first.
  mutable absl::Mutex others_mu_;
  absl::flat_hash_map<uint64_t, absl::InlinedVector<DeviceMr, 1>> others_
      ABSL_GUARDED_BY(others_mu_);
};

}  // namespace mrd::core

#endif  // MRD_SERVER_CORE_REGISTRATIONS_H_
