#include "server/device/device_model.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/container/btree_set.h"
#include "absl/strings/str_cat.h"
#include "mrd/status.h"
#include "server/common/log.h"
#include "server/device/fast_register_rules.h"

namespace mrd::device {
namespace {

// A caller that gave up before anything was pinned gets CANCELLED at once.
absl::Status CheckNotCancelled(const MemorySpan& span, absl::string_view op) {
  if (!Cancelled(span.progress)) return absl::OkStatus();
  return absl::CancelledError(absl::StrCat(
      op, " of ", span.length, " bytes was cancelled before pinning"));
}

constexpr uint32_t kKnownAccess = kAccessLocalWrite | kAccessRemoteRead |
                                  kAccessRemoteWrite | kAccessReadSink;
constexpr uint32_t kRemoteAccess = kAccessRemoteRead | kAccessRemoteWrite;
constexpr uint32_t kKnownWorkFlags =
    kWorkSilentSuccess | kWorkReadFence | kWorkDefer;
constexpr uint64_t kMaxGuardPages = 16;
constexpr size_t kTicketBytes = 16;  // 128-bit secret

std::string Hex(uint64_t value) { return absl::StrCat("0x", absl::Hex(value)); }

absl::Status InvalidParameter(absl::string_view reason,
                              absl::string_view message) {
  return SeedError(STATUS_INVALID_PARAMETER, reason, message);
}

absl::Status UnknownMr(MrId mr) {
  return MrdError(absl::StatusCode::kNotFound, "UNKNOWN_MR",
                  absl::StrCat("no memory region ", mr));
}

absl::Status CheckAccessBits(uint32_t access, absl::string_view call) {
  if ((access & ~kKnownAccess) == 0) return absl::OkStatus();
  return InvalidParameter(
      "UNKNOWN_ACCESS_BITS",
      absl::StrCat(call, ": access ", Hex(access), " has unknown bits ",
                   Hex(access & ~kKnownAccess)));
}

absl::Status CheckWorkFlags(uint32_t flags, absl::string_view call) {
  if ((flags & ~kKnownWorkFlags) == 0) return absl::OkStatus();
  return InvalidParameter(
      "UNKNOWN_WORK_FLAGS",
      absl::StrCat(call, ": flags ", Hex(flags), " have unknown bits ",
                   Hex(flags & ~kKnownWorkFlags)));
}

absl::Status CheckBaseAddress(uint64_t base_address, uint64_t length,
                              absl::string_view call) {
  if (base_address == 0) {
    return InvalidParameter(
        "ZERO_BASED_ADDRESS",
        absl::StrCat(call,
                     ": base address 0: zero-based addressing is not "
                     "supported"));
  }
  uint64_t end = 0;
  if (__builtin_add_overflow(base_address, length, &end)) {
    return InvalidParameter(
        "BASE_ADDRESS_OVERFLOW",
        absl::StrCat(call, ": base address ", Hex(base_address), " + ", length,
                     " bytes wraps around"));
  }
  return absl::OkStatus();
}

}  // namespace

// All fields of the structs below are guarded by DeviceModel::mu_ unless
// marked immutable.

struct DeviceModel::Pd {
  PdId id = 0;                  // immutable
  PdEventSink* sink = nullptr;  // immutable
  std::unique_ptr<ProviderState> state;
  bool dying = false;         // DeallocatePd has begun
  int busy = 0;               // see BeginPdOp
  absl::btree_set<MrId> mrs;  // normal and fast-register MRs (compact)
  absl::flat_hash_set<LamId> lams;
  absl::flat_hash_set<ConnectionId> connections;  // bound to this PD
  std::vector<std::string> tickets;
};

// What only a fast-register MR object has (C1, F4): a normal MR carries none
// of it, so a million registrations do not pay for it. It is the MR's
// `object` (Mr::fr()), and holds the provider's own state of the MR object.
struct FastRegisterState : ProviderState {
  std::unique_ptr<ProviderState> keys;  // the provider's MR object
  bool allow_remote = false;            // immutable (F4)
  uint32_t max_pages = 0;               // immutable
  // Fast-registered: the mapping.
  uint32_t fbo = 0;
  std::vector<PageRef> pages;
  // The page array as posted, for DescribeFastMr: a handover re-resolves
  // it through the LAMs the new process adopted at the same addresses.
  std::vector<uint64_t> logical_pages;
  std::vector<LamId> lams;  // distinct LAMs the mapping holds a ref on
  std::unique_ptr<ProviderState> mapping;
};

// One per live registration: a million of them pay for each byte, so the
// fields are packed (80 bytes) and the registered memory is kept as the
// parts of its MemorySpan that outlive the RegisterMr call.
struct DeviceModel::Mr {
  MrId id = 0;                 // immutable
  PdId pd = 0;                 // immutable
  bool fast : 1 = false;       // immutable: a fast-register MR object (C1)
  bool key_only : 1 = false;   // immutable: no object, ProviderDeregisterKey
  bool pending : 1 = false;    // reserved, not in its PD yet: treat as gone
  bool revoking : 1 = false;   // being destroyed: treat as gone
  bool valid : 1 = false;      // registered / fast-registered: peers may use it
  bool executing : 1 = false;  // the worker is fast-registering it now
  // Callers waiting in UnmapLocked without destroying it (an invalidation);
  // DestroyMrLocked frees the slot only once they are gone.
  uint8_t holders = 0;
  int inflight = 0;  // peer operations inside the memory now
  uint32_t lkey = 0;
  uint32_t rkey = 0;
  uint32_t access = 0;
  int fd = -1;  // normal MRs: the registered memory's file
  uint64_t base = 0;
  uint64_t length = 0;  // normal MRs: also the registered memory's length
  void* host_address = nullptr;  // normal MRs: the registered memory
  uint64_t file_offset = 0;      // normal MRs
  // Normal MRs: the registration; none for a provider whose registration
  // is its key alone (`key_only`). Fast MRs: their FastRegisterState.
  std::unique_ptr<ProviderState> object;

  FastRegisterState* fr() const {
    return fast ? static_cast<FastRegisterState*>(object.get()) : nullptr;
  }

  // Normal MRs: the memory it registered (without the caller's progress).
  MemorySpan Span() const {
    return MemorySpan{host_address, length,  fd,
                      file_offset,  nullptr, SpanPages::kUnknown};
  }
};

struct DeviceModel::Lam {
  LamId id = 0;
  PdId pd = 0;
  MemorySpan span;
  uint32_t fbo = 0;
  uint64_t iova = 0;  // logical address of the first page
  uint64_t page_count = 0;
  uint32_t fr_users = 0;  // fast-registered MRs mapping any of its pages
  std::unique_ptr<ProviderState> state;
};

struct DeviceModel::Connection {
  // kHandshake: not bound to a PD yet; kConnecting: bound, not usable yet.
  enum class State { kHandshake, kConnecting, kReady, kError, kClosed };
  ConnectionId id = 0;  // immutable
  std::string remote;   // immutable
  State state = State::kHandshake;
  PdId pd = 0;                // set by BindConnection
  bool announced = false;     // OnPeerConnected is queued
  std::deque<Work> deferred;  // kWorkDefer work held back
};

struct DeviceModel::ResolvedPages {
  std::vector<PageRef> pages;
  std::vector<LamId> lams;  // distinct
};

// ---------------------------------------------------------------------------
// Creation, lifecycle.

DeviceModel::DeviceModel(DeviceAttributes attributes,
                         const DeviceModelOptions& options)
    : options_(options),
      attributes_(std::move(attributes)),
      iova_(options.page_size, options.iova_start, options.iova_limit,
            options.fault_points),
      mrs_(SlabIds::kMaxSlots) {
  static_assert(sizeof(Mr) == 80, "a million MRs pay for each byte");
  attributes_.page_size = options.page_size;
  attributes_.max_mr_size = options.max_mr_size;
  attributes_.max_page_list_length = options.max_page_list_length;
  absl::MutexLock lock(&mu_);
  next_connection_ = options.connection_id_base + 1;
}

DeviceModel::~DeviceModel() {
  // The provider's destructor released everything (ShutdownAndReleaseAll).
  absl::MutexLock lock(&mu_);
  MRD_CHECK(pds_.empty());
}

void DeviceModel::ShutdownAndReleaseAll() {
  Shutdown();
  DropPinsAhead();
  std::vector<PdId> left;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, pd] : pds_) left.push_back(id);
  }
  for (PdId pd : left) (void)DeallocatePd(pd);
}

absl::Status DeviceModel::Start() {
  {
    absl::MutexLock lock(&mu_);
    if (started_ || shut_down_) {
      return MrdError(absl::StatusCode::kFailedPrecondition, "ALREADY_STARTED",
                      absl::StrCat("the ", attributes_.kind,
                                   " device was started or shut down before"));
    }
    MRD_RETURN_IF_ERROR(FaultPoint(options_.fault_points, "thread.create"));
    MRD_ASSIGN_OR_RETURN(
        worker_, Thread::Start(absl::StrCat("mrd-", attributes_.kind, "-work"),
                               [this] { WorkerLoop(); }));
    started_ = true;
  }
  absl::Status status = ProviderStart();
  // Without the provider no peer can ever connect: stop the worker again,
  // so that the device is cleanly shut down rather than half started.
  if (!status.ok()) Shutdown();
  return status;
}

