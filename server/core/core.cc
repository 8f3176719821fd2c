#include "server/core/core.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "mrd/status.h"
#include "mrd/status_proto.h"
#include "server/common/fair_scheduler.h"
#include "server/common/log.h"
#include "server/common/progress.h"
#include "server/core/errors.h"

namespace mrd::core {
namespace {

// An item of a batch names no session, or the batch's.
absl::Status CheckItemSession(const std::string& item,
                              const std::string& batch) {
  if (item.empty() || item == batch) return absl::OkStatus();
  return SeedError(STATUS_INVALID_PARAMETER, "ITEM_SESSION_MISMATCH",
                   "an item names another session than its batch");
}

std::string RandomToken() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      Fatal("getrandom failed");
    }
    got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

void FillBufferInfo(const BufferRecord& b, v1::BufferInfo* out) {
  out->set_buffer(b.id);
  out->set_size(b.file->size());
  out->set_writable(b.file->writable());
  out->set_device(b.file->device());
  out->set_inode(b.file->inode());
  out->set_source(b.file->source());
  out->set_address(b.address);
}

}  // namespace

Core::Core(device::Device* device, const Clock* clock, CoreOptions options)
    : Core(std::vector<device::Device*>{device}, clock, std::move(options)) {}

Core::Core(std::vector<device::Device*> devices, const Clock* clock,
           CoreOptions options)
    : devices_(std::move(devices)),
      device_(devices_.at(0)),
      clock_(clock),
      options_(std::move(options)),
      sessions_(options_.max_sessions),
      budgets_(BudgetLimits{
          options_.max_session_pinned_bytes, options_.max_total_pinned_bytes,
          options_.max_session_registrations, options_.max_total_registrations,
          options_.max_total_buffers, options_.max_total_lams,
          options_.max_total_mrs}),
      progress_(options_.progress),
      registrations_(
          devices_, &budgets_,
          RegistrationOptions{
              options_.request_id_memory,
              cache::WarmPinLimits{options_.warm_pin_bytes_per_session,
                                   options_.warm_pin_bytes_total},
              &progress_, options_.parallel_devices_min_bytes}),
      fast_(&budgets_, &registrations_, &next_handle_,
            FastRegistrationLimits{
                options_.max_session_lams,
                // A registration counts its MR objects in 28 bits.
                std::min<uint64_t>(options_.max_session_mrs,
                                   RegistrationRecord::kMaxMrRefs),
                &progress_}),
      tenants_(options_.tenants) {
  if (tenants_ == nullptr) {
    // Without a table every tenant may use everything: only the per-session
    // and total limits apply.
    TenantTableOptions defaults;
    defaults.default_percent = 100;
    defaults.totals.fill(~uint64_t{0});
    absl::StatusOr<std::unique_ptr<TenantTable>> table =
        TenantTable::Create(defaults);
    MRD_CHECK(table.ok());
    tenants_ = std::move(*table);
  }
  if (!options_.shm_dir.empty()) {
    shm_dir_fd_ =
        ::open(options_.shm_dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (shm_dir_fd_ < 0) {
      LogWarning("shared-memory directory ", options_.shm_dir,
                 " cannot be opened (", std::strerror(errno),
                 "): ImportFile is disabled");
    }
  }
}

Core::~Core() {
  Shutdown();
  if (shm_dir_fd_ >= 0) ::close(shm_dir_fd_);
}

absl::Status Core::Start() {
  MRD_RETURN_IF_ERROR(progress_.Start());
  MRD_ASSIGN_OR_RETURN(reaper_, Thread::Start("mrd-reaper", [this] {
                         absl::MutexLock lock(&reaper_mu_);
                         while (!reaper_stop_) {
                           reaper_mu_.AwaitWithTimeout(
                               absl::Condition(&reaper_stop_),
                               absl::Seconds(1));
                           if (reaper_stop_) break;
                           reaper_mu_.Unlock();
                           ReapExpiredLeases();
                           reaper_mu_.Lock();
                         }
                       }));
  return absl::OkStatus();
}

void Core::Shutdown() {
  {
    absl::MutexLock lock(&reaper_mu_);
    reaper_stop_ = true;
  }
  reaper_.Join();
  // The sessions whose teardown was given away are released first; the
  // rest here.
  SetTeardownRunner(nullptr);
  progress_.Stop();
  for (const std::shared_ptr<Session>& session : sessions_.Close()) {
    LogInfo("session ", session->id(), " released: server shutting down");
    TearDown(session);
  }
}

// --- sessions ---------------------------------------------------------------

absl::StatusOr<std::shared_ptr<Session>> Core::NewSession(
    SessionKind kind, const Identity& identity) {
  std::shared_ptr<Tenant> tenant = tenants_->Resolve(identity);
  MRD_ASSIGN_OR_RETURN(const uint64_t id, sessions_.Reserve());
  if (absl::Status s = tenant->Reserve(TenantResource::kSessions, 1); !s.ok()) {
    sessions_.Unreserve();
    return s;
  }
  auto session = std::make_shared<Session>(id, RandomToken(), kind,
                                           options_.completion_queue_depth,
                                           identity, tenant);
  absl::StatusOr<std::vector<device::PdId>> pds = AllocatePds(*session);
  if (!pds.ok()) {
    tenant->Release(TenantResource::kSessions, 1);
    sessions_.Unreserve();
    return pds.status();
  }
  {
    absl::MutexLock lock(&session->mu);
    session->pd = (*pds)[0];
    session->pds = *pds;
  }
  // Insert gives the reservation back itself.
  if (absl::Status s = sessions_.Insert(session); !s.ok()) {
    for (size_t i = 0; i < pds->size(); ++i) {
      (void)devices_[i]->DeallocatePd((*pds)[i]);
    }
    tenant->Release(TenantResource::kSessions, 1);
    return s;
  }
  return session;
}

absl::StatusOr<std::vector<device::PdId>> Core::AllocatePds(Session& session) {
  std::vector<device::PdId> pds;
  for (size_t i = 0; i < devices_.size(); ++i) {
    absl::StatusOr<device::PdId> pd =
        devices_[i]->AllocatePd(session.SinkFor(i));
    if (!pd.ok()) {
      for (size_t j = 0; j < pds.size(); ++j) {
        (void)devices_[j]->DeallocatePd(pds[j]);
      }
      return pd.status();
    }
    pds.push_back(*pd);
  }
  return pds;
}

absl::StatusOr<std::shared_ptr<Session>> Core::FindSession(
    const std::string& token) {
  if (token.empty()) {
    return NotConnected(
        "no session given: open one on the fd socket or with "
        "OpenLeaseSession and pass its token");
  }
  std::shared_ptr<Session> session = sessions_.Find(token);
  if (session == nullptr) {
    return NotConnected("unknown, closed or expired session");
  }
  absl::MutexLock lock(&session->mu);
  if (session->closing) return NotConnected("the session is closing");
  if (session->kind() == SessionKind::kLease) {
    absl::Time now = clock_->Now();
    if (session->LeaseExpiredLocked(now)) {
      return NotConnected("the lease expired");
    }
    session->RenewLeaseLocked(now);
  }
  return session;
}

void Core::EndSession(const std::string& token, absl::string_view why) {
  std::shared_ptr<Session> session = sessions_.Remove(token);
  if (session == nullptr) return;
  LogInfo("session ", session->id(), " released: ", why);
  TearDown(session);
}

namespace {
bool IsZero(uint64_t* count) { return *count == 0; }
}  // namespace

void Core::SetTeardownRunner(TeardownRunner runner) {
  absl::MutexLock lock(&teardown_mu_);
  teardown_mu_.Await(absl::Condition(&IsZero, &teardowns_pending_));
  teardown_runner_ = std::move(runner);
}

bool Core::AwaitTeardowns(absl::Duration timeout) {
  absl::MutexLock lock(&teardown_mu_);
  return teardown_mu_.AwaitWithTimeout(
      absl::Condition(&IsZero, &teardowns_pending_), timeout);
}

void Core::EndSessionSoon(const std::string& token, absl::string_view why) {
  std::shared_ptr<Session> session = sessions_.Find(token);
  if (session == nullptr) return;
  {
    absl::MutexLock lock(&teardown_mu_);
    if (teardown_runner_) {
      if (!MarkClosing(*session)) return;
      uint64_t pinned_bytes;
      {
        absl::MutexLock session_lock(&session->mu);
        pinned_bytes = session->pinned_bytes;
      }
      ++teardowns_pending_;
      LogInfo("session ", session->id(), " releasing: ", why);
      // With teardown_mu_ held, so that the runner is not swapped meanwhile
      // (it only queues).
      teardown_runner_(session->tenant(), pinned_bytes,
                       [this, session, why = std::string(why)]() mutable {
                         ReleaseClosing(session);
                         if (sessions_.Remove(session->token()) == session) {
                           LogInfo("session ", session->id(),
                                   " released: ", why);
                         }
                         session.reset();
                         absl::MutexLock lock(&teardown_mu_);
                         --teardowns_pending_;
                       });
      return;
    }
  }
  EndSession(token, why);
}

bool Core::MarkClosing(Session& session) {
  absl::MutexLock lock(&session.mu);
  if (session.closing) return false;
  session.closing = true;
  return true;
}

void Core::TearDown(const std::shared_ptr<Session>& session) {
  if (MarkClosing(*session)) ReleaseClosing(session);
}

void Core::ReleaseClosing(const std::shared_ptr<Session>& session) {
  std::map<uint64_t, MrObject> mrs;
  std::vector<uint64_t> entries;
  std::map<uint64_t, LamRecord> lams;
  std::map<uint64_t, BufferRecord> buffers;
  std::vector<device::PdId> pds;
  {
    absl::MutexLock lock(&session->mu);
    mrs.swap(session->mrs);
    entries = registrations_.DetachLocked(*session, /*buffer=*/0);
    lams.swap(session->lams);
    buffers.swap(session->buffers);
    session->page_to_lam.clear();
    pds = session->pds;
  }
  // Its names leave the directory (CloseSession waited for that already).
  publications_.DropAll(*session, /*wait=*/false);
  // Order matters: tokens die first (fast registrations, then
  // registrations), then LAM pages are unpinned, then the PD goes with its
  // connections.
  // The pages unpinned from here to DeallocatePd leave the device together.
  std::vector<std::unique_ptr<device::DeviceBatch>> batches = BeginBatches();
  fast_.FreeMrs(*session, mrs);
  {
    // The devices after the first deregister beside the first, and are
    // done before the PDs go.
    Registrations::OthersBatch others(&registrations_, session);
    (void)registrations_.Invalidate(*session, entries);
  }
  std::vector<const LamRecord*> lam_records;
  for (const auto& [id, lam] : lams) lam_records.push_back(&lam);
  fast_.ReleaseLams(*session, lam_records, "teardown");
  // `closing` is set: no warm pin of this session can be kept from now on.
  registrations_.DropWarm(session->id(), /*buffer=*/0);
  for (size_t i = 0; i < pds.size(); ++i) {
    if (pds[i] == 0) continue;
    absl::Status s = devices_[i]->DeallocatePd(pds[i]);
    if (!s.ok()) {
      LogWarning("teardown: deallocate PD on ", devices_[i]->Attributes().name,
                 ": ", s.ToString());
    }
  }
  batches.clear();
  // Only now may the mappings go: DeallocatePd unpins whatever the PD still
  // held (an MR or LAM released concurrently), through these mappings.
  session->MarkPdGone().clear();
  const uint64_t buffers_held = buffers.size();
  buffers.clear();
  uint64_t leftover;
  {
    absl::MutexLock lock(&session->mu);
    leftover = session->pinned_bytes;
  }
  budgets_.UnreservePinned(*session, leftover);
  budgets_.ReturnObjects(*session, TenantResource::kBuffers, buffers_held);
  session->ReleasePeerConnections();
  session->tenant()->Release(TenantResource::kSessions, 1);
  session->MarkEndedAndNotify();
  const uint64_t objects =
      entries.size() + mrs.size() + lams.size() + buffers_held;
  mrs.clear();
  lams.clear();
  freed_.Add(objects);
}

void Core::ReapExpiredLeases() {
  std::vector<std::string> expired;
  absl::Time now = clock_->Now();
  for (const std::shared_ptr<Session>& session : sessions_.All()) {
    if (session->kind() != SessionKind::kLease) continue;
    absl::MutexLock lock(&session->mu);
    if (session->LeaseExpiredLocked(now)) expired.push_back(session->token());
  }
  for (const auto& token : expired) EndSessionSoon(token, "lease expired");
}

absl::StatusOr<std::string> Core::OnConnect(
    const fd_socket::PeerCredentials& creds) {
  Identity identity;
  identity.verified = true;
  identity.uid = creds.uid;
  identity.gid = creds.gid;
  if (creds.cgroup.has_value() && creds.cgroup->delegated) {
    // Cgroups under a user's systemd delegation are named by that user:
    // trusted, they would let one uid mint tenants (and quotas) at will.
    identity.tenant_key = TenantKeyFor({}, TenantKeyKind::kUid, creds.uid);
  } else if (creds.cgroup.has_value()) {
    identity.tenant_key =
        TenantKeyFor(*creds.cgroup, options_.tenant_key, creds.uid);
    if (creds.cgroup->kubernetes && tenants_->names_pods_by_name()) {
      absl::StatusOr<std::string> name =
          KubeletPodName(options_.kubelet_pod_logs_dir, creds.cgroup->pod_uid);
      if (name.ok()) identity.pod_name = *std::move(name);
    }
  } else if (options_.tenant_key != TenantKeyKind::kUid &&
             !creds.cgroup_error.empty()) {
    // Without its cgroup the caller can only be told apart by its uid.
    LogWarning("fd socket: pid ", creds.pid, " uid ", creds.uid,
               " counts as its uid's tenant: ", creds.cgroup_error);
  }
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       NewSession(SessionKind::kFd, identity));
  {
    absl::MutexLock lock(&session->mu);
    session->SetPeerLocked(creds.uid, static_cast<uint32_t>(creds.pid));
  }
  LogInfo("session ", session->id(), " opened on the fd socket by pid ",
          creds.pid, " uid ", creds.uid, " (tenant ", session->tenant()->name(),
          ")");
  return session->token();
}

