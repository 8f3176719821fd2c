// DeviceModel: the device model every mrd device shares, written once. A
// device (the software device, the verbs device) is a provider: it derives
// from DeviceModel and implements only what its hardware does differently
// (the Provider* hooks below); everything else lives here:
//
// * Tables: protection domains, MRs (registered and fast-register MR
//   objects), LAMs, peer connections and peer tickets, each named by an id
//   that is never reused within the device's lifetime (MR ids: not before
//   2^40 MRs were made, see mrs_).
// * Rules: span and base-address checks, access and work-flag bits, the
//   fast-register page-array rules (fast_register_rules.h), the resolution
//   of a page array to the LAM pages of one PD, and MR-object states.
// * Ordering: posted work runs on one worker thread in post order per
//   connection; kWorkDefer work is held until the next non-deferred post on
//   its connection (or FlushDeferred); kWorkSilentSuccess hides successes
//   only; kWorkReadFence holds trivially, since each request runs to
//   completion before the next. The worker also delivers every sink event
//   (peer connected, completions, peer disconnected), so a PD's events come
//   in order, from one thread, never with a caller's device call on the
//   stack.
// * Revocation: a peer operation of a provider that moves data itself (the
//   software device) holds an in-flight reference on the MR it uses
//   (BeginPeerAccess / EndPeerAccess). Revoking (DeregisterMr, invalidation,
//   FreeFastRegisterMr, DeallocatePd) makes the MR unusable first, then waits
//   for those references and for a fast registration executing on it, and
//   only then asks the provider to release it. So every peer operation
//   either completes before the revoking call returns (or the invalidation's
//   completion is delivered) or fails.
// * Busy PDs: work on a PD's objects done outside the mutex (pinning,
//   provider calls, sink calls) holds the PD busy; DeallocatePd waits until
//   it is idle, so teardown never races it.
//
// Locking: one mutex (mu_) guards every table. Provider hooks are called
// without it unless their name ends in Locked, and a provider never calls
// the model's public methods from inside a Locked hook.
#ifndef MRD_SERVER_DEVICE_DEVICE_MODEL_H_
#define MRD_SERVER_DEVICE_DEVICE_MODEL_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/common/slab.h"
#include "server/common/thread.h"
#include "server/device/device.h"
#include "server/device/device_handover.h"
#include "server/device/fault_points.h"
#include "server/device/iova_space.h"
#include "server/device/secure_random.h"

namespace mrd::device {

// What a provider keeps for one object of the model (a verbs PD, a verbs
// registration, a key of the software device's key table). The model owns it
// while the object lives and hands it back to the provider to release.
class ProviderState {
 public:
  virtual ~ProviderState() = default;
};

// One run of backing-file bytes that a peer operation moves.
struct IoSegment {
  int fd = -1;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// Where the bytes of one page of a fast-registration page array live.
struct PageRef {
  int fd = -1;
  uint64_t file_offset = 0;
};

struct DeviceModelOptions {
  uint64_t page_size = 0;
  uint64_t max_mr_size = 0;
  uint32_t max_page_list_length = 0;
  // Peer connections bound to one PD at once.
  uint32_t max_session_connections = 1024;
  // The logical address space of LAMs: the first address (random, non-zero,
  // page-aligned) and the end.
  uint64_t iova_start = 0;
  uint64_t iova_limit = 0;
  // Not owned; nullptr in production (fault_points.h).
  FaultPoints* fault_points = nullptr;
  // Connection ids start above this (peers learn their id in the hello):
  // mrd gives device i the base i << 56, so that the ids of all its
  // devices differ and each says which device it is on.
  uint64_t connection_id_base = 0;
};

// The model is also the device's part in a handover (device_handover.h):
// what differs there between providers (whether they can, the peer path's
// listener and connections) is asked of the provider too.
class DeviceModel : public Device, public DeviceHandover {
 public:
  ~DeviceModel() override;
  DeviceModel(const DeviceModel&) = delete;
  DeviceModel& operator=(const DeviceModel&) = delete;