void DeviceModel::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;  // from here NewConnection refuses
  }
  // Every connection closes (ConnectionClosed queues flushes and
  // disconnects), after the frames and events being handled.
  ProviderStop();
  Thread worker;
  {
    absl::MutexLock lock(&mu_);
    // The worker drains what the closing connections queued: their PDs, and
    // so their sinks, are still alive.
    worker_stop_ = true;
    worker_wake_.Signal();
    worker = std::move(worker_);
  }
  worker.Join();
}

absl::Status DeviceModel::UsableLocked() const {
  // Nothing new on a device that was shut down (the other devices of an
  // mrd that serves several go on).
  if (shut_down_) {
    return MrdError(absl::StatusCode::kUnavailable, "DEVICE_SHUT_DOWN",
                    absl::StrCat("device ", attributes_.name, " is shut down"));
  }
  return ProviderUsable();
}

DeviceModel::Phase DeviceModel::phase() const {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return Phase::kShutDown;
  return started_ ? Phase::kStarted : Phase::kNew;
}

// ---------------------------------------------------------------------------
// Protection domains.

absl::StatusOr<DeviceModel::Pd*> DeviceModel::FindPdLocked(PdId pd) {
  auto it = pds_.find(pd);
  if (it == pds_.end() || it->second->dying) {
    return MrdError(absl::StatusCode::kNotFound, "UNKNOWN_PD",
                    absl::StrCat("no protection domain ", pd));
  }
  return it->second.get();
}

absl::StatusOr<ProviderState*> DeviceModel::BeginPdOp(PdId pd) {
  absl::MutexLock lock(&mu_);
  MRD_RETURN_IF_ERROR(UsableLocked());
  MRD_ASSIGN_OR_RETURN(Pd * found, FindPdLocked(pd));
  ++found->busy;
  return found->state.get();
}

void DeviceModel::EndPdOp(PdId pd) {
  absl::MutexLock lock(&mu_);
  EndPdOpLocked(pd);
}

void DeviceModel::EndPdOpLocked(PdId pd) {
  // DeallocatePd waits for busy == 0 before erasing, so the PD is here.
  auto it = pds_.find(pd);
  MRD_CHECK(it != pds_.end() && it->second->busy > 0);
  --it->second->busy;
}

absl::StatusOr<PdId> DeviceModel::AllocatePd(PdEventSink* sink) {
  if (sink == nullptr) {
    return MrdError(absl::StatusCode::kInvalidArgument, "NULL_SINK",
                    "AllocatePd needs an event sink");
  }
  MRD_RETURN_IF_ERROR(FaultPoint(options_.fault_points, "pd.allocate"));
  {
    absl::MutexLock lock(&mu_);
    MRD_RETURN_IF_ERROR(UsableLocked());
  }
  MRD_ASSIGN_OR_RETURN(std::unique_ptr<ProviderState> state,
                       ProviderAllocatePd());
  absl::StatusOr<PdId> id = [&]() -> absl::StatusOr<PdId> {
    absl::MutexLock lock(&mu_);
    // Lost meanwhile: TakeAllProviderState may have run already.
    MRD_RETURN_IF_ERROR(UsableLocked());
    auto pd = std::make_unique<Pd>();
    pd->id = next_pd_++;
    pd->sink = sink;
    pd->state = std::move(state);
    const PdId pd_id = pd->id;
    pds_.emplace(pd_id, std::move(pd));
    return pd_id;
  }();
  if (!id.ok()) (void)ProviderDeallocatePd(std::move(state));
  return id;
}

absl::Status DeviceModel::CanHandOver() const { return ProviderCanHandOver(); }

absl::StatusOr<UniqueFd> DeviceModel::StopPeerAccepting() {
  return ProviderStopPeerAccepting();
}

void DeviceModel::ResumePeerAccepting() { ProviderResumePeerAccepting(); }

absl::StatusOr<UniqueFd> DeviceModel::DuplicatePeerListener() {
  return ProviderDuplicatePeerListener();
}

absl::StatusOr<std::vector<DeviceHandover::HandedOverPeer>>
DeviceModel::FreezePeers(absl::Duration timeout) {
  return ProviderFreezePeers(timeout);
}

void DeviceModel::ThawPeers() { ProviderThawPeers(); }

void DeviceModel::DropFrozenPeers() { ProviderDropFrozenPeers(); }

absl::Status DeviceModel::AdoptPeer(PdId pd, HandedOverPeer peer) {
  return ProviderAdoptPeer(pd, std::move(peer));
}

bool DeviceModel::DisconnectPeers(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  std::vector<ConnectionId> closing;
  for (auto& [id, connection] : connections_) {
    if (connection->state == Connection::State::kClosed) continue;
    connection->state = Connection::State::kClosed;
    connection->deferred.clear();
    closing.push_back(id);
  }
  if (!closing.empty()) ProviderCloseConnectionsLocked(closing);
  // A connection leaves the table once its provider closed it, after the
  // operation it was serving.
  return mu_.AwaitWithTimeout(
      absl::Condition(
          +[](absl::flat_hash_map<ConnectionId, std::unique_ptr<Connection>>*
                  c) { return c->empty(); },
          &connections_),
      timeout);
}

absl::Status DeviceModel::DeallocatePd(PdId pd_id) {
  Released released;
  std::unique_ptr<ProviderState> pd_state;
  {
    absl::MutexLock lock(&mu_);
    MRD_ASSIGN_OR_RETURN(Pd * pd, FindPdLocked(pd_id));
    // From here new calls naming the PD fail, its tickets are refused, and
    // the worker drops its queued tasks.
    pd->dying = true;
    for (const std::string& ticket : pd->tickets) tickets_.erase(ticket);
    pd->tickets.clear();
    std::vector<ConnectionId> closing;
    for (ConnectionId id : pd->connections) {
      auto it = connections_.find(id);
      if (it == connections_.end()) continue;
      it->second->state = Connection::State::kClosed;
      it->second->deferred.clear();
      closing.push_back(id);
    }
    if (!closing.empty()) ProviderCloseConnectionsLocked(closing);
    // Pins in progress, teardowns and sink calls finish first, and the
    // provider lets go of the PD's connections: after this the PD's objects
    // are ours alone (peers in flight aside).
    mu_.Await(absl::Condition(
        +[](const Pd* p) { return p->busy == 0 && p->connections.empty(); },
        static_cast<const Pd*>(pd)));
    std::vector<MrId> mrs(pd->mrs.begin(), pd->mrs.end());
    for (MrId id : mrs) {
      Mr* mr = LookupMrLocked(id);
      if (mr == nullptr) continue;
      DestroyMrLocked(mr, &released);
    }
    for (LamId id : pd->lams) {
      auto it = lams_.find(id);
      if (it == lams_.end()) continue;
      // Every MR of the PD is gone, so no fast registration maps it.
      MRD_CHECK(it->second->fr_users == 0);
      iova_.Free(it->second->iova);
      released.states.push_back(std::move(it->second->state));
      released.unpin.push_back(it->second->span);
      lams_.erase(it);
    }
    pd_state = std::move(pd->state);
    pds_.erase(pd_id);
  }
  absl::Status status = Release(std::move(released));
  absl::Status pd_status = ProviderDeallocatePd(std::move(pd_state));
  return status.ok() ? pd_status : status;
}

absl::StatusOr<std::string> DeviceModel::CreatePeerTicket(PdId pd_id) {
  MRD_RETURN_IF_ERROR(FaultPoint(options_.fault_points, "random.ticket"));
  MRD_ASSIGN_OR_RETURN(std::string ticket, SecureRandomHex(kTicketBytes));
  absl::MutexLock lock(&mu_);
  MRD_RETURN_IF_ERROR(UsableLocked());
  MRD_ASSIGN_OR_RETURN(Pd * pd, FindPdLocked(pd_id));
  MRD_RETURN_IF_ERROR(FaultPoint(options_.fault_points, "ticket.insert"));
  tickets_.emplace(ticket, pd_id);
  pd->tickets.push_back(ticket);
  return ticket;
}