absl::StatusOr<v1::BufferInfo> Core::OnImport(const std::string& token,
                                              UniqueFd fd,
                                              const v1::ImportMemfd& request) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(token));
  fd_socket::MemfdImportOptions opts;
  opts.writable = request.writable();
  opts.expected_size = request.expected_size();
  opts.max_size = options_.max_buffer_size;
  // fd budget: the memfd is charged to the session until it is closed.
  MRD_ASSIGN_OR_RETURN(
      FdCharge charge,
      ChargeFd(options_.fd_budget, session->id(), "an imported memfd"));
  MRD_ASSIGN_OR_RETURN(std::unique_ptr<fd_socket::MappedFile> file,
                       fd_socket::MapMemfd(std::move(fd), opts));
  return AddBuffer(session,
                   ShareWithCharge(std::move(file), std::move(charge)));
}

void Core::OnDisconnect(const std::string& token) {
  EndSessionSoon(token, "fd socket closed");
}

absl::Status Core::OpenLeaseSession(const v1::OpenLeaseSessionRequest& req,
                                    v1::SessionInfo* out) {
  absl::Duration ttl = req.ttl_seconds() == 0
                           ? options_.default_lease_ttl
                           : absl::Seconds(req.ttl_seconds());
  if (ttl > options_.max_lease_ttl) {
    return SeedError(
        STATUS_INVALID_PARAMETER, "TTL_TOO_LONG",
        absl::StrCat("ttl_seconds ", req.ttl_seconds(),
                     " exceeds the maximum of ",
                     absl::ToInt64Seconds(options_.max_lease_ttl)));
  }
  // A lease is as trusted as the fd session that vouches for it: that one's
  // owner was proven by SO_PEERCRED. Without one, the caller is anyone who
  // can reach the gRPC socket.
  Identity identity;
  uint32_t vouching_pid = 0;
  if (!req.vouching_session().empty()) {
    absl::StatusOr<std::shared_ptr<Session>> voucher =
        FindSession(req.vouching_session());
    if (!voucher.ok() || !(*voucher)->identity().verified) {
      return MrdError(
          absl::StatusCode::kPermissionDenied, "BAD_VOUCHING_SESSION",
          "vouching_session must be a live session of a verified owner (an "
          "fd session, or a lease it vouched for)");
    }
    identity = (*voucher)->identity();
    absl::MutexLock lock(&(*voucher)->mu);
    vouching_pid = (*voucher)->peer_pid_locked();
  }
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       NewSession(SessionKind::kLease, identity));
  {
    absl::MutexLock lock(&session->mu);
    session->StartLeaseLocked(ttl, clock_->Now());
    if (identity.verified) session->SetPeerLocked(identity.uid, vouching_pid);
  }
  LogInfo("lease session ", session->id(), " opened, ttl ",
          absl::FormatDuration(ttl), ", tenant ", session->tenant()->name(),
          identity.verified ? " (vouched for)" : " (anonymous)");
  v1::GetSessionRequest get;
  get.set_session(session->token());
  return GetSession(get, out);
}

