#include "server/core/core.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <limits>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "mrd/status.h"
#include "server/common/log.h"
#include "server/core/flags.h"
#include "server/device/fast_register_rules.h"

namespace mrd::core {
namespace {

// Longest RegisterMr request_id (idempotency key) a session may use.
constexpr size_t kMaxRequestIdBytes = 128;

constexpr uint32_t kDescriptorSize = 24;  // rkey(4) pad(4) base(8) length(8)
constexpr uint64_t kLamHeaderSize = 8;    // page count + FBO
constexpr uint64_t kLamEntrySize = 8;     // one logical address

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

absl::Status NotConnected(absl::string_view why) {
  return SeedError(WSAENOTCONN, "SESSION_NOT_CONNECTED", why);
}

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

absl::Status UnknownHandle(absl::string_view what, uint64_t id) {
  std::string reason = absl::StrCat("UNKNOWN_", what);
  for (char& c : reason) c = static_cast<char>(std::toupper(c));
  return MrdError(absl::StatusCode::kNotFound, reason,
                  absl::StrCat("this session has no ", what, " ", id));
}

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
    : device_(device),
      clock_(clock),
      options_(std::move(options)),
      page_size_(device->Attributes().page_size),
      sessions_(options_.max_sessions),
      budgets_(BudgetLimits{
          options_.max_session_pinned_bytes, options_.max_total_pinned_bytes,
          options_.max_session_registrations, options_.max_total_registrations,
          options_.max_total_buffers, options_.max_total_lams,
          options_.max_total_mrs}),
      warm_(cache::WarmPinLimits{options_.warm_pin_bytes_per_session,
                                 options_.warm_pin_bytes_total}),
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
  absl::StatusOr<device::PdId> pd = device_->AllocatePd(session.get());
  if (!pd.ok()) {
    tenant->Release(TenantResource::kSessions, 1);
    sessions_.Unreserve();
    return pd.status();
  }
  {
    absl::MutexLock lock(&session->mu);
    session->pd = *pd;
  }
  if (absl::Status s = sessions_.Insert(session); !s.ok()) {
    tenant->Release(TenantResource::kSessions, 1);
    (void)device_->DeallocatePd(*pd);
    return s;
  }
  return session;
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
    if (now >= session->expires) return NotConnected("the lease expired");
    session->expires = now + session->ttl;  // every call renews the lease
  }
  return session;
}

void Core::EndSession(const std::string& token, absl::string_view why) {
  std::shared_ptr<Session> session = sessions_.Remove(token);
  if (session == nullptr) return;
  LogInfo("session ", session->id(), " released: ", why);
  TearDown(session);
}

void Core::TearDown(const std::shared_ptr<Session>& session) {
  std::map<uint64_t, MrObject> mrs;
  std::map<uint64_t, RegistrationRecord> registrations;
  std::map<uint64_t, LamRecord> lams;
  std::map<uint64_t, BufferRecord> buffers;
  device::PdId pd;
  {
    absl::MutexLock lock(&session->mu);
    if (session->closing) return;
    session->closing = true;
    mrs.swap(session->mrs);
    registrations.swap(session->registrations);
    lams.swap(session->lams);
    buffers.swap(session->buffers);
    session->page_to_lam.clear();
    pd = session->pd;
  }
  // Order matters: tokens die first (fast registrations, then
  // registrations), then LAM pages are unpinned, then the PD goes with its
  // connections.
  for (auto& [id, mr] : mrs) {
    if (mr.fast_register && mr.device_mr != 0) {
      absl::Status s = device_->FreeFastRegisterMr(mr.device_mr);
      if (!s.ok()) LogWarning("teardown: free MR ", id, ": ", s.ToString());
    }
  }
  for (auto& [entry, rec] : registrations) {
    absl::StatusOr<cache::CachedRegistration> reg = cache_.Invalidate(entry);
    if (reg.ok()) DeregisterCached(*session, *reg);
  }
  for (auto& [id, lam] : lams) {
    absl::Status s = device_->ReleaseLam(lam.device_lam);
    if (!s.ok()) LogWarning("teardown: release LAM ", id, ": ", s.ToString());
    budgets_.UnreservePinned(*session, lam.pinned_bytes);
  }
  // `closing` is set: no warm pin of this session can be kept from now on.
  ReleaseWarm(warm_.DropSession(session->id()));
  if (pd != 0) {
    absl::Status s = device_->DeallocatePd(pd);
    if (!s.ok()) LogWarning("teardown: deallocate PD: ", s.ToString());
  }
  // Only now may the mappings go: DeallocatePd unpins whatever the PD still
  // held (an MR or LAM released concurrently), through these mappings.
  std::vector<std::shared_ptr<const void>> parked;
  {
    absl::MutexLock lock(&session->mu);
    session->pd_gone = true;
    parked.swap(session->memory_until_pd_gone);
  }
  parked.clear();
  const uint64_t buffers_held = buffers.size();
  buffers.clear();
  uint64_t leftover;
  {
    absl::MutexLock lock(&session->mu);
    leftover = session->pinned_bytes;
  }
  budgets_.UnreservePinned(*session, leftover);
  budgets_.ReturnObjects(*session, TenantResource::kMrs, mrs.size());
  budgets_.ReturnObjects(*session, TenantResource::kLams, lams.size());
  budgets_.ReturnObjects(*session, TenantResource::kBuffers, buffers_held);
  session->ReleasePeerConnections();
  session->tenant()->Release(TenantResource::kSessions, 1);
  session->MarkEndedAndNotify();
}