absl::Status DeviceModel::AdoptPeerTicket(PdId pd_id,
                                          const std::string& ticket) {
  MRD_RETURN_IF_ERROR(CanHandOver());
  // Exactly what CreatePeerTicket makes. The message never shows the
  // ticket: it is a secret.
  const bool well_formed =
      ticket.size() == 2 * kTicketBytes &&
      std::all_of(ticket.begin(), ticket.end(), [](char c) {
        return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
      });
  if (!well_formed) {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "BAD_TICKET",
        absl::StrCat("AdoptPeerTicket: a peer ticket is ", 2 * kTicketBytes,
                     " lower-case hex digits; got ", ticket.size(),
                     " characters that are not one"));
  }
  absl::MutexLock lock(&mu_);
  MRD_RETURN_IF_ERROR(UsableLocked());
  MRD_ASSIGN_OR_RETURN(Pd * pd, FindPdLocked(pd_id));
  if (auto it = tickets_.find(ticket); it != tickets_.end()) {
    if (it->second == pd_id) return absl::OkStatus();
    return MrdError(absl::StatusCode::kFailedPrecondition, "TICKET_IN_USE",
                    absl::StrCat("AdoptPeerTicket: the ticket belongs to "
                                 "protection domain ",
                                 it->second, ", not ", pd_id));
  }
  MRD_RETURN_IF_ERROR(FaultPoint(options_.fault_points, "ticket.insert"));
  tickets_.emplace(ticket, pd_id);
  pd->tickets.push_back(ticket);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Memory regions.

absl::Status DeviceModel::ValidateSpan(const MemorySpan& span,
                                       absl::string_view call) const {
  if (span.host_address == nullptr || span.fd < 0) {
    return InvalidParameter(
        "INVALID_SPAN",
        absl::StrCat(call, ": span has host address ",
                     Hex(reinterpret_cast<uint64_t>(span.host_address)),
                     " and fd ", span.fd));
  }
  if (span.length == 0) {
    return InvalidParameter("ZERO_LENGTH",
                            absl::StrCat(call, ": span length is 0"));
  }
  if (span.length > options_.max_mr_size) {
    // Never truncated: the caller learns both sizes.
    return InvalidParameter(
        "LENGTH_OVER_MAX_MR_SIZE",
        absl::StrCat(call, ": length ", span.length,
                     " exceeds the device's max_mr_size ", options_.max_mr_size,
                     " (", attributes_.name, ")"));
  }
  uint64_t host = reinterpret_cast<uint64_t>(span.host_address);
  uint64_t end = 0;
  uint64_t file_end = 0;
  // pread/pwrite and mmap take a signed off_t: the span must stay below it.
  if (__builtin_add_overflow(host, span.length, &end) ||
      __builtin_add_overflow(span.file_offset, span.length, &file_end) ||
      file_end > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
    return InvalidParameter(
        "SPAN_OVERFLOW",
        absl::StrCat(call, ": span of ", span.length, " bytes at ", Hex(host),
                     " (file offset ", span.file_offset, ") wraps around"));
  }
  return absl::OkStatus();
}

absl::StatusOr<MrKeys> DeviceModel::RegisterMr(PdId pd, const MemorySpan& span,
                                               uint64_t base_address,
                                               uint32_t access) {
  return Register(pd, span, base_address, access, nullptr);
}

absl::StatusOr<MrKeys> DeviceModel::AdoptMr(PdId pd, const MemorySpan& span,
                                            uint64_t base_address,
                                            uint32_t access, uint32_t lkey,
                                            uint32_t rkey) {
  MRD_RETURN_IF_ERROR(CanHandOver());
  const AdoptedKeys adopt{lkey, rkey};
  return Register(pd, span, base_address, access, &adopt);
}

