#include "server/core/registrations.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "absl/numeric/bits.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "mrd/status.h"
#include "server/common/log.h"
#include "server/common/thread.h"
#include "server/core/errors.h"
#include "server/core/flags.h"

namespace mrd::core {
namespace {

// Longest RegisterMr request_id (idempotency key) a session may use.
constexpr size_t kMaxRequestIdBytes = 128;

constexpr uint32_t kDescriptorSize = 24;  // rkey(4) pad(4) base(8) length(8)

// W2: a buffer outside the caller's memory. No required size: the caller's
// descriptor length is left as it gave it.
absl::Status OutsideCallerMemory(absl::string_view why) {
  return SeedError(
      WSAEFAULT, "BUFFER_OUTSIDE_CALLER_MEMORY",
      absl::StrCat("the buffer is not within the caller's memory: ", why));
}

// Little-endian `bytes` bytes of `value` at `at`.
void PutLe(char* at, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) {
    at[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  }
}

std::string EncodeDescriptor(uint32_t rkey, uint64_t base, uint64_t length) {
  char d[kDescriptorSize] = {};
  PutLe(d, rkey, 4);  // then 4 bytes of padding, zero
  PutLe(d + 8, base, 8);
  PutLe(d + 16, length, 8);
  return std::string(d, sizeof(d));
}

// The request alone: request id length, flags (R3/W6), descriptor space
// (W2).
absl::Status CheckRequest(const v1::RegisterMrRequest& req, uint32_t* access) {
  // Idempotency keys are remembered per session (request_id_memory of them):
  // their length is bounded so that remembering costs bounded memory.
  if (req.request_id().size() > kMaxRequestIdBytes) {
    return SeedError(
        STATUS_INVALID_PARAMETER, "REQUEST_ID_TOO_LONG",
        absl::StrCat("request_id is ", req.request_id().size(),
                     " bytes; at most ", kMaxRequestIdBytes, " are allowed"));
  }
  MRD_ASSIGN_OR_RETURN(*access,
                       RegistrationAccess(req.flags(), req.mem_flags()));
  // W2: check the caller's space before doing anything.
  if (req.descriptor_capacity() != 0 &&
      req.descriptor_capacity() < kDescriptorSize) {
    return SeedError(
        WSAEFAULT, "DESCRIPTOR_SPACE_TOO_SMALL",
        absl::StrCat("descriptor_capacity ", req.descriptor_capacity(),
                     " is too small: the descriptor needs ", kDescriptorSize,
                     " bytes"),
        kDescriptorSize);
  }
  return absl::OkStatus();
}

// What a warm pin keeps alive besides its pages: the mapping of the buffer
// it was made on, and a way back to its session for the accounting.
struct WarmOwner {
  std::weak_ptr<Session> session;
  std::shared_ptr<fd_socket::MappedFile> file;
};

// get_mempolicy's flags (<numaif.h> is libnuma's; the system call is the
// kernel's).
constexpr unsigned long kMpolFNode = 1;
constexpr unsigned long kMpolFAddr = 2;

cache::WarmKey WarmKeyOf(const cache::CacheKey& key) {
  return cache::WarmKey{key.session, key.buffer, key.offset, key.length};
}

}  // namespace

Registrations::Registrations(std::vector<device::Device*> devices,
                             Budgets* budgets,
                             const RegistrationOptions& options)
    : devices_(std::move(devices)),
      device_(devices_.at(0)),
      budgets_(budgets),
      options_(options),
      page_size_(device_->Attributes().page_size),
      warm_(options.warm) {}

// --- devices -----------------------------------------------------------------

absl::StatusOr<size_t> Registrations::DeviceIndex(
    absl::string_view name) const {
  for (size_t i = 0; i < devices_.size(); ++i) {
    if (devices_[i]->Attributes().name == name) return i;
  }
  std::vector<std::string> names;
  for (const device::Device* d : devices_)
    names.push_back(d->Attributes().name);
  return MrdError(absl::StatusCode::kInvalidArgument, "UNKNOWN_DEVICE",
                  absl::StrCat("no device '", name, "': mrd serves ",
                               absl::StrJoin(names, ", ")));
}

absl::StatusOr<uint32_t> Registrations::DeviceBits(
    const v1::DeviceSelection& selection) const {
  if (int{selection.all()} + int{selection.nearest()} +
          int{!selection.names().empty()} >
      1) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_DEVICE_SELECTION",
                    "a device selection gives names, all or nearest: one of "
                    "them");
  }
  if (selection.nearest()) return 0;
  if (selection.all()) {
    return devices_.size() >= 32 ? ~uint32_t{0}
                                 : (uint32_t{1} << devices_.size()) - 1;
  }
  if (selection.names().empty()) return 1;
  uint32_t bits = 0;
  for (const std::string& name : selection.names()) {
    MRD_ASSIGN_OR_RETURN(const size_t index, DeviceIndex(name));
    bits |= uint32_t{1} << index;
  }
  return bits;
}

uint32_t Registrations::NearestDevices(const void* address) const {
  const uint32_t all = devices_.size() >= 32
                           ? ~uint32_t{0}
                           : (uint32_t{1} << devices_.size()) - 1;
  // The node of the page at `address` (MPOL_F_NODE | MPOL_F_ADDR); the
  // page is the client's, already in the file, so looking it up costs a
  // fault of mrd's mapping at most, which the pin makes anyway.
  int node = -1;
  if (::syscall(SYS_get_mempolicy, &node, nullptr, 0,
                const_cast<void*>(address), kMpolFNode | kMpolFAddr) != 0) {
    return all;
  }
  uint32_t bits = 0;
  for (size_t i = 0; i < devices_.size(); ++i) {
    if (devices_[i]->Attributes().numa_node == node) bits |= uint32_t{1} << i;
  }
  return bits != 0 ? bits : all;
}