absl::Status Core::GetSession(const v1::GetSessionRequest& req,
                              v1::SessionInfo* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  {
    absl::MutexLock lock(&session->mu);
    session->FillInfoLocked(out);
    out->set_published(static_cast<uint32_t>(session->published.size()));
  }
  out->set_directory_state(publications_.StateName());
  return absl::OkStatus();
}

absl::Status Core::SetDefaultDevices(const v1::SetDefaultDevicesRequest& req,
                                     v1::SessionInfo* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  MRD_ASSIGN_OR_RETURN(const uint32_t bits,
                       registrations_.DeviceBits(req.devices()));
  {
    absl::MutexLock lock(&session->mu);
    session->default_devices = req.devices();
    session->default_device_bits = bits != 0 ? bits : 1;
    session->default_nearest = req.devices().nearest();
  }
  v1::GetSessionRequest get;
  get.set_session(req.session());
  return GetSession(get, out);
}

std::shared_ptr<Tenant> Core::TenantOfSession(const std::string& token) const {
  if (token.empty()) return nullptr;
  std::shared_ptr<Session> session = sessions_.Find(token);
  return session == nullptr ? nullptr : session->tenant();
}

// --- tenants (the administrative calls) -------------------------------------

namespace {

void FillTenantInfo(const Tenant& tenant, bool configured,
                    v1::TenantInfo* out) {
  out->set_name(tenant.name());
  out->set_weight(tenant.weight());
  out->set_configured(configured);
  const TenantQuota quotas = tenant.quotas();
  for (int i = 0; i < kTenantResourceCount; ++i) {
    const auto resource = static_cast<TenantResource>(i);
    v1::TenantResourceUse* use = out->add_resources();
    use->set_resource(std::string(TenantResourceName(resource)));
    use->set_used(tenant.Used(resource));
    use->set_quota(quotas[i]);
    use->set_refused(tenant.Refused(resource));
  }
}

}  // namespace

