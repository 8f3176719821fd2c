// The core's part of a live handover (docs/ARCHITECTURE.md, "Live
// handover"): its sessions and what they hold, out of the old mrd process
// and into the new one, with every id, key and reference the clients and
// their peers know.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "mrd/status.h"
#include "server/common/log.h"
#include "server/common/thread.h"
#include "server/core/core.h"
#include "server/core/errors.h"
#include "server/core/registrations.h"

namespace mrd::core {
namespace {

absl::Status Busy(const Session& session, uint64_t mr) {
  return MrdError(
      absl::StatusCode::kUnavailable, "HANDOVER_BUSY",
      absl::StrCat("session ", session.id(), "'s MR object ", mr,
                   " has fast-register or invalidate work in flight on a "
                   "peer connection, which does not move to another process; "
                   "try again once it completed"));
}

}  // namespace

absl::Status Registrations::Adopt(
    Session& session, const std::vector<device::PdId>& pds,
    const std::shared_ptr<fd_socket::MappedFile>& file,
    const v1::HandedOverRegistration& r) {
  // 0: a process of one device handed it over.
  const uint32_t bits = r.devices() == 0 ? 1 : r.devices();
  if (pds.size() > 32 || (bits >> pds.size()) != 0) {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "HANDOVER_UNKNOWN_DEVICE",
        absl::StrCat("registration ", r.id(), " is on devices 0x",
                     absl::Hex(bits), "; this mrd has ", pds.size()));
  }
  MRD_ASSIGN_OR_RETURN(device::MemorySpan span,
                       file->Span(r.offset(), r.length()));
  file->Prefault(r.offset(), r.length());
  // On every device it was on, with the keys it had there, or on none.
  absl::InlinedVector<DeviceMr, 2> made;
  auto undo = [&] {
    for (auto mr = made.rbegin(); mr != made.rend(); ++mr) {
      (void)devices_[mr->device]->DeregisterMr(mr->mr);
    }
  };
  for (uint32_t rest = bits; rest != 0; rest &= rest - 1) {
    const uint32_t device = FirstDevice(rest);
    uint32_t lkey = r.lkey();
    uint32_t rkey = r.rkey();
    if (!made.empty()) {
      auto keys = std::find_if(r.device_keys().begin(), r.device_keys().end(),
                               [&](const v1::HandedOverDeviceKeys& k) {
                                 return k.device() == device;
                               });
      if (keys == r.device_keys().end()) {
        undo();
        return MrdError(absl::StatusCode::kInvalidArgument,
                        "HANDOVER_UNKNOWN_DEVICE",
                        absl::StrCat("registration ", r.id(),
                                     " has no keys for device ", device));
      }
      lkey = keys->lkey();
      rkey = keys->rkey();
    }
    absl::StatusOr<device::MrKeys> keys = devices_[device]->handover().AdoptMr(
        pds[device], span, r.base_address(), r.access(), lkey, rkey);
    if (!keys.ok()) {
      undo();
      return bits == 1
                 ? keys.status()
                 : OnDevice(keys.status(), devices_[device]->Attributes().name);
    }
    made.push_back(DeviceMr{device, keys->mr, keys->lkey, keys->rkey});
  }
  cache::CachedRegistration reg;
  reg.device_mr = made[0].mr;
  reg.lkey = made[0].lkey;
  reg.rkey = made[0].rkey;
  reg.devices = bits;
  reg.pinned_bytes = r.pinned_bytes();
  reg.memory = file;
  cache::CacheKey key{session.id(), r.buffer(), r.offset(),
                      r.length(),   r.access(), r.base_address()};
  key.devices = bits;
  if (absl::Status s =
          cache_.Adopt(r.id(), key, reg, r.references(), r.restored());
      !s.ok()) {
    undo();
    return s;
  }
  if (made.size() > 1) {
    absl::MutexLock lock(&others_mu_);
    others_[OthersKey(made[0].device, made[0].mr)].assign(made.begin() + 1,
                                                          made.end());
  }
  budgets_->Adopt(session, r.pinned_bytes(), /*registrations=*/made.size(),
                  /*buffers=*/0, MapSplitsOf(*file));
  absl::MutexLock lock(&session.mu);
  RegistrationRecord& record = session.registrations[r.id()];
  record.implicit_refs = r.implicit_refs();
  record.mr_refs = std::min(r.mr_refs(), RegistrationRecord::kMaxMrRefs);
  record.flags = r.flags() & 0xF;
  return absl::OkStatus();
}

void Core::HoldStreams(bool hold) {
  for (const std::shared_ptr<Session>& session : sessions_.All()) {
    session->HoldStream(hold);
  }
}