uint32_t Registrations::FirstDevice(uint32_t bits) {
  return static_cast<uint32_t>(absl::countr_zero(bits));
}

Registrations::DeviceMrs Registrations::MrsOf(
    const cache::EntryView& view) const {
  DeviceMrs mrs;
  const uint32_t first = FirstDevice(view.key.devices);
  mrs.push_back(DeviceMr{first, view.device_mr, view.lkey, view.rkey});
  if ((view.key.devices & (view.key.devices - 1)) == 0) return mrs;
  absl::MutexLock lock(&others_mu_);
  auto it = others_.find(OthersKey(first, view.device_mr));
  if (it != others_.end()) {
    mrs.insert(mrs.end(), it->second.begin(), it->second.end());
  }
  return mrs;
}

void Registrations::AddTokens(
    const cache::EntryView& view,
    google::protobuf::RepeatedPtrField<v1::DeviceToken>* out) const {
  for (const DeviceMr& mr : MrsOf(view)) {
    const device::DeviceAttributes& a = devices_[mr.device]->Attributes();
    v1::DeviceToken* token = out->Add();
    token->set_device(a.name);
    token->set_rkey(mr.rkey);
    token->set_lkey(mr.lkey);
    token->set_peer_address(a.peer_address);
  }
}

absl::StatusOr<device::MrKeys> Registrations::RegisterOn(
    uint32_t index, const Plan& plan, const device::MemorySpan& span) {
  absl::StatusOr<device::MrKeys> keys;
  do {
    keys = devices_[index]->RegisterMr(plan.pds[index], span,
                                       plan.key.base_address, plan.key.access);
  } while (!keys.ok() &&
           keys.status().code() == absl::StatusCode::kResourceExhausted &&
           EvictWarmForDevice());
  return keys;
}

namespace {

// The thread's open OthersBatch, if any.
thread_local Registrations::OthersBatch* open_others_batch = nullptr;
// The thread's open PinAhead, if any.
thread_local Registrations::PinAhead* open_pin_ahead = nullptr;

}  // namespace

Registrations::PinAhead::PinAhead(Registrations* registrations,
                                  std::shared_ptr<Session> session,
                                  uint64_t buffer, uint64_t offset,
                                  uint64_t length)
    : registrations_(registrations), session_(std::move(session)) {
  if (open_pin_ahead != nullptr || length == 0) return;
  std::shared_ptr<fd_socket::MappedFile> file;
  uint32_t devices = 0;
  bool nearest = false;
  {
    absl::MutexLock lock(&session_->mu);
    auto b = session_->buffers.find(buffer);
    if (b == session_->buffers.end() || b->second.file == nullptr) return;
    file = b->second.file;
    devices = session_->default_device_bits;
    nearest = session_->default_nearest;
  }
  // Read-only memory is pinned with mlock, whose memory maps each item's
  // own reservation counts.
  if (!file->writable()) return;
  absl::StatusOr<device::MemorySpan> span = file->Span(offset, length);
  if (!span.ok() || span->pages != device::SpanPages::kBase) return;
  if (nearest) devices = registrations_->NearestDevices(span->host_address);
  const uint64_t bytes =
      PageRound(registrations_->page_size_,
                reinterpret_cast<uintptr_t>(span->host_address), span->length);
  Budgets::PinLimit hit;
  uint64_t over = 0;
  if (!registrations_->budgets_->TryReservePinned(*session_, bytes, &hit, &over)
           .ok()) {
    return;
  }
  for (uint32_t bits = devices; bits != 0; bits &= bits - 1) {
    const uint32_t d = static_cast<uint32_t>(absl::countr_zero(bits));
    if (d >= registrations_->devices_.size()) break;
    std::unique_ptr<device::BatchPin> pin =
        registrations_->devices_[d]->PinForBatch(*span);
    if (pin != nullptr) pins_.push_back(std::move(pin));
  }
  if (pins_.empty()) {
    registrations_->budgets_->UnreservePinned(*session_, bytes);
    return;
  }
  reserved_ = bytes;
  start_ = reinterpret_cast<uint64_t>(span->host_address);
  end_ = start_ + span->length;
  open_pin_ahead = this;
}

Registrations::PinAhead::~PinAhead() {
  if (!active()) return;
  open_pin_ahead = nullptr;
  pins_.clear();
  if (reserved_ > 0) {
    registrations_->budgets_->UnreservePinned(*session_, reserved_);
  }
}

bool Registrations::PinAhead::Take(const Session& session,
                                   const device::MemorySpan& span,
                                   uint64_t bytes) {
  const uint64_t at = reinterpret_cast<uint64_t>(span.host_address);
  if (&session != session_.get() || bytes > reserved_ || at < start_ ||
      at > end_ || span.length > end_ - at) {
    return false;
  }
  reserved_ -= bytes;
  return true;
}

Registrations::OthersBatch::OthersBatch(Registrations* registrations,
                                        std::shared_ptr<Session> session)
    : registrations_(registrations), session_(std::move(session)) {
  if (registrations_->devices_.size() < 2 || open_others_batch != nullptr) {
    return;
  }
  open_others_batch = this;
  open_ = true;
}

Registrations::OthersBatch::~OthersBatch() {
  if (!open_) return;
  open_others_batch = nullptr;
  {
    absl::MutexLock lock(&mu_);
    done_ = true;
  }
  thread_.Join();
}

bool Registrations::OthersBatch::Add(absl::InlinedVector<DeviceMr, 1> mrs,
                                     std::shared_ptr<const void> memory) {
  if (!open_ || no_thread_) return false;
  if (!thread_.joinable()) {
    absl::StatusOr<Thread> thread =
        Thread::Start("mrd-dereg-other", [this] { Run(); });
    if (!thread.ok()) {
      no_thread_ = true;
      return false;
    }
    thread_ = *std::move(thread);
  }
  absl::MutexLock lock(&mu_);
  queue_.push_back(Item{std::move(mrs), std::move(memory)});
  return true;
}