absl::Status DeviceModel::PinAhead(const MemorySpan& span) {
  MRD_RETURN_IF_ERROR(CanHandOver());
  MRD_RETURN_IF_ERROR(ValidateSpan(span, "PinAhead"));
  MemorySpan kept = span;
  kept.progress = nullptr;  // not the caller's to watch any more
  MRD_RETURN_IF_ERROR(ProviderPin(kept));
  absl::MutexLock lock(&ahead_mu_);
  PinnedAhead& pinned =
      pins_ahead_[{reinterpret_cast<uint64_t>(kept.host_address), kept.length}];
  if (pinned.count == 0) pinned.span = kept;
  ++pinned.count;
  any_ahead_.store(true, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status DeviceModel::PinTakingAhead(const MemorySpan& span) {
  if (any_ahead_.load(std::memory_order_acquire)) {
    absl::MutexLock lock(&ahead_mu_);
    auto it = pins_ahead_.find(std::make_pair(
        reinterpret_cast<uint64_t>(span.host_address), span.length));
    if (it != pins_ahead_.end()) {
      if (--it->second.count == 0) pins_ahead_.erase(it);
      if (pins_ahead_.empty()) {
        any_ahead_.store(false, std::memory_order_release);
      }
      return absl::OkStatus();
    }
  }
  return ProviderPin(span);
}

void DeviceModel::DropPinsAhead() {
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, PinnedAhead> left;
  {
    absl::MutexLock lock(&ahead_mu_);
    left.swap(pins_ahead_);
    any_ahead_.store(false, std::memory_order_release);
  }
  for (const auto& [key, pinned] : left) {
    for (uint32_t i = 0; i < pinned.count; ++i) ProviderUnpin(pinned.span);
  }
}

size_t DeviceModel::PinsAhead() const {
  absl::MutexLock lock(&ahead_mu_);
  size_t n = 0;
  for (const auto& [key, pinned] : pins_ahead_) n += pinned.count;
  return n;
}

absl::StatusOr<MrKeys> DeviceModel::Register(PdId pd, const MemorySpan& span,
                                             uint64_t base_address,
                                             uint32_t access,
                                             const AdoptedKeys* adopt) {
  const absl::string_view call = adopt == nullptr ? "RegisterMr" : "AdoptMr";
  MRD_RETURN_IF_ERROR(ValidateSpan(span, call));
  MRD_RETURN_IF_ERROR(CheckBaseAddress(base_address, span.length, call));
  MRD_RETURN_IF_ERROR(CheckAccessBits(access, call));
  MRD_RETURN_IF_ERROR(ProviderCheckBase(span, base_address));
  MRD_ASSIGN_OR_RETURN(ProviderState * pd_state, BeginPdOp(pd));
  absl::StatusOr<MrKeys> keys =
      RegisterPinned(pd, pd_state, span, base_address, access, adopt);
  EndPdOp(pd);
  return keys;
}

absl::StatusOr<MrKeys> DeviceModel::RegisterPinned(
    PdId pd_id, ProviderState* pd_state, const MemorySpan& span,
    uint64_t base_address, uint32_t access, const AdoptedKeys* adopt) {
  const absl::string_view call = adopt == nullptr ? "RegisterMr" : "AdoptMr";
  MRD_RETURN_IF_ERROR(CheckNotCancelled(span, call));
  MRD_RETURN_IF_ERROR(PinTakingAhead(span));
  MrId id = 0;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<Mr*> reserved = ReserveMrLocked(pd_id, call);
    if (!reserved.ok()) {
      ProviderUnpin(span);
      return reserved.status();
    }
    id = (*reserved)->id;
  }
  absl::StatusOr<Registration> registration =
      adopt == nullptr
          ? ProviderRegister(pd_state, span, base_address, access, id, false)
          : ProviderAdoptRegister(pd_state, span, base_address, access, id,
                                  adopt->lkey, adopt->rkey, /*lam=*/false);
  if (!registration.ok()) {
    ProviderUnpin(span);
    absl::MutexLock lock(&mu_);
    FreeMrLocked(id);
    return registration.status();
  }
  absl::StatusOr<MrKeys> keys = [&]() -> absl::StatusOr<MrKeys> {
    MRD_RETURN_IF_ERROR(FaultPoint(options_.fault_points, "mr.insert"));
    absl::MutexLock lock(&mu_);
    MRD_RETURN_IF_ERROR(UsableLocked());
    MRD_ASSIGN_OR_RETURN(Pd * pd, FindPdLocked(pd_id));
    Mr* mr = LookupMrLocked(id);
    mr->pending = false;
    mr->lkey = registration->lkey;
    mr->rkey = registration->rkey;
    mr->valid = true;
    mr->base = base_address;
    mr->length = span.length;
    mr->access = access;
    mr->host_address = span.host_address;
    mr->fd = span.fd;
    mr->file_offset = span.file_offset;
    mr->object = std::move(registration->state);
    mr->key_only = mr->object == nullptr;
    pd->mrs.insert(id);
    return MrKeys{id, mr->lkey, mr->rkey};
  }();
  if (!keys.ok()) {
    // The PD began dying or the device was lost meanwhile: undo (L7) before
    // the PD stops being busy, so that no teardown misses this MR.
    {
      absl::MutexLock lock(&mu_);
      FreeMrLocked(id);
    }
    Released undo;
    if (registration->state != nullptr) {
      undo.states.push_back(std::move(registration->state));
    } else {
      undo.keys.push_back(registration->lkey);
    }
    undo.unpin.push_back(span);
    (void)Release(std::move(undo));
  }
  if (keys.ok() && span.progress != nullptr) span.progress->SetAllPinned();
  return keys;
}

DeviceModel::Mr* DeviceModel::LookupMrLocked(MrId id) const {
  Mr* mr = mrs_.Get(MrSlot(id));
  return mr != nullptr && mr->id == id ? mr : nullptr;
}

absl::StatusOr<DeviceModel::Mr*> DeviceModel::FindMrLocked(MrId id) const {
  Mr* mr = LookupMrLocked(id);
  if (mr == nullptr || mr->pending || mr->revoking) return UnknownMr(id);
  auto pd = pds_.find(mr->pd);
  // A dying PD's objects belong to DeallocatePd now.
  if (pd == pds_.end() || pd->second->dying) return UnknownMr(id);
  return mr;
}

absl::StatusOr<DeviceModel::Mr*> DeviceModel::ReserveMrLocked(
    PdId pd, absl::string_view call) {
  std::optional<uint32_t> index = mrs_.Allocate();
  if (!index.has_value()) {
    return MrdError(
        absl::StatusCode::kResourceExhausted, "LIMIT_DEVICE_MRS",
        absl::StrCat(call, ": the device's MR table is full (", mrs_.size(),
                     " MRs and MR objects of at most ", mrs_.capacity(),
                     ") or out of memory; free some first"));
  }
  Mr* mr = mrs_.Get(*index);
  mr->id = mr_ids_.Next(*index);
  mr->pd = pd;
  mr->pending = true;
  return mr;
}

void DeviceModel::FreeMrLocked(MrId id) { mrs_.Free(MrSlot(id)); }

std::unique_ptr<ProviderState> DeviceModel::UnmapLocked(Mr* mr) {
  mr->valid = false;
  // The MR stays in its slot during this wait: our caller is destroying it
  // (no one else frees it) or holds it (DestroyMrLocked waits for holders).
  mu_.Await(absl::Condition(
      +[](const Mr* m) { return m->inflight == 0; },
      static_cast<const Mr*>(mr)));
  FastRegisterState* fr = mr->fr();
  if (fr == nullptr) return nullptr;
  DropLamRefsLocked(fr->lams);
  fr->lams.clear();
  fr->pages.clear();
  fr->logical_pages.clear();
  return std::move(fr->mapping);
}

void DeviceModel::DropLamRefsLocked(const std::vector<LamId>& lams) {
  for (LamId id : lams) {
    auto it = lams_.find(id);
    // A LAM is never released while fr_users > 0.
    MRD_CHECK(it != lams_.end() && it->second->fr_users > 0);
    --it->second->fr_users;
  }
}

void DeviceModel::DestroyMrLocked(Mr* mr, Released* released) {
  // The waits below release the mutex; `mr` stays in its slot until this
  // function frees it (revoking: no other caller destroys it).
  const MrId id = mr->id;
  // The MR stops matching before anything else: a peer that looks it up
  // from now on fails, and one already inside is waited for below, as is a
  // fast registration executing on it (its result is torn down with the
  // rest).
  mr->revoking = true;
  mu_.Await(absl::Condition(
      +[](const Mr* m) { return !m->executing; }, static_cast<const Mr*>(mr)));
  std::unique_ptr<ProviderState> mapping = UnmapLocked(mr);
  if (mapping != nullptr) released->states.push_back(std::move(mapping));
  std::unique_ptr<ProviderState>& state =
      mr->fast ? mr->fr()->keys : mr->object;
  if (state != nullptr) released->states.push_back(std::move(state));
  if (mr->key_only) released->keys.push_back(mr->lkey);
  if (!mr->fast) released->unpin.push_back(mr->Span());
  auto pd = pds_.find(mr->pd);
  if (pd != pds_.end()) {
    pd->second->mrs.erase(id);
  }
  // An invalidation may still be waiting in UnmapLocked on this MR.
  mu_.Await(absl::Condition(
      +[](const Mr* m) { return m->holders == 0; },
      static_cast<const Mr*>(mr)));
  FreeMrLocked(id);
}

absl::Status DeviceModel::Release(Released released) {
  absl::Status status;
  for (std::unique_ptr<ProviderState>& state : released.states) {
    if (state == nullptr) continue;  // taken by TakeAllProviderState
    absl::Status s = ProviderDeregister(std::move(state));
    if (!s.ok() && status.ok()) status = s;
  }
  for (uint32_t key : released.keys) {
    absl::Status s = ProviderDeregisterKey(key);
    if (!s.ok() && status.ok()) status = s;
  }
  // A deregistration that failed leaves its memory pinned by the adapter;
  // unpinning our own count is still right for memory the model let go.
  for (const MemorySpan& span : released.unpin) ProviderUnpin(span);
  return status;
}

absl::Status DeviceModel::DeregisterMr(MrId mr) { return DestroyMr(mr, false); }

absl::StatusOr<DeviceModel::Registration> DeviceModel::ProviderAdoptRegister(
    ProviderState* /*pd*/, const MemorySpan& /*span*/, uint64_t /*iova*/,
    uint32_t /*access*/, uint64_t /*owner*/, uint32_t /*lkey*/,
    uint32_t /*rkey*/, bool lam) {
  MRD_RETURN_IF_ERROR(CanHandOver());
  return MrdError(
      absl::StatusCode::kUnimplemented, "HANDOVER_UNIMPLEMENTED",
      absl::StrCat(lam ? "AdoptLam" : "AdoptMr", ": the ", attributes_.kind,
                   " device cannot register memory with given keys"));
}

absl::StatusOr<DeviceModel::Registration> DeviceModel::ProviderAdoptFastMr(
    ProviderState* /*pd*/, MrId /*owner*/, uint32_t /*lkey*/,
    uint32_t /*rkey*/) {
  MRD_RETURN_IF_ERROR(CanHandOver());
  return MrdError(
      absl::StatusCode::kUnimplemented, "HANDOVER_UNIMPLEMENTED",
      absl::StrCat("AdoptFastRegisterMr: the ", attributes_.kind,
                   " device cannot make an MR object with given keys"));
}

absl::Status DeviceModel::DestroyMr(MrId mr_id, bool fast) {
  Released released;
  PdId pd = 0;
  {
    absl::MutexLock lock(&mu_);
    MRD_ASSIGN_OR_RETURN(Mr * mr, FindMrLocked(mr_id));
    if (mr->fast != fast) {
      return MrdError(
          absl::StatusCode::kInvalidArgument, "WRONG_MR_KIND",
          mr->fast ? absl::StrCat("MR ", mr_id,
                                  " is a fast-register MR object: free it "
                                  "with FreeFastRegisterMr")
                   : absl::StrCat("MR ", mr_id,
                                  " is a registered MR: deregister it with "
                                  "DeregisterMr"));
    }
    pd = mr->pd;
    // Until released: DestroyMrLocked may wait for peers and the worker.
    ++pds_.find(pd)->second->busy;
    DestroyMrLocked(mr, &released);
  }
  absl::Status status = Release(std::move(released));
  EndPdOp(pd);
  return status;
}

// ---------------------------------------------------------------------------
// Logical address mappings.

absl::StatusOr<LogicalMapping> DeviceModel::BuildLam(PdId pd,
                                                     const MemorySpan& span) {
  return Map(pd, span, nullptr);
}

absl::StatusOr<LogicalMapping> DeviceModel::AdoptLam(PdId pd,
                                                     const MemorySpan& span,
                                                     uint64_t first_page,
                                                     uint32_t privileged_key) {
  MRD_RETURN_IF_ERROR(CanHandOver());
  const AdoptedLam adopt{first_page, privileged_key};
  return Map(pd, span, &adopt);
}

absl::StatusOr<LogicalMapping> DeviceModel::Map(PdId pd, const MemorySpan& span,
                                                const AdoptedLam* adopt) {
  const absl::string_view call = adopt == nullptr ? "BuildLam" : "AdoptLam";
  MRD_RETURN_IF_ERROR(ValidateSpan(span, call));
  const uint64_t host = reinterpret_cast<uint64_t>(span.host_address);
  // The host page and the file page must line up, as they do in any mmap;
  // otherwise a logical page would not correspond to one file page.
  if (span.file_offset % page_size() != host % page_size()) {
    return InvalidParameter(
        "SPAN_MISALIGNED",
        absl::StrCat(call, ": host address ", Hex(host), " and file offset ",
                     span.file_offset,
                     " are at different offsets within a page"));
  }
  MRD_ASSIGN_OR_RETURN(ProviderState * pd_state, BeginPdOp(pd));
  absl::StatusOr<LogicalMapping> mapping = MapPinned(pd, pd_state, span, adopt);
  EndPdOp(pd);
  return mapping;
}

absl::StatusOr<uint64_t> DeviceModel::ReserveIovaLocked(
    LamId id, uint64_t page_count, const AdoptedLam* adopt) {
  if (adopt != nullptr) {
    // The other process's layout, guard gaps included, is kept as it was.
    MRD_RETURN_IF_ERROR(iova_.AllocateAt(adopt->first_page, page_count, id));
    return adopt->first_page;
  }
  MRD_RETURN_IF_ERROR(FaultPoint(options_.fault_points, "random.iova_guard"));
  MRD_ASSIGN_OR_RETURN(uint64_t pick, random_.Uint64());
  return iova_.Allocate(page_count, 1 + pick % kMaxGuardPages, id);
}

absl::StatusOr<LogicalMapping> DeviceModel::MapPinned(PdId pd_id,
                                                      ProviderState* pd_state,
                                                      const MemorySpan& span,
                                                      const AdoptedLam* adopt) {
  const uint64_t host = reinterpret_cast<uint64_t>(span.host_address);
  const uint32_t fbo = static_cast<uint32_t>(host % page_size());
  const uint64_t page_count =
      (fbo + span.length + page_size() - 1) / page_size();
  // L7: on any failure below, nothing stays pinned or mapped.
  MRD_RETURN_IF_ERROR(
      CheckNotCancelled(span, adopt == nullptr ? "BuildLam" : "AdoptLam"));
  MRD_RETURN_IF_ERROR(PinTakingAhead(span));
  LamId id = 0;
  uint64_t iova = 0;
  absl::Status status = [&]() -> absl::Status {
    absl::MutexLock lock(&mu_);
    MRD_RETURN_IF_ERROR(FindPdLocked(pd_id).status());
    id = next_lam_++;
    MRD_ASSIGN_OR_RETURN(iova, ReserveIovaLocked(id, page_count, adopt));
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    ProviderUnpin(span);
    return status;
  }
  // Local only (access 0): it pins the pages, and its lkey is the
  // privileged token for the logical addresses (L9).
  absl::StatusOr<Registration> registration =
      adopt == nullptr
          ? ProviderRegister(pd_state, span, iova + fbo, 0, id, true)
          : ProviderAdoptRegister(pd_state, span, iova + fbo, 0, id,
                                  adopt->privileged_key, adopt->privileged_key,
                                  /*lam=*/true);
  absl::StatusOr<LogicalMapping> mapping =
      [&]() -> absl::StatusOr<LogicalMapping> {
    MRD_RETURN_IF_ERROR(registration.status());
    MRD_RETURN_IF_ERROR(FaultPoint(options_.fault_points, "lam.insert"));
    absl::MutexLock lock(&mu_);
    MRD_RETURN_IF_ERROR(UsableLocked());
    MRD_ASSIGN_OR_RETURN(Pd * pd, FindPdLocked(pd_id));
    auto lam = std::make_unique<Lam>();
    lam->id = id;
    lam->pd = pd_id;
    lam->span = span;
    lam->span.progress = nullptr;  // the caller's, for this call only
    lam->fbo = fbo;
    lam->iova = iova;
    lam->page_count = page_count;
    lam->state = std::move(registration->state);
    LogicalMapping result;
    result.lam = id;
    result.fbo = fbo;
    result.privileged_key = registration->lkey;
    result.pages.reserve(page_count);
    for (uint64_t i = 0; i < page_count; ++i) {
      result.pages.push_back(iova + i * page_size());
    }
    pd->lams.insert(id);
    lams_.emplace(id, std::move(lam));
    return result;
  }();
  if (!mapping.ok()) {
    {
      absl::MutexLock lock(&mu_);
      iova_.Free(iova);
    }
    Released undo;
    if (registration.ok())
      undo.states.push_back(std::move(registration->state));
    undo.unpin.push_back(span);
    (void)Release(std::move(undo));
  }
  if (mapping.ok() && span.progress != nullptr) span.progress->SetAllPinned();
  return mapping;
}

absl::Status DeviceModel::ReleaseLam(LamId lam_id) {
  Released released;
  PdId pd_id = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = lams_.find(lam_id);
    if (it == lams_.end() || pds_.find(it->second->pd)->second->dying) {
      return MrdError(absl::StatusCode::kNotFound, "UNKNOWN_LAM",
                      absl::StrCat("no logical address mapping ", lam_id));
    }
    Lam& lam = *it->second;
    if (lam.fr_users > 0) {
      return MrdError(
          absl::StatusCode::kFailedPrecondition, "LAM_IN_USE",
          absl::StrCat("LAM ", lam_id, " has pages fast-registered by ",
                       lam.fr_users, " MR(s); invalidate them first"));
    }
    pd_id = lam.pd;
    Pd& pd = *pds_.find(pd_id)->second;
    ++pd.busy;  // until released
    pd.lams.erase(lam_id);
    iova_.Free(lam.iova);
    released.states.push_back(std::move(lam.state));
    released.unpin.push_back(lam.span);
    lams_.erase(it);
  }
  absl::Status status = Release(std::move(released));
  EndPdOp(pd_id);
  return status;
}