absl::StatusOr<TenantSettings> TenantSettingsFromProto(
    const google::protobuf::RepeatedPtrField<v1::TenantQuotaValue>& quotas,
    uint32_t weight) {
  TenantSettings settings;
  for (const v1::TenantQuotaValue& q : quotas) {
    std::optional<TenantResource> resource = TenantResourceByName(q.resource());
    if (!resource.has_value()) {
      return MrdError(absl::StatusCode::kInvalidArgument, "BAD_TENANT_RESOURCE",
                      absl::StrCat("'", q.resource(),
                                   "' is no resource: sessions, buffers, "
                                   "registrations, pinned_bytes, lams, mrs, "
                                   "peer_connections, memory_maps"));
    }
    settings.quota[static_cast<int>(*resource)] = q.amount();
  }
  if (weight != 0) settings.weight = weight;
  return settings;
}

absl::Status Core::ListTenants(v1::ListTenantsResponse* out) const {
  for (const std::shared_ptr<Tenant>& tenant : tenants_->All()) {
    FillTenantInfo(*tenant, tenants_->HasSettings(tenant->name()),
                   out->add_tenants());
  }
  return absl::OkStatus();
}

absl::Status Core::SetTenant(const v1::SetTenantRequest& req,
                             v1::TenantInfo* out) {
  MRD_ASSIGN_OR_RETURN(TenantSettings settings,
                       TenantSettingsFromProto(req.quotas(), req.weight()));
  MRD_RETURN_IF_ERROR(tenants_->Set(req.tenant(), settings));
  LogInfo("tenant ", req.tenant(), ": settings set by the administrator");
  for (const std::shared_ptr<Tenant>& tenant : tenants_->All()) {
    if (tenant->name() == req.tenant()) FillTenantInfo(*tenant, true, out);
  }
  return absl::OkStatus();
}

absl::Status Core::ClearTenant(const v1::ClearTenantRequest& req,
                               v1::TenantInfo* out) {
  MRD_RETURN_IF_ERROR(tenants_->Clear(req.tenant()));
  LogInfo("tenant ", req.tenant(), ": settings cleared by the administrator");
  for (const std::shared_ptr<Tenant>& tenant : tenants_->All()) {
    if (tenant->name() == req.tenant()) FillTenantInfo(*tenant, false, out);
  }
  return absl::OkStatus();
}

absl::Status Core::CloseSession(const v1::CloseSessionRequest& req) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  // The session's names leave the directory before the reply.
  publications_.DropAll(*session, /*wait=*/true);
  EndSession(session->token(), "closed by the client");
  if (session->kind() == SessionKind::kFd && fd_hangup_) {
    fd_hangup_(session->token());
  }
  return absl::OkStatus();
}

// --- buffers ----------------------------------------------------------------

absl::StatusOr<v1::BufferInfo> Core::AddBuffer(
    const std::shared_ptr<Session>& session,
    std::shared_ptr<fd_socket::MappedFile> file) {
  absl::MutexLock lock(&session->mu);
  if (session->closing) return NotConnected("the session is closing");
  if (session->buffers.size() >= options_.max_buffers_per_session) {
    return SeedError(
        STATUS_INSUFFICIENT_RESOURCES, "LIMIT_SESSION_BUFFERS",
        absl::StrCat("the session holds its maximum of ",
                     options_.max_buffers_per_session, " buffers"));
  }
  MRD_RETURN_IF_ERROR(budgets_.TakeObject(*session, TenantResource::kBuffers));
  BufferRecord record;
  record.id = next_handle_.fetch_add(1);
  record.file = std::move(file);
  // 2 MiB-aligned, with a gap, so that buffers never look adjacent.
  record.address = session->NextBufferAddressLocked(record.file->size());
  v1::BufferInfo info;
  FillBufferInfo(record, &info);
  session->buffers.emplace(record.id, std::move(record));
  return info;
}

absl::Status Core::ImportFile(const v1::ImportFileRequest& req,
                              v1::BufferInfo* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  if (shm_dir_fd_ < 0) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "SHM_DIR_DISABLED",
                    "this server has no usable --shm_dir: ImportFile is off");
  }
  fd_socket::SharedFileOptions opts;
  opts.writable = req.writable();
  opts.max_size = options_.max_buffer_size;
  opts.allowed_owner_uids = options_.allowed_uids;
  // fd budget: the file is charged to the session until it is closed.
  MRD_ASSIGN_OR_RETURN(
      FdCharge charge,
      ChargeFd(options_.fd_budget, session->id(), "an imported file"));
  MRD_ASSIGN_OR_RETURN(
      std::unique_ptr<fd_socket::MappedFile> file,
      fd_socket::OpenSharedFile(shm_dir_fd_, req.path(), opts));
  // Checked on the open file, so that what was checked is what is mapped.
  struct stat st;
  if (::fstat(file->fd(), &st) != 0) {
    return ErrnoError(errno, "fstat", "BAD_FD");
  }
  MRD_RETURN_IF_ERROR(CheckFileAccess(*session, st, req.writable()));
  MRD_ASSIGN_OR_RETURN(
      *out,
      AddBuffer(session, ShareWithCharge(std::move(file), std::move(charge))));
  return absl::OkStatus();
}

absl::Status Core::CheckFileAccess(const Session& session,
                                   const struct stat& st, bool writable) const {
  const Identity& who = session.identity();
  // The permission bits that apply to the weakest caller the session can
  // stand for: its proven owner, or, for an anonymous lease, anyone able to
  // reach the gRPC socket.
  std::string principal;
  mode_t bits;
  auto as_user = [&](uint32_t uid, std::optional<uint32_t> gid) -> mode_t {
    if (uid == 0) return S_IRWXO;  // root opens anything
    if (st.st_uid == uid) return (st.st_mode & S_IRWXU) >> 6;
    if (gid.has_value() && st.st_gid == *gid) {
      return (st.st_mode & S_IRWXG) >> 3;
    }
    return st.st_mode & S_IRWXO;
  };
  if (who.verified) {
    principal = absl::StrCat("uid ", who.uid, " (gid ", who.gid, ")");
    bits = as_user(who.uid, who.gid);
  } else {
    switch (options_.anonymous_reach) {
      case CoreOptions::Reach::kUser:
        principal =
            absl::StrCat("an anonymous lease (only uid ", options_.anonymous_id,
                         " can reach the gRPC socket)");
        bits = as_user(options_.anonymous_id, std::nullopt);
        break;
      case CoreOptions::Reach::kGroupMember:
        principal =
            absl::StrCat("an anonymous lease (any member of group ",
                         options_.anonymous_id, " can reach the gRPC socket)");
        bits = st.st_gid == options_.anonymous_id ? (st.st_mode & S_IRWXG) >> 3
                                                  : st.st_mode & S_IRWXO;
        break;
      case CoreOptions::Reach::kAnyone:
      default:
        principal =
            "an anonymous lease (anyone can reach the gRPC socket or the "
            "debug listener)";
        bits = st.st_mode & S_IRWXO;
        break;
    }
  }
  const mode_t need = S_IROTH | (writable ? S_IWOTH : 0);
  if ((bits & need) == need) return absl::OkStatus();
  return MrdError(
      absl::StatusCode::kPermissionDenied, "IDENTITY_DENIES_ACCESS",
      absl::StrCat(
          "the file (owner ", st.st_uid, ", group ", st.st_gid, ", mode ",
          absl::StrFormat("%04o", st.st_mode & 07777),
          ") may not be opened for ",
          writable ? "reading and writing" : "reading", " by ", principal,
          "; vouch for the lease with an fd session (vouching_session) or "
          "change the file's mode"));
}