void Registrations::OthersBatch::Run() {
  // This thread's unpins leave the devices together too (Device::BeginBatch).
  std::vector<std::unique_ptr<device::DeviceBatch>> batches;
  for (device::Device* device : registrations_->devices_) {
    batches.push_back(device->BeginBatch());
  }
  for (;;) {
    std::deque<Item> items;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &OthersBatch::HasWorkOrDone));
      if (queue_.empty()) return;
      items.swap(queue_);
    }
    for (const Item& item : items) {
      registrations_->DeregisterNow(*session_, item.mrs, item.memory);
    }
  }
}

void Registrations::DeregisterOthers(Session& session,
                                     const cache::CachedRegistration& reg) {
  if ((reg.devices & (reg.devices - 1)) == 0) return;
  absl::InlinedVector<DeviceMr, 1> others;
  {
    absl::MutexLock lock(&others_mu_);
    auto it = others_.find(OthersKey(FirstDevice(reg.devices), reg.device_mr));
    if (it != others_.end()) {
      others = std::move(it->second);
      others_.erase(it);
    }
  }
  if (others.empty()) {  // not expected: the budget's share comes back
    budgets_->UnreserveRegistration(
        session, 0, static_cast<uint32_t>(absl::popcount(reg.devices) - 1));
    return;
  }
  OthersBatch* batch = open_others_batch;
  if (batch != nullptr && batch->For(this, &session) &&
      batch->Add(others, reg.memory)) {
    return;
  }
  DeregisterNow(session, others, reg.memory);
}

void Registrations::DeregisterNow(Session& session,
                                  const absl::InlinedVector<DeviceMr, 1>& mrs,
                                  const std::shared_ptr<const void>& memory) {
  for (auto mr = mrs.rbegin(); mr != mrs.rend(); ++mr) {
    absl::Status s = devices_[mr->device]->DeregisterMr(mr->mr);
    if (s.ok()) continue;
    // Not deregistered: its pages stay pinned until the PD goes (NOT_FOUND:
    // the PD is going already), so the mapping stays too.
    session.KeepUntilPdGone(memory);
    if (s.code() != absl::StatusCode::kNotFound) {
      LogWarning("deregister MR ", mr->mr, " on ",
                 devices_[mr->device]->Attributes().name,
                 " (kept until the session ends): ", s.ToString());
    }
  }
  budgets_->UnreserveRegistration(session, /*map_splits=*/0,
                                  static_cast<uint32_t>(mrs.size()));
}

// --- RegisterMr --------------------------------------------------------------

absl::Status Registrations::Register(const std::shared_ptr<Session>& session,
                                     const v1::RegisterMrRequest& req,
                                     v1::RegisterMrResponse* out,
                                     const CancelCheck& cancelled) {
  if (cancelled && cancelled()) {  // gave up while the call waited its turn
    return absl::CancelledError(absl::StrCat("RegisterMr of ", req.length(),
                                             " bytes of buffer ", req.buffer(),
                                             " was cancelled before it began"));
  }
  uint32_t access = 0;
  MRD_RETURN_IF_ERROR(CheckRequest(req, &access));
  Plan plan;
  {
    absl::MutexLock lock(&session->mu);
    // A retried request with the same id gets the first answer (no second
    // reference).
    if (ReplayLocked(*session, req, out)) return absl::OkStatus();
    MRD_RETURN_IF_ERROR(CheckTargetsLocked(*session, req, access, &plan));
  }
  MRD_RETURN_IF_ERROR(PlanRegistration(*session, req, access, &plan));
  plan.cancelled = cancelled;
  absl::StatusOr<cache::AcquireResult> acquired = cache_.Acquire(
      plan.key, [&] { return RegisterOnDevice(session, plan, req); });
  if (!acquired.ok()) {
    absl::MutexLock lock(&session->mu);
    if (session->closing) {
      return NotConnected("the session closed during the registration");
    }
    return acquired.status();
  }
  // The caller is gone: no one would learn of this reference.
  if (cancelled && cancelled()) {
    (void)DropReference(session, acquired->entry);
    return absl::CancelledError(absl::StrCat("RegisterMr of ", req.length(),
                                             " bytes of buffer ", req.buffer(),
                                             " was cancelled; it was undone"));
  }
  // Commit to the session, or undo: either the registration exists and is
  // owned by the session, or nothing of it does.
  absl::Status commit;
  {
    absl::MutexLock lock(&session->mu);
    commit = CommitLocked(*session, req, plan, *acquired, out);
  }
  if (!commit.ok()) (void)DropReference(session, acquired->entry);
  return commit;
}

std::optional<absl::Status> Registrations::TryRegisterHit(
    const std::shared_ptr<Session>& session, const v1::RegisterMrRequest& req,
    v1::RegisterMrResponse* out) {
  uint32_t access = 0;
  MRD_RETURN_IF_ERROR(CheckRequest(req, &access));
  // One hold of the session's lock from the checks to the commit: nothing
  // the commit checks can change in between, so a hit is never undone.
  absl::MutexLock lock(&session->mu);
  if (ReplayLocked(*session, req, out)) return absl::OkStatus();
  Plan plan;
  MRD_RETURN_IF_ERROR(CheckTargetsLocked(*session, req, access, &plan));
  MRD_RETURN_IF_ERROR(PlanRegistration(*session, req, access, &plan));
  std::optional<cache::AcquireResult> hit = cache_.TryAcquireReady(plan.key);
  if (!hit.has_value()) return std::nullopt;
  absl::Status commit = CommitLocked(*session, req, plan, *hit, out);
  if (!commit.ok()) {
    // Not expected (the lock was held throughout); give the reference back
    // without blocking when it is not the last, on a worker otherwise.
    uint32_t left = 0;
    if (!cache_.ReleaseIfNotLast(hit->entry, &left)) {
      out->Clear();
      return std::nullopt;
    }
    return commit;
  }
  return absl::OkStatus();
}