// ---------------------------------------------------------------------------
// Fast registration.

absl::StatusOr<MrKeys> DeviceModel::AllocateFastRegisterMr(PdId pd_id,
                                                           bool allow_remote,
                                                           uint32_t max_pages) {
  return AllocateFastMr(pd_id, allow_remote, max_pages, nullptr);
}

absl::StatusOr<MrKeys> DeviceModel::AdoptFastRegisterMr(
    PdId pd_id, const FastMrState& state) {
  MRD_RETURN_IF_ERROR(CanHandOver());
  return AllocateFastMr(pd_id, state.allow_remote, state.max_pages, &state);
}

absl::Status DeviceModel::CheckAdoptedFastRegistration(
    const FastMrState& state) const {
  if (!state.valid) return absl::OkStatus();
  MRD_RETURN_IF_ERROR(CheckAccessBits(state.access, "AdoptFastRegisterMr"));
  if ((state.access & kRemoteAccess) != 0 && !state.allow_remote) {
    return SeedError(
        STATUS_ACCESS_VIOLATION, "REMOTE_ACCESS_NOT_ALLOWED",
        absl::StrCat("AdoptFastRegisterMr: the MR object has no remote "
                     "access, but its fast registration has access ",
                     Hex(state.access)));
  }
  // The rules PostFastRegister applied in the other process.
  return ValidatePageArray(page_size(), state.max_pages, state.pages, state.fbo,
                           state.length, state.base_address);
}

absl::StatusOr<MrKeys> DeviceModel::AllocateFastMr(PdId pd_id,
                                                   bool allow_remote,
                                                   uint32_t max_pages,
                                                   const FastMrState* adopt) {
  const absl::string_view call =
      adopt == nullptr ? "AllocateFastRegisterMr" : "AdoptFastRegisterMr";
  if (max_pages == 0 || max_pages > options_.max_page_list_length) {
    return InvalidParameter(
        "BAD_MAX_PAGES",
        absl::StrCat(call, ": max_pages ", max_pages, " is not in [1, ",
                     options_.max_page_list_length, "]"));
  }
  if (adopt != nullptr) {
    MRD_RETURN_IF_ERROR(CheckAdoptedFastRegistration(*adopt));
  }
  MRD_ASSIGN_OR_RETURN(ProviderState * pd_state, BeginPdOp(pd_id));
  MrId id = 0;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<Mr*> reserved = ReserveMrLocked(pd_id, call);
    if (!reserved.ok()) {
      EndPdOpLocked(pd_id);
      return reserved.status();
    }
    id = (*reserved)->id;
  }
  // The keys exist from the start, as an MR object's do, but match nothing
  // until a fast registration makes the MR valid.
  absl::StatusOr<Registration> registration =
      adopt == nullptr
          ? ProviderAllocateFastMr(pd_state, id)
          : ProviderAdoptFastMr(pd_state, id, adopt->lkey, adopt->rkey);
  absl::StatusOr<MrKeys> keys = [&]() -> absl::StatusOr<MrKeys> {
    MRD_RETURN_IF_ERROR(registration.status());
    MRD_RETURN_IF_ERROR(FaultPoint(options_.fault_points, "mr.insert"));
    absl::MutexLock lock(&mu_);
    MRD_ASSIGN_OR_RETURN(Pd * pd, FindPdLocked(pd_id));
    // Resolved in the same critical section as the commit: the LAMs cannot
    // be released in between.
    ResolvedPages resolved;
    if (adopt != nullptr && adopt->valid) {
      MRD_ASSIGN_OR_RETURN(resolved, ResolvePagesLocked(pd_id, adopt->pages));
    }
    Mr* mr = LookupMrLocked(id);
    mr->pending = false;
    mr->fast = true;
    auto fr = std::make_unique<FastRegisterState>();
    fr->allow_remote = allow_remote;
    fr->max_pages = max_pages;
    fr->keys = std::move(registration->state);
    mr->lkey = registration->lkey;
    mr->rkey = registration->rkey;
    mr->object = std::move(fr);
    if (adopt != nullptr && adopt->valid) {
      CommitAdoptedLocked(mr, *adopt, std::move(resolved));
    }
    pd->mrs.insert(id);
    return MrKeys{id, mr->lkey, mr->rkey};
  }();
  if (!keys.ok()) {
    absl::MutexLock lock(&mu_);
    FreeMrLocked(id);
  }
  if (!keys.ok() && registration.ok()) {
    Released undo;
    undo.states.push_back(std::move(registration->state));
    (void)Release(std::move(undo));
  }
  EndPdOp(pd_id);
  return keys;
}