uint64_t Core::ReleaseBufferBytes(const v1::ReleaseBufferRequest& req) {
  absl::StatusOr<std::shared_ptr<Session>> session = FindSession(req.session());
  if (!session.ok()) return 0;
  absl::MutexLock lock(&(*session)->mu);
  auto it = (*session)->buffers.find(req.buffer());
  if (it == (*session)->buffers.end() || it->second.file == nullptr) return 0;
  return it->second.file->size();
}

uint64_t Core::CloseSessionBytes(const v1::CloseSessionRequest& req) {
  absl::StatusOr<std::shared_ptr<Session>> session = FindSession(req.session());
  if (!session.ok()) return 0;
  absl::MutexLock lock(&(*session)->mu);
  return (*session)->pinned_bytes;
}

absl::Status Core::ReleaseBuffer(const v1::ReleaseBufferRequest& req,
                                 v1::ReleaseBufferResponse* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  // The mapping (and its fd, through which the software device moves peer
  // data) must outlive every registration, LAM and warm pin made on it, not
  // just the buffer's record: a closed fd number may be reused at once.
  std::shared_ptr<fd_socket::MappedFile> file;
  std::vector<uint64_t> entries;
  FastRegistration::Detached detached;
  {
    absl::MutexLock lock(&session->mu);
    auto it = session->buffers.find(req.buffer());
    if (it == session->buffers.end()) {
      return UnknownHandle("buffer", req.buffer());
    }
    file = std::move(it->second.file);
    session->buffers.erase(it);
    // W11: everything made on this buffer goes with it.
    entries = registrations_.DetachLocked(*session, req.buffer());
    detached = fast_.DetachLocked(*session, req.buffer());
  }
  budgets_.ReturnObjects(*session, TenantResource::kBuffers, 1);
  // Tokens die first (fast registrations mapping its LAMs, then
  // registrations), then the LAMs' pages are unpinned.
  fast_.ResetFastRegistrations(*session, detached);
  const uint32_t invalidated = registrations_.Invalidate(*session, entries);
  std::vector<const LamRecord*> lam_records;
  for (const LamRecord& lam : detached.lams) lam_records.push_back(&lam);
  fast_.ReleaseLams(*session, lam_records, "release buffer");
  // The buffer is out of the session: no warm pin of it can be kept any more.
  registrations_.DropWarm(session->id(), req.buffer());
  publications_.Sync(*session);
  out->set_invalidated_registrations(invalidated);
  out->set_released_lams(static_cast<uint32_t>(detached.lams.size()));
  file.reset();
  detached = {};
  freed_.Add(1 + entries.size() + lam_records.size());
  return absl::OkStatus();
}

// --- registrations, LAMs and MR objects: registrations.h, fast_registration.h

absl::Status Core::RegisterMr(const v1::RegisterMrRequest& req,
                              v1::RegisterMrResponse* out,
                              const CancelCheck& cancelled) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  return RegisterAndPublish(session, req, out, cancelled);
}

absl::Status Core::RegisterAndPublish(const std::shared_ptr<Session>& session,
                                      const v1::RegisterMrRequest& req,
                                      v1::RegisterMrResponse* out,
                                      const CancelCheck& cancelled) {
  if (req.publish_name().empty()) {
    return registrations_.Register(session, req, out, cancelled);
  }
  MRD_RETURN_IF_ERROR(
      publications_.CheckPublishable(*session, req.publish_name()));
  MRD_RETURN_IF_ERROR(registrations_.Register(session, req, out, cancelled));
  v1::PublishRequest publish;
  publish.set_name(req.publish_name());
  publish.set_registration(out->registration());
  v1::PublishedEntry entry;
  absl::Status published = publications_.Publish(*session, publish, &entry);
  if (published.ok()) {
    out->set_published_key(entry.key());
    return absl::OkStatus();
  }
  // Nothing of this call stays: its reference goes back.
  v1::DeregisterMrRequest undo;
  if (req.mr() != 0) {
    undo.set_mr(req.mr());
  } else {
    undo.set_registration(out->registration());
  }
  v1::DeregisterMrResponse ignored;
  if (absl::Status s = registrations_.Deregister(session, undo, &ignored);
      !s.ok()) {
    LogWarning("RegisterMr: undoing registration ", out->registration(),
               " after its publish failed: ", s.ToString());
  }
  out->Clear();
  return published;
}

std::optional<absl::Status> Core::TryRegisterMrHit(
    const v1::RegisterMrRequest& req, v1::RegisterMrResponse* out) {
  // Publishing at registration runs on a worker (it may undo).
  if (!req.publish_name().empty()) return std::nullopt;
  absl::StatusOr<std::shared_ptr<Session>> session = FindSession(req.session());
  if (!session.ok()) return session.status();
  return registrations_.TryRegisterHit(*session, req, out);
}

std::optional<absl::Status> Core::TryRegisterMrSmall(
    const v1::RegisterMrRequest& req, v1::RegisterMrResponse* out) {
  if (req.length() == 0 || req.length() > kInlineRegisterBytes) {
    return std::nullopt;
  }
  absl::StatusOr<std::shared_ptr<Session>> session = FindSession(req.session());
  if (!session.ok()) return session.status();
  Tenant& tenant = *(*session)->tenant();
  if (!tenant.TryEnterInline(kInlinePerTenant)) return std::nullopt;
  // A name is only queued for the directory's writer (and a refusal undoes
  // a small registration): nothing here waits for etcd.
  absl::Status status = RegisterAndPublish(*session, req, out, nullptr);
  tenant.LeaveInline();
  return status;
}