std::optional<absl::Status> Registrations::TryDeregisterNotLast(
    const std::shared_ptr<Session>& session, const v1::DeregisterMrRequest& req,
    v1::DeregisterMrResponse* out, uint64_t* last_bytes) {
  // Through an MR object the reference is the object's: the worker path.
  if (!req.has_registration()) return std::nullopt;
  absl::MutexLock lock(&session->mu);
  auto r = session->registrations.find(req.registration());
  if (r == session->registrations.end() || r->second.implicit_refs == 0) {
    return std::nullopt;  // an error: the worker's
  }
  // The last reference: the worker's, which unpins the range.
  auto last = [&] {
    if (last_bytes != nullptr) {
      std::optional<cache::CacheKey> key = cache_.KeyOf(r->first);
      *last_bytes = key.has_value() ? key->length : 0;
    }
    return std::nullopt;
  };
  if (r->second.implicit_refs + r->second.mr_refs < 2) return last();
  uint32_t left = 0;
  if (!cache_.ReleaseIfNotLast(r->first, &left)) return last();
  --r->second.implicit_refs;
  out->set_references(left);
  return absl::OkStatus();
}

bool Registrations::ReplayLocked(Session& session,
                                 const v1::RegisterMrRequest& req,
                                 v1::RegisterMrResponse* out) {
  if (req.request_id().empty()) return false;
  const v1::RegisterMrResponse* first =
      session.FindRequestLocked(req.request_id());
  if (first == nullptr) return false;
  *out = *first;
  out->set_references(cache_.References(first->registration()));
  return true;
}

absl::Status Registrations::CheckTargetsLocked(Session& session,
                                               const v1::RegisterMrRequest& req,
                                               uint32_t access, Plan* plan) {
  // The Winsock form of the call (WSPRegisterRdmaMemory: MEM_* flags) speaks
  // Winsock errors: memory that is not the caller's is WSAEFAULT (W2).
  const bool winsock = req.mem_flags() != 0;
  auto b = session.buffers.find(req.buffer());
  if (b == session.buffers.end()) {
    if (winsock) {
      return OutsideCallerMemory(
          absl::StrCat("this session has no buffer ", req.buffer()));
    }
    return UnknownHandle("buffer", req.buffer());
  }
  if (req.mr() != 0) {
    auto m = session.mrs.find(req.mr());
    if (m == session.mrs.end()) return UnknownHandle("mr", req.mr());
    if (m->second.fast_register) {
      return SeedError(STATUS_INVALID_PARAMETER, "MR_IS_FAST_REGISTER",
                       absl::StrCat("MR ", req.mr(),
                                    " was created for fast registration; "
                                    "RegisterMr needs fast_register=false "
                                    "(R4)"));
    }
    if (m->second.registration != 0) {
      return MrdError(
          absl::StatusCode::kFailedPrecondition, "MR_ALREADY_REGISTERED",
          absl::StrCat("MR ", req.mr(),
                       " already holds "
                       "registration ",
                       m->second.registration, "; deregister it first"));
    }
  }
  plan->file = b->second.file;
  if ((access & (device::kAccessLocalWrite | device::kAccessRemoteWrite)) &&
      !plan->file->writable()) {
    return SeedError(STATUS_INVALID_PARAMETER, "BUFFER_READ_ONLY",
                     absl::StrCat("buffer ", req.buffer(),
                                  " was imported read-only; write access "
                                  "cannot be granted on it (W6)"));
  }
  plan->pds.assign(session.pds.begin(), session.pds.end());
  plan->key.devices = session.default_device_bits;
  plan->nearest = session.default_nearest;
  if (req.mr() != 0) {
    // Not the session's defaults: the MR object's own device.
    plan->mr_device = session.mrs.find(req.mr())->second.device;
    plan->key.devices = uint32_t{1} << *plan->mr_device;
    plan->nearest = false;
  }
  plan->key.base_address = b->second.address + req.offset();
  return absl::OkStatus();
}

absl::Status Registrations::PlanRegistration(Session& session,
                                             const v1::RegisterMrRequest& req,
                                             uint32_t access,
                                             Plan* plan) const {
  absl::StatusOr<device::MemorySpan> span =
      plan->file->Span(req.offset(), req.length());
  if (!span.ok()) {
    if (req.mem_flags() != 0)
      return OutsideCallerMemory(span.status().message());
    return span.status();
  }
  plan->span = *span;
  cache::CacheKey& key = plan->key;
  if (req.has_base_address()) {
    if (req.base_address() == 0) {
      return SeedError(STATUS_INVALID_PARAMETER, "ZERO_BASED_ADDRESS",
                       "base_address 0: zero-based virtual addressing is not "
                       "supported (R8)");
    }
    key.base_address = req.base_address();
  }
  if (key.base_address > std::numeric_limits<uint64_t>::max() - req.length()) {
    return SeedError(
        STATUS_INVALID_PARAMETER, "BASE_ADDRESS_OVERFLOW",
        absl::StrCat("base_address ", key.base_address, " + length ",
                     req.length(), " overflows the address space"));
  }
  if (req.has_devices()) {
    MRD_ASSIGN_OR_RETURN(const uint32_t bits, DeviceBits(req.devices()));
    if (plan->mr_device.has_value() &&
        (req.devices().nearest() || bits != key.devices)) {
      return SeedError(
          STATUS_INVALID_PARAMETER, "MR_ON_ANOTHER_DEVICE",
          absl::StrCat("MR ", req.mr(), " belongs to device ",
                       devices_[*plan->mr_device]->Attributes().name,
                       "; a registration through it is made there only: "
                       "leave devices unset, or name that device alone"));
    }
    key.devices = bits;
    plan->nearest = req.devices().nearest();
  }
  if (plan->nearest) key.devices = NearestDevices(plan->span.host_address);
  key.session = session.id();
  key.offset = req.offset();
  key.length = req.length();
  key.access = access;
  key.buffer = req.buffer();
  plan->pin_bytes = PageRound(
      page_size_, reinterpret_cast<uintptr_t>(plan->span.host_address),
      plan->span.length);
  return absl::OkStatus();
}