void Core::ReapExpiredLeases() {
  std::vector<std::string> expired;
  absl::Time now = clock_->Now();
  for (const std::shared_ptr<Session>& session : sessions_.All()) {
    if (session->kind() != SessionKind::kLease) continue;
    absl::MutexLock lock(&session->mu);
    if (now >= session->expires) expired.push_back(session->token());
  }
  for (const auto& token : expired) EndSession(token, "lease expired");
}

absl::StatusOr<std::string> Core::OnConnect(
    const fd_socket::PeerCredentials& creds) {
  Identity identity;
  identity.verified = true;
  identity.uid = creds.uid;
  identity.gid = creds.gid;
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       NewSession(SessionKind::kFd, identity));
  {
    absl::MutexLock lock(&session->mu);
    session->peer_uid = creds.uid;
    session->peer_pid = static_cast<uint32_t>(creds.pid);
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
  EndSession(token, "fd socket closed");
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
    vouching_pid = (*voucher)->peer_pid;
  }
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       NewSession(SessionKind::kLease, identity));
  {
    absl::MutexLock lock(&session->mu);
    session->ttl = ttl;
    session->expires = clock_->Now() + ttl;
    if (identity.verified) {
      session->peer_uid = identity.uid;
      session->peer_pid = vouching_pid;
    }
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
  absl::MutexLock lock(&session->mu);
  out->set_session(session->token());
  out->set_kind(session->kind() == SessionKind::kFd ? "fd" : "lease");
  if (session->kind() == SessionKind::kLease) {
    out->set_ttl_seconds(
        static_cast<uint32_t>(absl::ToInt64Seconds(session->ttl)));
    out->set_expires_unix_ms(absl::ToUnixMillis(session->expires));
  }
  out->set_peer_uid(session->peer_uid);
  out->set_peer_pid(session->peer_pid);
  out->set_pinned_bytes(session->pinned_bytes);
  out->set_registrations(static_cast<uint32_t>(session->registrations.size()));
  out->set_tenant(session->tenant()->name());
  out->set_verified(session->identity().verified);
  return absl::OkStatus();
}

absl::Status Core::CloseSession(const v1::CloseSessionRequest& req) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
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
  constexpr uint64_t kAlign = uint64_t{2} << 20;
  record.address = session->next_buffer_address;
  uint64_t span = (record.file->size() + kAlign - 1) / kAlign * kAlign;
  session->next_buffer_address += span + kAlign;
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

absl::Status Core::DetachBufferLocked(Session& session, uint64_t buffer,
                                      DetachedBuffer* detached) {
  auto it = session.buffers.find(buffer);
  if (it == session.buffers.end()) return UnknownHandle("buffer", buffer);
  detached->file = std::move(it->second.file);
  session.buffers.erase(it);
  // W11: everything made on this buffer goes with it.
  for (auto r = session.registrations.begin();
       r != session.registrations.end();) {
    if (r->second.buffer == buffer) {
      detached->entries.push_back(r->first);
      r = session.registrations.erase(r);
    } else {
      ++r;
    }
  }
  for (auto& [id, mr] : session.mrs) {
    if (mr.fast_register) continue;
    for (uint64_t e : detached->entries) {
      if (mr.registration == e) mr.registration = 0;
    }
  }
  absl::flat_hash_set<uint64_t> lam_ids;
  for (auto l = session.lams.begin(); l != session.lams.end();) {
    if (l->second.buffer == buffer) {
      lam_ids.insert(l->first);
      for (uint64_t page : l->second.pages) session.page_to_lam.erase(page);
      detached->lams.push_back(std::move(l->second));
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
        detached->fr_to_reset.emplace_back(id, mr.device_mr);
        break;
      }
    }
  }
  return absl::OkStatus();
}