std::optional<absl::Status> Core::TryDeregisterMrSmall(
    const v1::DeregisterMrRequest& req, v1::DeregisterMrResponse* out,
    uint64_t last_bytes) {
  if (last_bytes == 0 || last_bytes > kInlineRegisterBytes ||
      !req.has_registration()) {
    return std::nullopt;
  }
  absl::StatusOr<std::shared_ptr<Session>> session = FindSession(req.session());
  if (!session.ok()) return session.status();
  {
    // A published name's delete is waited for (Publications::Sync): a
    // worker's wait.
    absl::MutexLock lock(&(*session)->mu);
    if ((*session)->published.Names(req.registration())) return std::nullopt;
  }
  Tenant& tenant = *(*session)->tenant();
  if (!tenant.TryEnterInline(kInlinePerTenant)) return std::nullopt;
  absl::Status status = registrations_.Deregister(*session, req, out);
  tenant.LeaveInline();
  if (status.ok() && out->references() == 0) freed_.Add(1);
  return status;
}

std::optional<absl::Status> Core::TryDeregisterMrNotLast(
    const v1::DeregisterMrRequest& req, v1::DeregisterMrResponse* out,
    uint64_t* last_bytes) {
  absl::StatusOr<std::shared_ptr<Session>> session = FindSession(req.session());
  if (!session.ok()) return session.status();
  return registrations_.TryDeregisterNotLast(*session, req, out, last_bytes);
}

absl::Status Core::DeregisterMr(const v1::DeregisterMrRequest& req,
                                v1::DeregisterMrResponse* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  MRD_RETURN_IF_ERROR(registrations_.Deregister(session, req, out));
  if (out->references() == 0) {
    freed_.Add(1);
    if (req.has_registration()) {
      const uint64_t gone = req.registration();
      publications_.Sync(*session, {&gone, 1});
    } else {
      publications_.Sync(*session);  // an MR object's mapping
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Session>> Core::FindBatchSession(
    const std::string& token, size_t items) {
  if (items > options_.max_batch_items) {
    return SeedError(STATUS_INVALID_PARAMETER, "BATCH_TOO_LARGE",
                     absl::StrCat("the batch has ", items,
                                  " items; this server takes at most ",
                                  options_.max_batch_items, " in one call"));
  }
  return FindSession(token);
}

// How many items of a batch go between two yields to the fair scheduler.
constexpr int kBatchYieldItems = 16;

// Items of a batch that register adjacent ranges of one buffer, each of at
// most kPinAheadItemBytes, are pinned together ahead of them
// (Registrations::PinAhead): at least kPinAheadMinItems of them, at most
// kPinAheadBytes at a time.
constexpr uint64_t kPinAheadItemBytes = uint64_t{64} << 10;
constexpr uint64_t kPinAheadBytes = uint64_t{16} << 20;
constexpr int kPinAheadMinItems = 4;

// The items from `first` on that can be pinned ahead together: those whose
// page-rounded ranges of one buffer follow each other without a gap or an
// overlap (the pin ahead then counts exactly the pages the items reserve).
// Returns the end of the run, and its range within the buffer in `offset`
// and `length`.
int PinAheadRun(
    const google::protobuf::RepeatedPtrField<v1::RegisterMrRequest>& items,
    int first, const std::string& session, uint64_t page, uint64_t* offset,
    uint64_t* length) {
  auto eligible = [&](const v1::RegisterMrRequest& item) {
    return (item.session().empty() || item.session() == session) &&
           item.mr() == 0 && item.publish_name().empty() &&
           !item.has_devices() && item.length() > 0 &&
           item.length() <= kPinAheadItemBytes &&
           item.offset() <= UINT64_MAX - kPinAheadBytes;
  };
  auto page_start = [&](const v1::RegisterMrRequest& item) {
    return item.offset() & ~(page - 1);
  };
  auto page_end = [&](const v1::RegisterMrRequest& item) {
    return (item.offset() + item.length() + page - 1) & ~(page - 1);
  };
  const v1::RegisterMrRequest& head = items.Get(first);
  if (!eligible(head)) return first + 1;
  *offset = page_start(head);
  uint64_t end = page_end(head);
  int last = first + 1;
  for (; last < items.size(); ++last) {
    const v1::RegisterMrRequest& item = items.Get(last);
    if (!eligible(item) || item.buffer() != head.buffer() ||
        page_start(item) != end || page_end(item) - *offset > kPinAheadBytes) {
      break;
    }
    end = page_end(item);
  }
  *length = end - *offset;
  return last;
}

absl::Status Core::RegisterMrBatch(const v1::RegisterMrBatchRequest& req,
                                   v1::RegisterMrBatchResponse* out,
                                   const CancelCheck& cancelled) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindBatchSession(req.session(), req.items_size()));
  int done = 0;
  // The pages of the items before `ahead_end`, pinned together.
  std::optional<Registrations::PinAhead> ahead;
  int ahead_end = 0;
  for (const v1::RegisterMrRequest& item : req.items()) {
    if (done >= ahead_end) {
      ahead.reset();
      uint64_t offset = 0;
      uint64_t length = 0;
      ahead_end = PinAheadRun(req.items(), done, req.session(),
                              registrations_.page_size(), &offset, &length);
      if (ahead_end - done >= kPinAheadMinItems) {
        ahead.emplace(&registrations_, session, item.buffer(), offset, length);
      }
    }
    // Between items, other tenants' requests may go first (a batch is
    // many requests in one call).
    if (++done % kBatchYieldItems == 0) {
      FairScheduler::YieldCurrent(kBatchYieldItems + WorkCost(item.length()));
    }
    // The caller gave up: the items after this are not tried (those done
    // stay, for a retry with the same request ids to get back).
    if (cancelled && cancelled()) {
      out->Clear();
      return absl::CancelledError(
          absl::StrCat("RegisterMrBatch was cancelled after ",
                       out->items_size(), " of ", req.items_size(), " items"));
    }
    v1::RegisterMrBatchResult* result = out->add_items();
    absl::Status status = CheckItemSession(item.session(), req.session());
    if (status.ok()) {
      // The check above is this item's; a long pin checks between its
      // steps too.
      status = RegisterAndPublish(
          session, item, result->mutable_registration(),
          item.length() >= kProgressMinBytes ? cancelled : nullptr);
    }
    // An item that succeeded carries no status (code 0, the default).
    if (!status.ok()) {
      result->clear_registration();
      *result->mutable_status() = ItemStatusToProto(status);
    }
  }
  return absl::OkStatus();
}

absl::Status Core::DeregisterMrBatch(const v1::DeregisterMrBatchRequest& req,
                                     v1::DeregisterMrBatchResponse* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindBatchSession(req.session(), req.items_size()));
  // The items' pages leave the device together, before the reply.
  const std::vector<std::unique_ptr<device::DeviceBatch>> batches =
      BeginBatches();
  uint64_t released = 0;
  // The registrations the call ended, for their published names; an MR
  // object's mapping ended: every name is checked.
  std::vector<uint64_t> gone;
  bool mapping_gone = false;
  // The items' MRs on the devices after the first are deregistered beside
  // the first device's, and are gone when the call returns.
  std::optional<Registrations::OthersBatch> others;
  others.emplace(&registrations_, session);
  int done = 0;
  for (const v1::DeregisterMrRequest& item : req.items()) {
    if (++done % kBatchYieldItems == 0) {
      FairScheduler::YieldCurrent(kBatchYieldItems);
    }
    v1::DeregisterMrBatchResult* result = out->add_items();
    v1::DeregisterMrResponse response;
    absl::Status status = CheckItemSession(item.session(), req.session());
    if (status.ok())
      status = registrations_.Deregister(session, item, &response);
    if (status.ok() && response.references() == 0) {
      ++released;
      if (item.has_registration()) {
        gone.push_back(item.registration());
      } else {
        mapping_gone = true;
      }
    }
    result->set_references(status.ok() ? response.references() : 0);
    if (!status.ok()) *result->mutable_status() = ItemStatusToProto(status);
  }
  others.reset();
  freed_.Add(released);
  if (mapping_gone) {
    publications_.Sync(*session);
  } else if (!gone.empty()) {
    publications_.Sync(*session, gone);
  }
  return absl::OkStatus();
}