  const DeviceAttributes& Attributes() const final { return attributes_; }
  // The provider's (ProviderPeerPath).
  std::optional<PeerPathCounts> PeerPath() const final {
    return ProviderPeerPath();
  }

  // Starts the worker, then the provider (ProviderStart). Errors:
  // FAILED_PRECONDITION "ALREADY_STARTED", or the provider's.
  absl::Status Start() final;
  // Stops the provider (ProviderStop: no new peers, every connection
  // closed), then lets the worker drain and stop. Idempotent.
  void Shutdown() final;

  absl::StatusOr<PdId> AllocatePd(PdEventSink* sink) final;
  absl::Status DeallocatePd(PdId pd) final;
  absl::StatusOr<std::string> CreatePeerTicket(PdId pd) final;

  absl::StatusOr<MrKeys> RegisterMr(PdId pd, const MemorySpan& span,
                                    uint64_t base_address,
                                    uint32_t access) final;
  absl::Status DeregisterMr(MrId mr) final;

  absl::StatusOr<LogicalMapping> BuildLam(PdId pd,
                                          const MemorySpan& span) final;
  absl::Status ReleaseLam(LamId lam) final;

  absl::StatusOr<MrKeys> AllocateFastRegisterMr(PdId pd, bool allow_remote,
                                                uint32_t max_pages) final;
  absl::Status FreeFastRegisterMr(MrId mr) final;
  absl::StatusOr<MrKeys> QueryMr(MrId mr) const final;

  absl::StatusOr<uint64_t> PostFastRegister(ConnectionId connection,
                                            const FastRegisterWork& work) final;
  absl::StatusOr<uint64_t> PostInvalidate(ConnectionId connection,
                                          const InvalidateWork& work) final;

  // --- DeviceHandover ---
  DeviceHandover& handover() final { return *this; }
  // The provider's (ProviderCanHandOver).
  absl::Status CanHandOver() const final;
  bool DisconnectPeers(absl::Duration timeout) final;
  // The peer path's listener and established connections are the
  // provider's (ProviderStopPeerAccepting and the like).
  absl::StatusOr<UniqueFd> StopPeerAccepting() final;
  void ResumePeerAccepting() final;
  absl::StatusOr<UniqueFd> DuplicatePeerListener() final;
  absl::StatusOr<std::vector<HandedOverPeer>> FreezePeers(
      absl::Duration timeout) final;
  void ThawPeers() final;
  void DropFrozenPeers() final;
  absl::Status AdoptPeer(PdId pd, HandedOverPeer peer) final;

  // The adoptions refuse with CanHandOver's error first.
  //
  // AdoptMr is RegisterMr (same checks, pinning, undo on failure: a refusal
  // leaves nothing pinned), except that the provider is asked for exactly
  // `lkey` and `rkey` (ProviderAdoptRegister) instead of drawing new keys.
  // The MR gets a new MrId of this device. Adopt every MR before anything
  // else takes keys here: a key drawn meanwhile may be one an adopted MR
  // needs (KEY_IN_USE).
  absl::StatusOr<MrKeys> AdoptMr(PdId pd, const MemorySpan& span,
                                 uint64_t base_address, uint32_t access,
                                 uint32_t lkey, uint32_t rkey) final;
  // Adds `ticket` to the PD's tickets, as CreatePeerTicket does: a PD may
  // hold several tickets (CreatePeerTicket may be called again), so a
  // ticket the PD already has stays valid, and adopting one the PD already
  // holds is OK and changes nothing. Errors: INVALID_ARGUMENT "BAD_TICKET"
  // (not a ticket CreatePeerTicket makes: 32 lower-case hex digits; the
  // message never shows it), FAILED_PRECONDITION "TICKET_IN_USE" (another
  // PD holds it), NOT_FOUND (PD).
  absl::Status AdoptPeerTicket(PdId pd, const std::string& ticket) final;
  // The MR object as AdoptFastRegisterMr takes it; its pages are the page
  // array exactly as posted. Refused with CanHandOver's error first.
  absl::StatusOr<FastMrState> DescribeFastMr(MrId mr) const final;
  // BuildLam (same checks, pinning, undo on failure) at exactly
  // `first_page` (IovaSpace::AllocateAt: no guard gap of its own) with
  // exactly `privileged_key` (ProviderAdoptRegister with `lam` set). Adopt
  // the LAMs before the MR objects whose pages they map.
  absl::StatusOr<LogicalMapping> AdoptLam(PdId pd, const MemorySpan& span,
                                          uint64_t first_page,
                                          uint32_t privileged_key) final;
  // AllocateFastRegisterMr with exactly `state`'s keys
  // (ProviderAdoptFastMr); when state.valid, the fast registration is
  // committed at once, as ExecuteFastRegister commits one, with its pages
  // resolved through this device's LAMs and the keys kept (no new rkey).
  absl::StatusOr<MrKeys> AdoptFastRegisterMr(PdId pd,
                                             const FastMrState& state) final;
  uint64_t LogicalAddressWatermark() const final;
  void ContinueLogicalAddressesAbove(uint64_t watermark) final;
  uint64_t ConnectionIdWatermark() const final;
  void ContinueConnectionIdsAbove(uint64_t watermark) final;
  // ProviderPin now, taken over by the next registration or LAM of the
  // same span (PinTakingAhead); DropPinsAhead gives back the ones not
  // taken.
  absl::Status PinAhead(const MemorySpan& span) final;
  void DropPinsAhead() final;
  size_t PinsAhead() const final;