void Core::ResetFastRegistration(Session& session, uint64_t id,
                                 device::MrId device_mr) {
  // There is no synchronous invalidate in the device interface: replace the
  // device MR object, which kills the old key at once.
  bool allow_remote;
  device::PdId pd;
  {
    absl::MutexLock lock(&session.mu);
    auto it = session.mrs.find(id);
    if (it == session.mrs.end()) return;
    allow_remote = it->second.allow_remote;
    pd = session.pd;
  }
  (void)device_->FreeFastRegisterMr(device_mr);
  absl::StatusOr<device::MrKeys> keys = device_->AllocateFastRegisterMr(
      pd, allow_remote, device_->Attributes().max_page_list_length);
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

absl::Status Core::ReleaseBuffer(const v1::ReleaseBufferRequest& req,
                                 v1::ReleaseBufferResponse* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  // The mapping (and its fd, through which the software device moves peer
  // data) must outlive every registration, LAM and warm pin made on it, not
  // just the buffer's record: a closed fd number may be reused at once.
  DetachedBuffer detached;
  {
    absl::MutexLock lock(&session->mu);
    MRD_RETURN_IF_ERROR(DetachBufferLocked(*session, req.buffer(), &detached));
  }
  budgets_.ReturnObjects(*session, TenantResource::kBuffers, 1);
  budgets_.ReturnObjects(*session, TenantResource::kLams, detached.lams.size());
  for (const auto& [id, device_mr] : detached.fr_to_reset) {
    ResetFastRegistration(*session, id, device_mr);
  }
  uint32_t invalidated = 0;
  for (uint64_t entry : detached.entries) {
    absl::StatusOr<cache::CachedRegistration> reg = cache_.Invalidate(entry);
    if (reg.ok()) {
      DeregisterCached(*session, *reg);
      ++invalidated;
    }
  }
  for (const LamRecord& lam : detached.lams) {
    absl::Status s = device_->ReleaseLam(lam.device_lam);
    if (!s.ok()) {
      LogWarning("release buffer: LAM ", lam.id, ": ", s.ToString());
      KeepUntilPdGone(*session, lam.file);  // still pinned: keep it mapped
    }
    budgets_.UnreservePinned(*session, lam.pinned_bytes);
  }
  // The buffer is out of the session: no warm pin of it can be kept any more.
  ReleaseWarm(warm_.DropBuffer(session->id(), req.buffer()));
  out->set_invalidated_registrations(invalidated);
  out->set_released_lams(static_cast<uint32_t>(detached.lams.size()));
  return absl::OkStatus();
}

// --- pinned-byte accounting -----------------------------------------------

uint64_t Core::PageRound(uint64_t address, uint64_t length) const {
  uint64_t first = address / page_size_;
  uint64_t last = (address + length - 1) / page_size_;
  return (last - first + 1) * page_size_;
}

absl::Status Core::ReservePinned(Session& session, uint64_t bytes) {
  for (;;) {
    Budgets::PinLimit hit;
    uint64_t over;
    absl::Status status =
        budgets_.TryReservePinned(session, bytes, &hit, &over);
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

absl::Status Core::SessionAwareError(Session& session, absl::Status status,
                                     absl::string_view call) {
  absl::MutexLock lock(&session.mu);
  // The session ended while the device worked: its PD is gone, and the
  // device's "unknown PD" would only leak an internal id.
  if (session.closing) {
    return NotConnected(absl::StrCat("the session ended during ", call));
  }
  return status;
}

// --- MR objects
// ---------------------------------------------------------------

absl::Status Core::CreateMr(const v1::CreateMrRequest& req, v1::MrInfo* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  MrObject mr;
  device::PdId pd;
  {
    absl::MutexLock lock(&session->mu);
    if (session->mrs.size() >= options_.max_session_mrs) {
      return SeedError(STATUS_INSUFFICIENT_RESOURCES, "LIMIT_SESSION_MRS",
                       absl::StrCat("the session holds its maximum of ",
                                    options_.max_session_mrs, " MR objects"));
    }
    MRD_RETURN_IF_ERROR(budgets_.TakeObject(*session, TenantResource::kMrs));
    pd = session->pd;
  }
  absl::Cleanup give_back = [&] {
    budgets_.ReturnObjects(*session, TenantResource::kMrs, 1);
  };
  mr.id = next_handle_.fetch_add(1);
  mr.fast_register = req.fast_register();
  mr.allow_remote = req.allow_remote_access();
  if (mr.fast_register) {
    absl::StatusOr<device::MrKeys> keys = device_->AllocateFastRegisterMr(
        pd, mr.allow_remote, device_->Attributes().max_page_list_length);
    if (!keys.ok())
      return SessionAwareError(*session, keys.status(), "CreateMr");
    mr.device_mr = keys->mr;
    mr.lkey = keys->lkey;
    mr.rkey = keys->rkey;
  }
  absl::MutexLock lock(&session->mu);
  if (session->closing) {
    session->mu.Unlock();
    if (mr.device_mr != 0) (void)device_->FreeFastRegisterMr(mr.device_mr);
    session->mu.Lock();
    return NotConnected("the session is closing");
  }
  out->set_mr(mr.id);
  out->set_fast_register(mr.fast_register);
  out->set_allow_remote_access(mr.allow_remote);
  out->set_state("free");
  out->set_lkey(mr.lkey);
  session->mrs.emplace(mr.id, std::move(mr));
  std::move(give_back).Cancel();
  return absl::OkStatus();
}

absl::Status Core::CloseMr(const v1::CloseMrRequest& req) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  MrObject mr;
  {
    absl::MutexLock lock(&session->mu);
    auto it = session->mrs.find(req.mr());
    if (it == session->mrs.end()) return UnknownHandle("mr", req.mr());
    mr = std::move(it->second);
    session->mrs.erase(it);
    budgets_.ReturnObjects(*session, TenantResource::kMrs, 1);
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
    return device_->FreeFastRegisterMr(mr.device_mr);
  }
  if (mr.registration != 0) {
    MRD_RETURN_IF_ERROR(DropReference(session, mr.registration).status());
  }
  return absl::OkStatus();
}

// --- registration
// -------------------------------------------------------------

namespace {

// What a warm pin keeps alive besides its pages: the mapping of the buffer
// it was made on, and a way back to its session for the accounting.
struct WarmOwner {
  std::weak_ptr<Session> session;
  std::shared_ptr<fd_socket::MappedFile> file;
};

cache::WarmKey WarmKeyOf(const cache::CacheKey& key) {
  return cache::WarmKey{key.session,    key.buffer, key.file_device,
                        key.file_inode, key.offset, key.length};
}

}  // namespace

std::optional<cache::WarmPin> Core::MakeWarmPin(
    const std::shared_ptr<Session>& session, const cache::CacheKey& key,
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
  pin.key = WarmKeyOf(key);
  pin.device_lam = lam->lam;
  pin.pinned_bytes = pinned_bytes;
  pin.owner = std::make_shared<WarmOwner>(WarmOwner{session, std::move(file)});
  return pin;
}

void Core::KeepWarm(const std::shared_ptr<Session>& session,
                    cache::WarmPin pin) {
  std::vector<cache::WarmPin> release;
  {
    // Under the session's lock, so that ReleaseBuffer and TearDown (which
    // drop warm pins after taking the buffer out / setting `closing` under
    // this lock) cannot miss a pin put here.
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

void Core::KeepUntilPdGone(Session& session,
                           std::shared_ptr<const void> memory) {
  if (memory == nullptr) return;
  absl::MutexLock lock(&session.mu);
  // Once the PD is gone nothing of it points into the memory any more.
  if (session.pd_gone) return;
  session.memory_until_pd_gone.push_back(std::move(memory));
}

void Core::ReleaseWarm(std::vector<cache::WarmPin> pins) {
  for (cache::WarmPin& pin : pins) {
    absl::Status s = device_->ReleaseLam(pin.device_lam);
    auto* owner = static_cast<WarmOwner*>(pin.owner.get());
    std::shared_ptr<Session> session =
        owner == nullptr ? nullptr : owner->session.lock();
    // Not released (NOT_FOUND: the PD is being torn down and unpins the LAM
    // itself; anything else: it stays pinned until the PD goes): the pages
    // must stay mapped until then.
    if (!s.ok() && session != nullptr) KeepUntilPdGone(*session, pin.owner);
    if (!s.ok() && s.code() != absl::StatusCode::kNotFound) {
      // Its pages stay pinned until the PD goes at the session's end: so
      // do its bytes in the books (the session's end settles them).
      LogWarning("release warm pin (LAM ", pin.device_lam, "): ", s.ToString(),
                 "; its pages stay accounted until the session ends");
      continue;
    }
    if (session != nullptr)
      budgets_.UnreservePinned(*session, pin.pinned_bytes);
    // A session that is gone settled its whole reservation when it ended.
  }
}

bool Core::EvictWarmForDevice() {
  std::optional<cache::WarmPin> victim = warm_.EvictOldest(std::nullopt);
  if (!victim.has_value()) return false;
  std::vector<cache::WarmPin> victims;
  victims.push_back(std::move(*victim));
  ReleaseWarm(std::move(victims));
  return true;
}

absl::StatusOr<uint32_t> Core::DropReference(
    const std::shared_ptr<Session>& session, uint64_t entry) {
  MRD_ASSIGN_OR_RETURN(cache::ReleaseResult result, cache_.Release(entry));
  if (result.released.has_value()) {
    const cache::CachedRegistration& reg = *result.released;
    // The warm pin takes the pages before the MR lets go of them, so that
    // they are never unpinned in between; the key dies either way.
    std::optional<cache::WarmPin> warm =
        MakeWarmPin(session, result.key, reg.pinned_bytes);
    absl::Status s = device_->DeregisterMr(reg.device_mr);
    if (!s.ok() && s.code() != absl::StatusCode::kNotFound) {
      if (warm.has_value()) {
        // The MR still holds the reservation; only the LAM goes.
        if (!device_->ReleaseLam(warm->device_lam).ok()) {
          KeepUntilPdGone(*session, warm->owner);
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
    if (!s.ok()) KeepUntilPdGone(*session, reg.memory);
    budgets_.UnreserveRegistration(*session);
    if (warm.has_value()) {
      KeepWarm(session, std::move(*warm));  // the reservation moves to it
    } else {
      budgets_.UnreservePinned(*session, reg.pinned_bytes);
    }
  }
  return result.references;
}

void Core::DeregisterCached(Session& session,
                            const cache::CachedRegistration& reg) {
  absl::Status s = device_->DeregisterMr(reg.device_mr);
  // Not deregistered (NOT_FOUND: the PD is being torn down): the pages stay
  // pinned until the PD goes, so the mapping stays too.
  if (!s.ok()) KeepUntilPdGone(session, reg.memory);
  if (!s.ok() && s.code() != absl::StatusCode::kNotFound) {
    LogWarning("deregister device MR ", reg.device_mr, ": ", s.ToString());
  }
  budgets_.UnreserveRegistration(session);
  budgets_.UnreservePinned(session, reg.pinned_bytes);
}

absl::Status Core::CheckRegisterRequest(const v1::RegisterMrRequest& req,
                                        uint32_t* access) const {
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

bool Core::ReplayLocked(Session& session, const v1::RegisterMrRequest& req,
                        v1::RegisterMrResponse* out) {
  if (req.request_id().empty()) return false;
  auto seen = session.request_ids.find(req.request_id());
  if (seen == session.request_ids.end()) return false;
  auto rec = session.registrations.find(seen->second.registration());
  if (rec == session.registrations.end()) {
    session.request_ids.erase(seen);  // released since: register anew
    return false;
  }
  *out = seen->second;
  out->set_references(cache_.References(rec->first));
  return true;
}

absl::Status Core::CheckTargetsLocked(Session& session,
                                      const v1::RegisterMrRequest& req,
                                      uint32_t access, RegistrationPlan* plan) {
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
  plan->pd = session.pd;
  plan->key.base_address = b->second.address + req.offset();
  return absl::OkStatus();
}

absl::Status Core::PlanRegistration(Session& session,
                                    const v1::RegisterMrRequest& req,
                                    uint32_t access, RegistrationPlan* plan) {
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
  key.session = session.id();
  key.file_device = plan->file->device();
  key.file_inode = plan->file->inode();
  key.offset = req.offset();
  key.length = req.length();
  key.access = access;
  key.buffer = req.buffer();
  plan->pin_bytes = PageRound(
      reinterpret_cast<uintptr_t>(plan->span.host_address), plan->span.length);
  return absl::OkStatus();
}

absl::StatusOr<cache::CachedRegistration> Core::RegisterOnDevice(
    const std::shared_ptr<Session>& session, const RegistrationPlan& plan) {
  MRD_RETURN_IF_ERROR(budgets_.ReserveRegistration(*session));
  // A warm pin of exactly these pages: its reservation becomes this
  // registration's, and the device pins nothing anew.
  std::optional<cache::WarmPin> warm = warm_.Take(WarmKeyOf(plan.key));
  if (!warm.has_value()) {
    if (absl::Status s = ReservePinned(*session, plan.pin_bytes); !s.ok()) {
      budgets_.UnreserveRegistration(*session);
      return s;
    }
  }
  absl::StatusOr<device::MrKeys> keys;
  do {
    keys = device_->RegisterMr(plan.pd, plan.span, plan.key.base_address,
                               plan.key.access);
  } while (!keys.ok() &&
           keys.status().code() == absl::StatusCode::kResourceExhausted &&
           EvictWarmForDevice());
  if (!keys.ok()) {
    if (warm.has_value()) {
      std::vector<cache::WarmPin> pins;
      pins.push_back(std::move(*warm));
      ReleaseWarm(std::move(pins));  // and its reservation
    } else {
      budgets_.UnreservePinned(*session, plan.pin_bytes);
    }
    budgets_.UnreserveRegistration(*session);
    return keys.status();
  }
  if (warm.has_value()) ReleaseWarmAfterHit(session, std::move(*warm));
  cache::CachedRegistration reg;
  reg.device_mr = keys->mr;
  reg.lkey = keys->lkey;
  reg.rkey = keys->rkey;
  reg.buffer = plan.key.buffer;
  reg.pinned_bytes = plan.pin_bytes;
  reg.memory = plan.file;  // unmapped only after the MR is deregistered
  return reg;
}

void Core::ReleaseWarmAfterHit(const std::shared_ptr<Session>& session,
                               cache::WarmPin warm) {
  absl::Status s = device_->ReleaseLam(warm.device_lam);
  if (s.code() == absl::StatusCode::kNotFound) {
    // The PD is being torn down and unpins the LAM itself.
    KeepUntilPdGone(*session, warm.owner);
  } else if (!s.ok()) {
    // The registration stands; the LAM still pins its pages, so it stays a
    // warm pin with its bytes accounted (over the limit if need be: they
    // are pinned) and is released again on eviction or at the session's
    // end.
    LogWarning("release warm pin (LAM ", warm.device_lam,
               ") after a warm hit: ", s.ToString(),
               "; keeping it as a warm pin");
    budgets_.ForceReservePinned(*session, warm.pinned_bytes);
    KeepWarm(session, std::move(warm));
  }
}

absl::Status Core::CommitRegistrationLocked(
    Session& session, const v1::RegisterMrRequest& req,
    const RegistrationPlan& plan, const cache::AcquireResult& acquired,
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
  rec.entry = acquired.entry;
  rec.buffer = req.buffer();
  rec.offset = req.offset();
  rec.length = req.length();
  rec.flags = req.flags() != 0 ? req.flags() : FlagsFromAccess(plan.key.access);
  rec.base_address = base;
  rec.lkey = acquired.registration.lkey;
  rec.rkey = acquired.registration.rkey;
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
  if (!req.request_id().empty()) {
    session.request_ids[req.request_id()] = *out;
    session.request_id_order.push_back(req.request_id());
    if (session.request_id_order.size() > options_.request_id_memory) {
      session.request_ids.erase(session.request_id_order.front());
      session.request_id_order.pop_front();
    }
  }
  return absl::OkStatus();
}

absl::Status Core::RegisterMr(const v1::RegisterMrRequest& req,
                              v1::RegisterMrResponse* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  uint32_t access = 0;
  MRD_RETURN_IF_ERROR(CheckRegisterRequest(req, &access));
  RegistrationPlan plan;
  {
    absl::MutexLock lock(&session->mu);
    // A retried request with the same id gets the first answer (no second
    // reference).
    if (ReplayLocked(*session, req, out)) return absl::OkStatus();
    MRD_RETURN_IF_ERROR(CheckTargetsLocked(*session, req, access, &plan));
  }
  MRD_RETURN_IF_ERROR(PlanRegistration(*session, req, access, &plan));
  absl::StatusOr<cache::AcquireResult> acquired =
      cache_.Acquire(plan.key, [&] { return RegisterOnDevice(session, plan); });
  if (!acquired.ok()) {
    absl::MutexLock lock(&session->mu);
    if (session->closing) {
      return NotConnected("the session closed during the registration");
    }
    return acquired.status();
  }
  // Commit to the session, or undo: either the registration exists and is
  // owned by the session, or nothing of it does.
  absl::Status commit;
  {
    absl::MutexLock lock(&session->mu);
    commit = CommitRegistrationLocked(*session, req, plan, *acquired, out);
  }
  if (!commit.ok()) (void)DropReference(session, acquired->entry);
  return commit;
}

void Core::EraseIfUnreferencedLocked(
    Session& session, std::map<uint64_t, RegistrationRecord>::iterator r,
    TakenReference* taken) {
  if (r->second.implicit_refs + r->second.mr_refs != 0) return;
  taken->record = r->second;
  taken->erased = true;
  session.registrations.erase(r);
}

absl::Status Core::TakeReferenceLocked(Session& session,
                                       const v1::DeregisterMrRequest& req,
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

void Core::PutReferenceBack(Session& session, const TakenReference& taken) {
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

absl::Status Core::DeregisterMr(const v1::DeregisterMrRequest& req,
                                v1::DeregisterMrResponse* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
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

// --- LAMs
// ---------------------------------------------------------------------

absl::Status Core::BuildLam(const v1::BuildLamRequest& req,
                            v1::BuildLamResponse* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  std::shared_ptr<fd_socket::MappedFile> file;
  device::PdId pd;
  {
    absl::MutexLock lock(&session->mu);
    auto b = session->buffers.find(req.buffer());
    if (b == session->buffers.end())
      return UnknownHandle("buffer", req.buffer());
    if (session->lams.size() >= options_.max_session_lams) {
      return SeedError(STATUS_INSUFFICIENT_RESOURCES, "LIMIT_SESSION_LAMS",
                       absl::StrCat("the session holds its maximum of ",
                                    options_.max_session_lams, " LAMs"));
    }
    MRD_RETURN_IF_ERROR(budgets_.TakeObject(*session, TenantResource::kLams));
    file = b->second.file;
    pd = session->pd;
  }
  absl::Cleanup give_back = [&] {
    budgets_.ReturnObjects(*session, TenantResource::kLams, 1);
  };
  MRD_ASSIGN_OR_RETURN(device::MemorySpan span,
                       file->Span(req.offset(), req.length()));
  const uint64_t address = reinterpret_cast<uintptr_t>(span.host_address);
  const uint64_t pin_bytes = PageRound(address, span.length);
  const uint64_t page_count = pin_bytes / page_size_;
  const uint64_t lam_size = kLamHeaderSize + kLamEntrySize * page_count;
  if (req.lam_capacity() != 0 && req.lam_capacity() < lam_size) {
    return SeedError(STATUS_BUFFER_TOO_SMALL, "LAM_SPACE_TOO_SMALL",
                     absl::StrCat("lam_capacity ", req.lam_capacity(),
                                  " is too small: ", page_count, " pages need ",
                                  lam_size, " bytes"),
                     lam_size);
  }
  MRD_RETURN_IF_ERROR(ReservePinned(*session, pin_bytes));
  absl::StatusOr<device::LogicalMapping> mapping;
  do {
    mapping = device_->BuildLam(pd, span);
  } while (!mapping.ok() &&
           mapping.status().code() == absl::StatusCode::kResourceExhausted &&
           EvictWarmForDevice());
  if (!mapping.ok()) {
    budgets_.UnreservePinned(*session, pin_bytes);
    return SessionAwareError(*session, mapping.status(), "BuildLam");
  }
  LamRecord lam;
  lam.id = next_handle_.fetch_add(1);
  lam.device_lam = mapping->lam;
  lam.buffer = req.buffer();
  lam.offset = req.offset();
  lam.length = req.length();
  lam.pages = mapping->pages;
  lam.fbo = mapping->fbo;
  lam.pinned_bytes = pin_bytes;
  lam.file = file;
  {
    absl::MutexLock lock(&session->mu);
    if (!session->closing && session->buffers.contains(req.buffer())) {
      out->set_lam(lam.id);
      for (uint64_t page : lam.pages) {
        out->add_pages(page);
        session->page_to_lam[page] = lam.id;
      }
      out->set_fbo(lam.fbo);
      out->set_length(lam.length);
      out->set_lam_size(static_cast<uint32_t>(lam_size));
      out->set_privileged_token(mapping->privileged_key);
      session->lams.emplace(lam.id, std::move(lam));
      std::move(give_back).Cancel();
      return absl::OkStatus();
    }
  }
  // The session or the buffer went away meanwhile (L7: leave nothing).
  if (!device_->ReleaseLam(lam.device_lam).ok()) {
    KeepUntilPdGone(*session, lam.file);
  }
  budgets_.UnreservePinned(*session, pin_bytes);
  return NotConnected("the session or its buffer went away during BuildLam");
}

absl::Status Core::ReleaseLam(const v1::ReleaseLamRequest& req) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  device::LamId device_lam;
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
    // Held until the device has unpinned: a ReleaseBuffer racing this call
    // must not unmap the pages first.
    file = l->second.file;
  }
  MRD_RETURN_IF_ERROR(device_->ReleaseLam(device_lam));
  uint64_t pinned = 0;
  {
    absl::MutexLock lock(&session->mu);
    auto l = session->lams.find(req.lam());
    if (l != session->lams.end()) {
      pinned = l->second.pinned_bytes;
      for (uint64_t page : l->second.pages) session->page_to_lam.erase(page);
      session->lams.erase(l);
      budgets_.ReturnObjects(*session, TenantResource::kLams, 1);
    }
  }
  budgets_.UnreservePinned(*session, pinned);
  return absl::OkStatus();
}

// --- fast registration ------------------------------------------------------

absl::Status Core::FastRegister(const v1::FastRegisterRequest& req,
                                v1::FastRegisterResponse* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  MRD_ASSIGN_OR_RETURN(uint32_t access, FastRegisterAccess(req.flags()));
  MRD_RETURN_IF_ERROR(device::ValidatePageArray(
      page_size_, device_->Attributes().max_page_list_length,
      absl::MakeConstSpan(req.pages().data(), req.pages().size()), req.fbo(),
      req.length(), req.base_address()));

  device::FastRegisterWork work;
  {
    absl::MutexLock lock(&session->mu);
    auto m = session->mrs.find(req.mr());
    if (m == session->mrs.end()) return UnknownHandle("mr", req.mr());
    MrObject& mr = m->second;
    if (!mr.fast_register) {
      return SeedError(STATUS_INVALID_PARAMETER, "MR_NOT_FAST_REGISTER",
                       absl::StrCat("MR ", req.mr(),
                                    " was created with fast_register=false"));
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
      auto p = session->page_to_lam.find(page);
      if (p == session->page_to_lam.end()) {
        return SeedError(STATUS_INVALID_PARAMETER, "UNKNOWN_LOGICAL_ADDRESS",
                         absl::StrCat("page 0x", absl::Hex(page),
                                      " is not a logical address of any LAM "
                                      "of this session"));
      }
      if (std::find(pending.lams.begin(), pending.lams.end(), p->second) ==
          pending.lams.end()) {
        pending.lams.push_back(p->second);
      }
      if ((access & (device::kAccessLocalWrite | device::kAccessRemoteWrite)) &&
          !session->lams[p->second].file->writable()) {
        return SeedError(STATUS_INVALID_PARAMETER, "BUFFER_READ_ONLY",
                         absl::StrCat("page 0x", absl::Hex(page),
                                      " belongs to LAM ", p->second,
                                      " of a read-only buffer; write access "
                                      "cannot be granted on it"));
      }
    }
    pending.silent = (req.flags() & device::kWorkSilentSuccess) != 0;
    mr.pending.push_back(std::move(pending));
    work.mr = mr.device_mr;
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
      device_->PostFastRegister(req.connection(), work);
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

absl::Status Core::InvalidateMr(const v1::InvalidateMrRequest& req,
                                v1::InvalidateMrResponse* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  constexpr uint32_t kKnown =
      device::kWorkSilentSuccess | device::kWorkReadFence | device::kWorkDefer;
  if (req.flags() & ~kKnown) {
    return SeedError(STATUS_INVALID_PARAMETER, "UNKNOWN_FLAGS",
                     absl::StrCat("flags 0x", absl::Hex(req.flags()),
                                  " has bits InvalidateMr does not know: 0x",
                                  absl::Hex(req.flags() & ~kKnown)));
  }
  device::InvalidateWork work;
  {
    absl::MutexLock lock(&session->mu);
    auto m = session->mrs.find(req.mr());
    if (m == session->mrs.end()) return UnknownHandle("mr", req.mr());
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
      device_->PostInvalidate(req.connection(), work);
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

absl::Status Core::CreatePeerTicket(const v1::CreatePeerTicketRequest& req,
                                    v1::PeerTicket* out) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       FindSession(req.session()));
  device::PdId pd;
  {
    absl::MutexLock lock(&session->mu);
    if (!session->peer_ticket.empty()) {
      out->set_ticket(session->peer_ticket);
      out->set_peer_address(device_->Attributes().peer_address);
      return absl::OkStatus();
    }
    pd = session->pd;
  }
  absl::StatusOr<std::string> ticket = device_->CreatePeerTicket(pd);
  if (!ticket.ok()) {
    return SessionAwareError(*session, ticket.status(), "CreatePeerTicket");
  }
  absl::MutexLock lock(&session->mu);
  if (session->peer_ticket.empty()) session->peer_ticket = *ticket;
  out->set_ticket(session->peer_ticket);
  out->set_peer_address(device_->Attributes().peer_address);
  return absl::OkStatus();
}

// --- inspection
// ----------------------------------------------------------------

absl::Status Core::GetDeviceInfo(v1::DeviceInfo* out) const {
  const device::DeviceAttributes& a = device_->Attributes();
  device::DeviceHealth health = device_->Health();
  out->set_name(a.name);
  out->set_kind(a.kind);
  out->set_page_size(a.page_size);
  out->set_max_mr_size(a.max_mr_size);
  out->set_max_page_list_length(a.max_page_list_length);
  out->set_adapter_flags(a.adapter_flags);
  out->set_peer_address(a.peer_address);
  out->set_healthy(health.healthy);
  out->set_status_message(health.message);
  out->set_pinned_bytes(device_->PinnedBytes());
  // Always answered: this is where a lost or unhealthy device is reported
  // (healthy = false, status_message says why); requests that need the
  // device fail with UNAVAILABLE instead.
  return absl::OkStatus();
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
    info->set_buffer(r.buffer);
    info->set_offset(r.offset);
    info->set_length(r.length);
    info->set_flags(r.flags);
    info->set_lkey(r.lkey);
    info->set_rkey(r.rkey);
    info->set_base_address(r.base_address);
    info->set_references(r.implicit_refs + r.mr_refs);
  }
  for (const auto& [id, l] : session->lams) {
    v1::LamInfo* info = out->add_lams();
    info->set_lam(id);
    info->set_buffer(l.buffer);
    info->set_offset(l.offset);
    info->set_length(l.length);
    info->set_page_count(static_cast<uint32_t>(l.pages.size()));
    info->set_fbo(l.fbo);
  }
  for (const auto& [id, m] : session->mrs) {
    v1::MrInfo* info = out->add_mrs();
    info->set_mr(id);
    info->set_fast_register(m.fast_register);
    info->set_allow_remote_access(m.allow_remote);
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
      auto r = session->registrations.find(m.registration);
      if (r != session->registrations.end()) {
        info->set_lkey(r->second.lkey);
        info->set_rkey(r->second.rkey);
        info->set_base_address(r->second.base_address);
        info->set_length(r->second.length);
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

absl::StatusOr<std::shared_ptr<Session>> Core::SubscribeCompletions(
    const std::string& token, std::function<void()> notify) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(token));
  absl::MutexLock lock(&session->mu);
  if (session->subscribed) {
    return MrdError(absl::StatusCode::kFailedPrecondition,
                    "STREAM_ALREADY_OPEN",
                    "this session already has an open completion stream");
  }
  session->subscribed = true;
  session->notify = std::move(notify);
  return session;
}

void Core::UnsubscribeCompletions(const std::shared_ptr<Session>& session) {
  absl::MutexLock lock(&session->mu);
  session->subscribed = false;
  session->notify = nullptr;
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
    stats.completions_dropped_total += s->completions_dropped;
  }
  stats.device_pinned_bytes = device_->PinnedBytes();
  stats.cache = cache_.Stats();
  stats.warm = warm_.Stats();
  return stats;
}

}  // namespace mrd::core