absl::Status Core::CreateMr(const v1::CreateMrRequest& req, v1::MrInfo* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  return fast_.CreateMr(session, req, out);
}

absl::Status Core::CloseMr(const v1::CloseMrRequest& req) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  MRD_RETURN_IF_ERROR(fast_.CloseMr(session, req));
  publications_.Sync(*session);
  return absl::OkStatus();
}

// --- the directory: publications.h ------------------------------------------

absl::Status Core::Publish(const v1::PublishRequest& req,
                           v1::PublishedEntry* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  return publications_.Publish(*session, req, out);
}

absl::Status Core::Unpublish(const v1::UnpublishRequest& req,
                             v1::UnpublishResponse* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  return publications_.Unpublish(*session, req, out);
}

absl::Status Core::ListPublished(const v1::ListPublishedRequest& req,
                                 v1::ListPublishedResponse* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  return publications_.List(*session, out);
}

absl::StatusOr<std::unique_ptr<Publications::NameWatch>> Core::WatchName(
    const v1::ResolveRequest& req, Publications::NameEventCallback on_event) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  return publications_.WatchName(*session, req, std::move(on_event));
}

absl::Status Core::Resolve(const v1::ResolveRequest& req,
                           v1::PublishedEntry* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  return publications_.Resolve(*session, req, out);
}

absl::Status Core::BuildLam(const v1::BuildLamRequest& req,
                            v1::BuildLamResponse* out,
                            const CancelCheck& cancelled) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  return fast_.BuildLam(session, req, out, cancelled);
}

absl::Status Core::ReleaseLam(const v1::ReleaseLamRequest& req) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  return fast_.ReleaseLam(session, req);
}

absl::Status Core::FastRegister(const v1::FastRegisterRequest& req,
                                v1::FastRegisterResponse* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  return fast_.FastRegister(session, req, out);
}

absl::Status Core::InvalidateMr(const v1::InvalidateMrRequest& req,
                                v1::InvalidateMrResponse* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  MRD_RETURN_IF_ERROR(fast_.InvalidateMr(session, req, out));
  // The token dies once the work posted runs; its names are gone first.
  publications_.DropMr(*session, req.mr());
  return absl::OkStatus();
}

absl::Status Core::CreatePeerTicket(const v1::CreatePeerTicketRequest& req,
                                    v1::PeerTicket* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  size_t index = 0;
  if (!req.device().empty()) {
    MRD_ASSIGN_OR_RETURN(index, registrations_.DeviceIndex(req.device()));
  }
  device::Device* const device = devices_[index];
  out->set_device(device->Attributes().name);
  out->set_peer_address(device->Attributes().peer_address);
  device::PdId pd;
  {
    absl::MutexLock lock(&session->mu);
    if (std::string ticket = session->PeerTicketLocked(index);
        !ticket.empty()) {
      out->set_ticket(std::move(ticket));
      return absl::OkStatus();
    }
    if (index >= session->pds.size()) {
      return NotConnected("the session has no PD on that device");
    }
    pd = session->pds[index];
  }
  absl::StatusOr<std::string> ticket = device->CreatePeerTicket(pd);
  if (!ticket.ok()) {
    return SessionAwareError(*session, ticket.status(), "CreatePeerTicket");
  }
  absl::MutexLock lock(&session->mu);
  session->SetPeerTicketLocked(index, *ticket);
  out->set_ticket(session->PeerTicketLocked(index));
  return absl::OkStatus();
}

std::vector<std::unique_ptr<device::DeviceBatch>> Core::BeginBatches() {
  std::vector<std::unique_ptr<device::DeviceBatch>> batches;
  batches.reserve(devices_.size());
  for (device::Device* device : devices_) {
    batches.push_back(device->BeginBatch());
  }
  return batches;
}

// --- inspection -------------------------------------------------------------

absl::Status Core::GetDeviceInfo(v1::DeviceInfo* out) const {
  DescribeDevice(*device_, out);
  for (const device::Device* device : devices_) {
    DescribeDevice(*device, out->add_devices());
  }
  // Always answered: this is where a lost or unhealthy device is reported
  // (healthy = false, status_message says why); requests that need the
  // device fail with UNAVAILABLE instead.
  return absl::OkStatus();
}

std::vector<DeviceState> Core::DeviceStates() const {
  std::vector<DeviceState> states;
  states.reserve(devices_.size());
  for (const device::Device* device : devices_) {
    const device::DeviceHealth health = device->Health();
    states.push_back(DeviceState{device->Attributes().name, health.healthy,
                                 health.message, device->PinnedBytes()});
  }
  return states;
}

