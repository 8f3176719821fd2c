// Session: everything one client holds, and the device event sink of its
// protection domain. Owned by Core (shared_ptr, so that in-flight requests
// keep it alive while it is being torn down); fields are guarded by `mu`.
//
// Thread safety: `mu` guards all state. Device events arrive on device
// threads through the PdEventSink methods, which take `mu` briefly and call
// the completion-stream notifier outside it.
#ifndef MRD_SERVER_CORE_SESSION_H_
#define MRD_SERVER_CORE_SESSION_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mrd/v1/handover.pb.h"
#include "mrd/v1/mrd.pb.h"
#include "server/core/tenants.h"
#include "server/device/device.h"
#include "server/fd_socket/memory_file.h"

namespace mrd::core {

enum class SessionKind { kFd, kLease };

struct BufferRecord {
  uint64_t id = 0;
  uint64_t address = 0;  // default base address on the wire (not mrd's pointer)
  std::shared_ptr<fd_socket::MappedFile> file;
};

// The session's share of one cache entry (keyed by its id, the registration
// id). What the entry itself says — buffer, range, base address, keys — is
// read from the cache (Registrations::Describe), not copied here: a million
// registrations pay for each byte of this.
// 8 bytes: the session's B-tree of them costs 16 a registration.
struct RegistrationRecord {
  uint32_t implicit_refs = 0;  // RegisterMr calls without an MR object
  static constexpr uint32_t kMaxMrRefs = (uint32_t{1} << 28) - 1;
  // MR objects holding it: at most the session's MR objects, a limit the
  // core caps at kMaxMrRefs.
  uint32_t mr_refs : 28 = 0;
  uint32_t flags : 4 = 0;  // NDK_MR_FLAG_* as requested (known bits: 0xF)
};
static_assert(sizeof(RegistrationRecord) == 8);

struct PendingFastRegister {
  uint64_t base_address = 0;
  uint64_t length = 0;
  std::vector<uint64_t> lams;  // LAMs whose pages the request maps
  bool silent = false;         // SILENT_SUCCESS: no completion on success
  uint32_t access = 0;         // device::kAccess* bits it grants
};

struct MrObject {
  uint64_t id = 0;
  uint32_t device = 0;  // the core's device it belongs to
  bool fast_register = false;
  bool allow_remote = false;
  // Normal MR objects: the registration they hold (0 = none).
  uint64_t registration = 0;
  // Fast-register MR objects.
  device::MrId device_mr = 0;
  uint32_t lkey = 0;
  uint32_t rkey = 0;
  bool fast_registered = false;
  uint64_t base_address = 0;
  uint64_t length = 0;
  uint32_t access = 0;         // device::kAccess* bits of the mapping
  std::vector<uint64_t> lams;  // LAMs mapped while fast-registered
  // Posted and not yet completed, in posting order (a connection executes
  // its work in order).
  std::deque<PendingFastRegister> pending;
  std::deque<bool> pending_invalidate_silent;
};

struct LamRecord {
  uint64_t id = 0;
  uint32_t device = 0;  // the core's device that maps it
  device::LamId device_lam = 0;
  uint64_t buffer = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  std::vector<uint64_t> pages;
  uint32_t fbo = 0;
  uint64_t pinned_bytes = 0;
  std::shared_ptr<fd_socket::MappedFile> file;  // keeps the pages mapped
  uint32_t privileged_key = 0;  // L9, as BuildLam answered (handover)
};

// What a published name names: a registration, or a fast-register MR
// object's mapping as it was when published (its rkey: a mapping made
// again after an invalidate is another token, which the name does not
// follow).
struct PublishedTarget {
  uint64_t registration = 0;  // 0: an MR object's mapping
  uint64_t mr = 0;
  uint32_t rkey = 0;  // the mapping's, for an MR object
  bool operator==(const PublishedTarget&) const = default;
};

// The names a session published (publications.h), each with what it
// names, indexed both ways: a deregistration (or an invalidate) finds its
// own names without walking the session's others. Not thread-safe (the
// session's mutex guards it).
class PublishedNames {
 public:
  using Map = std::map<std::string, PublishedTarget>;
  Map::const_iterator begin() const { return by_name_.begin(); }
  Map::const_iterator end() const { return by_name_.end(); }
  Map::const_iterator find(const std::string& name) const {
    return by_name_.find(name);
  }
  bool contains(const std::string& name) const {
    return by_name_.contains(name);
  }
  size_t size() const { return by_name_.size(); }
  bool empty() const { return by_name_.empty(); }