absl::StatusOr<cache::CachedRegistration> Registrations::RegisterOnDevice(
    const std::shared_ptr<Session>& session, const Plan& plan,
    const v1::RegisterMrRequest& req) {
  // A long pin: watched (its progress reported on the session's stream) and
  // cancellable between steps.
  device::MemorySpan span = plan.span;
  v1::Completion call;  // only a long pin reports (no allocation otherwise)
  if (span.length >= kProgressMinBytes) {
    call.set_request_id(req.request_id());
    call.set_buffer(req.buffer());
    call.set_offset(req.offset());
    call.set_length(req.length());
  }
  const LongPin long_pin(options_.progress, session, span, plan.cancelled,
                         call);
  const uint64_t map_splits = MapSplitsOf(*plan.file);
  // Each device holds an MR and a key of it: it counts once per device.
  const uint32_t device_count =
      static_cast<uint32_t>(absl::popcount(plan.key.devices));
  MRD_RETURN_IF_ERROR(
      budgets_->ReserveRegistration(*session, map_splits, device_count));
  // A warm pin of exactly these pages: its reservation becomes this
  // registration's, and the device pins nothing anew. Warm pins are the
  // first device's: a registration on others makes its own pins.
  std::optional<cache::WarmPin> warm;
  if (plan.key.devices == 1) warm = warm_.Take(WarmKeyOf(plan.key));
  // Pages a batch pinned ahead: reserved with them, and in memory.
  const bool ahead = !warm.has_value() && open_pin_ahead != nullptr &&
                     open_pin_ahead->Take(*session, span, plan.pin_bytes);
  if (!warm.has_value() && !ahead) {
    if (absl::Status s = ReservePinned(*session, plan.pin_bytes); !s.ok()) {
      budgets_->UnreserveRegistration(*session, map_splits, device_count);
      return s;
    }
  }
  // The pin would fault mrd's mapping in page by page: filled by several
  // threads first, it walks the page tables instead (prefault.h).
  if (!warm.has_value() && !ahead) {
    plan.file->Prefault(plan.key.offset, plan.key.length, span.progress);
  }
  // On every device of the key, or on none: what one refuses, the others
  // that made theirs undo, last first. A big registration is made on the
  // devices after the first on threads of their own (one that cannot start
  // leaves its device to the sequence below).
  absl::InlinedVector<uint32_t, 2> order;
  for (uint32_t bits = plan.key.devices; bits != 0; bits &= bits - 1) {
    order.push_back(FirstDevice(bits));
  }
  std::vector<std::optional<absl::StatusOr<device::MrKeys>>> results(
      order.size());
  std::vector<Thread> helpers;
  if (order.size() > 1 &&
      plan.pin_bytes >= options_.parallel_devices_min_bytes) {
    for (size_t k = 1; k < order.size(); ++k) {
      absl::StatusOr<Thread> helper = Thread::Start(
          "mrd-device-reg", [this, &results, &order, &plan, &span, k] {
            results[k] = RegisterOn(order[k], plan, span);
          });
      if (helper.ok()) helpers.push_back(*std::move(helper));
    }
  }
  results[0] = RegisterOn(order[0], plan, span);
  for (Thread& helper : helpers) helper.Join();
  absl::InlinedVector<DeviceMr, 2> made;
  absl::Status failed;
  for (size_t k = 0; k < order.size(); ++k) {
    // Sequential: not tried once a device before it refused.
    if (!results[k].has_value() && failed.ok()) {
      results[k] = RegisterOn(order[k], plan, span);
    }
    if (!results[k].has_value()) continue;
    const absl::StatusOr<device::MrKeys>& keys = *results[k];
    if (keys.ok()) {
      made.push_back(DeviceMr{order[k], keys->mr, keys->lkey, keys->rkey});
    } else if (failed.ok()) {
      failed =
          plan.key.devices == 1
              ? keys.status()
              : OnDevice(keys.status(), devices_[order[k]]->Attributes().name);
    }
  }
  if (!failed.ok()) {
    for (auto mr = made.rbegin(); mr != made.rend(); ++mr) {
      absl::Status s = devices_[mr->device]->DeregisterMr(mr->mr);
      if (!s.ok()) {
        session->KeepUntilPdGone(plan.file);
        LogWarning("undo of MR ", mr->mr, " on ",
                   devices_[mr->device]->Attributes().name,
                   " (kept until the session ends): ", s.ToString());
      }
    }
    if (warm.has_value()) {
      std::vector<cache::WarmPin> pins;
      pins.push_back(std::move(*warm));
      ReleaseWarm(std::move(pins));  // and its reservation
    } else {
      budgets_->UnreservePinned(*session, plan.pin_bytes);
    }
    budgets_->UnreserveRegistration(*session, map_splits, device_count);
    return failed;
  }
  if (warm.has_value()) ReleaseWarmAfterHit(session, std::move(*warm));
  if (made.size() > 1) {
    absl::MutexLock lock(&others_mu_);
    others_[OthersKey(made[0].device, made[0].mr)].assign(made.begin() + 1,
                                                          made.end());
  }
  cache::CachedRegistration reg;
  reg.device_mr = made[0].mr;
  reg.lkey = made[0].lkey;
  reg.rkey = made[0].rkey;
  reg.devices = plan.key.devices;
  reg.pinned_bytes = plan.pin_bytes;
  reg.memory = plan.file;  // unmapped only after the MR is deregistered
  return reg;
}