  // Hands the connection's deferred (kWorkDefer) work to the worker now, as
  // the next non-deferred post would. Errors: FAILED_PRECONDITION
  // (STATUS_CONNECTION_INVALID) as for posts.
  absl::Status FlushDeferred(ConnectionId connection);
  // Blocks until the worker has no task queued or running: every event due
  // so far has been delivered. For tests and orderly teardown; must not be
  // called from a sink. Returns at once when the device was never started.
  void WaitForWorkerIdle();

  // What the model holds right now, for leak checks in tests.
  struct ModelCounts {
    size_t pds = 0;
    size_t mrs = 0;        // registered MRs and fast-register MR objects
    size_t valid_mrs = 0;  // registered or fast-registered: peers may use
    size_t lams = 0;
    size_t iova_ranges = 0;  // logical address ranges mapped
    size_t tickets = 0;
    size_t connections = 0;
    size_t lam_fast_register_refs = 0;    // sum of the LAMs' fast-reg users
    size_t pd_objects = 0;                // sum over PDs of their MR/LAM sets
    uint64_t session_limit_refusals = 0;  // connections refused: PD at cap
  };
  ModelCounts CountModel() const;

 protected:
  // What a provider registered: the keys, and its own state to release.
  struct Registration {
    uint32_t lkey = 0;
    uint32_t rkey = 0;
    std::unique_ptr<ProviderState> state;
  };
  // A peer operation's view of the memory behind an rkey (BeginPeerAccess).
  struct PeerAccess {
    std::vector<IoSegment> plan;
    MrId mr = 0;  // EndPeerAccess's argument: the MR held
  };
  struct BindResult {
    PdId pd = 0;
    ProviderState* pd_state = nullptr;  // valid while the PD lives
  };

  DeviceModel(DeviceAttributes attributes, const DeviceModelOptions& options);

  // Shutdown(), then DeallocatePd of every PD left (nothing stays pinned),
  // without calling their sinks. A provider's destructor calls this first:
  // the model's own destructor can no longer reach the provider's hooks.
  void ShutdownAndReleaseAll();

  // --- Provider hooks ------------------------------------------------------

  // Threads and listeners of the provider, after the worker started.
  virtual absl::Status ProviderStart() = 0;
  // No new peer connections; every connection closed (each reported with
  // ConnectionClosed). Called once, before the worker stops.
  virtual void ProviderStop() = 0;
  // Checked by every call that needs the adapter (verbs: a lost device).
  virtual absl::Status ProviderUsable() const { return absl::OkStatus(); }
  // Extra checks of a registration's base address (verbs: the adapter maps
  // whole pages).
  virtual absl::Status ProviderCheckBase(const MemorySpan& /*span*/,
                                         uint64_t /*base_address*/) const {
    return absl::OkStatus();
  }