void Core::MarkHandedOver() {
  for (const std::shared_ptr<Session>& session : sessions_.All()) {
    session->MarkHandedOverAndNotify();
  }
}

absl::StatusOr<Core::FastMrStates> Core::DescribeFastMrs(Session& session) {
  std::vector<std::tuple<uint64_t, uint32_t, device::MrId>> objects;
  {
    absl::MutexLock lock(&session.mu);
    for (const auto& [id, mr] : session.mrs) {
      if (!mr.pending.empty() || !mr.pending_invalidate_silent.empty()) {
        return Busy(session, id);
      }
      if (mr.fast_register && mr.device_mr != 0) {
        objects.emplace_back(id, mr.device, mr.device_mr);
      }
    }
  }
  FastMrStates states;
  for (const auto& [id, device, device_mr] : objects) {
    absl::StatusOr<device::DeviceHandover::FastMrState> state =
        devices_[device]->handover().DescribeFastMr(device_mr);
    if (!state.ok()) {
      if (absl::IsFailedPrecondition(state.status())) return Busy(session, id);
      return state.status();
    }
    states.emplace(id, *std::move(state));
  }
  return states;
}

absl::Status Core::ExportFastRegistrationLocked(const Session& session,
                                                const FastMrStates& fast,
                                                v1::HandedOverSession* out) {
  for (const auto& [id, lam] : session.lams) {
    v1::HandedOverLam* l = out->add_lams();
    l->set_id(id);
    l->set_buffer(lam.buffer);
    l->set_offset(lam.offset);
    l->set_length(lam.length);
    l->set_first_page(lam.pages.empty() ? 0 : lam.pages.front());
    l->set_page_count(lam.pages.size());
    l->set_fbo(lam.fbo);
    l->set_pinned_bytes(lam.pinned_bytes);
    l->set_privileged_key(lam.privileged_key);
    l->set_device(lam.device);
  }
  for (const auto& [id, mr] : session.mrs) {
    // Work posted since DescribeFastMrs looked: it would not move.
    if (!mr.pending.empty() || !mr.pending_invalidate_silent.empty()) {
      return Busy(session, id);
    }
    v1::HandedOverMrObject* m = out->add_mrs();
    m->set_id(id);
    m->set_fast_register(mr.fast_register);
    m->set_allow_remote(mr.allow_remote);
    m->set_registration(mr.registration);
    m->set_device(mr.device);
    if (!mr.fast_register || mr.device_mr == 0) continue;
    auto it = fast.find(id);
    // Created, or its state changed, since the device was asked.
    if (it == fast.end() || it->second.valid != mr.fast_registered ||
        it->second.rkey != mr.rkey) {
      return Busy(session, id);
    }
    const device::DeviceHandover::FastMrState& state = it->second;
    m->set_has_device_mr(true);
    m->set_reported_lkey(mr.lkey);
    m->set_lkey(state.lkey);
    m->set_rkey(state.rkey);
    m->set_max_pages(state.max_pages);
    m->set_fast_registered(state.valid);
    for (uint64_t page : state.pages) m->add_pages(page);
    m->set_fbo(state.fbo);
    m->set_length(state.length);
    m->set_base_address(state.base_address);
    m->set_access(state.access);
    for (uint64_t lam : mr.lams) m->add_lams(lam);
  }
  return absl::OkStatus();
}