  // `name` names `target` (again, or now instead of something else).
  void Set(const std::string& name, const PublishedTarget& target) {
    auto [it, inserted] = by_name_.try_emplace(name, target);
    if (!inserted) {
      by_handle_.erase(HandleOf(it->second, name));
      it->second = target;
    }
    by_handle_.insert(HandleOf(target, name));
  }
  // False if the session has not published `name`.
  bool Erase(const std::string& name) {
    auto it = by_name_.find(name);
    if (it == by_name_.end()) return false;
    by_handle_.erase(HandleOf(it->second, name));
    by_name_.erase(it);
    return true;
  }
  void clear() {
    by_name_.clear();
    by_handle_.clear();
  }
  // Whether a name names registration `registration`.
  bool Names(uint64_t registration) const {
    return HasAny({false, registration});
  }
  // Erases the names of registration `registration` (of MR object `mr`'s
  // mapping), appending them to `out`.
  void TakeNamesOf(uint64_t registration, std::vector<std::string>* out) {
    TakeAll({false, registration}, out);
  }
  void TakeNamesOfMr(uint64_t mr, std::vector<std::string>* out) {
    TakeAll({true, mr}, out);
  }

 private:
  using Handle = std::pair<bool, uint64_t>;  // (an MR object's?, id)
  static std::pair<Handle, std::string> HandleOf(const PublishedTarget& t,
                                                 const std::string& name) {
    return t.registration != 0
               ? std::make_pair(Handle{false, t.registration}, name)
               : std::make_pair(Handle{true, t.mr}, name);
  }
  bool HasAny(const Handle& handle) const {
    auto it = by_handle_.lower_bound({handle, std::string()});
    return it != by_handle_.end() && it->first == handle;
  }
  void TakeAll(const Handle& handle, std::vector<std::string>* out) {
    auto it = by_handle_.lower_bound({handle, std::string()});
    while (it != by_handle_.end() && it->first == handle) {
      by_name_.erase(it->second);
      out->push_back(it->second);
      it = by_handle_.erase(it);
    }
  }

  Map by_name_;
  std::set<std::pair<Handle, std::string>> by_handle_;
};

class Session final : public device::PdEventSink {
 public:
  Session(uint64_t id, std::string token, SessionKind kind,
          size_t completion_depth, Identity identity,
          std::shared_ptr<Tenant> tenant)
      : id_(id),
        token_(std::move(token)),
        kind_(kind),
        completion_depth_(completion_depth),
        identity_(identity),
        tenant_(std::move(tenant)) {}

  uint64_t id() const { return id_; }
  const std::string& token() const { return token_; }
  SessionKind kind() const { return kind_; }
  // Who owns the session, and the tenant its use counts against.
  const Identity& identity() const { return identity_; }
  const std::shared_ptr<Tenant>& tenant() const { return tenant_; }

  // --- device::PdEventSink ---
  void OnCompletion(const device::WorkCompletion& completion) override;
  void OnPeerConnected(device::ConnectionId connection,
                       const std::string& peer) override;
  void OnPeerDisconnected(device::ConnectionId connection) override;
  // Charges the connection to the tenant's peer-connection quota.
  absl::Status AdmitPeerConnection() override;
  // Gives back what admitted connections still hold (the session ended, so
  // their disconnects will not come).
  void ReleasePeerConnections();
  // A connection the old process admitted, handed over with the session:
  // charged to the tenant whatever its quota says now (it was admitted),
  // and listed, without a PEER_CONNECTED (the client heard it).
  void AdoptPeerConnection(device::ConnectionId connection,
                           const std::string& peer);

