#include "server/core/fast_registration.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "mrd/status.h"
#include "server/common/log.h"
#include "server/core/errors.h"
#include "server/core/flags.h"
#include "server/device/fast_register_rules.h"

namespace mrd::core {
namespace {

constexpr uint64_t kLamHeaderSize = 8;  // page count + FBO
constexpr uint64_t kLamEntrySize = 8;   // one logical address

// The device is the authority on connections (a peer may have connected a
// moment ago, before the session heard of it; another may be closing). Its
// answer is reported in one form, which tells nothing about other sessions'
// connections.
absl::Status ConnectionError(const absl::Status& device_status,
                             uint64_t connection) {
  if (GetErrorDetail(device_status).seed_status() !=
      STATUS_CONNECTION_INVALID) {
    return device_status;
  }
  return SeedError(STATUS_CONNECTION_INVALID, "NO_SUCH_CONNECTION",
                   absl::StrCat("connection ", connection,
                                " is not a connected peer of this session"));
}

}  // namespace

FastRegistration::FastRegistration(Budgets* budgets,
                                   Registrations* registrations,
                                   std::atomic<uint64_t>* handles,
                                   const FastRegistrationLimits& limits)
    : devices_(registrations->devices()),
      budgets_(budgets),
      registrations_(registrations),
      handles_(handles),
      limits_(limits),
      page_size_(devices_[0]->Attributes().page_size) {}

absl::StatusOr<uint32_t> FastRegistration::DeviceOf(
    const std::string& name) const {
  if (name.empty()) return 0;
  MRD_ASSIGN_OR_RETURN(const size_t index, registrations_->DeviceIndex(name));
  return static_cast<uint32_t>(index);
}

// --- MR objects --------------------------------------------------------------

absl::Status FastRegistration::CreateMr(const std::shared_ptr<Session>& session,
                                        const v1::CreateMrRequest& req,
                                        v1::MrInfo* out) {
  MrObject mr;
  MRD_ASSIGN_OR_RETURN(mr.device, DeviceOf(req.device()));
  device::Device* const device = devices_[mr.device];
  device::PdId pd;
  {
    absl::MutexLock lock(&session->mu);
    if (session->mrs.size() >= limits_.max_session_mrs) {
      return SeedError(STATUS_INSUFFICIENT_RESOURCES, "LIMIT_SESSION_MRS",
                       absl::StrCat("the session holds its maximum of ",
                                    limits_.max_session_mrs, " MR objects"));
    }
    MRD_RETURN_IF_ERROR(budgets_->TakeObject(*session, TenantResource::kMrs));
    pd = session->pds[mr.device];
  }
  absl::Cleanup give_back = [&] {
    budgets_->ReturnObjects(*session, TenantResource::kMrs, 1);
  };
  mr.id = handles_->fetch_add(1);
  mr.fast_register = req.fast_register();
  mr.allow_remote = req.allow_remote_access();
  if (mr.fast_register) {
    absl::StatusOr<device::MrKeys> keys = device->AllocateFastRegisterMr(
        pd, mr.allow_remote, device->Attributes().max_page_list_length);
    if (!keys.ok()) {
      return SessionAwareError(*session, keys.status(), "CreateMr");
    }
    mr.device_mr = keys->mr;
    mr.lkey = keys->lkey;
    mr.rkey = keys->rkey;
  }
  absl::MutexLock lock(&session->mu);
  if (session->closing) {
    session->mu.Unlock();
    if (mr.device_mr != 0) (void)device->FreeFastRegisterMr(mr.device_mr);
    session->mu.Lock();
    return NotConnected("the session is closing");
  }
  out->set_mr(mr.id);
  out->set_fast_register(mr.fast_register);
  out->set_allow_remote_access(mr.allow_remote);
  out->set_state("free");
  out->set_lkey(mr.lkey);
  out->set_device(device->Attributes().name);
  session->mrs.emplace(mr.id, std::move(mr));
  std::move(give_back).Cancel();
  return absl::OkStatus();
}

absl::Status FastRegistration::CloseMr(const std::shared_ptr<Session>& session,
                                       const v1::CloseMrRequest& req) {
  MrObject mr;
  {
    absl::MutexLock lock(&session->mu);
    auto it = session->mrs.find(req.mr());
    if (it == session->mrs.end()) return UnknownHandle("mr", req.mr());
    mr = std::move(it->second);
    session->mrs.erase(it);
    budgets_->ReturnObjects(*session, TenantResource::kMrs, 1);
    if (mr.registration != 0) {
      auto r = session->registrations.find(mr.registration);
      if (r != session->registrations.end()) {
        --r->second.mr_refs;
        if (r->second.implicit_refs + r->second.mr_refs == 0) {
          session->registrations.erase(r);
        }
      }
    }
  }
  if (mr.fast_register) {
    // device_mr 0: its device object could not be recreated after a
    // ReleaseBuffer (logged then); there is nothing left to free.
    if (mr.device_mr == 0) return absl::OkStatus();
    return devices_[mr.device]->FreeFastRegisterMr(mr.device_mr);
  }
  if (mr.registration != 0) {
    MRD_RETURN_IF_ERROR(
        registrations_->DropReference(session, mr.registration).status());
  }
  return absl::OkStatus();
}

void FastRegistration::ResetFastRegistration(Session& session, uint64_t id,
                                             device::MrId device_mr) {
  // There is no synchronous invalidate in the device interface: replace the
  // device MR object, which kills the old key at once.
  bool allow_remote;
  device::PdId pd;
  device::Device* device;
  {
    absl::MutexLock lock(&session.mu);
    auto it = session.mrs.find(id);
    if (it == session.mrs.end()) return;
    allow_remote = it->second.allow_remote;
    pd = session.pds[it->second.device];
    device = devices_[it->second.device];
  }
  (void)device->FreeFastRegisterMr(device_mr);
  absl::StatusOr<device::MrKeys> keys = device->AllocateFastRegisterMr(
      pd, allow_remote, device->Attributes().max_page_list_length);
  absl::MutexLock lock(&session.mu);
  auto it = session.mrs.find(id);
  if (it == session.mrs.end()) return;
  MrObject& mr = it->second;
  mr.fast_registered = false;
  mr.base_address = 0;
  mr.length = 0;
  mr.lams.clear();
  mr.pending.clear();
  mr.pending_invalidate_silent.clear();
  if (!keys.ok()) {
    LogWarning("release buffer: MR ", id, " could not be given a new device ",
               "object: ", keys.status().ToString(),
               "; it cannot be fast-registered again");
  }
  mr.device_mr = keys.ok() ? keys->mr : 0;
  mr.lkey = keys.ok() ? keys->lkey : 0;
  mr.rkey = keys.ok() ? keys->rkey : 0;
}

// --- LAMs --------------------------------------------------------------------

absl::Status FastRegistration::BuildLam(const std::shared_ptr<Session>& session,
                                        const v1::BuildLamRequest& req,
                                        v1::BuildLamResponse* out,
                                        const CancelCheck& cancelled) {
  if (cancelled && cancelled()) {  // gave up while the call waited its turn
    return absl::CancelledError(absl::StrCat("BuildLam of ", req.length(),
                                             " bytes of buffer ", req.buffer(),
                                             " was cancelled before it began"));
  }
  std::shared_ptr<fd_socket::MappedFile> file;
  MRD_ASSIGN_OR_RETURN(const uint32_t index, DeviceOf(req.device()));
  device::Device* const device = devices_[index];
  device::PdId pd;
  {
    absl::MutexLock lock(&session->mu);
    auto b = session->buffers.find(req.buffer());
    if (b == session->buffers.end()) {
      return UnknownHandle("buffer", req.buffer());
    }
    if (session->lams.size() >= limits_.max_session_lams) {
      return SeedError(STATUS_INSUFFICIENT_RESOURCES, "LIMIT_SESSION_LAMS",
                       absl::StrCat("the session holds its maximum of ",
                                    limits_.max_session_lams, " LAMs"));
    }
    MRD_RETURN_IF_ERROR(budgets_->TakeObject(*session, TenantResource::kLams));
    file = b->second.file;
    pd = session->pds[index];
  }
  absl::Cleanup give_back = [&] {
    budgets_->ReturnObjects(*session, TenantResource::kLams, 1);
  };
  MRD_ASSIGN_OR_RETURN(device::MemorySpan span,
                       file->Span(req.offset(), req.length()));
  const uint64_t pin_bytes = PageRound(
      page_size_, reinterpret_cast<uintptr_t>(span.host_address), span.length);
  const uint64_t page_count = pin_bytes / page_size_;
  const uint64_t lam_size = kLamHeaderSize + kLamEntrySize * page_count;
  if (req.lam_capacity() != 0 && req.lam_capacity() < lam_size) {
    return SeedError(STATUS_BUFFER_TOO_SMALL, "LAM_SPACE_TOO_SMALL",
                     absl::StrCat("lam_capacity ", req.lam_capacity(),
                                  " is too small: ", page_count, " pages need ",
                                  lam_size, " bytes"),
                     lam_size);
  }
  MRD_RETURN_IF_ERROR(registrations_->ReservePinned(*session, pin_bytes));
  // A long pin: watched and cancellable between steps (as a registration).
  v1::Completion call;
  call.set_buffer(req.buffer());
  call.set_offset(req.offset());
  call.set_length(req.length());
  const LongPin long_pin(limits_.progress, session, span, cancelled, call);
  file->Prefault(req.offset(), req.length(), span.progress);
  absl::StatusOr<device::LogicalMapping> mapping;
  do {
    mapping = device->BuildLam(pd, span);
  } while (!mapping.ok() &&
           mapping.status().code() == absl::StatusCode::kResourceExhausted &&
           registrations_->EvictWarmForDevice());
  if (!mapping.ok()) {
    budgets_->UnreservePinned(*session, pin_bytes);
    return SessionAwareError(*session, mapping.status(), "BuildLam");
  }
  LamRecord lam{handles_->fetch_add(1),
                index,
                mapping->lam,
                req.buffer(),
                req.offset(),
                req.length(),
                mapping->pages,
                mapping->fbo,
                pin_bytes,
                file,
                mapping->privileged_key};
  // The caller is gone: no one would learn of this LAM.
  const bool gone = cancelled && cancelled();
  if (!gone) {
    absl::MutexLock lock(&session->mu);
    if (!session->closing && session->buffers.contains(req.buffer())) {
      out->set_lam(lam.id);
      for (uint64_t page : lam.pages) {
        out->add_pages(page);
        session->page_to_lam[Session::LamPageKey(index, page)] = lam.id;
      }
      out->set_device(device->Attributes().name);
      out->set_fbo(lam.fbo);
      out->set_length(lam.length);
      out->set_lam_size(static_cast<uint32_t>(lam_size));
      out->set_privileged_token(mapping->privileged_key);
      session->lams.emplace(lam.id, std::move(lam));
      std::move(give_back).Cancel();
      return absl::OkStatus();
    }
  }
  // The caller, the session or the buffer went away meanwhile (L7: leave
  // nothing).
  if (!device->ReleaseLam(lam.device_lam).ok()) {
    session->KeepUntilPdGone(lam.file);
  }
  budgets_->UnreservePinned(*session, pin_bytes);
  if (gone) {
    return absl::CancelledError(absl::StrCat("BuildLam of ", req.length(),
                                             " bytes of buffer ", req.buffer(),
                                             " was cancelled; it was undone"));
  }
  return NotConnected("the session or its buffer went away during BuildLam");
}

absl::Status FastRegistration::ReleaseLam(
    const std::shared_ptr<Session>& session, const v1::ReleaseLamRequest& req) {
  device::LamId device_lam;
  device::Device* device;
  std::shared_ptr<fd_socket::MappedFile> file;
  {
    absl::MutexLock lock(&session->mu);
    auto l = session->lams.find(req.lam());
    if (l == session->lams.end()) return UnknownHandle("lam", req.lam());
    for (auto& [id, mr] : session->mrs) {
      if (mr.fast_register && mr.fast_registered &&
          std::find(mr.lams.begin(), mr.lams.end(), req.lam()) !=
              mr.lams.end()) {
        return MrdError(
            absl::StatusCode::kFailedPrecondition, "LAM_IN_USE",
            absl::StrCat("LAM ", req.lam(), " is mapped by fast-registered MR ",
                         id, "; invalidate it first"));
      }
    }
    device_lam = l->second.device_lam;
    device = devices_[l->second.device];
    // Held until the device has unpinned: a ReleaseBuffer racing this call
    // must not unmap the pages first.
    file = l->second.file;
  }
  MRD_RETURN_IF_ERROR(device->ReleaseLam(device_lam));
  uint64_t pinned = 0;
  {
    absl::MutexLock lock(&session->mu);
    auto l = session->lams.find(req.lam());
    if (l != session->lams.end()) {
      pinned = l->second.pinned_bytes;
      for (uint64_t page : l->second.pages) {
        session->page_to_lam.erase(Session::LamPageKey(l->second.device, page));
      }
      session->lams.erase(l);
      budgets_->ReturnObjects(*session, TenantResource::kLams, 1);
    }
  }
  budgets_->UnreservePinned(*session, pinned);
  return absl::OkStatus();
}

// --- W11 and the session's end ----------------------------------------------

FastRegistration::Detached FastRegistration::DetachLocked(Session& session,
                                                          uint64_t buffer) {
  Detached detached;
  absl::flat_hash_set<uint64_t> lam_ids;
  for (auto l = session.lams.begin(); l != session.lams.end();) {
    if (l->second.buffer == buffer) {
      lam_ids.insert(l->first);
      for (uint64_t page : l->second.pages) {
        session.page_to_lam.erase(Session::LamPageKey(l->second.device, page));
      }
      detached.lams.push_back(std::move(l->second));
      l = session.lams.erase(l);
    } else {
      ++l;
    }
  }
  // Fast registrations mapping those LAMs die too.
  for (auto& [id, mr] : session.mrs) {
    if (!mr.fast_register || !mr.fast_registered) continue;
    for (uint64_t lam : mr.lams) {
      if (lam_ids.contains(lam)) {
        detached.fr_to_reset.emplace_back(id, mr.device_mr);
        break;
      }
    }
  }
  return detached;
}

void FastRegistration::ResetFastRegistrations(Session& session,
                                              const Detached& detached) {
  for (const auto& [id, device_mr] : detached.fr_to_reset) {
    ResetFastRegistration(session, id, device_mr);
  }
}

void FastRegistration::FreeMrs(Session& session,
                               const std::map<uint64_t, MrObject>& mrs) {
  for (const auto& [id, mr] : mrs) {
    if (mr.fast_register && mr.device_mr != 0) {
      absl::Status s = devices_[mr.device]->FreeFastRegisterMr(mr.device_mr);
      if (!s.ok()) LogWarning("teardown: free MR ", id, ": ", s.ToString());
    }
  }
  budgets_->ReturnObjects(session, TenantResource::kMrs, mrs.size());
}

void FastRegistration::ReleaseLams(Session& session,
                                   const std::vector<const LamRecord*>& lams,
                                   absl::string_view why) {
  for (const LamRecord* lam : lams) {
    absl::Status s = devices_[lam->device]->ReleaseLam(lam->device_lam);
    if (!s.ok()) {
      LogWarning(why, ": release LAM ", lam->id, ": ", s.ToString());
      session.KeepUntilPdGone(lam->file);  // still pinned: keep it mapped
    }
    budgets_->UnreservePinned(session, lam->pinned_bytes);
  }
  budgets_->ReturnObjects(session, TenantResource::kLams, lams.size());
}

// --- fast registration -------------------------------------------------------

absl::Status FastRegistration::QueueFastRegisterLocked(
    Session& session, const v1::FastRegisterRequest& req, uint32_t access,
    device::MrId* device_mr) {
  auto m = session.mrs.find(req.mr());
  if (m == session.mrs.end()) return UnknownHandle("mr", req.mr());
  MrObject& mr = m->second;
  if (!mr.fast_register) {
    return SeedError(
        STATUS_INVALID_PARAMETER, "MR_NOT_FAST_REGISTER",
        absl::StrCat("MR ", req.mr(), " was created with fast_register=false"));
  }
  const uint32_t device = Session::DeviceOfConnection(req.connection());
  if (mr.device != device) {
    return SeedError(
        STATUS_CONNECTION_INVALID, "MR_ON_ANOTHER_DEVICE",
        absl::StrCat("MR ", req.mr(), " belongs to device ",
                     devices_[mr.device]->Attributes().name, "; connection ",
                     req.connection(), " is on another"));
  }
  if ((access & (device::kAccessRemoteRead | device::kAccessRemoteWrite)) &&
      !mr.allow_remote) {
    return SeedError(STATUS_ACCESS_VIOLATION, "MR_NOT_REMOTE",
                     absl::StrCat("MR ", req.mr(),
                                  " was created without remote access; the "
                                  "request asks for remote read or write "
                                  "(F4)"));
  }
  PendingFastRegister pending;
  pending.base_address = req.base_address();
  pending.length = req.length();
  for (uint64_t page : req.pages()) {
    auto p = session.page_to_lam.find(Session::LamPageKey(device, page));
    if (p == session.page_to_lam.end()) {
      return SeedError(STATUS_INVALID_PARAMETER, "UNKNOWN_LOGICAL_ADDRESS",
                       absl::StrCat("page 0x", absl::Hex(page),
                                    " is not a logical address of any LAM "
                                    "of this session on the connection's "
                                    "device"));
    }
    if (std::find(pending.lams.begin(), pending.lams.end(), p->second) ==
        pending.lams.end()) {
      pending.lams.push_back(p->second);
    }
    if ((access & (device::kAccessLocalWrite | device::kAccessRemoteWrite)) &&
        !session.lams[p->second].file->writable()) {
      return SeedError(STATUS_INVALID_PARAMETER, "BUFFER_READ_ONLY",
                       absl::StrCat("page 0x", absl::Hex(page),
                                    " belongs to LAM ", p->second,
                                    " of a read-only buffer; write access "
                                    "cannot be granted on it"));
    }
  }
  pending.silent = (req.flags() & device::kWorkSilentSuccess) != 0;
  pending.access = access;
  mr.pending.push_back(std::move(pending));
  *device_mr = mr.device_mr;
  return absl::OkStatus();
}

absl::Status FastRegistration::FastRegister(
    const std::shared_ptr<Session>& session, const v1::FastRegisterRequest& req,
    v1::FastRegisterResponse* out) {
  MRD_ASSIGN_OR_RETURN(uint32_t access, FastRegisterAccess(req.flags()));
  const uint32_t index = Session::DeviceOfConnection(req.connection());
  if (index >= devices_.size()) {
    return ConnectionError(
        SeedError(STATUS_CONNECTION_INVALID, "UNKNOWN_CONNECTION",
                  absl::StrCat("connection ", req.connection(),
                               " is on no device of this mrd")),
        req.connection());
  }
  device::Device* const device = devices_[index];
  MRD_RETURN_IF_ERROR(device::ValidatePageArray(
      page_size_, device->Attributes().max_page_list_length,
      absl::MakeConstSpan(req.pages().data(), req.pages().size()), req.fbo(),
      req.length(), req.base_address()));
  device::FastRegisterWork work;
  {
    absl::MutexLock lock(&session->mu);
    MRD_RETURN_IF_ERROR(
        QueueFastRegisterLocked(*session, req, access, &work.mr));
  }
  work.pages.assign(req.pages().begin(), req.pages().end());
  work.fbo = req.fbo();
  work.length = req.length();
  work.base_address = req.base_address();
  work.access = access;
  // SILENT_SUCCESS is applied by the session, not the device: the session
  // must see every completion to keep the MR's token state (F5) true.
  work.flags = req.flags() & (device::kWorkReadFence | device::kWorkDefer);
  work.request_context = req.request_context();
  absl::StatusOr<uint64_t> posted =
      device->PostFastRegister(req.connection(), work);
  if (!posted.ok()) {
    absl::MutexLock lock(&session->mu);
    auto m = session->mrs.find(req.mr());
    if (m != session->mrs.end() && !m->second.pending.empty()) {
      m->second.pending.pop_back();
    }
    return ConnectionError(posted.status(), req.connection());
  }
  out->set_work_request(*posted);
  return absl::OkStatus();
}

absl::Status FastRegistration::InvalidateMr(
    const std::shared_ptr<Session>& session, const v1::InvalidateMrRequest& req,
    v1::InvalidateMrResponse* out) {
  constexpr uint32_t kKnown =
      device::kWorkSilentSuccess | device::kWorkReadFence | device::kWorkDefer;
  if (req.flags() & ~kKnown) {
    return SeedError(STATUS_INVALID_PARAMETER, "UNKNOWN_FLAGS",
                     absl::StrCat("flags 0x", absl::Hex(req.flags()),
                                  " has bits InvalidateMr does not know: 0x",
                                  absl::Hex(req.flags() & ~kKnown)));
  }
  const uint32_t index = Session::DeviceOfConnection(req.connection());
  device::InvalidateWork work;
  {
    absl::MutexLock lock(&session->mu);
    auto m = session->mrs.find(req.mr());
    if (m == session->mrs.end()) return UnknownHandle("mr", req.mr());
    if (m->second.device != index) {
      return SeedError(
          STATUS_CONNECTION_INVALID, "MR_ON_ANOTHER_DEVICE",
          absl::StrCat("MR ", req.mr(), " belongs to device ",
                       devices_[m->second.device]->Attributes().name,
                       "; connection ", req.connection(), " is on another"));
    }
    if (!m->second.fast_register) {
      return SeedError(STATUS_INVALID_PARAMETER, "MR_NOT_FAST_REGISTER",
                       absl::StrCat("MR ", req.mr(),
                                    " is not a fast-register MR: use "
                                    "DeregisterMr"));
    }
    work.mr = m->second.device_mr;
    m->second.pending_invalidate_silent.push_back(
        (req.flags() & device::kWorkSilentSuccess) != 0);
  }
  work.flags = req.flags() & ~device::kWorkSilentSuccess;
  work.request_context = req.request_context();
  absl::StatusOr<uint64_t> posted =
      devices_[index]->PostInvalidate(req.connection(), work);
  if (!posted.ok()) {
    absl::MutexLock lock(&session->mu);
    auto m = session->mrs.find(req.mr());
    if (m != session->mrs.end() &&
        !m->second.pending_invalidate_silent.empty()) {
      m->second.pending_invalidate_silent.pop_back();
    }
    return ConnectionError(posted.status(), req.connection());
  }
  out->set_work_request(*posted);
  return absl::OkStatus();
}

}  // namespace mrd::core