absl::Status Core::ExportState(v1::HandoverSnapshot* out,
                               std::vector<UniqueFd>* fds) {
  const absl::Time now = clock_->Now();
  absl::flat_hash_map<uint64_t,
                      std::vector<std::pair<cache::WarmKey, uint64_t>>>
      warm;
  for (auto& [key, bytes] : registrations_.WarmKept()) {
    warm[key.session].emplace_back(key, bytes);
  }
  for (const std::shared_ptr<Session>& session : sessions_.All()) {
    MRD_ASSIGN_OR_RETURN(FastMrStates fast, DescribeFastMrs(*session));
    absl::MutexLock lock(&session->mu);
    if (session->closing) continue;
    v1::HandedOverSession* s = out->add_sessions();
    session->ExportLocked(now, s);
    for (const auto& [id, buffer] : session->buffers) {
      const int fd = ::fcntl(buffer.file->fd(), F_DUPFD_CLOEXEC, 0);
      if (fd < 0) {
        return ErrnoError(errno, "dup of a buffer's fd", "HANDOVER_FD");
      }
      fds->emplace_back(fd);
      v1::HandedOverBuffer* b = s->add_buffers();
      b->set_id(id);
      b->set_address(buffer.address);
      b->set_fd(static_cast<int32_t>(fds->size() - 1));
      b->set_writable(buffer.file->writable());
      b->set_source(buffer.file->source());
    }
    for (const auto& [id, record] : session->registrations) {
      std::optional<cache::EntryView> view = registrations_.Describe(id);
      if (!view.has_value()) continue;  // being deregistered: not held
      v1::HandedOverRegistration* r = s->add_registrations();
      r->set_id(id);
      r->set_buffer(view->key.buffer);
      r->set_offset(view->key.offset);
      r->set_length(view->key.length);
      r->set_access(view->key.access);
      r->set_base_address(view->key.base_address);
      r->set_lkey(view->lkey);
      r->set_rkey(view->rkey);
      r->set_references(view->references);
      r->set_pinned_bytes(view->pinned_bytes);
      r->set_implicit_refs(record.implicit_refs);
      r->set_mr_refs(record.mr_refs);
      r->set_flags(record.flags);
      r->set_restored(view->restored);
      if (view->key.devices == 1) continue;
      r->set_devices(view->key.devices);
      const Registrations::DeviceMrs mrs = registrations_.MrsOf(*view);
      for (size_t k = 1; k < mrs.size(); ++k) {
        v1::HandedOverDeviceKeys* keys = r->add_device_keys();
        keys->set_device(mrs[k].device);
        keys->set_lkey(mrs[k].lkey);
        keys->set_rkey(mrs[k].rkey);
      }
    }
    MRD_RETURN_IF_ERROR(ExportFastRegistrationLocked(*session, fast, s));
    for (const auto& [key, bytes] : warm[session->id()]) {
      v1::HandedOverWarmPin* w = s->add_warm_pins();
      w->set_buffer(key.buffer);
      w->set_offset(key.offset);
      w->set_length(key.length);
      w->set_pinned_bytes(bytes);
    }
  }
  out->set_logical_address_watermark(
      device_->handover().LogicalAddressWatermark());
  out->set_next_connection_id(device_->handover().ConnectionIdWatermark());
  for (size_t i = 1; i < devices_.size(); ++i) {
    v1::HandedOverDevice* d = out->add_other_devices();
    d->set_name(devices_[i]->Attributes().name);
    d->set_peer_listener(-1);  // the participant's
    d->set_logical_address_watermark(
        devices_[i]->handover().LogicalAddressWatermark());
    d->set_next_connection_id(devices_[i]->handover().ConnectionIdWatermark());
  }
  out->set_next_handle(next_handle_.load());
  out->set_next_session_id(sessions_.next_id());
  out->set_registration_sequence(registrations_.NextRegistrationSequence());
  const SessionCounts counts = sessions_.Counts();
  out->set_sessions_opened_total(counts.opened_total);
  out->set_sessions_closed_total(counts.closed_total);
  for (const auto& [name, settings] : tenants_->Settings()) {
    v1::HandedOverTenantSettings* t = out->add_tenant_settings();
    t->set_name(name);
    for (int i = 0; i < kTenantResourceCount; ++i) {
      if (!settings.quota[i].has_value()) continue;
      v1::TenantQuotaValue* q = t->add_quotas();
      q->set_resource(
          std::string(TenantResourceName(static_cast<TenantResource>(i))));
      q->set_amount(*settings.quota[i]);
    }
    t->set_weight(settings.weight.value_or(0));
  }
  return absl::OkStatus();
}