void DeviceModel::CommitAdoptedLocked(Mr* mr, const FastMrState& state,
                                      ResolvedPages resolved) {
  // The LAM references ExecuteFastRegister takes: ReleaseLam refuses while
  // this mapping lives.
  for (LamId id : resolved.lams) ++lams_.find(id)->second->fr_users;
  FastRegisterWork work;
  work.pages = state.pages;
  work.fbo = state.fbo;
  work.length = state.length;
  work.base_address = state.base_address;
  work.access = state.access;
  SetMappingLocked(mr, work, std::move(resolved));
}

void DeviceModel::SetMappingLocked(Mr* mr, const FastRegisterWork& fr,
                                   ResolvedPages resolved) {
  FastRegisterState* state = mr->fr();
  mr->base = fr.base_address;
  mr->length = fr.length;
  mr->access = fr.access;
  state->fbo = fr.fbo;
  state->pages = std::move(resolved.pages);
  state->logical_pages = fr.pages;
  state->lams = std::move(resolved.lams);
  mr->valid = true;
}

absl::StatusOr<DeviceHandover::FastMrState> DeviceModel::DescribeFastMr(
    MrId mr_id) const {
  MRD_RETURN_IF_ERROR(CanHandOver());
  absl::MutexLock lock(&mu_);
  MRD_ASSIGN_OR_RETURN(Mr * mr, FindMrLocked(mr_id));
  const FastRegisterState* fr = mr->fr();
  if (fr == nullptr) {
    return MrdError(absl::StatusCode::kNotFound, "UNKNOWN_MR",
                    absl::StrCat("no MR object ", mr_id,
                                 " (a registered MR is adopted with AdoptMr)"));
  }
  // Its state is about to change under the worker: a description now would
  // be out of date before the caller used it.
  if (mr->executing) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "MR_BUSY",
                    absl::StrCat("MR object ", mr_id,
                                 " is being fast-registered; try again"));
  }
  FastMrState state;
  state.allow_remote = fr->allow_remote;
  state.max_pages = fr->max_pages;
  state.lkey = mr->lkey;
  state.rkey = mr->rkey;
  state.valid = mr->valid;
  if (mr->valid) {
    state.pages = fr->logical_pages;
    state.fbo = fr->fbo;
    state.length = mr->length;
    state.base_address = mr->base;
    state.access = mr->access;
  }
  return state;
}

uint64_t DeviceModel::LogicalAddressWatermark() const {
  absl::MutexLock lock(&mu_);
  return iova_.watermark();
}

void DeviceModel::ContinueLogicalAddressesAbove(uint64_t watermark) {
  absl::MutexLock lock(&mu_);
  iova_.ContinueAbove(watermark);
}

uint64_t DeviceModel::ConnectionIdWatermark() const {
  absl::MutexLock lock(&mu_);
  return next_connection_;
}

void DeviceModel::ContinueConnectionIdsAbove(uint64_t watermark) {
  absl::MutexLock lock(&mu_);
  next_connection_ = std::max(next_connection_, watermark);
}

absl::Status DeviceModel::FreeFastRegisterMr(MrId mr) {
  return DestroyMr(mr, true);
}

absl::StatusOr<MrKeys> DeviceModel::QueryMr(MrId mr_id) const {
  absl::MutexLock lock(&mu_);
  MRD_ASSIGN_OR_RETURN(Mr * mr, FindMrLocked(mr_id));
  return MrKeys{mr->id, mr->lkey, mr->rkey};
}

absl::StatusOr<DeviceModel::ResolvedPages> DeviceModel::ResolvePagesLocked(
    PdId pd, const std::vector<uint64_t>& pages) const {
  ResolvedPages resolved;
  resolved.pages.reserve(pages.size());
  absl::flat_hash_set<LamId> seen;
  for (size_t i = 0; i < pages.size(); ++i) {
    const uint64_t page = pages[i];
    std::optional<IovaSpace::Hit> hit = iova_.Lookup(page);
    const Lam* lam = nullptr;
    if (hit.has_value()) {
      auto it = lams_.find(hit->owner);
      if (it != lams_.end()) lam = it->second.get();
    }
    // Pages of another PD read exactly like unmapped ones: the caller learns
    // nothing about other sessions' mappings (W8).
    if (lam == nullptr || lam->pd != pd) {
      return InvalidParameter(
          "PAGE_NOT_MAPPED",
          absl::StrCat("page[", i, "] = ", Hex(page),
                       " is not a logical page mapped in protection domain ",
                       pd));
    }
    resolved.pages.push_back(PageRef{
        lam->span.fd,
        lam->span.file_offset - lam->fbo + hit->page_index * page_size()});
    if (seen.insert(lam->id).second) resolved.lams.push_back(lam->id);
  }
  return resolved;
}

absl::StatusOr<DeviceModel::Connection*> DeviceModel::FindPostConnectionLocked(
    ConnectionId connection, PdId pd) const {
  auto it = connections_.find(connection);
  // Unknown, closing, failed and other-PD connections all read the same:
  // which one it was is none of this PD's business.
  if (it == connections_.end() ||
      it->second->state != Connection::State::kReady || it->second->pd != pd) {
    return SeedError(STATUS_CONNECTION_INVALID, "CONNECTION_INVALID",
                     absl::StrCat("connection ", connection,
                                  " is not a connected queue pair of "
                                  "protection domain ",
                                  pd));
  }
  return it->second.get();
}

void DeviceModel::ReleaseDeferredLocked(Connection& connection) {
  for (Work& work : connection.deferred) {
    Task task;
    task.kind = Task::Kind::kWork;
    task.pd = work.pd;
    task.connection = work.connection;
    task.work = std::move(work);
    QueueTaskLocked(std::move(task));
  }
  connection.deferred.clear();
}

uint64_t DeviceModel::EnqueueLocked(Connection& connection, Work work) {
  work.id = next_work_++;
  const uint64_t id = work.id;
  if ((work.flags & kWorkDefer) != 0) {
    connection.deferred.push_back(std::move(work));
    return id;
  }
  // Deferred work goes to the "hardware" with the next non-deferred work,
  // ahead of it, in post order.
  ReleaseDeferredLocked(connection);
  Task task;
  task.kind = Task::Kind::kWork;
  task.pd = work.pd;
  task.connection = work.connection;
  task.work = std::move(work);
  QueueTaskLocked(std::move(task));
  return id;
}

absl::StatusOr<uint64_t> DeviceModel::PostFastRegister(
    ConnectionId connection_id, const FastRegisterWork& work) {
  MRD_RETURN_IF_ERROR(CheckWorkFlags(work.flags, "fast register"));
  MRD_RETURN_IF_ERROR(CheckAccessBits(work.access, "fast register"));
  absl::MutexLock lock(&mu_);
  MRD_RETURN_IF_ERROR(UsableLocked());
  MRD_ASSIGN_OR_RETURN(Mr * mr, FindMrLocked(work.mr));
  if (!mr->fast) {
    return InvalidParameter(
        "NOT_FAST_REGISTER_MR",
        absl::StrCat("MR ", work.mr,
                     " was not created for fast registration (R4/C1)"));
  }
  MRD_ASSIGN_OR_RETURN(Connection * connection,
                       FindPostConnectionLocked(connection_id, mr->pd));
  if ((work.access & kRemoteAccess) != 0 && !mr->fr()->allow_remote) {
    return SeedError(
        STATUS_ACCESS_VIOLATION, "REMOTE_ACCESS_NOT_ALLOWED",
        absl::StrCat("MR ", work.mr,
                     " was allocated without remote access, but the fast "
                     "registration asks for access ",
                     Hex(work.access)));
  }
  // F2/F6, the same rules the core applied, against this MR's own
  // max_pages.
  MRD_RETURN_IF_ERROR(ValidatePageArray(page_size(), mr->fr()->max_pages,
                                        work.pages, work.fbo, work.length,
                                        work.base_address));
  MRD_RETURN_IF_ERROR(ResolvePagesLocked(mr->pd, work.pages).status());
  MRD_RETURN_IF_ERROR(FaultPoint(options_.fault_points, "work.post"));
  Work queued{WorkCompletion::Kind::kFastRegister,
              /*id=*/0,
              connection_id,
              mr->pd,
              work.mr,
              work.flags,
              work.request_context,
              work};
  return EnqueueLocked(*connection, std::move(queued));
}

absl::StatusOr<uint64_t> DeviceModel::PostInvalidate(
    ConnectionId connection_id, const InvalidateWork& work) {
  MRD_RETURN_IF_ERROR(CheckWorkFlags(work.flags, "invalidate"));
  absl::MutexLock lock(&mu_);
  MRD_RETURN_IF_ERROR(UsableLocked());
  MRD_ASSIGN_OR_RETURN(Mr * mr, FindMrLocked(work.mr));
  if (!mr->fast) {
    return InvalidParameter(
        "NOT_FAST_REGISTER_MR",
        absl::StrCat("MR ", work.mr,
                     " was not created for fast registration; deregister "
                     "it instead"));
  }
  MRD_ASSIGN_OR_RETURN(Connection * connection,
                       FindPostConnectionLocked(connection_id, mr->pd));
  MRD_RETURN_IF_ERROR(FaultPoint(options_.fault_points, "work.post"));
  Work queued{WorkCompletion::Kind::kInvalidate,
              /*id=*/0,
              connection_id,
              mr->pd,
              work.mr,
              work.flags,
              work.request_context,
              {}};
  return EnqueueLocked(*connection, std::move(queued));
}