absl::Status Registrations::CommitLocked(Session& session,
                                         const v1::RegisterMrRequest& req,
                                         const Plan& plan,
                                         const cache::AcquireResult& acquired,
                                         v1::RegisterMrResponse* out) {
  if (session.closing) {
    return NotConnected("the session closed during the registration");
  }
  if (!session.buffers.contains(req.buffer())) {
    return MrdError(absl::StatusCode::kNotFound, "UNKNOWN_BUFFER",
                    absl::StrCat("buffer ", req.buffer(),
                                 " was released during the registration"));
  }
  if (req.mr() != 0 && (!session.mrs.contains(req.mr()) ||
                        session.mrs[req.mr()].registration != 0)) {
    return MrdError(absl::StatusCode::kFailedPrecondition,
                    "MR_ALREADY_REGISTERED",
                    absl::StrCat("MR ", req.mr(),
                                 " was closed or registered concurrently"));
  }
  const uint64_t base = plan.key.base_address;
  RegistrationRecord& rec = session.registrations[acquired.entry];
  rec.flags = req.flags() != 0 ? req.flags() : FlagsFromAccess(plan.key.access);
  if (req.mr() != 0) {
    ++rec.mr_refs;
    session.mrs[req.mr()].registration = acquired.entry;
  } else {
    ++rec.implicit_refs;
  }
  out->set_registration(acquired.entry);
  out->set_lkey(acquired.registration.lkey);
  out->set_rkey(acquired.registration.rkey);
  out->set_base_address(base);
  out->set_length(req.length());
  out->set_references(acquired.references);
  out->set_cache_hit(acquired.hit);
  out->set_rdma_descriptor(
      EncodeDescriptor(acquired.registration.rkey, base, req.length()));
  out->set_mr(req.mr());
  cache::EntryView view;
  view.key = plan.key;
  view.device_mr = acquired.registration.device_mr;
  view.lkey = acquired.registration.lkey;
  view.rkey = acquired.registration.rkey;
  AddTokens(view, out->mutable_tokens());
  if (!req.request_id().empty()) {
    session.RememberRequestLocked(req.request_id(), *out,
                                  options_.request_id_memory);
  }
  return absl::OkStatus();
}

// --- DeregisterMr ------------------------------------------------------------

absl::Status Registrations::Deregister(const std::shared_ptr<Session>& session,
                                       const v1::DeregisterMrRequest& req,
                                       v1::DeregisterMrResponse* out) {
  // What this call takes from the session, to put back if the device cannot
  // deregister (then nothing changed and the caller may retry).
  TakenReference taken;
  {
    absl::MutexLock lock(&session->mu);
    MRD_RETURN_IF_ERROR(TakeReferenceLocked(*session, req, &taken));
  }
  absl::StatusOr<uint32_t> left = DropReference(session, taken.entry);
  if (!left.ok()) {
    if (GetErrorDetail(left.status()).reason() == "DEREGISTER_FAILED") {
      PutReferenceBack(*session, taken);
    }
    return left.status();
  }
  out->set_references(*left);
  return absl::OkStatus();
}

void Registrations::EraseIfUnreferencedLocked(
    Session& session, absl::btree_map<uint64_t, RegistrationRecord>::iterator r,
    TakenReference* taken) {
  if (r->second.implicit_refs + r->second.mr_refs != 0) return;
  taken->record = r->second;
  taken->erased = true;
  session.registrations.erase(r);
}

absl::Status Registrations::TakeReferenceLocked(
    Session& session, const v1::DeregisterMrRequest& req,
    TakenReference* taken) {
  if (req.has_mr()) {
    auto m = session.mrs.find(req.mr());
    if (m == session.mrs.end()) return UnknownHandle("mr", req.mr());
    if (m->second.fast_register) {
      return SeedError(STATUS_INVALID_PARAMETER, "MR_IS_FAST_REGISTER",
                       absl::StrCat("MR ", req.mr(),
                                    " is for fast registration: use "
                                    "InvalidateMr"));
    }
    if (m->second.registration == 0) {
      return MrdError(absl::StatusCode::kFailedPrecondition,
                      "MR_NOT_REGISTERED",
                      absl::StrCat("MR ", req.mr(), " holds no registration"));
    }
    taken->entry = m->second.registration;
    m->second.registration = 0;
    taken->mr_object = req.mr();
    auto r = session.registrations.find(taken->entry);
    if (r != session.registrations.end()) {
      --r->second.mr_refs;
      EraseIfUnreferencedLocked(session, r, taken);
    }
    return absl::OkStatus();
  }
  if (!req.has_registration()) {
    return SeedError(STATUS_INVALID_PARAMETER, "NO_TARGET",
                     "DeregisterMr needs a registration or an mr");
  }
  auto r = session.registrations.find(req.registration());
  if (r == session.registrations.end()) {
    return UnknownHandle("registration", req.registration());
  }
  if (r->second.implicit_refs == 0) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "HELD_BY_MR_OBJECT",
                    absl::StrCat("registration ", req.registration(),
                                 " is held only by MR objects; "
                                 "deregister it through its MR"));
  }
  taken->entry = r->first;
  --r->second.implicit_refs;
  EraseIfUnreferencedLocked(session, r, taken);
  return absl::OkStatus();
}

void Registrations::PutReferenceBack(Session& session,
                                     const TakenReference& taken) {
  absl::MutexLock lock(&session.mu);
  if (session.closing) {
    // The session's end takes the PD, and the MR with it.
    (void)cache_.Invalidate(taken.entry);
    return;
  }
  RegistrationRecord& rec = session.registrations[taken.entry];
  if (taken.erased) rec = taken.record;
  if (taken.mr_object != 0) {
    ++rec.mr_refs;
    auto m = session.mrs.find(taken.mr_object);
    if (m != session.mrs.end()) m->second.registration = taken.entry;
  } else {
    ++rec.implicit_refs;
  }
}