namespace {

// Calls fn(buffer, offset, length) for every span of `in` that holds pinned
// memory: its registrations, LAMs and warm pins.
template <typename Fn>
void ForEachPinnedSpan(const v1::HandedOverSession& in, Fn fn) {
  for (const v1::HandedOverRegistration& r : in.registrations()) {
    fn(r.buffer(), r.offset(), r.length());
  }
  for (const v1::HandedOverLam& l : in.lams()) {
    fn(l.buffer(), l.offset(), l.length());
  }
  for (const v1::HandedOverWarmPin& w : in.warm_pins()) {
    fn(w.buffer(), w.offset(), w.length());
  }
}

// The runs of pinned memory of each buffer of `in` (registrations, LAMs and
// warm pins that overlap or touch, merged), as [offset, end).
absl::btree_map<uint64_t, std::vector<std::pair<uint64_t, uint64_t>>>
RegisteredRuns(const v1::HandedOverSession& in) {
  absl::btree_map<uint64_t, std::vector<std::pair<uint64_t, uint64_t>>> runs;
  ForEachPinnedSpan(in, [&](uint64_t buffer, uint64_t offset, uint64_t length) {
    if (length == 0 || offset > UINT64_MAX - length) return;
    runs[buffer].emplace_back(offset, offset + length);
  });
  for (auto& [buffer, list] : runs) {
    std::sort(list.begin(), list.end());
    std::vector<std::pair<uint64_t, uint64_t>> merged;
    for (const auto& [from, to] : list) {
      if (!merged.empty() && from <= merged.back().second) {
        merged.back().second = std::max(merged.back().second, to);
      } else {
        merged.emplace_back(from, to);
      }
    }
    list = std::move(merged);
  }
  return runs;
}

// Fills `file`'s page tables for `runs` (on the prefault threads); a run
// past the buffer's end holds a registration its adoption refuses.
void PrefaultRunsOf(const fd_socket::MappedFile& file,
                    const std::vector<std::pair<uint64_t, uint64_t>>& runs) {
  for (const auto& [from, to] : runs) {
    if (!file.Span(from, to - from).ok()) continue;
    file.Prefault(from, to - from);
  }
}

// Whether `fd` is the file `file` maps.
bool SameFile(const fd_socket::MappedFile& file, int fd) {
  struct stat st {};
  return ::fstat(fd, &st) == 0 &&
         static_cast<uint64_t>(st.st_dev) == file.device() &&
         static_cast<uint64_t>(st.st_ino) == file.inode();
}

// The spans PinAhead pins, by buffer: every registration, LAM and warm pin
// of the prepare frame, as (offset, length).
absl::flat_hash_map<uint64_t, std::vector<std::pair<uint64_t, uint64_t>>>
SpansToPin(const v1::HandoverSnapshot& prepare) {
  absl::flat_hash_map<uint64_t, std::vector<std::pair<uint64_t, uint64_t>>>
      spans;
  for (const v1::HandedOverSession& session : prepare.sessions()) {
    ForEachPinnedSpan(session,
                      [&](uint64_t buffer, uint64_t offset, uint64_t length) {
                        spans[buffer].emplace_back(offset, length);
                      });
  }
  return spans;
}

// Pins ahead (Device::PinAhead) the spans of the buffers handed to it, on
// a thread of its own, while the caller fills the next buffers' page
// tables: the two overlap instead of following each other. Without the
// thread (none could be started) Add pins on the caller's.
class AheadPinner {
 public:
  AheadPinner(device::Device& device, const v1::HandoverSnapshot& prepare)
      : device_(device), spans_(SpansToPin(prepare)), start_(absl::Now()) {
    absl::StatusOr<Thread> thread =
        Thread::Start("mrd-pin-ahead", [this] { Run(); });
    if (thread.ok()) thread_ = *std::move(thread);
  }
  ~AheadPinner() { Finish(); }
  AheadPinner(const AheadPinner&) = delete;
  AheadPinner& operator=(const AheadPinner&) = delete;

  // `file` (buffer `buffer`, its page tables filled) is pinned next; it
  // must stay mapped until Finish returns.
  void Add(uint64_t buffer, const fd_socket::MappedFile* file) {
    if (!thread_.joinable()) {
      Pin(buffer, *file);
      return;
    }
    absl::MutexLock lock(&mu_);
    queue_.emplace_back(buffer, file);
  }

  // Pins what is queued, then logs what was pinned. Idempotent.
  void Finish() {
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      finished_ = true;
    }
    thread_.Join();
    LogInfo("pinned ahead ", pins_, " registrations, LAMs and warm pins (",
            bytes_, " bytes) in ", absl::FormatDuration(absl::Now() - start_),
            " from the first page-table fill");
    if (!first_error_.ok()) {
      LogWarning("some could not be pinned ahead (their adoption pins them): ",
                 first_error_.ToString());
    }
  }

 private:
  void Run() {
    for (;;) {
      std::pair<uint64_t, const fd_socket::MappedFile*> next;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &AheadPinner::HasWorkOrFinished));
        if (queue_.empty()) return;
        next = queue_.front();
        queue_.pop_front();
      }
      Pin(next.first, *next.second);
    }
  }

  bool HasWorkOrFinished() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !queue_.empty() || finished_;
  }

  // One thread at a time pins: the thread, or (without it) the caller.
  void Pin(uint64_t buffer, const fd_socket::MappedFile& file) {
    auto it = spans_.find(buffer);
    if (it == spans_.end()) return;
    for (const auto& [offset, length] : it->second) {
      absl::StatusOr<device::MemorySpan> span = file.Span(offset, length);
      if (!span.ok()) continue;  // its adoption refuses it
      if (absl::Status s = device_.handover().PinAhead(*span); !s.ok()) {
        if (first_error_.ok()) first_error_ = s;
        continue;
      }
      ++pins_;
      bytes_ += length;
    }
  }

  device::Device& device_;
  const absl::flat_hash_map<uint64_t,
                            std::vector<std::pair<uint64_t, uint64_t>>>
      spans_;
  const absl::Time start_;
  Thread thread_;
  mutable absl::Mutex mu_;
  std::deque<std::pair<uint64_t, const fd_socket::MappedFile*>> queue_
      ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  // The pinning thread's, read by Finish after the join.
  uint64_t pins_ = 0;
  uint64_t bytes_ = 0;
  absl::Status first_error_;
};

}  // namespace