  // Keeps `memory` (a mapping an MR or LAM of the session pointed into)
  // until the session's PD is gone, when the device's release of that MR or
  // LAM found the PD dying: DeallocatePd unpins it later, and the pages must
  // still be mapped then. Drops it at once when the PD is already gone.
  void KeepUntilPdGone(std::shared_ptr<const void> memory)
      ABSL_LOCKS_EXCLUDED(mu);
  // The PD is gone: returns what KeepUntilPdGone kept, for the caller to
  // drop (outside the lock: dropping a mapping unmaps it).
  std::vector<std::shared_ptr<const void>> MarkPdGone() ABSL_LOCKS_EXCLUDED(mu);

  // Completion stream plumbing. Push queues a completion (core-made ones:
  // REGISTRATION_PROGRESS) and wakes the stream. A progress report replaces
  // the queued report of the same work (request id, buffer, range); a full
  // queue drops its oldest progress report, or else its oldest entry, to
  // take a completion, and drops a new progress report rather than push a
  // completion out. Every drop is counted.
  void Push(v1::Completion completion) ABSL_LOCKS_EXCLUDED(mu);
  std::optional<v1::Completion> PopCompletion() ABSL_LOCKS_EXCLUDED(mu);
  // PopCompletion for stream `stream`: nothing once another took over.
  std::optional<v1::Completion> PopCompletionFor(uint64_t stream)
      ABSL_LOCKS_EXCLUDED(mu);
  bool ended() const ABSL_LOCKS_EXCLUDED(mu);
  void MarkEndedAndNotify() ABSL_LOCKS_EXCLUDED(mu);
  // A live handover: while held, the stream delivers nothing (what is
  // queued goes into the snapshot, and must not also be streamed here);
  // once handed over, the stream ends with UNAVAILABLE HANDED_OVER (the
  // session goes on in the new process: open the stream again there).
  // Each wakes the stream.
  void HoldStream(bool hold) ABSL_LOCKS_EXCLUDED(mu);
  void MarkHandedOverAndNotify() ABSL_LOCKS_EXCLUDED(mu);
  bool stream_held() const ABSL_LOCKS_EXCLUDED(mu);
  bool handed_over() const ABSL_LOCKS_EXCLUDED(mu);
  void Notify() ABSL_LOCKS_EXCLUDED(mu);

  // --- lease sessions ---
  void StartLeaseLocked(absl::Duration ttl, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  bool LeaseExpiredLocked(absl::Time now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Every call renews the lease by its ttl.
  void RenewLeaseLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Who the session's process is (SO_PEERCRED, or the vouching session's).
  void SetPeerLocked(uint32_t uid, uint32_t pid)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  uint32_t peer_pid_locked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return peer_pid_;
  }
  // GetSession's answer.
  void FillInfoLocked(v1::SessionInfo* out) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // A new buffer's default base address: from a per-session space that says
  // nothing about mrd's own address layout, 2 MiB-aligned, with a gap, so
  // that buffers never look adjacent.
  uint64_t NextBufferAddressLocked(uint64_t size)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // The session's peer ticket, once made (empty before).
  const std::string& peer_ticket_locked() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return peer_ticket_;
  }
  // Keeps the first ticket made; later ones are dropped.
  void SetPeerTicketLocked(const std::string& ticket)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // The same for the core's device `device` (0: the two above).
  std::string PeerTicketLocked(size_t device) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void SetPeerTicketLocked(size_t device, const std::string& ticket)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // The event sink of the session's PD on the core's device `device`: the
  // session itself for device 0; for another device, one that tags the
  // connection ids it reports with the device (ConnectionOnDevice), so
  // that the connections of every device share `connections` without
  // colliding. mrd's devices number their connections so (device i's ids
  // start at i << kDeviceShift: DeviceModelOptions::connection_id_base),
  // and then the tag changes nothing: the id the session lists is the one
  // the peer learns and FastRegister names. Alive as long as the session.
  device::PdEventSink* SinkFor(size_t device);
  // A connection id of device `device` as the session lists it.
  static device::ConnectionId ConnectionOnDevice(size_t device,
                                                 device::ConnectionId id) {
    return id | (static_cast<device::ConnectionId>(device) << kDeviceShift);
  }
  static constexpr int kDeviceShift = 56;