  virtual absl::StatusOr<std::unique_ptr<ProviderState>> ProviderAllocatePd() {
    return nullptr;
  }
  // Called with every MR, LAM and connection of the PD already released.
  virtual absl::Status ProviderDeallocatePd(
      std::unique_ptr<ProviderState> /*pd*/) {
    return absl::OkStatus();
  }
  // Pins [span) (software: page refcounts) before a registration or LAM.
  // Verbs pins by registering: nothing to do here.
  virtual absl::Status ProviderPin(const MemorySpan& /*span*/) {
    return absl::OkStatus();
  }
  virtual void ProviderUnpin(const MemorySpan& /*span*/) {}
  // Makes pinned [span) reachable at `iova` with `access` (AccessBits; 0 for
  // a LAM's local-only registration). `owner` names the object (the MR's id,
  // or the LAM's id with `lam` set).
  virtual absl::StatusOr<Registration> ProviderRegister(
      ProviderState* pd, const MemorySpan& span, uint64_t iova, uint32_t access,
      uint64_t owner, bool lam) = 0;
  // ProviderRegister for an MR (AdoptMr) or a LAM (`lam`, AdoptLam) that
  // must get exactly `lkey` and `rkey`, the keys another process had for
  // it. A LAM is local-only: only its lkey (the privileged key) was handed
  // out, and the model passes it as both. Errors: INVALID_ARGUMENT
  // "BAD_KEY" (keys this provider cannot give), FAILED_PRECONDITION
  // "KEY_IN_USE" (held here). A provider whose CanHandOver is OK
  // implements it; the default refuses.
  virtual absl::StatusOr<Registration> ProviderAdoptRegister(
      ProviderState* pd, const MemorySpan& span, uint64_t iova, uint32_t access,
      uint64_t owner, uint32_t lkey, uint32_t rkey, bool lam);
  // Releases a registration (its key is dead when this returns). Errors
  // leave the memory pinned; the model reports them.
  virtual absl::Status ProviderDeregister(
      std::unique_ptr<ProviderState> state) = 0;
  // A provider whose MR registration is nothing but its key (software) may
  // return no state from ProviderRegister for an MR (not for a LAM): the
  // model then keeps none (a million MRs do not pay for an object each) and
  // releases the registration by its lkey with this. A provider that never
  // returns a null MR state never sees it called.
  virtual absl::Status ProviderDeregisterKey(uint32_t /*lkey*/) {
    return absl::OkStatus();
  }
  // An MR object's keys (C1): a key that matches nothing yet (software), or
  // none until the first fast registration (verbs).
  virtual absl::StatusOr<Registration> ProviderAllocateFastMr(ProviderState* pd,
                                                              MrId owner) = 0;
  // ProviderAllocateFastMr with exactly `lkey` and `rkey`, an MR object's
  // current keys in another process (AdoptFastRegisterMr). When the object
  // was fast-registered these keys are also its mapping's: the model then
  // commits the mapping without ProviderFastRegister, so only a provider
  // whose mapping is its key and the model's page array (software) can
  // implement it. Errors as ProviderAdoptRegister's; the default refuses.
  virtual absl::StatusOr<Registration> ProviderAdoptFastMr(ProviderState* pd,
                                                           MrId owner,
                                                           uint32_t lkey,
                                                           uint32_t rkey);
  // Maps `pages` at fr.base_address for the MR (on the worker). `object` is
  // ProviderAllocateFastMr's state, `previous_rkey` the MR's last rkey,
  // which the new one must differ from. Returns the new keys, and the
  // mapping's own state if it has one (verbs: the remap's registration).
  virtual absl::StatusOr<Registration> ProviderFastRegister(
      ProviderState* pd, ProviderState* object, MrId mr,
      const std::vector<PageRef>& pages, const FastRegisterWork& fr,
      uint32_t previous_rkey) = 0;
  // Asks the provider to close these connections of a dying PD; each is
  // reported with ConnectionClosed (DeallocatePd waits for that).
  virtual void ProviderCloseConnectionsLocked(
      const std::vector<ConnectionId>& connections)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) = 0;
  // The peer path's gauges, if the provider keeps them.
  virtual std::optional<PeerPathCounts> ProviderPeerPath() const {
    return std::nullopt;
  }
  // Handover (device_handover.h, where each call is described): whether
  // this provider can re-create its objects in another process, and its
  // peer path's listener and established connections. The defaults are
  // those of a provider that cannot (DeviceHandover's).
  virtual absl::Status ProviderCanHandOver() const {
    return DeviceHandover::CanHandOver();
  }
  virtual absl::StatusOr<UniqueFd> ProviderStopPeerAccepting() {
    return DeviceHandover::StopPeerAccepting();
  }
  virtual void ProviderResumePeerAccepting() {}
  virtual absl::StatusOr<UniqueFd> ProviderDuplicatePeerListener() {
    return DeviceHandover::DuplicatePeerListener();
  }
  virtual absl::StatusOr<std::vector<HandedOverPeer>> ProviderFreezePeers(
      absl::Duration /*timeout*/) {
    return std::vector<HandedOverPeer>{};
  }
  virtual void ProviderThawPeers() {}
  virtual void ProviderDropFrozenPeers() {}
  virtual absl::Status ProviderAdoptPeer(PdId pd, HandedOverPeer peer) {
    return DeviceHandover::AdoptPeer(pd, std::move(peer));
  }