PreparedBuffers PrepareBuffers(const v1::HandoverSnapshot& prepare,
                               std::vector<UniqueFd>& fds,
                               device::Device* device) {
  PreparedBuffers prepared;
  const absl::Time start = absl::Now();
  uint64_t bytes = 0;
  std::optional<AheadPinner> pinner;
  if (device != nullptr) pinner.emplace(*device, prepare);
  for (const v1::HandedOverSession& session : prepare.sessions()) {
    auto runs = RegisteredRuns(session);
    for (const v1::HandedOverBuffer& b : session.buffers()) {
      if (b.fd() < 0 || static_cast<size_t>(b.fd()) >= fds.size() ||
          !fds[b.fd()].valid()) {
        continue;
      }
      absl::StatusOr<std::unique_ptr<fd_socket::MappedFile>> file =
          fd_socket::MapHandedOver(std::move(fds[b.fd()]), b.writable(),
                                   b.source());
      if (!file.ok()) continue;  // the snapshot's copy is mapped instead
      if (auto it = runs.find(b.id()); it != runs.end()) {
        PrefaultRunsOf(**file, it->second);
        for (const auto& [from, to] : it->second) bytes += to - from;
      }
      if (pinner.has_value()) pinner->Add(b.id(), file->get());
      prepared[b.id()] = std::move(*file);
    }
  }
  LogInfo("prepared ", prepared.size(), " buffers, ", bytes,
          " registered bytes prefaulted, in ",
          absl::FormatDuration(absl::Now() - start));
  if (pinner.has_value()) pinner->Finish();
  return prepared;
}

void Core::PrefaultRuns(Session& session, const v1::HandedOverSession& in,
                        AdoptTimes* times) {
  const absl::Time start = absl::Now();
  for (const auto& [buffer, runs] : RegisteredRuns(in)) {
    std::shared_ptr<fd_socket::MappedFile> file;
    {
      absl::MutexLock lock(&session.mu);
      auto it = session.buffers.find(buffer);
      if (it == session.buffers.end()) continue;  // refused by the adoption
      file = it->second.file;
    }
    // What the prepare frame filled is not walked again (Prefault knows).
    PrefaultRunsOf(*file, runs);
  }
  times->prefault += absl::Now() - start;
}