absl::Status DeviceModel::FlushDeferred(ConnectionId connection_id) {
  absl::MutexLock lock(&mu_);
  auto it = connections_.find(connection_id);
  if (it == connections_.end() ||
      it->second->state != Connection::State::kReady) {
    return SeedError(STATUS_CONNECTION_INVALID, "CONNECTION_INVALID",
                     absl::StrCat("connection ", connection_id,
                                  " is not a connected queue pair"));
  }
  ReleaseDeferredLocked(*it->second);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Worker.

bool DeviceModel::WorkerHasTask() const {
  return worker_stop_ || !tasks_.empty();
}

bool DeviceModel::WorkerIdle() const { return tasks_.empty() && !worker_busy_; }

void DeviceModel::QueueTaskLocked(Task task) {
  tasks_.push_back(std::move(task));
  worker_wake_.Signal();
}

void DeviceModel::WaitForWorkerIdle() {
  absl::MutexLock lock(&mu_);
  if (!started_) return;
  mu_.Await(absl::Condition(this, &DeviceModel::WorkerIdle));
}

DeviceModel::ModelCounts DeviceModel::CountModel() const {
  absl::MutexLock lock(&mu_);
  ModelCounts counts;
  counts.pds = pds_.size();
  mrs_.ForEach([&](uint32_t, const Mr& mr) {
    if (mr.pending) return;
    ++counts.mrs;
    counts.valid_mrs += mr.valid ? 1 : 0;
  });
  counts.lams = lams_.size();
  counts.iova_ranges = iova_.ranges();
  counts.tickets = tickets_.size();
  counts.connections = connections_.size();
  for (const auto& [id, lam] : lams_) {
    counts.lam_fast_register_refs += lam->fr_users;
  }
  for (const auto& [id, pd] : pds_) {
    counts.pd_objects += pd->mrs.size() + pd->lams.size();
  }
  counts.session_limit_refusals = session_limit_refusals_;
  return counts;
}

void DeviceModel::WorkerLoop() {
  while (true) {
    Task task;
    PdEventSink* sink = nullptr;
    {
      absl::MutexLock lock(&mu_);
      while (!WorkerHasTask()) worker_wake_.Wait(&mu_);
      if (tasks_.empty()) return;  // asked to stop, and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
      auto it = pds_.find(task.pd);
      // A deallocated PD's queued tasks vanish: its sink is never called
      // again once DeallocatePd returns.
      if (it == pds_.end() || it->second->dying) continue;
      ++it->second->busy;
      sink = it->second->sink;
      worker_busy_ = true;
    }
    switch (task.kind) {
      case Task::Kind::kWork:
        if (std::optional<WorkCompletion> completion = Execute(task.work)) {
          sink->OnCompletion(*completion);
        }
        break;
      case Task::Kind::kConnected:
        sink->OnPeerConnected(task.connection, task.remote);
        break;
      case Task::Kind::kDisconnected:
        sink->OnPeerDisconnected(task.connection);
        break;
    }
    absl::MutexLock lock(&mu_);
    EndPdOpLocked(task.pd);
    worker_busy_ = false;
  }
}

std::optional<WorkCompletion> DeviceModel::Execute(const Work& work) {
  WorkCompletion completion;
  completion.kind = work.kind;
  completion.connection = work.connection;
  completion.work_request = work.id;
  completion.request_context = work.request_context;
  completion.mr = work.mr;
  bool ready = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = connections_.find(work.connection);
    ready = it != connections_.end() &&
            it->second->state == Connection::State::kReady;
  }
  if (!ready) {
    completion.status = SeedError(
        STATUS_CONNECTION_INVALID, "FLUSHED",
        absl::StrCat("work request ", work.id, " flushed: connection ",
                     work.connection, " is closed or in error"));
  } else if (work.kind == WorkCompletion::Kind::kFastRegister) {
    completion.status = ExecuteFastRegister(work, &completion.rkey);
  } else {
    completion.status = ExecuteInvalidate(work);
  }
  // SILENT_SUCCESS hides successes only; failures always complete (F3).
  if (completion.status.ok() && (work.flags & kWorkSilentSuccess) != 0) {
    return std::nullopt;
  }
  return completion;
}

absl::Status DeviceModel::ExecuteFastRegister(const Work& work,
                                              uint32_t* rkey) {
  MRD_RETURN_IF_ERROR(
      FaultPoint(options_.fault_points, "fast_register.execute"));
  const FastRegisterWork& fr = work.fast_register;
  Mr* mr = nullptr;
  ResolvedPages resolved;
  ProviderState* pd_state = nullptr;
  ProviderState* object = nullptr;
  uint32_t previous_rkey = 0;
  {
    absl::MutexLock lock(&mu_);
    MRD_RETURN_IF_ERROR(UsableLocked());
    MRD_ASSIGN_OR_RETURN(mr, FindMrLocked(work.mr));
    if (mr->valid) {
      return InvalidParameter(
          "MR_NOT_FREE",
          absl::StrCat("MR ", work.mr, " is already fast-registered (rkey ",
                       Hex(mr->rkey), "); invalidate it first"));
    }
    // The LAMs may have been released since the post.
    MRD_ASSIGN_OR_RETURN(resolved, ResolvePagesLocked(mr->pd, fr.pages));
    for (LamId id : resolved.lams) ++lams_.find(id)->second->fr_users;
    mr->executing = true;
    // The PD is busy (held by the worker), so its state stays.
    pd_state = pds_.find(mr->pd)->second->state.get();
    // The MR object's state stays too: DestroyMrLocked waits for executing.
    object = mr->fr()->keys.get();
    previous_rkey = mr->rkey;
  }
  absl::StatusOr<Registration> registration = ProviderFastRegister(
      pd_state, object, work.mr, resolved.pages, fr, previous_rkey);
  absl::MutexLock lock(&mu_);
  mr->executing = false;
  if (!registration.ok()) {
    DropLamRefsLocked(resolved.lams);
    return registration.status();
  }
  // Committed even when FreeFastRegisterMr waits for us: it tears the
  // mapping down right after.
  mr->lkey = registration->lkey;
  mr->rkey = registration->rkey;
  mr->fr()->mapping = std::move(registration->state);
  SetMappingLocked(mr, fr, std::move(resolved));
  *rkey = mr->rkey;
  return absl::OkStatus();
}

absl::Status DeviceModel::ExecuteInvalidate(const Work& work) {
  std::unique_ptr<ProviderState> mapping;
  {
    absl::MutexLock lock(&mu_);
    MRD_ASSIGN_OR_RETURN(Mr * mr, FindMrLocked(work.mr));
    if (!mr->valid) {
      return InvalidParameter(
          "MR_NOT_FAST_REGISTERED",
          absl::StrCat("MR ", work.mr, " is not fast-registered"));
    }
    // The rkey stays what QueryMr reports, now dead, until the next fast
    // registration; no peer operation is inside the mapping after this.
    // A FreeFastRegisterMr meanwhile waits for us before freeing the MR.
    ++mr->holders;
    mapping = UnmapLocked(mr);
    --mr->holders;
  }
  // The old rkey is dead before the completion is delivered.
  if (mapping == nullptr) return absl::OkStatus();  // none, or taken
  return ProviderDeregister(std::move(mapping));
}

// ---------------------------------------------------------------------------
// Peer connections.

std::optional<ConnectionId> DeviceModel::NewConnection(
    const std::string& remote) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return std::nullopt;
  auto connection = std::make_unique<Connection>();
  connection->id = next_connection_++;
  connection->remote = remote;
  ConnectionId id = connection->id;
  connections_.emplace(id, std::move(connection));
  return id;
}

absl::StatusOr<DeviceModel::BindResult> DeviceModel::BindConnection(
    ConnectionId connection_id, absl::string_view ticket, bool ready) {
  absl::MutexLock lock(&mu_);
  auto c = connections_.find(connection_id);
  if (c == connections_.end() ||
      c->second->state != Connection::State::kHandshake) {
    return MrdError(
        absl::StatusCode::kFailedPrecondition, "ALREADY_BOUND",
        absl::StrCat("connection ", connection_id, " is bound or closed"));
  }
  Connection& connection = *c->second;
  auto found = tickets_.find(ticket);
  Pd* pd = nullptr;
  if (found != tickets_.end()) {
    auto it = pds_.find(found->second);
    if (it != pds_.end() && !it->second->dying) pd = it->second.get();
  }
  if (pd == nullptr) {
    return MrdError(absl::StatusCode::kNotFound, "BAD_TICKET",
                    "unknown ticket, or its session has ended");
  }
  if (pd->connections.size() >= options_.max_session_connections) {
    ++session_limit_refusals_;
    return MrdError(
        absl::StatusCode::kResourceExhausted, "LIMIT_PEER_CONNECTIONS",
        absl::StrCat("LIMIT_PEER_CONNECTIONS: the session already has ",
                     pd->connections.size(), " peer connections (max ",
                     options_.max_session_connections, ")"));
  }
  if (absl::Status admitted = pd->sink->AdmitPeerConnection(); !admitted.ok()) {
    ++session_limit_refusals_;
    const std::string reason = GetErrorDetail(admitted).reason();
    return MrdError(absl::StatusCode::kResourceExhausted, reason,
                    absl::StrCat(reason, ": ", admitted.message()));
  }
  connection.pd = pd->id;
  connection.state = Connection::State::kConnecting;
  pd->connections.insert(connection.id);
  if (ready) AnnounceLocked(connection);
  return BindResult{pd->id, pd->state.get()};
}