  // --- What providers call -------------------------------------------------

  // A new peer connection that has not named a PD yet. nullopt once the
  // device is shut down.
  std::optional<ConnectionId> NewConnection(const std::string& remote)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Binds a new connection to the PD of `ticket`, within the PD's
  // connection limit and if its sink admits it. `ready`: peers may use it
  // at once (OnPeerConnected is queued before this returns); otherwise it
  // is connecting until ConnectionEstablished. The PD's state stays valid
  // until the connection is reported closed. Errors: NOT_FOUND "BAD_TICKET"
  // (unknown ticket, or its PD is gone), RESOURCE_EXHAUSTED (the message
  // says which limit), FAILED_PRECONDITION "ALREADY_BOUND".
  absl::StatusOr<BindResult> BindConnection(ConnectionId connection,
                                            absl::string_view ticket,
                                            bool ready = true)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A connecting connection is up: OnPeerConnected is queued, posts work.
  void ConnectionEstablished(ConnectionId connection) ABSL_LOCKS_EXCLUDED(mu_);
  // An RC queue pair in error: posts fail from now on.
  void ConnectionError(ConnectionId connection) ABSL_LOCKS_EXCLUDED(mu_);
  // The connection is gone: queued work is flushed with FLUSHED
  // completions, then the PD's sink hears OnPeerDisconnected (when it heard
  // OnPeerConnected).
  void ConnectionClosed(ConnectionId connection) ABSL_LOCKS_EXCLUDED(mu_);
  // Handover: the PD of a connection that may move to another process —
  // ready (announced) and with no work held back on it; nullopt otherwise.
  std::optional<PdId> MovableConnection(ConnectionId connection) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Another process's connection `id` (MovableConnection there), ready in
  // `pd` at once, without OnPeerConnected (its sink heard it there) and
  // without asking the sink to admit it (the sink's owner counted it when
  // it adopted the PD's state); OnPeerDisconnected follows at its end.
  // Errors: ALREADY_EXISTS "CONNECTION_EXISTS", NOT_FOUND "UNKNOWN_PD",
  // FAILED_PRECONDITION "DEVICE_SHUT_DOWN".
  absl::Status AdoptConnection(ConnectionId id, PdId pd,
                               const std::string& remote)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The slot of an MR in the model's MR table: at most 2^24 - 1, the same
  // for the MR's whole life. A provider may name an MR by it (the software
  // device's key table does, in 32 bits instead of 64).
  static uint32_t MrSlot(MrId mr) { return SlabIds::SlotOf(mr); }
  static constexpr uint32_t kNoMrSlot = ~uint32_t{0};
  // The NIC's checks of an incoming READ/WRITE on `connection` with `rkey`
  // (which the provider found to belong to the MR in slot `mr_slot`, or
  // kNoMrSlot): the MR there holds exactly `rkey` (so a slot reused since
  // the key was issued never matches), is valid, in the connection's PD,
  // covers [address, +length) and grants `need`. On success the MR cannot
  // be revoked until EndPeerAccess. Errors: PERMISSION_DENIED
  // "REMOTE_ACCESS_ERROR", one message for every key that does not work
  // here (a peer must not learn that a key exists elsewhere, W8).
  absl::StatusOr<PeerAccess> BeginPeerAccess(ConnectionId connection,
                                             uint32_t mr_slot, uint32_t rkey,
                                             uint64_t address, uint64_t length,
                                             uint32_t need)
      ABSL_LOCKS_EXCLUDED(mu_);
  void EndPeerAccess(const PeerAccess& access) ABSL_LOCKS_EXCLUDED(mu_);