absl::StatusOr<uint32_t> Registrations::DropReference(
    const std::shared_ptr<Session>& session, uint64_t entry) {
  MRD_ASSIGN_OR_RETURN(cache::ReleaseResult result, cache_.Release(entry));
  if (result.released.has_value()) {
    const cache::CachedRegistration& reg = *result.released;
    // The warm pin takes the pages before the MR lets go of them, so that
    // they are never unpinned in between; the key dies either way.
    std::optional<cache::WarmPin> warm;
    if (reg.devices == 1) {
      warm = MakeWarmPin(session, WarmKeyOf(result.key), reg.pinned_bytes);
    }
    absl::Status s =
        devices_[FirstDevice(reg.devices)]->DeregisterMr(reg.device_mr);
    if (!s.ok() && s.code() != absl::StatusCode::kNotFound) {
      if (warm.has_value()) {
        // The MR still holds the reservation; only the LAM goes.
        if (!device_->ReleaseLam(warm->device_lam).ok()) {
          session->KeepUntilPdGone(warm->owner);
        }
      }
      // The registration still exists (its key may still work): it goes
      // back, with the reference, so the caller's retry can release it.
      absl::Status restored = cache_.Restore(entry, result.key, reg);
      if (!restored.ok()) {
        LogError(
            "deregistration of MR ", reg.device_mr,
            " failed and its entry cannot be restored: ", restored.ToString());
      }
      return MrdError(
          absl::StatusCode::kUnavailable, "DEREGISTER_FAILED",
          absl::StrCat("the device could not deregister it (", s.message(),
                       "); the registration is unchanged: retry"));
    }
    // NOT_FOUND: the PD is being torn down and unpins the MR itself.
    if (!s.ok()) session->KeepUntilPdGone(reg.memory);
    // The first device's share here, the others' as they go.
    if (warm.has_value()) {
      budgets_->UnreserveRegistration(*session, MapSplitsOf(reg), 1);
      DeregisterOthers(*session, reg);
      KeepWarm(session, std::move(*warm));  // the reservation moves to it
    } else {
      budgets_->UnreserveRegistrationAndPinned(*session, MapSplitsOf(reg), 1,
                                               reg.pinned_bytes);
      DeregisterOthers(*session, reg);
    }
  }
  return result.references;
}

// --- invalidation (W11, session end) ----------------------------------------

std::vector<uint64_t> Registrations::DetachLocked(Session& session,
                                                  uint64_t buffer) {
  std::vector<uint64_t> entries;
  for (auto r = session.registrations.begin();
       r != session.registrations.end();) {
    std::optional<cache::CacheKey> key;
    if (buffer != 0) key = cache_.KeyOf(r->first);
    if (buffer == 0 || (key.has_value() && key->buffer == buffer)) {
      entries.push_back(r->first);
      r = session.registrations.erase(r);
    } else {
      ++r;
    }
  }
  // MR objects that held them hold nothing now.
  for (auto& [id, mr] : session.mrs) {
    if (mr.fast_register || mr.registration == 0) continue;
    for (uint64_t e : entries) {
      if (mr.registration == e) mr.registration = 0;
    }
  }
  return entries;
}

uint32_t Registrations::Invalidate(Session& session,
                                   const std::vector<uint64_t>& entries) {
  uint32_t invalidated = 0;
  for (uint64_t entry : entries) {
    absl::StatusOr<cache::CachedRegistration> reg = cache_.Invalidate(entry);
    if (!reg.ok()) continue;
    DeregisterCached(session, *reg);
    ++invalidated;
  }
  return invalidated;
}

void Registrations::DeregisterCached(Session& session,
                                     const cache::CachedRegistration& reg) {
  absl::Status s =
      devices_[FirstDevice(reg.devices)]->DeregisterMr(reg.device_mr);
  // Not deregistered (NOT_FOUND: the PD is being torn down): the pages stay
  // pinned until the PD goes, so the mapping stays too.
  if (!s.ok()) session.KeepUntilPdGone(reg.memory);
  if (!s.ok() && s.code() != absl::StatusCode::kNotFound) {
    LogWarning("deregister device MR ", reg.device_mr, ": ", s.ToString());
  }
  // The first device's share here, the others' as they go.
  budgets_->UnreserveRegistrationAndPinned(session, MapSplitsOf(reg), 1,
                                           reg.pinned_bytes);
  DeregisterOthers(session, reg);
}

uint64_t Registrations::MapSplitsOf(const fd_socket::MappedFile& file) const {
  const device::DeviceAttributes& a = device_->Attributes();
  return file.writable() ? a.map_splits_per_writable_pin
                         : a.map_splits_per_read_only_pin;
}

uint64_t Registrations::MapSplitsOf(
    const cache::CachedRegistration& reg) const {
  // Every registration the core makes keeps its buffer's MappedFile there
  // (RegisterOnDevice, Adopt).
  const auto* file =
      static_cast<const fd_socket::MappedFile*>(reg.memory.get());
  return file == nullptr ? 0 : MapSplitsOf(*file);
}

// --- pinned bytes and warm pins ---------------------------------------------