  // Idempotency: the first answer to `request_id` (null if none is
  // remembered), forgetting one whose registration is gone.
  const v1::RegisterMrResponse* FindRequestLocked(const std::string& request_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Remembers the first answer to `request_id`, forgetting the oldest
  // beyond `memory` of them.
  void RememberRequestLocked(const std::string& request_id,
                             const v1::RegisterMrResponse& response,
                             size_t memory) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Handover: the session's own state (lease, peer, ticket, buffer address
  // space, remembered request ids, queued completions) into the snapshot of
  // another mrd process, and taken from one. Its tables (buffers,
  // registrations) are the core's to hand over.
  void ExportLocked(absl::Time now, v1::HandedOverSession* out) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void AdoptLocked(const v1::HandedOverSession& in, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // The completion stream: one subscriber at a time. A new one takes over
  // from the one before, which is woken to find itself replaced: a client
  // whose stream broke can open another at once, before mrd has noticed
  // the old one's end. Returns the new stream's number, which Unsubscribe,
  // stream_replaced and PopCompletionFor take.
  uint64_t Subscribe(std::function<void()> notify) ABSL_LOCKS_EXCLUDED(mu);
  // Detaches stream `stream`, if it is still the session's.
  void Unsubscribe(uint64_t stream) ABSL_LOCKS_EXCLUDED(mu);
  bool stream_replaced(uint64_t stream) const ABSL_LOCKS_EXCLUDED(mu);
  uint64_t completions_dropped_locked() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return completions_dropped_;
  }

  mutable absl::Mutex mu;
  bool closing ABSL_GUARDED_BY(mu) = false;
  device::PdId pd ABSL_GUARDED_BY(mu) = 0;
  // The session's PD on each of the core's devices (pds[0] == pd; LAMs, MR
  // objects and fast registration use device 0's).
  std::vector<device::PdId> pds ABSL_GUARDED_BY(mu);
  // SetDefaultDevices: as the caller gave it, and as CacheKey::devices bits
  // (or `nearest`), for registrations that name no devices.
  v1::DeviceSelection default_devices ABSL_GUARDED_BY(mu);
  uint32_t default_device_bits ABSL_GUARDED_BY(mu) = 1;
  bool default_nearest ABSL_GUARDED_BY(mu) = false;
  uint64_t pinned_bytes ABSL_GUARDED_BY(mu) = 0;
  // Registrations made on the device for this session and not yet
  // deregistered (what the registration limit counts; cache hits are not).
  uint64_t device_registrations ABSL_GUARDED_BY(mu) = 0;
  // Logical page address on a device (LamPageKey) -> LAM id, for
  // FastRegister page checks.
  std::map<uint64_t, uint64_t> page_to_lam ABSL_GUARDED_BY(mu);
  // page_to_lam's key: every device has a logical address space of its own.
  static uint64_t LamPageKey(uint32_t device, uint64_t page) {
    return ConnectionOnDevice(device, page);
  }
  // The device a connection id the session lists is on.
  static uint32_t DeviceOfConnection(device::ConnectionId id) {
    return static_cast<uint32_t>(id >> kDeviceShift);
  }

  std::map<uint64_t, BufferRecord> buffers ABSL_GUARDED_BY(mu);
  // A B-tree: ordered by id like the other tables, at a few bytes per
  // registration over the record itself (a std::map node costs 48 more).
  absl::btree_map<uint64_t, RegistrationRecord> registrations
      ABSL_GUARDED_BY(mu);
  std::map<uint64_t, MrObject> mrs ABSL_GUARDED_BY(mu);
  std::map<uint64_t, LamRecord> lams ABSL_GUARDED_BY(mu);
  std::map<device::ConnectionId, std::string> connections ABSL_GUARDED_BY(mu);
  // Names the session published on the directory (publications.h).
  PublishedNames published ABSL_GUARDED_BY(mu);

 private:
  // The oldest completion not yet sent, taken off the queue.
  std::optional<v1::Completion> PopLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  bool ended_ ABSL_GUARDED_BY(mu) = false;
  bool stream_held_ ABSL_GUARDED_BY(mu) = false;
  bool handed_over_ ABSL_GUARDED_BY(mu) = false;
  uint32_t peer_uid_ ABSL_GUARDED_BY(mu) = 0;
  uint32_t peer_pid_ ABSL_GUARDED_BY(mu) = 0;
  absl::Duration ttl_ ABSL_GUARDED_BY(mu) = absl::ZeroDuration();
  absl::Time expires_ ABSL_GUARDED_BY(mu) = absl::InfiniteFuture();
  // Memory the device may still point into until DeallocatePd returns: an MR
  // or LAM whose own release found the PD already being torn down (NOT_FOUND)
  // leaves its mapping here, and the session's end drops it once the PD is
  // gone.
  std::vector<std::shared_ptr<const void>> memory_until_pd_gone_
      ABSL_GUARDED_BY(mu);
  bool pd_gone_ ABSL_GUARDED_BY(mu) = false;
  std::string peer_ticket_ ABSL_GUARDED_BY(mu);
  // Devices 1 and up: their tickets, by device - 1 ("" not made yet).
  std::vector<std::string> device_tickets_ ABSL_GUARDED_BY(mu);
  // Devices 1 and up: the sinks of SinkFor, by device - 1.
  absl::Mutex sinks_mu_;
  std::vector<std::unique_ptr<device::PdEventSink>> device_sinks_
      ABSL_GUARDED_BY(sinks_mu_);
  uint64_t next_buffer_address_ ABSL_GUARDED_BY(mu) = uint64_t{1} << 32;
  // Idempotency: request_id -> the response first returned.
  std::map<std::string, v1::RegisterMrResponse> request_ids_
      ABSL_GUARDED_BY(mu);
  std::deque<std::string> request_id_order_ ABSL_GUARDED_BY(mu);

  std::deque<v1::Completion> completions_ ABSL_GUARDED_BY(mu);
  uint64_t completions_dropped_ ABSL_GUARDED_BY(mu) = 0;
  std::function<void()> notify_ ABSL_GUARDED_BY(mu);
  // The subscribed stream's number (0: none); the last number given.
  uint64_t stream_ ABSL_GUARDED_BY(mu) = 0;
  uint64_t last_stream_ ABSL_GUARDED_BY(mu) = 0;

  const uint64_t id_;
  const std::string token_;
  const SessionKind kind_;
  const size_t completion_depth_;
  const Identity identity_;
  const std::shared_ptr<Tenant> tenant_;
  // Connections admitted and not yet disconnected (not under `mu`: admission
  // runs under the device's lock).
  std::atomic<uint64_t> admitted_peers_{0};
};

// A session's completion stream (Core::SubscribeCompletions): the session
// to pop from, and the stream's number. `->` reaches the session.
struct CompletionSubscription {
  std::shared_ptr<Session> session;
  uint64_t stream = 0;

  Session* operator->() const { return session.get(); }
};

}  // namespace mrd::core

#endif  // MRD_SERVER_CORE_SESSION_H_