  // The adapter is gone (ProviderUsable fails from before this call):
  // every connection is put in error, then, once no call is working on any
  // PD's objects, the provider state of every MR, LAM and PD is taken out
  // of the model and returned for the provider to release. The objects
  // stay (their ids remain valid for DeregisterMr, ReleaseLam and
  // DeallocatePd, which then have nothing left to undo); MRs are no longer
  // valid.
  struct Taken {
    std::vector<std::unique_ptr<ProviderState>> memory;  // MRs, LAMs
    std::vector<std::unique_ptr<ProviderState>> pds;
  };
  void MarkAllConnectionsError() ABSL_LOCKS_EXCLUDED(mu_);
  Taken TakeAllProviderState() ABSL_LOCKS_EXCLUDED(mu_);

  // Where the device is in its life (Start, Shutdown).
  enum class Phase { kNew, kStarted, kShutDown };
  Phase phase() const ABSL_LOCKS_EXCLUDED(mu_);

  uint64_t page_size() const { return options_.page_size; }
  FaultPoints* fault_points() const { return options_.fault_points; }
  DeviceAttributes& mutable_attributes() { return attributes_; }

  // Guards the model's tables; Locked hooks run under it.
  mutable absl::Mutex mu_;

 private:
  struct Pd;
  struct Mr;
  struct Lam;
  struct Connection;
  struct ResolvedPages;

  // One posted work request (a send-queue entry).
  struct Work {
    WorkCompletion::Kind kind = WorkCompletion::Kind::kFastRegister;
    uint64_t id = 0;
    ConnectionId connection = 0;
    PdId pd = 0;
    MrId mr = 0;
    uint32_t flags = 0;
    uint64_t request_context = 0;
    FastRegisterWork fast_register;  // kFastRegister only
  };
  // What the worker does next: run work, or deliver a connection event.
  struct Task {
    enum class Kind { kWork, kConnected, kDisconnected };
    Kind kind = Kind::kWork;
    PdId pd = 0;
    ConnectionId connection = 0;
    std::string remote;  // kConnected
    Work work;           // kWork
  };