std::vector<DeviceState> Core::TakeDeviceHealthChanges() {
  std::vector<DeviceState> changes;
  bool first;
  {
    absl::MutexLock lock(&health_mu_);
    std::vector<DeviceState> now = DeviceStates();
    first = last_healthy_.empty();
    last_healthy_.resize(now.size(), true);
    for (size_t i = 0; i < now.size(); ++i) {
      if (!first && now[i].healthy == last_healthy_[i]) continue;
      last_healthy_[i] = now[i].healthy;
      changes.push_back(std::move(now[i]));
    }
  }
  if (first) return changes;
  for (const DeviceState& change : changes) {
    if (change.healthy) {
      LogInfo("device ", change.name, " is healthy again");
    } else {
      LogError("device ", change.name, " is unhealthy: ", change.message);
    }
    v1::Completion c;
    c.set_kind(v1::Completion::DEVICE_HEALTH);
    c.set_status(change.healthy ? v1::STATUS_SUCCESS
                                : v1::STATUS_CONNECTION_INVALID);
    c.set_device(change.name);
    c.set_message(change.message);
    for (const std::shared_ptr<Session>& session : sessions_.All()) {
      session->Push(c);
    }
  }
  return changes;
}

void Core::DescribeDevice(const device::Device& device, v1::DeviceInfo* out) {
  const device::DeviceAttributes& a = device.Attributes();
  device::DeviceHealth health = device.Health();
  out->set_name(a.name);
  out->set_kind(a.kind);
  out->set_page_size(a.page_size);
  out->set_max_mr_size(a.max_mr_size);
  out->set_max_page_list_length(a.max_page_list_length);
  out->set_adapter_flags(a.adapter_flags);
  out->set_peer_address(a.peer_address);
  out->set_gid(a.gid);
  out->set_lid(a.lid);
  out->set_healthy(health.healthy);
  out->set_status_message(health.message);
  out->set_pinned_bytes(device.PinnedBytes());
  out->set_numa_node(a.numa_node);
  out->set_pci_address(a.pci_address);
  out->set_link_layer(a.link_layer);
}

absl::Status Core::ListRegistrations(const v1::ListRegistrationsRequest& req,
                                     v1::ListRegistrationsResponse* out) {
  v1::GetSessionRequest get;
  get.set_session(req.session());
  MRD_RETURN_IF_ERROR(GetSession(get, out->mutable_session()));
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  absl::MutexLock lock(&session->mu);
  for (const auto& [id, b] : session->buffers) {
    FillBufferInfo(b, out->add_buffers());
  }
  for (const auto& [id, r] : session->registrations) {
    v1::RegistrationInfo* info = out->add_registrations();
    info->set_registration(id);
    info->set_flags(r.flags);
    info->set_references(r.implicit_refs + r.mr_refs);
    // The range and keys are the cache entry's (ready while the session,
    // whose lock is held, has a record of it).
    if (std::optional<cache::EntryView> e = registrations_.Describe(id)) {
      info->set_buffer(e->key.buffer);
      info->set_offset(e->key.offset);
      info->set_length(e->key.length);
      info->set_lkey(e->lkey);
      info->set_rkey(e->rkey);
      info->set_base_address(e->key.base_address);
      registrations_.AddTokens(*e, info->mutable_tokens());
    }
  }
  for (const auto& [id, l] : session->lams) {
    v1::LamInfo* info = out->add_lams();
    info->set_lam(id);
    info->set_buffer(l.buffer);
    info->set_offset(l.offset);
    info->set_length(l.length);
    info->set_page_count(static_cast<uint32_t>(l.pages.size()));
    info->set_device(devices_[l.device]->Attributes().name);
    info->set_fbo(l.fbo);
  }
  for (const auto& [id, m] : session->mrs) {
    v1::MrInfo* info = out->add_mrs();
    info->set_mr(id);
    info->set_fast_register(m.fast_register);
    info->set_allow_remote_access(m.allow_remote);
    info->set_device(devices_[m.device]->Attributes().name);
    if (m.fast_register) {
      info->set_state(m.fast_registered ? "fast_registered" : "free");
      info->set_lkey(m.lkey);
      if (m.fast_registered) {
        info->set_rkey(m.rkey);
        info->set_base_address(m.base_address);
        info->set_length(m.length);
      }
    } else {
      info->set_state(m.registration != 0 ? "registered" : "free");
      info->set_registration(m.registration);
      if (session->registrations.contains(m.registration)) {
        if (std::optional<cache::EntryView> e =
                registrations_.Describe(m.registration)) {
          info->set_lkey(e->lkey);
          info->set_rkey(e->rkey);
          info->set_base_address(e->key.base_address);
          info->set_length(e->key.length);
        }
      }
    }
  }
  for (const auto& [id, peer] : session->connections) {
    v1::ConnectionInfo* info = out->add_connections();
    info->set_connection(id);
    info->set_peer(peer);
  }
  return absl::OkStatus();
}

absl::StatusOr<CompletionSubscription> Core::SubscribeCompletions(
    const std::string& token, std::function<void()> notify) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(token));
  const uint64_t stream = session->Subscribe(std::move(notify));
  return CompletionSubscription{std::move(session), stream};
}

void Core::UnsubscribeCompletions(const CompletionSubscription& subscription) {
  if (subscription.session != nullptr) {
    subscription.session->Unsubscribe(subscription.stream);
  }
}

CoreStats Core::Stats() const {
  CoreStats stats;
  const std::vector<std::shared_ptr<Session>> sessions = sessions_.All();
  const SessionCounts counts = sessions_.Counts();
  stats.accounted_pinned_bytes = budgets_.Totals().pinned_bytes;
  stats.sessions_opened_total = counts.opened_total;
  stats.sessions_closed_total = counts.closed_total;
  stats.sessions = sessions.size();
  for (const auto& s : sessions) {
    if (s->kind() == SessionKind::kFd) {
      ++stats.fd_sessions;
    } else {
      ++stats.lease_sessions;
    }
    absl::MutexLock lock(&s->mu);
    stats.buffers += s->buffers.size();
    stats.registrations += s->registrations.size();
    stats.lams += s->lams.size();
    stats.mrs += s->mrs.size();
    stats.connections += s->connections.size();
    stats.completions_dropped_total += s->completions_dropped_locked();
  }
  stats.device_pinned_bytes = device_->PinnedBytes();
  stats.cache = registrations_.CacheStats();
  stats.warm = registrations_.WarmStats();
  return stats;
}

}  // namespace mrd::core