absl::Status Core::AdoptSession(const v1::HandedOverSession& in,
                                std::vector<UniqueFd>& fds,
                                PreparedBuffers* prepared, AdoptTimes* times) {
  Identity identity;
  identity.verified = in.verified();
  identity.uid = in.uid();
  identity.gid = in.gid();
  identity.tenant_key = in.tenant_key();
  identity.pod_name = in.pod_name();
  std::shared_ptr<Tenant> tenant = tenants_->Resolve(identity);
  tenant->Force(TenantResource::kSessions, 1);
  auto session = std::make_shared<Session>(
      in.id(), in.token(), in.lease() ? SessionKind::kLease : SessionKind::kFd,
      options_.completion_queue_depth, identity, tenant);
  absl::StatusOr<std::vector<device::PdId>> allocated = AllocatePds(*session);
  if (!allocated.ok()) {
    tenant->Release(TenantResource::kSessions, 1);
    return allocated.status();
  }
  const std::vector<device::PdId> pds = *std::move(allocated);
  absl::StatusOr<uint32_t> default_bits = uint32_t{1};
  if (in.has_default_devices()) {
    default_bits = registrations_.DeviceBits(in.default_devices());
  }
  {
    absl::MutexLock lock(&session->mu);
    session->pd = pds[0];
    session->pds = pds;
    session->AdoptLocked(in, clock_->Now());
    if (in.has_default_devices() && default_bits.ok()) {
      session->default_devices = in.default_devices();
      session->default_device_bits = *default_bits;
      session->default_nearest = in.default_devices().nearest();
    }
  }
  if (absl::Status s = sessions_.Adopt(session); !s.ok()) {
    tenant->Release(TenantResource::kSessions, 1);
    for (size_t i = 0; i < pds.size(); ++i) {
      (void)devices_[i]->DeallocatePd(pds[i]);
    }
    return s;
  }
  // From here on a failure ends the session the usual way (TearDown gives
  // back whatever was adopted), and the caller releases the others.
  auto fail = [&](absl::Status s) {
    EndSession(session->token(), "handover failed");
    return s;
  };
  if (!default_bits.ok()) return fail(default_bits.status());
  // Its tickets: device 0's, then the others' by device - 1.
  for (size_t i = 0; i < devices_.size(); ++i) {
    std::string ticket;
    if (i == 0) {
      ticket = in.peer_ticket();
    } else if (i - 1 < static_cast<size_t>(in.device_tickets_size())) {
      ticket = in.device_tickets(static_cast<int>(i - 1));
    }
    if (ticket.empty()) continue;
    if (absl::Status s =
            devices_[i]->handover().AdoptPeerTicket(pds[i], ticket);
        !s.ok()) {
      return fail(s);
    }
    if (i > 0) {
      absl::MutexLock lock(&session->mu);
      session->SetPeerTicketLocked(i, ticket);
    }
  }
  for (const v1::HandedOverBuffer& b : in.buffers()) {
    if (b.fd() < 0 || static_cast<size_t>(b.fd()) >= fds.size() ||
        !fds[b.fd()].valid()) {
      return fail(MrdError(absl::StatusCode::kInvalidArgument, "HANDOVER_FD",
                           absl::StrCat("buffer ", b.id(), " names fd ", b.fd(),
                                        ", which was not sent")));
    }
    absl::StatusOr<FdCharge> charge =
        ChargeFd(options_.fd_budget, session->id(), "a handed-over buffer");
    if (!charge.ok()) return fail(charge.status());
    // Mapped (and its page tables filled) from the prepare frame already,
    // when it is the same file: the snapshot's fd is then not needed.
    absl::StatusOr<std::unique_ptr<fd_socket::MappedFile>> file;
    if (auto it = prepared != nullptr ? prepared->find(b.id())
                                      : PreparedBuffers::iterator();
        prepared != nullptr && it != prepared->end() &&
        it->second->writable() == b.writable() &&
        SameFile(*it->second, fds[b.fd()].get())) {
      file = std::move(it->second);
      prepared->erase(it);
      fds[b.fd()].Reset();
    } else {
      file = fd_socket::MapHandedOver(std::move(fds[b.fd()]), b.writable(),
                                      b.source());
    }
    if (!file.ok()) return fail(file.status());
    BufferRecord record;
    record.id = b.id();
    record.address = b.address();
    record.file = ShareWithCharge(std::move(*file), std::move(*charge));
    budgets_.Adopt(*session, 0, 0, /*buffers=*/1);
    absl::MutexLock lock(&session->mu);
    session->buffers.emplace(record.id, std::move(record));
  }
  PrefaultRuns(*session, in, times);
  const absl::Time start = absl::Now();
  absl::Cleanup timed = [&] { times->registrations += absl::Now() - start; };
  for (const v1::HandedOverRegistration& r : in.registrations()) {
    std::shared_ptr<fd_socket::MappedFile> file;
    {
      absl::MutexLock lock(&session->mu);
      auto it = session->buffers.find(r.buffer());
      if (it != session->buffers.end()) file = it->second.file;
    }
    if (file == nullptr) {
      return fail(MrdError(
          absl::StatusCode::kInvalidArgument, "HANDOVER_UNKNOWN_BUFFER",
          absl::StrCat("registration ", r.id(), " names buffer ", r.buffer(),
                       ", which was not handed over")));
    }
    if (absl::Status s = registrations_.Adopt(*session, pds, file, r);
        !s.ok()) {
      return fail(s);
    }
  }
  if (absl::Status s = AdoptLams(*session, pds, in); !s.ok()) return fail(s);
  if (absl::Status s = AdoptMrObjects(*session, pds, in); !s.ok()) {
    return fail(s);
  }
  for (const v1::HandedOverWarmPin& w : in.warm_pins()) {
    registrations_.AdoptWarm(
        session, cache::WarmKey{in.id(), w.buffer(), w.offset(), w.length()},
        w.pinned_bytes());
  }
  for (const v1::HandedOverPeerConnection& c : in.peer_connections()) {
    if (c.fd() < 0 || static_cast<size_t>(c.fd()) >= fds.size() ||
        !fds[c.fd()].valid()) {
      return fail(
          MrdError(absl::StatusCode::kInvalidArgument, "HANDOVER_BAD_FD",
                   absl::StrCat("peer connection ", c.id(), " names fd ",
                                c.fd(), " of ", fds.size())));
    }
    absl::StatusOr<device::Device*> device =
        HandedOverDevice(c.device(), "peer connection", c.id());
    if (!device.ok()) return fail(device.status());
    device::DeviceHandover::HandedOverPeer peer;
    peer.id = c.id();
    peer.remote = c.remote();
    peer.socket = std::move(fds[c.fd()]);
    peer.received = c.received();
    peer.unsent = c.unsent();
    if (absl::Status s =
            (*device)->handover().AdoptPeer(pds[c.device()], std::move(peer));
        !s.ok()) {
      return fail(s);
    }
    session->AdoptPeerConnection(c.id(), c.remote());
  }
  return absl::OkStatus();
}

