#include "tests/unit/core/core_test_util.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "mrd/status.h"
#include "server/common/log.h"

namespace mrd::core_test {

::testing::AssertionResult IsSeedErrorWithSize(const absl::Status& status,
                                               absl::StatusCode code,
                                               ::mrd::SeedStatus seed,
                                               absl::string_view reason,
                                               uint64_t required_size) {
  const ::mrd::ErrorDetail d = GetErrorDetail(status);
  if (status.code() == code && d.seed_status() == seed &&
      d.reason() == reason && d.required_size() == required_size) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "expected " << absl::StatusCodeToString(code) << " "
         << ::mrd::SeedStatusName(seed) << " " << reason << " required_size "
         << required_size << ", got " << status.ToString() << " ["
         << ::mrd::SeedStatusName(d.seed_status()) << " \"" << d.reason()
         << "\" required_size " << d.required_size() << "]";
}

::testing::AssertionResult IsSeedError(const absl::Status& status,
                                       absl::StatusCode code,
                                       ::mrd::SeedStatus seed,
                                       absl::string_view reason) {
  return IsSeedErrorWithSize(status, code, seed, reason,
                             GetErrorDetail(status).required_size());
}

::testing::AssertionResult IsMrdError(const absl::Status& status,
                                      absl::StatusCode code,
                                      absl::string_view reason) {
  return IsSeedError(status, code, ::mrd::SEED_STATUS_UNSPECIFIED, reason);
}

::testing::AssertionResult IsOk(const absl::Status& status) {
  if (status.ok()) return ::testing::AssertionSuccess();
  const ::mrd::ErrorDetail d = GetErrorDetail(status);
  return ::testing::AssertionFailure()
         << status.ToString() << " [" << ::mrd::SeedStatusName(d.seed_status())
         << " \"" << d.reason() << "\"]";
}

UniqueFd MakeSealedMemfd(uint64_t size) {
  UniqueFd fd(::memfd_create("mrd-core-test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) {
    ADD_FAILURE() << "memfd_create: " << std::strerror(errno);
    return fd;
  }
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) {
    ADD_FAILURE() << "ftruncate: " << std::strerror(errno);
    return UniqueFd();
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
    ADD_FAILURE() << "F_ADD_SEALS: " << std::strerror(errno);
    return UniqueFd();
  }
  return fd;
}

CoreTest::CoreTest() : page_(static_cast<uint64_t>(::sysconf(_SC_PAGESIZE))) {
  SetMinLogLevel(LogLevel::kWarning);  // session open/close lines are noise
}

void CoreTest::SetUp() {
  Configure(options_, device_options_);
  fake_ = std::make_unique<fake::FakeDevice>(device_options_);
  ASSERT_OK(fake_->Start());
  core_ = std::make_unique<core::Core>(fake_.get(), &clock_, options_);
}

void CoreTest::TearDown() {
  if (core_ == nullptr) return;
  for (auto& [token, session] : streams_)
    core_->UnsubscribeCompletions(session);
  streams_.clear();
  core_->Shutdown();
  if (!skip_teardown_checks_) {
    EXPECT_EQ(fake_->PinnedBytes(), 0u) << "pinned bytes left on the device";
    EXPECT_EQ(fake_->LiveMrCount(), 0u) << "MRs left on the device";
    EXPECT_EQ(fake_->LiveLamCount(), 0u) << "LAMs left on the device";
    EXPECT_EQ(fake_->LivePdCount(), 0u) << "PDs left on the device";
    EXPECT_EQ(fake_->LiveConnectionCount(), 0u);
    const core::CoreStats stats = core_->Stats();
    EXPECT_EQ(stats.accounted_pinned_bytes, 0u) << "core still accounts bytes";
    EXPECT_EQ(stats.sessions, 0u);
    EXPECT_EQ(stats.cache.entries, 0u) << "cache entries left";
  }
  core_.reset();
  fake_.reset();
}

std::string CoreTest::Connect(uint32_t uid, int pid) {
  fd_socket::PeerCredentials creds;
  creds.uid = uid;
  creds.pid = pid;
  creds.gid = uid;
  absl::StatusOr<std::string> token = core_->OnConnect(creds);
  EXPECT_TRUE(token.ok()) << token.status();
  return token.ok() ? *token : std::string();
}

std::string CoreTest::OpenLease(uint32_t ttl_seconds) {
  v1::OpenLeaseSessionRequest req;
  req.set_ttl_seconds(ttl_seconds);
  v1::SessionInfo info;
  absl::Status s = core_->OpenLeaseSession(req, &info);
  EXPECT_TRUE(s.ok()) << s;
  return info.session();
}

absl::StatusOr<v1::BufferInfo> CoreTest::TryImport(const std::string& session,
                                                   uint64_t size,
                                                   bool writable) {
  UniqueFd fd = MakeSealedMemfd(size);
  v1::ImportMemfd request;
  request.set_writable(writable);
  request.set_expected_size(size);
  return core_->OnImport(session, std::move(fd), request);
}

v1::BufferInfo CoreTest::Import(const std::string& session, uint64_t size,
                                bool writable) {
  absl::StatusOr<v1::BufferInfo> info = TryImport(session, size, writable);
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? *info : v1::BufferInfo();
}

v1::BufferInfo CoreTest::ImportDup(const std::string& session, int fd,
                                   bool writable) {
  v1::ImportMemfd request;
  request.set_writable(writable);
  absl::StatusOr<v1::BufferInfo> info = core_->OnImport(
      session, UniqueFd(::fcntl(fd, F_DUPFD_CLOEXEC, 0)), request);
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? *info : v1::BufferInfo();
}

v1::RegisterMrRequest CoreTest::RegisterRequest(const std::string& session,
                                                uint64_t buffer,
                                                uint64_t offset,
                                                uint64_t length,
                                                uint32_t flags) {
  v1::RegisterMrRequest req;
  req.set_session(session);
  req.set_buffer(buffer);
  req.set_offset(offset);
  req.set_length(length);
  req.set_flags(flags);
  return req;
}

absl::StatusOr<SessionWithBuffer> OpenSessionWithBuffer(core::Core& core,
                                                        uint64_t size) {
  SessionWithBuffer out;
  MRD_ASSIGN_OR_RETURN(
      out.session,
      core.OnConnect({getpid(), getuid(), getgid(), std::nullopt, ""}));
  out.memfd = MakeSealedMemfd(size);
  if (!out.memfd.valid()) return absl::InternalError("memfd");
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  out.pattern.resize(size);
  for (size_t i = 0; i < size; ++i) {
    out.pattern[i] = static_cast<char>('a' + (i * 7 + i / page) % 26);
  }
  if (pwrite(out.memfd.get(), out.pattern.data(), size, 0) !=
      static_cast<ssize_t>(size)) {
    return absl::InternalError("pwrite");
  }
  v1::ImportMemfd import;
  import.set_writable(true);
  MRD_ASSIGN_OR_RETURN(
      out.buffer,
      core.OnImport(out.session, UniqueFd(dup(out.memfd.get())), import));
  return out;
}

absl::StatusOr<v1::RegisterMrResponse> RegisterOn(
    core::Core& core, const v1::RegisterMrRequest& req) {
  v1::RegisterMrResponse out;
  absl::Status s = core.RegisterMr(req, &out);
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<uint32_t> DeregisterOn(core::Core& core,
                                      const std::string& session,
                                      uint64_t registration) {
  v1::DeregisterMrRequest req;
  req.set_session(session);
  req.set_registration(registration);
  v1::DeregisterMrResponse out;
  absl::Status s = core.DeregisterMr(req, &out);
  if (!s.ok()) return s;
  return out.references();
}

absl::StatusOr<v1::RegisterMrResponse> CoreTest::Register(
    const v1::RegisterMrRequest& req) {
  return RegisterOn(*core_, req);
}

absl::StatusOr<v1::RegisterMrResponse> CoreTest::Register(
    const std::string& session, uint64_t buffer, uint64_t offset,
    uint64_t length, uint32_t flags) {
  return Register(RegisterRequest(session, buffer, offset, length, flags));
}

absl::StatusOr<uint32_t> CoreTest::Deregister(const std::string& session,
                                              uint64_t registration) {
  return DeregisterOn(*core_, session, registration);
}

absl::StatusOr<uint32_t> CoreTest::DeregisterByMr(const std::string& session,
                                                  uint64_t mr) {
  v1::DeregisterMrRequest req;
  req.set_session(session);
  req.set_mr(mr);
  v1::DeregisterMrResponse out;
  absl::Status s = core_->DeregisterMr(req, &out);
  if (!s.ok()) return s;
  return out.references();
}

absl::StatusOr<v1::BuildLamResponse> CoreTest::BuildLam(
    const std::string& session, uint64_t buffer, uint64_t offset,
    uint64_t length, uint32_t lam_capacity) {
  v1::BuildLamRequest req;
  req.set_session(session);
  req.set_buffer(buffer);
  req.set_offset(offset);
  req.set_length(length);
  req.set_lam_capacity(lam_capacity);
  v1::BuildLamResponse out;
  absl::Status s = core_->BuildLam(req, &out);
  if (!s.ok()) return s;
  return out;
}

absl::Status CoreTest::ReleaseLam(const std::string& session, uint64_t lam) {
  v1::ReleaseLamRequest req;
  req.set_session(session);
  req.set_lam(lam);
  return core_->ReleaseLam(req);
}

absl::StatusOr<v1::MrInfo> CoreTest::CreateMr(const std::string& session,
                                              bool fast_register,
                                              bool allow_remote) {
  v1::CreateMrRequest req;
  req.set_session(session);
  req.set_fast_register(fast_register);
  req.set_allow_remote_access(allow_remote);
  v1::MrInfo out;
  absl::Status s = core_->CreateMr(req, &out);
  if (!s.ok()) return s;
  return out;
}

absl::Status CoreTest::CloseMr(const std::string& session, uint64_t mr) {
  v1::CloseMrRequest req;
  req.set_session(session);
  req.set_mr(mr);
  return core_->CloseMr(req);
}

absl::StatusOr<v1::ListRegistrationsResponse> CoreTest::List(
    const std::string& session) {
  v1::ListRegistrationsRequest req;
  req.set_session(session);
  v1::ListRegistrationsResponse out;
  absl::Status s = core_->ListRegistrations(req, &out);
  if (!s.ok()) return s;
  return out;
}

v1::MrInfo CoreTest::MrState(const std::string& session, uint64_t mr) {
  absl::StatusOr<v1::ListRegistrationsResponse> list = List(session);
  EXPECT_TRUE(list.ok()) << list.status();
  if (!list.ok()) return v1::MrInfo();
  for (const v1::MrInfo& info : list->mrs()) {
    if (info.mr() == mr) return info;
  }
  ADD_FAILURE() << "MR " << mr << " not listed";
  return v1::MrInfo();
}

absl::StatusOr<v1::ReleaseBufferResponse> CoreTest::ReleaseBuffer(
    const std::string& session, uint64_t buffer) {
  v1::ReleaseBufferRequest req;
  req.set_session(session);
  req.set_buffer(buffer);
  v1::ReleaseBufferResponse out;
  absl::Status s = core_->ReleaseBuffer(req, &out);
  if (!s.ok()) return s;
  return out;
}

device::ConnectionId CoreTest::ConnectPeer(const std::string& session) {
  v1::CreatePeerTicketRequest req;
  req.set_session(session);
  v1::PeerTicket ticket;
  absl::Status s = core_->CreatePeerTicket(req, &ticket);
  EXPECT_TRUE(s.ok()) << s;
  absl::StatusOr<device::ConnectionId> connection =
      fake_->ConnectPeerWithTicket(ticket.ticket());
  EXPECT_TRUE(connection.ok()) << connection.status();
  return connection.ok() ? *connection : 0;
}

v1::FastRegisterRequest CoreTest::FastRegisterRequest(
    const std::string& session, device::ConnectionId connection, uint64_t mr,
    const v1::BuildLamResponse& lam, uint32_t flags, uint64_t request_context) {
  v1::FastRegisterRequest req;
  req.set_session(session);
  req.set_connection(connection);
  req.set_request_context(request_context);
  req.set_mr(mr);
  *req.mutable_pages() = lam.pages();
  req.set_fbo(lam.fbo());
  req.set_length(lam.length());
  req.set_base_address(16 * page_ + lam.fbo());
  req.set_flags(flags);
  return req;
}

absl::StatusOr<v1::FastRegisterResponse> CoreTest::FastRegister(
    const v1::FastRegisterRequest& req) {
  v1::FastRegisterResponse out;
  absl::Status s = core_->FastRegister(req, &out);
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<v1::InvalidateMrResponse> CoreTest::Invalidate(
    const std::string& session, device::ConnectionId connection, uint64_t mr,
    uint32_t flags, uint64_t request_context) {
  v1::InvalidateMrRequest req;
  req.set_session(session);
  req.set_connection(connection);
  req.set_mr(mr);
  req.set_flags(flags);
  req.set_request_context(request_context);
  v1::InvalidateMrResponse out;
  absl::Status s = core_->InvalidateMr(req, &out);
  if (!s.ok()) return s;
  return out;
}

std::vector<v1::Completion> CoreTest::Drain(const std::string& session) {
  auto it = streams_.find(session);
  if (it == streams_.end()) {
    absl::StatusOr<core::CompletionSubscription> s =
        core_->SubscribeCompletions(session, [] {});
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return {};
    it = streams_.emplace(session, *s).first;
  }
  std::vector<v1::Completion> out;
  while (std::optional<v1::Completion> c = it->second->PopCompletion()) {
    out.push_back(std::move(*c));
  }
  return out;
}

std::vector<v1::Completion> CoreTest::RunWorkAndDrain(
    const std::string& session) {
  fake_->RunPostedWork();
  return Drain(session);
}

void CoreTest::ExpectAccountingMatchesDevice() {
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, fake_->PinnedBytes());
  EXPECT_OK(fake_->CheckLiveMemory());
}

}  // namespace mrd::core_test