absl::Status Registrations::ReservePinned(Session& session, uint64_t bytes) {
  for (;;) {
    Budgets::PinLimit hit;
    uint64_t over;
    absl::Status status =
        budgets_->TryReservePinned(session, bytes, &hit, &over);
    if (hit == Budgets::PinLimit::kNone) return status;
    // Warm pins give way before anything is refused: for the session's
    // limit its own, least recently kept first; for the total, anyone's.
    // None is evicted in vain: if all of them would not make room, refuse.
    const std::optional<uint64_t> whose =
        hit == Budgets::PinLimit::kSession
            ? std::optional<uint64_t>(session.id())
            : std::nullopt;
    const uint64_t evictable =
        whose.has_value() ? warm_.SessionBytes(*whose) : warm_.Stats().bytes;
    if (evictable < over) return status;
    std::optional<cache::WarmPin> victim = warm_.EvictOldest(whose);
    if (!victim.has_value()) return status;
    std::vector<cache::WarmPin> victims;
    victims.push_back(std::move(*victim));
    ReleaseWarm(std::move(victims));
  }
}

bool Registrations::EvictWarmForDevice() {
  std::optional<cache::WarmPin> victim = warm_.EvictOldest(std::nullopt);
  if (!victim.has_value()) return false;
  std::vector<cache::WarmPin> victims;
  victims.push_back(std::move(*victim));
  ReleaseWarm(std::move(victims));
  return true;
}

void Registrations::DropWarm(uint64_t session, uint64_t buffer) {
  ReleaseWarm(buffer == 0 ? warm_.DropSession(session)
                          : warm_.DropBuffer(session, buffer));
}

std::optional<cache::WarmPin> Registrations::MakeWarmPin(
    const std::shared_ptr<Session>& session, const cache::WarmKey& key,
    uint64_t pinned_bytes) {
  if (!warm_.Admissible(pinned_bytes)) return std::nullopt;
  std::shared_ptr<fd_socket::MappedFile> file;
  device::PdId pd;
  {
    absl::MutexLock lock(&session->mu);
    if (session->closing) return std::nullopt;
    auto b = session->buffers.find(key.buffer);
    if (b == session->buffers.end()) return std::nullopt;
    file = b->second.file;
    pd = session->pd;
  }
  absl::StatusOr<device::MemorySpan> span = file->Span(key.offset, key.length);
  if (!span.ok()) return std::nullopt;
  // A LAM pins the pages and exposes nothing: no peer can use it unless it
  // is fast-registered, and only the core knows of this one.
  absl::StatusOr<device::LogicalMapping> lam = device_->BuildLam(pd, *span);
  if (!lam.ok()) {
    LogDebug("no warm pin for session ", session->id(), " buffer ", key.buffer,
             ": ", lam.status().ToString());
    return std::nullopt;
  }
  cache::WarmPin pin;
  pin.key = key;
  pin.device_lam = lam->lam;
  pin.pinned_bytes = pinned_bytes;
  pin.owner = std::make_shared<WarmOwner>(WarmOwner{session, std::move(file)});
  return pin;
}

void Registrations::AdoptWarm(const std::shared_ptr<Session>& session,
                              const cache::WarmKey& key,
                              uint64_t pinned_bytes) {
  std::optional<cache::WarmPin> pin = MakeWarmPin(session, key, pinned_bytes);
  if (!pin.has_value()) {
    warm_.CountDrop();
    return;
  }
  budgets_->Adopt(*session, pinned_bytes, /*registrations=*/0,
                  /*buffers=*/0);
  KeepWarm(session, *std::move(pin));
}

void Registrations::KeepWarm(const std::shared_ptr<Session>& session,
                             cache::WarmPin pin) {
  std::vector<cache::WarmPin> release;
  {
    // Under the session's lock, so that ReleaseBuffer and the session's
    // end (which drop warm pins after taking the buffer out / setting
    // `closing` under this lock) cannot miss a pin put here.
    absl::MutexLock lock(&session->mu);
    if (session->closing || !session->buffers.contains(pin.key.buffer)) {
      warm_.CountDrop();
      release.push_back(std::move(pin));
    } else {
      release = warm_.Put(std::move(pin));
    }
  }
  ReleaseWarm(std::move(release));
}

void Registrations::ReleaseWarmAfterHit(const std::shared_ptr<Session>& session,
                                        cache::WarmPin warm) {
  absl::Status s = device_->ReleaseLam(warm.device_lam);
  if (s.code() == absl::StatusCode::kNotFound) {
    // The PD is being torn down and unpins the LAM itself.
    session->KeepUntilPdGone(warm.owner);
  } else if (!s.ok()) {
    // The registration stands; the LAM still pins its pages, so it stays a
    // warm pin with its bytes accounted (over the limit if need be: they
    // are pinned) and is released again on eviction or at the session's
    // end.
    LogWarning("release warm pin (LAM ", warm.device_lam,
               ") after a warm hit: ", s.ToString(),
               "; keeping it as a warm pin");
    budgets_->ForceReservePinned(*session, warm.pinned_bytes);
    KeepWarm(session, std::move(warm));
  }
}

void Registrations::ReleaseWarm(std::vector<cache::WarmPin> pins) {
  for (cache::WarmPin& pin : pins) {
    absl::Status s = device_->ReleaseLam(pin.device_lam);
    auto* owner = static_cast<WarmOwner*>(pin.owner.get());
    std::shared_ptr<Session> session =
        owner == nullptr ? nullptr : owner->session.lock();
    // Not released (NOT_FOUND: the PD is being torn down and unpins the LAM
    // itself; anything else: it stays pinned until the PD goes): the pages
    // must stay mapped until then.
    if (!s.ok() && session != nullptr) session->KeepUntilPdGone(pin.owner);
    if (!s.ok() && s.code() != absl::StatusCode::kNotFound) {
      // Its pages stay pinned until the PD goes at the session's end: so
      // do its bytes in the books (the session's end settles them).
      LogWarning("release warm pin (LAM ", pin.device_lam, "): ", s.ToString(),
                 "; its pages stay accounted until the session ends");
      continue;
    }
    if (session != nullptr) {
      budgets_->UnreservePinned(*session, pin.pinned_bytes);
    }
    // A session that is gone settled its whole reservation when it ended.
  }
}

}  // namespace mrd::core