void DeviceModel::AnnounceLocked(Connection& connection) {
  connection.state = Connection::State::kReady;
  connection.announced = true;
  // Queued before the peer hears it is connected, so OnPeerConnected
  // precedes every completion of work posted on this connection.
  Task task;
  task.kind = Task::Kind::kConnected;
  task.pd = connection.pd;
  task.connection = connection.id;
  task.remote = connection.remote;
  QueueTaskLocked(std::move(task));
}

void DeviceModel::ConnectionEstablished(ConnectionId connection_id) {
  absl::MutexLock lock(&mu_);
  auto it = connections_.find(connection_id);
  if (it == connections_.end() ||
      it->second->state != Connection::State::kConnecting) {
    return;
  }
  auto pd = pds_.find(it->second->pd);
  if (pd == pds_.end() || pd->second->dying) return;  // being closed
  AnnounceLocked(*it->second);
}

void DeviceModel::MarkAllConnectionsError() {
  absl::MutexLock lock(&mu_);
  for (auto& [id, connection] : connections_) {
    if (connection->state != Connection::State::kClosed) {
      connection->state = Connection::State::kError;
    }
  }
}

bool DeviceModel::NoPdBusy() const {
  for (const auto& [id, pd] : pds_) {
    if (pd->busy > 0) return false;
  }
  return true;
}

DeviceModel::Taken DeviceModel::TakeAllProviderState() {
  Taken taken;
  absl::MutexLock lock(&mu_);
  // No call is working on a PD's objects; new ones are refused
  // (ProviderUsable).
  mu_.Await(absl::Condition(this, &DeviceModel::NoPdBusy));
  mrs_.ForEach([&](uint32_t, Mr& mr) {
    mr.valid = false;
    if (FastRegisterState* fr = mr.fr(); fr != nullptr) {
      fr->lams.clear();  // the fast registrations go with the adapter
      fr->pages.clear();
      if (fr->mapping != nullptr)
        taken.memory.push_back(std::move(fr->mapping));
      if (fr->keys != nullptr) taken.memory.push_back(std::move(fr->keys));
    } else if (mr.object != nullptr) {
      taken.memory.push_back(std::move(mr.object));
    }
  });
  for (auto& [id, lam] : lams_) {
    lam->fr_users = 0;
    if (lam->state != nullptr) taken.memory.push_back(std::move(lam->state));
  }
  for (auto& [id, pd] : pds_) {
    if (pd->state != nullptr) taken.pds.push_back(std::move(pd->state));
  }
  return taken;
}

void DeviceModel::ConnectionError(ConnectionId connection_id) {
  absl::MutexLock lock(&mu_);
  auto it = connections_.find(connection_id);
  if (it != connections_.end() &&
      it->second->state == Connection::State::kReady) {
    it->second->state = Connection::State::kError;
  }
}

void DeviceModel::ConnectionClosed(ConnectionId connection_id) {
  absl::MutexLock lock(&mu_);
  auto it = connections_.find(connection_id);
  if (it == connections_.end()) return;
  std::unique_ptr<Connection> connection = std::move(it->second);
  connections_.erase(it);
  connection->state = Connection::State::kClosed;
  if (connection->pd == 0) return;  // never bound
  auto pd = pds_.find(connection->pd);
  if (pd == pds_.end()) return;
  pd->second->connections.erase(connection->id);
  if (pd->second->dying) return;  // DeallocatePd hears no events
  // Held work goes to the worker too, which flushes it (the connection is
  // gone), so every post gets its completion, then the disconnect.
  ReleaseDeferredLocked(*connection);
  if (!connection->announced) return;
  Task task;
  task.kind = Task::Kind::kDisconnected;
  task.pd = connection->pd;
  task.connection = connection->id;
  QueueTaskLocked(std::move(task));
}

std::optional<PdId> DeviceModel::MovableConnection(
    ConnectionId connection_id) const {
  absl::MutexLock lock(&mu_);
  auto it = connections_.find(connection_id);
  if (it == connections_.end()) return std::nullopt;
  const Connection& connection = *it->second;
  if (connection.state != Connection::State::kReady || !connection.announced ||
      !connection.deferred.empty()) {
    return std::nullopt;
  }
  return connection.pd;
}

absl::Status DeviceModel::AdoptConnection(ConnectionId id, PdId pd_id,
                                          const std::string& remote) {
  absl::MutexLock lock(&mu_);
  MRD_RETURN_IF_ERROR(UsableLocked());
  if (shut_down_) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "DEVICE_SHUT_DOWN",
                    "the device is shut down: no connection is adopted");
  }
  if (connections_.contains(id)) {
    return MrdError(absl::StatusCode::kAlreadyExists, "CONNECTION_EXISTS",
                    absl::StrCat("connection ", id, " exists already"));
  }
  MRD_ASSIGN_OR_RETURN(Pd * pd, FindPdLocked(pd_id));
  auto connection = std::make_unique<Connection>();
  connection->id = id;
  connection->remote = remote;
  connection->pd = pd_id;
  connection->state = Connection::State::kReady;
  connection->announced = true;  // OnPeerDisconnected follows at its end
  pd->connections.insert(id);
  connections_.emplace(id, std::move(connection));
  next_connection_ = std::max(next_connection_, id + 1);
  return absl::OkStatus();
}

absl::StatusOr<DeviceModel::PeerAccess> DeviceModel::BeginPeerAccess(
    ConnectionId connection_id, uint32_t mr_slot, uint32_t rkey,
    uint64_t address, uint64_t length, uint32_t need) {
  auto denied = [](std::string message) {
    return MrdError(absl::StatusCode::kPermissionDenied, "REMOTE_ACCESS_ERROR",
                    message);
  };
  absl::MutexLock lock(&mu_);
  auto c = connections_.find(connection_id);
  if (c == connections_.end() ||
      c->second->state != Connection::State::kReady) {
    return denied(absl::StrCat("connection ", connection_id, " is closing"));
  }
  Mr* mr = mrs_.Get(mr_slot);
  // One answer for a wrong key, a free or dying MR and another PD's MR: a
  // peer must not learn that a key exists elsewhere (W8).
  if (mr == nullptr || mr->pending || mr->revoking || !mr->valid ||
      mr->rkey != rkey || mr->pd != c->second->pd) {
    return denied(
        absl::StrCat("rkey ", Hex(rkey), " is not valid on this connection"));
  }
  if (address < mr->base || length > mr->length ||
      address - mr->base > mr->length - length) {
    return denied(absl::StrCat("[", Hex(address), ", +", length,
                               ") is outside the region [", Hex(mr->base),
                               ", +", mr->length, ") of rkey ", Hex(rkey)));
  }
  if ((mr->access & need) == 0) {
    return denied(absl::StrCat("rkey ", Hex(rkey), " does not grant remote ",
                               need == kAccessRemoteRead ? "read" : "write"));
  }
  const uint64_t offset = address - mr->base;
  PeerAccess access;
  if (!mr->fast) {
    access.plan.push_back(IoSegment{mr->fd, mr->file_offset + offset, length});
  } else {
    // VA -> position in the page array -> logical page -> file page.
    const FastRegisterState& fr = *mr->fr();
    uint64_t position = fr.fbo + offset;
    uint64_t left = length;
    while (left > 0) {
      const PageRef& page = fr.pages[position / page_size()];
      const uint64_t within = position % page_size();
      const uint64_t chunk = std::min(left, page_size() - within);
      IoSegment segment{page.fd, page.file_offset + within, chunk};
      std::vector<IoSegment>& plan = access.plan;
      if (!plan.empty() && plan.back().fd == segment.fd &&
          plan.back().offset + plan.back().length == segment.offset) {
        plan.back().length += chunk;  // neighbouring file pages: one call
      } else {
        plan.push_back(segment);
      }
      position += chunk;
      left -= chunk;
    }
  }
  ++mr->inflight;
  access.mr = mr->id;
  return access;
}

void DeviceModel::EndPeerAccess(const PeerAccess& access) {
  absl::MutexLock lock(&mu_);
  // Not freed while inflight > 0: its destroyer waits in UnmapLocked.
  Mr* mr = LookupMrLocked(access.mr);
  MRD_CHECK(mr != nullptr && mr->inflight > 0);
  --mr->inflight;
}

}  // namespace mrd::device