absl::Status Core::ExportPeers(
    std::vector<std::vector<device::DeviceHandover::HandedOverPeer>> peers,
    v1::HandoverSnapshot* out, std::vector<UniqueFd>* fds) {
  // (device, PD) -> the session's id.
  absl::flat_hash_map<std::pair<size_t, device::PdId>, uint64_t> session_of_pd;
  for (const std::shared_ptr<Session>& session : sessions_.All()) {
    absl::MutexLock lock(&session->mu);
    for (size_t i = 0; i < session->pds.size(); ++i) {
      session_of_pd[{i, session->pds[i]}] = session->id();
    }
  }
  absl::flat_hash_map<uint64_t, v1::HandedOverSession*> exported;
  for (v1::HandedOverSession& s : *out->mutable_sessions()) {
    exported[s.id()] = &s;
  }
  for (size_t device = 0; device < peers.size(); ++device) {
    for (device::DeviceHandover::HandedOverPeer& peer : peers[device]) {
      // A session that is closing was not exported: its connections close
      // with the old process.
      auto id = session_of_pd.find({device, peer.pd});
      if (id == session_of_pd.end()) continue;
      auto session = exported.find(id->second);
      if (session == exported.end()) continue;
      fds->push_back(std::move(peer.socket));
      v1::HandedOverPeerConnection* c = session->second->add_peer_connections();
      c->set_id(peer.id);
      c->set_remote(peer.remote);
      c->set_fd(static_cast<int32_t>(fds->size() - 1));
      c->set_received(std::move(peer.received));
      c->set_unsent(std::move(peer.unsent));
      c->set_device(static_cast<uint32_t>(device));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<device::Device*> Core::HandedOverDevice(uint32_t index,
                                                       absl::string_view what,
                                                       uint64_t id) const {
  if (index < devices_.size()) return devices_[index];
  return MrdError(absl::StatusCode::kInvalidArgument, "HANDOVER_UNKNOWN_DEVICE",
                  absl::StrCat(what, " ", id, " is on device ", index,
                               "; this mrd has ", devices_.size()));
}

absl::Status Core::AdoptLams(Session& session,
                             const std::vector<device::PdId>& pds,
                             const v1::HandedOverSession& in) {
  for (const v1::HandedOverLam& l : in.lams()) {
    MRD_ASSIGN_OR_RETURN(device::Device * device,
                         HandedOverDevice(l.device(), "LAM", l.id()));
    std::shared_ptr<fd_socket::MappedFile> file;
    {
      absl::MutexLock lock(&session.mu);
      auto it = session.buffers.find(l.buffer());
      if (it != session.buffers.end()) file = it->second.file;
    }
    if (file == nullptr) {
      return MrdError(absl::StatusCode::kInvalidArgument,
                      "HANDOVER_UNKNOWN_BUFFER",
                      absl::StrCat("LAM ", l.id(), " names buffer ", l.buffer(),
                                   ", which was not handed over"));
    }
    MRD_ASSIGN_OR_RETURN(device::MemorySpan span,
                         file->Span(l.offset(), l.length()));
    file->Prefault(l.offset(), l.length());
    MRD_ASSIGN_OR_RETURN(
        device::LogicalMapping mapping,
        device->handover().AdoptLam(pds[l.device()], span, l.first_page(),
                                    l.privileged_key()));
    if (mapping.pages.size() != l.page_count() || mapping.fbo != l.fbo()) {
      (void)device->ReleaseLam(mapping.lam);
      return MrdError(absl::StatusCode::kInvalidArgument,
                      "HANDOVER_LAM_MISMATCH",
                      absl::StrCat("LAM ", l.id(), " had ", l.page_count(),
                                   " pages at offset ", l.fbo(),
                                   " in its first; here its "
                                   "range maps to ",
                                   mapping.pages.size(), " at ", mapping.fbo));
    }
    budgets_.Adopt(session, l.pinned_bytes(), 0, 0);
    budgets_.AdoptObjects(session, TenantResource::kLams, 1);
    LamRecord lam{l.id(),
                  l.device(),
                  mapping.lam,
                  l.buffer(),
                  l.offset(),
                  l.length(),
                  std::move(mapping.pages),
                  l.fbo(),
                  l.pinned_bytes(),
                  file,
                  l.privileged_key()};
    absl::MutexLock lock(&session.mu);
    for (uint64_t page : lam.pages) {
      session.page_to_lam[Session::LamPageKey(lam.device, page)] = lam.id;
    }
    session.lams.emplace(lam.id, std::move(lam));
  }
  return absl::OkStatus();
}

absl::Status Core::AdoptMrObjects(Session& session,
                                  const std::vector<device::PdId>& pds,
                                  const v1::HandedOverSession& in) {
  for (const v1::HandedOverMrObject& m : in.mrs()) {
    MRD_ASSIGN_OR_RETURN(device::Device * device,
                         HandedOverDevice(m.device(), "MR object", m.id()));
    MrObject mr;
    mr.id = m.id();
    mr.device = m.device();
    mr.fast_register = m.fast_register();
    mr.allow_remote = m.allow_remote();
    mr.registration = m.registration();
    if (mr.fast_register && m.has_device_mr()) {
      device::DeviceHandover::FastMrState state;
      state.allow_remote = m.allow_remote();
      state.max_pages = m.max_pages();
      state.lkey = m.lkey();
      state.rkey = m.rkey();
      state.valid = m.fast_registered();
      state.pages.assign(m.pages().begin(), m.pages().end());
      state.fbo = m.fbo();
      state.length = m.length();
      state.base_address = m.base_address();
      state.access = m.access();
      MRD_ASSIGN_OR_RETURN(
          device::MrKeys keys,
          device->handover().AdoptFastRegisterMr(pds[m.device()], state));
      mr.device_mr = keys.mr;
      mr.lkey = m.reported_lkey();
      mr.rkey = keys.rkey;
      mr.fast_registered = m.fast_registered();
      mr.base_address = m.base_address();
      mr.length = m.length();
      mr.access = m.access();
      mr.lams.assign(m.lams().begin(), m.lams().end());
    }
    budgets_.AdoptObjects(session, TenantResource::kMrs, 1);
    absl::MutexLock lock(&session.mu);
    session.mrs.emplace(mr.id, std::move(mr));
  }
  return absl::OkStatus();
}

absl::Status Core::AdoptState(const v1::HandoverSnapshot& in,
                              std::vector<UniqueFd>& fds,
                              PreparedBuffers* prepared) {
  for (device::Device* device : devices_) {
    MRD_RETURN_IF_ERROR(device->handover().CanHandOver());
  }
  if (static_cast<size_t>(in.other_devices_size()) + 1 != devices_.size()) {
    return MrdError(
        absl::StatusCode::kFailedPrecondition, "HANDOVER_DEVICE_MISMATCH",
        absl::StrCat("the snapshot is of ", in.other_devices_size() + 1,
                     " devices; this mrd runs ", devices_.size()));
  }
  const absl::Time start = absl::Now();
  AdoptTimes times;
  // Before any session: its tenant is made with the settings it had.
  std::vector<std::pair<std::string, TenantSettings>> settings;
  for (const v1::HandedOverTenantSettings& t : in.tenant_settings()) {
    absl::StatusOr<TenantSettings> one =
        TenantSettingsFromProto(t.quotas(), t.weight());
    if (!one.ok()) return one.status();
    settings.emplace_back(t.name(), *std::move(one));
  }
  tenants_->Restore(settings);
  // Before any LAM is adopted: no address the old device handed out is
  // handed out here again.
  device_->handover().ContinueLogicalAddressesAbove(
      in.logical_address_watermark());
  device_->handover().ContinueConnectionIdsAbove(in.next_connection_id());
  for (size_t i = 1; i < devices_.size(); ++i) {
    const v1::HandedOverDevice& d = in.other_devices(static_cast<int>(i - 1));
    devices_[i]->handover().ContinueLogicalAddressesAbove(
        d.logical_address_watermark());
    devices_[i]->handover().ContinueConnectionIdsAbove(d.next_connection_id());
  }
  std::vector<std::string> adopted;
  uint64_t registrations = 0;
  for (const v1::HandedOverSession& session : in.sessions()) {
    registrations += static_cast<uint64_t>(session.registrations_size());
    if (absl::Status s = AdoptSession(session, fds, prepared, &times);
        !s.ok()) {
      for (const std::string& token : adopted) {
        EndSession(token, "handover failed");
      }
      return s;
    }
    adopted.push_back(session.token());
  }
  uint64_t next = next_handle_.load();
  while (next < in.next_handle() &&
         !next_handle_.compare_exchange_weak(next, in.next_handle())) {
  }
  sessions_.ContinueFrom(in.next_session_id(), in.sessions_opened_total(),
                         in.sessions_closed_total());
  registrations_.ContinueRegistrationSequence(in.registration_sequence());
  LogInfo("adopted ", in.sessions_size(), " sessions with ", registrations,
          " registrations in ", absl::FormatDuration(absl::Now() - start),
          ": prefault ", absl::FormatDuration(times.prefault),
          ", registrations ", absl::FormatDuration(times.registrations));
  return absl::OkStatus();
}

}  // namespace mrd::core
