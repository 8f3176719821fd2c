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
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "mrd/status.h"
#include "server/common/log.h"
#include "server/common/thread.h"
#include "server/core/core.h"
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
    Session& session, device::PdId pd,
    const std::shared_ptr<fd_socket::MappedFile>& file,
    const v1::HandedOverRegistration& r) {
  MRD_ASSIGN_OR_RETURN(device::MemorySpan span,
                       file->Span(r.offset(), r.length()));
  file->Prefault(r.offset(), r.length());
  MRD_ASSIGN_OR_RETURN(
      device::MrKeys keys,
      device_->handover().AdoptMr(pd, span, r.base_address(), r.access(),
                                  r.lkey(), r.rkey()));
  cache::CachedRegistration reg;
  reg.device_mr = keys.mr;
  reg.lkey = keys.lkey;
  reg.rkey = keys.rkey;
  reg.pinned_bytes = r.pinned_bytes();
  reg.memory = file;
  const cache::CacheKey key{session.id(), r.buffer(), r.offset(),
                            r.length(),   r.access(), r.base_address()};
  if (absl::Status s =
          cache_.Adopt(r.id(), key, reg, r.references(), r.restored());
      !s.ok()) {
    (void)device_->DeregisterMr(keys.mr);
    return s;
  }
  budgets_->Adopt(session, r.pinned_bytes(), /*registrations=*/1,
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
  std::vector<std::pair<uint64_t, device::MrId>> objects;
  {
    absl::MutexLock lock(&session.mu);
    for (const auto& [id, mr] : session.mrs) {
      if (!mr.pending.empty() || !mr.pending_invalidate_silent.empty()) {
        return Busy(session, id);
      }
      if (mr.fast_register && mr.device_mr != 0) {
        objects.emplace_back(id, mr.device_mr);
      }
    }
  }
  FastMrStates states;
  for (const auto& [id, device_mr] : objects) {
    absl::StatusOr<device::DeviceHandover::FastMrState> state =
        device_->handover().DescribeFastMr(device_mr);
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

absl::Status Core::CanHandOverDevices() const {
  if (devices_.size() == 1) return absl::OkStatus();
  return MrdError(absl::StatusCode::kFailedPrecondition,
                  "HANDOVER_SEVERAL_DEVICES",
                  absl::StrCat("this mrd serves ", devices_.size(),
                               " devices; a live handover of more than one "
                               "is not supported yet: restart it instead"));
}

absl::Status Core::ExportState(v1::HandoverSnapshot* out,
                               std::vector<UniqueFd>* fds) {
  MRD_RETURN_IF_ERROR(CanHandOverDevices());
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
  absl::StatusOr<device::PdId> pd = device_->AllocatePd(session.get());
  if (!pd.ok()) {
    tenant->Release(TenantResource::kSessions, 1);
    return pd.status();
  }
  {
    absl::MutexLock lock(&session->mu);
    session->pd = *pd;
    session->pds = {*pd};
    session->AdoptLocked(in, clock_->Now());
  }
  if (absl::Status s = sessions_.Adopt(session); !s.ok()) {
    tenant->Release(TenantResource::kSessions, 1);
    (void)device_->DeallocatePd(*pd);
    return s;
  }
  // From here on a failure ends the session the usual way (TearDown gives
  // back whatever was adopted), and the caller releases the others.
  auto fail = [&](absl::Status s) {
    EndSession(session->token(), "handover failed");
    return s;
  };
  if (!in.peer_ticket().empty()) {
    if (absl::Status s =
            device_->handover().AdoptPeerTicket(*pd, in.peer_ticket());
        !s.ok()) {
      return fail(s);
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
    if (absl::Status s = registrations_.Adopt(*session, *pd, file, r);
        !s.ok()) {
      return fail(s);
    }
  }
  if (absl::Status s = AdoptLams(*session, *pd, in); !s.ok()) return fail(s);
  if (absl::Status s = AdoptMrObjects(*session, *pd, in); !s.ok()) {
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
    device::DeviceHandover::HandedOverPeer peer;
    peer.id = c.id();
    peer.remote = c.remote();
    peer.socket = std::move(fds[c.fd()]);
    peer.received = c.received();
    peer.unsent = c.unsent();
    if (absl::Status s = device_->handover().AdoptPeer(*pd, std::move(peer));
        !s.ok()) {
      return fail(s);
    }
    session->AdoptPeerConnection(c.id(), c.remote());
  }
  return absl::OkStatus();
}

absl::Status Core::ExportPeers(
    std::vector<device::DeviceHandover::HandedOverPeer> peers,
    v1::HandoverSnapshot* out, std::vector<UniqueFd>* fds) {
  absl::flat_hash_map<device::PdId, uint64_t> session_of_pd;
  for (const std::shared_ptr<Session>& session : sessions_.All()) {
    absl::MutexLock lock(&session->mu);
    session_of_pd[session->pd] = session->id();
  }
  absl::flat_hash_map<uint64_t, v1::HandedOverSession*> exported;
  for (v1::HandedOverSession& s : *out->mutable_sessions()) {
    exported[s.id()] = &s;
  }
  for (device::DeviceHandover::HandedOverPeer& peer : peers) {
    // A session that is closing was not exported: its connections close
    // with the old process.
    auto id = session_of_pd.find(peer.pd);
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
  }
  return absl::OkStatus();
}

absl::Status Core::AdoptLams(Session& session, device::PdId pd,
                             const v1::HandedOverSession& in) {
  for (const v1::HandedOverLam& l : in.lams()) {
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
    MRD_ASSIGN_OR_RETURN(device::LogicalMapping mapping,
                         device_->handover().AdoptLam(pd, span, l.first_page(),
                                                      l.privileged_key()));
    if (mapping.pages.size() != l.page_count() || mapping.fbo != l.fbo()) {
      (void)device_->ReleaseLam(mapping.lam);
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
                  /*device=*/0, mapping.lam,
                  l.buffer(),   l.offset(),
                  l.length(),   std::move(mapping.pages),
                  l.fbo(),      l.pinned_bytes(),
                  file,         l.privileged_key()};
    absl::MutexLock lock(&session.mu);
    for (uint64_t page : lam.pages) session.page_to_lam[page] = lam.id;
    session.lams.emplace(lam.id, std::move(lam));
  }
  return absl::OkStatus();
}

absl::Status Core::AdoptMrObjects(Session& session, device::PdId pd,
                                  const v1::HandedOverSession& in) {
  for (const v1::HandedOverMrObject& m : in.mrs()) {
    MrObject mr;
    mr.id = m.id();
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
      MRD_ASSIGN_OR_RETURN(device::MrKeys keys,
                           device_->handover().AdoptFastRegisterMr(pd, state));
      mr.device_mr = keys.mr;
      mr.lkey = m.reported_lkey();
      mr.rkey = keys.rkey;
      mr.fast_registered = m.fast_registered();
      mr.base_address = m.base_address();
      mr.length = m.length();
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
  MRD_RETURN_IF_ERROR(device_->handover().CanHandOver());
  MRD_RETURN_IF_ERROR(CanHandOverDevices());
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