  absl::Status ValidateSpan(const MemorySpan& span,
                            absl::string_view call) const;
  absl::Status UsableLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // A live (not dying) PD. Errors: NOT_FOUND "UNKNOWN_PD".
  absl::StatusOr<Pd*> FindPdLocked(PdId pd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the PD busy: DeallocatePd waits until it is idle again.
  absl::StatusOr<ProviderState*> BeginPdOp(PdId pd) ABSL_LOCKS_EXCLUDED(mu_);
  void EndPdOp(PdId pd) ABSL_LOCKS_EXCLUDED(mu_);
  void EndPdOpLocked(PdId pd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The keys AdoptMr asks the provider for.
  struct AdoptedKeys {
    uint32_t lkey = 0;
    uint32_t rkey = 0;
  };
  // The pin of a registration or LAM of `span` (RegisterMr, BuildLam and
  // their adoptions): one PinAhead made of exactly this span if one is
  // left, else ProviderPin. Either way the caller owns a pin of `span` on
  // OK (ProviderUnpin gives it back).
  absl::Status PinTakingAhead(const MemorySpan& span) ABSL_LOCKS_EXCLUDED(mu_);
  // RegisterMr and AdoptMr (`adopt` non-null), from the checks on.
  absl::StatusOr<MrKeys> Register(PdId pd, const MemorySpan& span,
                                  uint64_t base_address, uint32_t access,
                                  const AdoptedKeys* adopt)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<MrKeys> RegisterPinned(PdId pd, ProviderState* pd_state,
                                        const MemorySpan& span,
                                        uint64_t base_address, uint32_t access,
                                        const AdoptedKeys* adopt)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Where AdoptLam puts the LAM, and the key it gets.
  struct AdoptedLam {
    uint64_t first_page = 0;
    uint32_t privileged_key = 0;
  };
  // BuildLam and AdoptLam (`adopt` non-null), from the checks on.
  absl::StatusOr<LogicalMapping> Map(PdId pd, const MemorySpan& span,
                                     const AdoptedLam* adopt)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<LogicalMapping> MapPinned(PdId pd, ProviderState* pd_state,
                                           const MemorySpan& span,
                                           const AdoptedLam* adopt)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The LAM's logical range: drawn after a random guard gap, or exactly
  // adopt->first_page.
  absl::StatusOr<uint64_t> ReserveIovaLocked(LamId id, uint64_t page_count,
                                             const AdoptedLam* adopt)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // AllocateFastRegisterMr and AdoptFastRegisterMr (`adopt` non-null:
  // allow_remote and max_pages are its own).
  absl::StatusOr<MrKeys> AllocateFastMr(PdId pd, bool allow_remote,
                                        uint32_t max_pages,
                                        const FastMrState* adopt)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The checks of an adopted fast registration that need no table, as
  // PostFastRegister makes them.
  absl::Status CheckAdoptedFastRegistration(const FastMrState& state) const;
  // Commits the adopted fast registration of a new MR object (its pages
  // resolved already), as ExecuteFastRegister commits one, but keeping the
  // keys it has.
  void CommitAdoptedLocked(Mr* mr, const FastMrState& state,
                           ResolvedPages resolved)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A fast registration's mapping (`fr`'s range, access and page array,
  // `resolved` through the LAMs) on the MR, which becomes valid: what
  // ExecuteFastRegister and CommitAdoptedLocked both commit.
  void SetMappingLocked(Mr* mr, const FastRegisterWork& fr,
                        ResolvedPages resolved)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The MR of `id` (any state), or nullptr.
  Mr* LookupMrLocked(MrId id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An MR that is not being destroyed. Errors: NOT_FOUND "UNKNOWN_MR".
  absl::StatusOr<Mr*> FindMrLocked(MrId mr) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A slot for a new MR of `pd`, not yet findable (InsertMrLocked makes it
  // so, FreeMrLocked gives it back). Errors: RESOURCE_EXHAUSTED when the MR
  // table is full or out of memory.
  absl::StatusOr<Mr*> ReserveMrLocked(PdId pd, absl::string_view call)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeMrLocked(MrId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes the MR's fast-registered mapping unusable, waits (releasing the
  // mutex) until no peer operation is inside it, and takes what it held:
  // its LAM references are dropped, its provider state returned. The MR
  // stays where it is during the wait: the caller either destroys it
  // (DestroyMrLocked) or holds it (Mr::holders).
  std::unique_ptr<ProviderState> UnmapLocked(Mr* mr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Revokes the MR, waits for peers and the worker to leave it, erases it
  // and returns what the provider must release.
  struct Released {
    std::vector<std::unique_ptr<ProviderState>> states;  // deregister these
    std::vector<uint32_t> keys;     // and these (ProviderDeregisterKey)
    std::vector<MemorySpan> unpin;  // then unpin these
  };
  void DestroyMrLocked(Mr* mr, Released* released)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // DeregisterMr (`fast` false) and FreeFastRegisterMr (true).
  absl::Status DestroyMr(MrId mr, bool fast) ABSL_LOCKS_EXCLUDED(mu_);
  // Provider releases outside the mutex; the first error is returned.
  absl::Status Release(Released released) ABSL_LOCKS_EXCLUDED(mu_);
  void DropLamRefsLocked(const std::vector<LamId>& lams)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Translates a fast-register page array that passed ValidatePageArray.
  // Errors: INVALID_ARGUMENT (STATUS_INVALID_PARAMETER "PAGE_NOT_MAPPED").
  absl::StatusOr<ResolvedPages> ResolvePagesLocked(
      PdId pd, const std::vector<uint64_t>& pages) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A connected queue pair of `pd`. Errors: FAILED_PRECONDITION
  // (STATUS_CONNECTION_INVALID "CONNECTION_INVALID").
  absl::StatusOr<Connection*> FindPostConnectionLocked(ConnectionId connection,
                                                       PdId pd) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t EnqueueLocked(Connection& connection, Work work)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseDeferredLocked(Connection& connection)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Worker.
  void WorkerLoop();
  // Runs one work request; nullopt = nothing to deliver (silent success).
  std::optional<WorkCompletion> Execute(const Work& work)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ExecuteFastRegister(const Work& work, uint32_t* rkey)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ExecuteInvalidate(const Work& work) ABSL_LOCKS_EXCLUDED(mu_);
  bool WorkerHasTask() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues a task for the worker and wakes it.
  void QueueTaskLocked(Task task) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool WorkerIdle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool NoPdBusy() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // kReady, announced, OnPeerConnected queued.
  void AnnounceLocked(Connection& connection)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const DeviceModelOptions options_;
  DeviceAttributes attributes_;

  Thread worker_ ABSL_GUARDED_BY(mu_);
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  bool worker_stop_ ABSL_GUARDED_BY(mu_) = false;
  bool worker_busy_ ABSL_GUARDED_BY(mu_) = false;
  // The idle worker waits on this, not on a condition of mu_: a waiter with
  // a condition sends every unlock of mu_ (each registration takes it
  // several times) down Abseil's slow path to evaluate it. Signalled when
  // a task is queued and when the worker is asked to stop.
  absl::CondVar worker_wake_;
  SecureRandomPool random_ ABSL_GUARDED_BY(mu_);
  IovaSpace iova_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<PdId, std::unique_ptr<Pd>> pds_ ABSL_GUARDED_BY(mu_);
  // Registered MRs and MR objects, one slot each: an MR id is its slot
  // and a sequence number above (mr_ids_, SlabIds), so an id comes back
  // only after 2^40 MRs were made (a stale id names no MR before that). An
  // MR stays in place until freed (the waits in DestroyMrLocked and
  // UnmapLocked rely on it); a million MRs cost their own size and nothing
  // else.
  mutable Slab<Mr> mrs_ ABSL_GUARDED_BY(mu_);  // mutable: FindMrLocked
  absl::flat_hash_map<LamId, std::unique_ptr<Lam>> lams_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<ConnectionId, std::unique_ptr<Connection>> connections_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, PdId> tickets_ ABSL_GUARDED_BY(mu_);
  std::deque<Task> tasks_ ABSL_GUARDED_BY(mu_);
  uint64_t next_pd_ ABSL_GUARDED_BY(mu_) = 1;
  SlabIds mr_ids_ ABSL_GUARDED_BY(mu_);
  uint64_t next_lam_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_connection_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_work_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t session_limit_refusals_ ABSL_GUARDED_BY(mu_) = 0;

  // PinAhead's pins, by host address and length, until a registration or
  // LAM of that span takes one (PinTakingAhead) or DropPinsAhead unpins them.
  // Its own lock: never held across a provider call.
  struct PinnedAhead {
    MemorySpan span;     // what ProviderUnpin is given back
    uint32_t count = 0;  // pins of this span not taken yet
  };
  mutable absl::Mutex ahead_mu_;
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, PinnedAhead> pins_ahead_
      ABSL_GUARDED_BY(ahead_mu_);
  // Whether pins_ahead_ may hold any (written under ahead_mu_): while none
  // does, a registration pins without taking the lock. One that races a
  // PinAhead of its span pins anew, and DropPinsAhead unpins the other.
  std::atomic<bool> any_ahead_{false};
};

}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_DEVICE_MODEL_H_
