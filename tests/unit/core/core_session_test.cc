// Core sessions: fd sessions (OnConnect/OnImport/OnDisconnect), lease
// sessions on a FakeClock, isolation between sessions (W8: another session's
// handle does not exist), limits, completion streams and shutdown.
#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "server/core/session.h"
#include "tests/unit/core/core_test_util.h"

namespace mrd::core_test {
namespace {

using fake::FakeDevice;

::testing::AssertionResult IsNotConnected(const absl::Status& s) {
  return IsSeedError(s, absl::StatusCode::kFailedPrecondition,
                     ::mrd::WSAENOTCONN, "SESSION_NOT_CONNECTED");
}

using SessionTest = CoreTest;

TEST_F(SessionTest, UnknownSessionTokenIsWsaenotconn) {
  for (const std::string& token :
       {std::string("no-such-session"), std::string()}) {
    EXPECT_TRUE(
        IsNotConnected(Register(token, 1, 0, page_, kMrRemoteRead).status()));
    EXPECT_TRUE(IsNotConnected(BuildLam(token, 1, 0, page_).status()));
    EXPECT_TRUE(IsNotConnected(CreateMr(token, true).status()));
    EXPECT_TRUE(IsNotConnected(List(token).status()));
    EXPECT_TRUE(IsNotConnected(TryImport(token, page_).status()));
    EXPECT_TRUE(IsNotConnected(Deregister(token, 1).status()));
    v1::CloseSessionRequest close;
    close.set_session(token);
    EXPECT_TRUE(IsNotConnected(core_->CloseSession(close)));
  }
  EXPECT_EQ(fake_->LivePdCount(), 0u);
}

TEST_F(SessionTest, FdSessionDescribesItsPeer) {
  std::string token = Connect(/*uid=*/1234, /*pid=*/5678);
  v1::GetSessionRequest get;
  get.set_session(token);
  v1::SessionInfo info;
  ASSERT_OK(core_->GetSession(get, &info));
  EXPECT_EQ(info.session(), token);
  EXPECT_EQ(info.kind(), "fd");
  EXPECT_EQ(info.peer_uid(), 1234u);
  EXPECT_EQ(info.peer_pid(), 5678u);
  // Each session has its own protection domain (W8).
  EXPECT_EQ(fake_->LivePdCount(), 1u);
  Connect();
  EXPECT_EQ(fake_->LivePdCount(), 2u);
  EXPECT_EQ(core_->Stats().fd_sessions, 2u);
}

// W8: a handle of another session is not found, exactly as if it did not
// exist, and using it changes nothing of the owner's.
TEST_F(SessionTest, AnotherSessionsHandlesAreNotFound) {
  std::string alice = Connect();
  std::string bob = Connect();
  v1::BufferInfo buffer = Import(alice, 8 * page_);
  absl::StatusOr<v1::RegisterMrResponse> reg =
      Register(alice, buffer.buffer(), 0, page_, kMrRemoteRead);
  absl::StatusOr<v1::BuildLamResponse> lam =
      BuildLam(alice, buffer.buffer(), 0, page_);
  absl::StatusOr<v1::MrInfo> normal = CreateMr(alice, false);
  absl::StatusOr<v1::MrInfo> fast = CreateMr(alice, true, true);
  ASSERT_TRUE(reg.ok() && lam.ok() && normal.ok() && fast.ok());

  EXPECT_TRUE(IsMrdError(
      Register(bob, buffer.buffer(), 0, page_, kMrRemoteRead).status(),
      absl::StatusCode::kNotFound, "UNKNOWN_BUFFER"));
  EXPECT_TRUE(IsMrdError(BuildLam(bob, buffer.buffer(), 0, page_).status(),
                         absl::StatusCode::kNotFound, "UNKNOWN_BUFFER"));
  EXPECT_TRUE(IsMrdError(ReleaseBuffer(bob, buffer.buffer()).status(),
                         absl::StatusCode::kNotFound, "UNKNOWN_BUFFER"));
  EXPECT_TRUE(IsMrdError(Deregister(bob, reg->registration()).status(),
                         absl::StatusCode::kNotFound, "UNKNOWN_REGISTRATION"));
  EXPECT_TRUE(IsMrdError(ReleaseLam(bob, lam->lam()),
                         absl::StatusCode::kNotFound, "UNKNOWN_LAM"));
  EXPECT_TRUE(IsMrdError(CloseMr(bob, normal->mr()),
                         absl::StatusCode::kNotFound, "UNKNOWN_MR"));
  EXPECT_TRUE(IsMrdError(DeregisterByMr(bob, normal->mr()).status(),
                         absl::StatusCode::kNotFound, "UNKNOWN_MR"));
  // Bob's own buffer with Alice's MR object.
  v1::BufferInfo bobs = Import(bob, 4 * page_);
  v1::RegisterMrRequest req =
      RegisterRequest(bob, bobs.buffer(), 0, page_, kMrRemoteRead);
  req.set_mr(normal->mr());
  EXPECT_TRUE(IsMrdError(Register(req).status(), absl::StatusCode::kNotFound,
                         "UNKNOWN_MR"));
  device::ConnectionId bobs_peer = ConnectPeer(bob);
  v1::FastRegisterRequest fr =
      FastRegisterRequest(bob, bobs_peer, fast->mr(), *lam, kOpRemoteRead, 1);
  EXPECT_TRUE(IsMrdError(FastRegister(fr).status(), absl::StatusCode::kNotFound,
                         "UNKNOWN_MR"));
  EXPECT_TRUE(IsMrdError(Invalidate(bob, bobs_peer, fast->mr(), 0, 1).status(),
                         absl::StatusCode::kNotFound, "UNKNOWN_MR"));

  // Alice's things are untouched.
  EXPECT_TRUE(fake_->IsKeyValid(reg->rkey()));
  EXPECT_EQ(fake_->LiveLamCount(), 1u);
  absl::StatusOr<uint32_t> left = Deregister(alice, reg->registration());
  ASSERT_TRUE(left.ok());
  EXPECT_EQ(*left, 0u);
  EXPECT_OK(ReleaseLam(alice, lam->lam()));
  EXPECT_OK(CloseMr(alice, normal->mr()));
  // Bob's list shows nothing of Alice's.
  absl::StatusOr<v1::ListRegistrationsResponse> list = List(bob);
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->buffers_size(), 1);
  EXPECT_EQ(list->registrations_size(), 0);
  EXPECT_EQ(list->mrs_size(), 0);
}

TEST_F(SessionTest, SameRangeInTwoSessionsIsTwoRegistrations) {
  std::string alice = Connect();
  std::string bob = Connect();
  UniqueFd fd = MakeSealedMemfd(4 * page_);
  v1::BufferInfo a = ImportDup(alice, fd.get());
  v1::BufferInfo b = ImportDup(bob, fd.get());
  v1::RegisterMrRequest req =
      RegisterRequest(alice, a.buffer(), 0, page_, kMrRemoteRead);
  req.set_base_address(0x500000);
  absl::StatusOr<v1::RegisterMrResponse> ra = Register(req);
  req.set_session(bob);
  req.set_buffer(b.buffer());
  absl::StatusOr<v1::RegisterMrResponse> rb = Register(req);
  ASSERT_TRUE(ra.ok() && rb.ok());
  EXPECT_FALSE(rb->cache_hit());
  EXPECT_NE(ra->registration(), rb->registration());
  EXPECT_NE(ra->rkey(), rb->rkey());
}

TEST_F(SessionTest, DisconnectReleasesEverythingButOtherSessionsStay) {
  std::string alice = Connect();
  std::string bob = Connect();
  v1::BufferInfo abuf = Import(alice, 8 * page_);
  absl::StatusOr<v1::RegisterMrResponse> areg =
      Register(alice, abuf.buffer(), 0, 2 * page_, kMrRemoteWrite);
  ASSERT_TRUE(
      Register(alice, abuf.buffer(), 0, 2 * page_, kMrRemoteWrite).ok());
  absl::StatusOr<v1::BuildLamResponse> alam =
      BuildLam(alice, abuf.buffer(), 0, 3 * page_);
  absl::StatusOr<v1::MrInfo> amr = CreateMr(alice, true, true);
  absl::StatusOr<v1::MrInfo> anormal = CreateMr(alice, false);
  ASSERT_TRUE(areg.ok() && alam.ok() && amr.ok() && anormal.ok());
  v1::RegisterMrRequest held =
      RegisterRequest(alice, abuf.buffer(), 4 * page_, page_, 0);
  held.set_mr(anormal->mr());
  absl::StatusOr<v1::RegisterMrResponse> aheld = Register(held);
  ASSERT_TRUE(aheld.ok());
  device::ConnectionId apeer = ConnectPeer(alice);
  ASSERT_TRUE(FastRegister(FastRegisterRequest(alice, apeer, amr->mr(), *alam,
                                               kOpRemoteRead, 1))
                  .ok());
  std::vector<v1::Completion> done = RunWorkAndDrain(alice);
  ASSERT_FALSE(done.empty());
  const uint32_t fast_rkey = done.back().rkey();
  ASSERT_TRUE(fake_->IsKeyValid(fast_rkey));

  v1::BufferInfo bbuf = Import(bob, 4 * page_);
  absl::StatusOr<v1::RegisterMrResponse> breg =
      Register(bob, bbuf.buffer(), 0, page_, kMrRemoteRead);
  ASSERT_TRUE(breg.ok());

  core_->OnDisconnect(alice);

  EXPECT_FALSE(fake_->IsKeyValid(areg->rkey()));
  EXPECT_FALSE(fake_->IsKeyValid(aheld->rkey()));
  EXPECT_FALSE(fake_->IsKeyValid(fast_rkey));
  EXPECT_TRUE(fake_->IsKeyValid(breg->rkey()));
  EXPECT_EQ(fake_->LivePdCount(), 1u);
  EXPECT_EQ(fake_->LiveMrCount(), 1u);
  EXPECT_EQ(fake_->LiveLamCount(), 0u);
  EXPECT_EQ(fake_->LiveConnectionCount(), 0u);
  EXPECT_EQ(fake_->PinnedBytes(), page_);
  ExpectAccountingMatchesDevice();
  EXPECT_TRUE(IsNotConnected(List(alice).status()));
  // Bob goes on working.
  absl::StatusOr<uint32_t> left = Deregister(bob, breg->registration());
  ASSERT_TRUE(left.ok());
  EXPECT_EQ(*left, 0u);
  EXPECT_TRUE(Register(bob, bbuf.buffer(), 0, page_, kMrRemoteRead).ok());
  // A second disconnect of the same session is harmless.
  core_->OnDisconnect(alice);
  EXPECT_EQ(core_->Stats().sessions, 1u);
}

// A client whose stream broke opens another before mrd has seen the first
// one's end: the new stream takes over, the old one is woken to find
// itself replaced, and what is queued goes to the new one only.
TEST_F(SessionTest, ANewCompletionStreamTakesOverFromTheOneBefore) {
  std::string token = Connect();
  std::atomic<int> first_notified{0};
  absl::StatusOr<core::CompletionSubscription> first =
      core_->SubscribeCompletions(token, [&] { ++first_notified; });
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE((*first)->stream_replaced(first->stream));

  std::atomic<int> second_notified{0};
  absl::StatusOr<core::CompletionSubscription> second =
      core_->SubscribeCompletions(token, [&] { ++second_notified; });
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE(second->stream, first->stream);
  EXPECT_EQ(first_notified.load(), 1);
  EXPECT_TRUE((*first)->stream_replaced(first->stream));
  EXPECT_FALSE((*second)->stream_replaced(second->stream));

  device::ConnectionId peer = ConnectPeer(token);
  EXPECT_EQ(first_notified.load(), 1);
  EXPECT_GE(second_notified.load(), 1);
  EXPECT_FALSE((*first)->PopCompletionFor(first->stream).has_value());
  // The old stream's end does not detach the new one.
  core_->UnsubscribeCompletions(*first);
  std::optional<v1::Completion> c = (*second)->PopCompletionFor(second->stream);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->kind(), v1::Completion::PEER_CONNECTED);
  EXPECT_EQ(c->connection(), peer);
  const int before = second_notified.load();
  core_->OnDisconnect(token);
  EXPECT_GT(second_notified.load(), before);
  core_->UnsubscribeCompletions(*second);
}

TEST_F(SessionTest, SessionEndMarksItsCompletionStreamEnded) {
  std::string token = Connect();
  std::atomic<int> notified{0};
  absl::StatusOr<core::CompletionSubscription> stream =
      core_->SubscribeCompletions(token, [&] { ++notified; });
  ASSERT_TRUE(stream.ok()) << stream.status();
  device::ConnectionId peer = ConnectPeer(token);
  EXPECT_GE(notified.load(), 1);
  std::optional<v1::Completion> c = (*stream)->PopCompletion();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->kind(), v1::Completion::PEER_CONNECTED);
  EXPECT_EQ(c->connection(), peer);
  EXPECT_FALSE((*stream)->ended());
  const int before = notified.load();
  core_->OnDisconnect(token);
  EXPECT_TRUE((*stream)->ended());
  EXPECT_GT(notified.load(), before);
  core_->UnsubscribeCompletions(*stream);
}

TEST_F(SessionTest, CloseSessionReleasesEverything) {
  std::string token = OpenLease(60);
  v1::BufferInfo buffer = Import(token, 4 * page_);
  ASSERT_TRUE(Register(token, buffer.buffer(), 0, page_, kMrRemoteRead).ok());
  ASSERT_TRUE(BuildLam(token, buffer.buffer(), 0, page_).ok());
  v1::CloseSessionRequest close;
  close.set_session(token);
  EXPECT_OK(core_->CloseSession(close));
  EXPECT_EQ(fake_->LivePdCount(), 0u);
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 0u);
  EXPECT_TRUE(IsNotConnected(core_->CloseSession(close)));
}

// --- lease sessions (FakeClock) ----------------------------------------------

TEST_F(SessionTest, LeaseSessionExpiresAfterItsTtl) {
  std::string token = OpenLease(10);
  v1::BufferInfo buffer = Import(token, 4 * page_);
  absl::StatusOr<v1::RegisterMrResponse> reg =
      Register(token, buffer.buffer(), 0, page_, kMrRemoteRead);
  ASSERT_TRUE(reg.ok());
  clock_.Advance(absl::Seconds(9));
  core_->ReapExpiredLeases();
  EXPECT_TRUE(fake_->IsKeyValid(reg->rkey()));
  clock_.Advance(absl::Seconds(2));  // 11 s after the last call
  EXPECT_TRUE(IsNotConnected(List(token).status()));
  core_->ReapExpiredLeases();
  EXPECT_FALSE(fake_->IsKeyValid(reg->rkey()));
  EXPECT_EQ(fake_->LivePdCount(), 0u);
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
  EXPECT_EQ(core_->Stats().sessions, 0u);
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 0u);
}

TEST_F(SessionTest, EveryCallRenewsTheLease) {
  std::string token = OpenLease(10);
  v1::BufferInfo buffer = Import(token, 4 * page_);
  // 8 s apart, 40 s in all: each call renews the 10 s lease.
  for (int i = 0; i < 5; ++i) {
    clock_.Advance(absl::Seconds(8));
    core_->ReapExpiredLeases();
    absl::StatusOr<v1::RegisterMrResponse> r =
        Register(token, buffer.buffer(), 0, page_, kMrRemoteRead);
    ASSERT_TRUE(r.ok()) << "call " << i << ": " << r.status();
  }
  v1::GetSessionRequest get;
  get.set_session(token);
  v1::SessionInfo info;
  ASSERT_OK(core_->GetSession(get, &info));
  EXPECT_EQ(info.kind(), "lease");
  EXPECT_EQ(info.ttl_seconds(), 10u);
  EXPECT_EQ(info.expires_unix_ms(),
            absl::ToUnixMillis(clock_.Now() + absl::Seconds(10)));
  EXPECT_EQ(info.registrations(), 1u);
}

TEST_F(SessionTest, ReapingLeavesLiveLeasesAndFdSessionsAlone) {
  std::string short_lease = OpenLease(5);
  std::string long_lease = OpenLease(100);
  std::string fd = Connect();
  clock_.Advance(absl::Seconds(50));
  core_->ReapExpiredLeases();
  EXPECT_TRUE(IsNotConnected(List(short_lease).status()));
  EXPECT_TRUE(List(long_lease).ok());
  EXPECT_TRUE(List(fd).ok());
  EXPECT_EQ(core_->Stats().sessions, 2u);
  EXPECT_EQ(fake_->LivePdCount(), 2u);
}

TEST_F(SessionTest, DefaultAndMaximumLeaseTtl) {
  std::string token = OpenLease(0);
  v1::GetSessionRequest get;
  get.set_session(token);
  v1::SessionInfo info;
  ASSERT_OK(core_->GetSession(get, &info));
  EXPECT_EQ(
      info.ttl_seconds(),
      static_cast<uint32_t>(absl::ToInt64Seconds(options_.default_lease_ttl)));
  v1::OpenLeaseSessionRequest req;
  req.set_ttl_seconds(
      static_cast<uint32_t>(absl::ToInt64Seconds(options_.max_lease_ttl) + 1));
  EXPECT_TRUE(IsSeedError(core_->OpenLeaseSession(req, &info),
                          absl::StatusCode::kInvalidArgument,
                          ::mrd::STATUS_INVALID_PARAMETER, "TTL_TOO_LONG"));
  EXPECT_EQ(core_->Stats().sessions, 1u);
}

TEST_F(SessionTest, ShutdownEndsSessionsAndRefusesNewOnes) {
  std::string token = Connect();
  v1::BufferInfo buffer = Import(token, 4 * page_);
  ASSERT_TRUE(Register(token, buffer.buffer(), 0, page_, kMrRemoteRead).ok());
  core_->Shutdown();
  EXPECT_EQ(fake_->LivePdCount(), 0u);
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
  fd_socket::PeerCredentials creds;
  EXPECT_TRUE(IsMrdError(core_->OnConnect(creds).status(),
                         absl::StatusCode::kUnavailable, "SHUTTING_DOWN"));
  v1::OpenLeaseSessionRequest req;
  v1::SessionInfo info;
  EXPECT_TRUE(IsMrdError(core_->OpenLeaseSession(req, &info),
                         absl::StatusCode::kUnavailable, "SHUTTING_DOWN"));
  EXPECT_TRUE(IsNotConnected(List(token).status()));
  core_->Shutdown();  // idempotent
}

TEST_F(SessionTest, StartedReaperStopsOnShutdown) {
  ASSERT_OK(core_->Start());
  std::string token = OpenLease(1);
  clock_.Advance(absl::Seconds(5));
  // The reaper runs about once a second on real time.
  for (int i = 0; i < 300 && core_->Stats().sessions != 0; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(core_->Stats().sessions, 0u);
  core_->Shutdown();
}

// --- limits
// -------------------------------------------------------------------

class LimitTest : public CoreTest {
 protected:
  void Configure(core::CoreOptions& options,
                 fake::FakeDeviceOptions&) override {
    options.max_sessions = 3;
    options.max_session_registrations = 2;
    options.max_session_pinned_bytes = 4 * page_;
    options.max_total_pinned_bytes = 6 * page_;
  }
};

TEST_F(LimitTest, SessionRegistrationLimitIsInsufficientResources) {
  std::string token = Connect();
  v1::BufferInfo buffer = Import(token, 8 * page_);
  absl::StatusOr<v1::RegisterMrResponse> first =
      Register(token, buffer.buffer(), 0, 1, kMrRemoteRead);
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(Register(token, buffer.buffer(), 0, 2, kMrRemoteRead).ok());
  absl::Status s =
      Register(token, buffer.buffer(), 0, 3, kMrRemoteRead).status();
  EXPECT_TRUE(IsSeedError(s, absl::StatusCode::kResourceExhausted,
                          ::mrd::STATUS_INSUFFICIENT_RESOURCES,
                          "LIMIT_SESSION_REGISTRATIONS"));
  EXPECT_EQ(fake_->LiveRegisteredMrCount(), 2u);
  ExpectAccountingMatchesDevice();
  // The session still works: after one goes, another fits.
  ASSERT_TRUE(Deregister(token, first->registration()).ok());
  EXPECT_TRUE(Register(token, buffer.buffer(), 0, 3, kMrRemoteRead).ok());
}

// W5: "the same buffer may be registered any number of times". A cache hit
// adds a reference, not a registration, so the registration limit must not
// refuse it.
TEST_F(LimitTest, CacheHitIsNotRefusedAtTheRegistrationLimit) {
  std::string token = Connect();
  v1::BufferInfo buffer = Import(token, 8 * page_);
  ASSERT_TRUE(Register(token, buffer.buffer(), 0, 1, kMrRemoteRead).ok());
  absl::StatusOr<v1::RegisterMrResponse> full =
      Register(token, buffer.buffer(), 0, 2, kMrRemoteRead);
  ASSERT_TRUE(full.ok());
  absl::StatusOr<v1::RegisterMrResponse> again =
      Register(token, buffer.buffer(), 0, 2, kMrRemoteRead);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->cache_hit());
  EXPECT_EQ(again->registration(), full->registration());
  EXPECT_EQ(again->references(), 2u);
}

TEST_F(LimitTest, SessionPinnedBytesLimitIsInsufficientResources) {
  std::string token = Connect();
  std::string other = Connect();
  v1::BufferInfo buffer = Import(token, 8 * page_);
  ASSERT_TRUE(
      Register(token, buffer.buffer(), 0, 3 * page_, kMrRemoteRead).ok());
  absl::Status s =
      Register(token, buffer.buffer(), 0, 2 * page_, kMrRemoteWrite).status();
  EXPECT_TRUE(IsSeedError(s, absl::StatusCode::kResourceExhausted,
                          ::mrd::STATUS_INSUFFICIENT_RESOURCES,
                          "LIMIT_SESSION_PINNED_BYTES"));
  EXPECT_TRUE(IsSeedError(
      BuildLam(token, buffer.buffer(), 0, 2 * page_).status(),
      absl::StatusCode::kResourceExhausted,
      ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_SESSION_PINNED_BYTES"));
  EXPECT_EQ(fake_->PinnedBytes(), 3 * page_);
  ExpectAccountingMatchesDevice();
  // What still fits is fine, in this session and in another.
  EXPECT_TRUE(Register(token, buffer.buffer(), 0, page_, kMrRemoteWrite).ok());
  v1::BufferInfo theirs = Import(other, 4 * page_);
  EXPECT_TRUE(
      Register(other, theirs.buffer(), 0, 2 * page_, kMrRemoteRead).ok());
}

TEST_F(LimitTest, TotalPinnedBytesLimitIsInsufficientResources) {
  std::string a = Connect();
  std::string b = Connect();
  v1::BufferInfo abuf = Import(a, 8 * page_);
  v1::BufferInfo bbuf = Import(b, 8 * page_);
  ASSERT_TRUE(Register(a, abuf.buffer(), 0, 4 * page_, kMrRemoteRead).ok());
  absl::Status s =
      Register(b, bbuf.buffer(), 0, 3 * page_, kMrRemoteRead).status();
  EXPECT_TRUE(IsSeedError(s, absl::StatusCode::kResourceExhausted,
                          ::mrd::STATUS_INSUFFICIENT_RESOURCES,
                          "LIMIT_TOTAL_PINNED_BYTES"));
  EXPECT_TRUE(IsSeedError(BuildLam(b, bbuf.buffer(), 0, 3 * page_).status(),
                          absl::StatusCode::kResourceExhausted,
                          ::mrd::STATUS_INSUFFICIENT_RESOURCES,
                          "LIMIT_TOTAL_PINNED_BYTES"));
  ExpectAccountingMatchesDevice();
  EXPECT_TRUE(Register(b, bbuf.buffer(), 0, 2 * page_, kMrRemoteRead).ok());
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 6 * page_);
}

TEST_F(LimitTest, SessionLimitIsInsufficientResources) {
  std::string first = Connect();
  Connect();
  OpenLease(60);
  fd_socket::PeerCredentials creds;
  EXPECT_TRUE(IsSeedError(
      core_->OnConnect(creds).status(), absl::StatusCode::kResourceExhausted,
      ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_SESSIONS"));
  v1::OpenLeaseSessionRequest req;
  v1::SessionInfo info;
  EXPECT_TRUE(IsSeedError(
      core_->OpenLeaseSession(req, &info), absl::StatusCode::kResourceExhausted,
      ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_SESSIONS"));
  EXPECT_EQ(fake_->LivePdCount(), 3u);
  // The existing sessions still work, and a place freed is a place taken.
  v1::BufferInfo buffer = Import(first, 4 * page_);
  EXPECT_TRUE(Register(first, buffer.buffer(), 0, page_, kMrRemoteRead).ok());
  core_->OnDisconnect(first);
  EXPECT_TRUE(core_->OnConnect(creds).ok());
}

class SessionRaceTest : public CoreTest {
 protected:
  void Configure(core::CoreOptions& options,
                 fake::FakeDeviceOptions&) override {
    options.max_sessions = 1;
  }
};

// The session limit is checked before the PD is allocated and the session is
// inserted after: concurrent connects must still not exceed it.
TEST_F(SessionRaceTest, ConcurrentConnectsNeverExceedTheSessionLimit) {
  fake_->SetDelay(FakeDevice::Op::kAllocatePd, absl::Milliseconds(50));
  constexpr int kThreads = 4;
  std::atomic<int> opened{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&] {
      fd_socket::PeerCredentials creds;
      if (core_->OnConnect(creds).ok()) ++opened;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(opened.load(), 1);
  EXPECT_LE(core_->Stats().sessions, 1u);
}

// The completion queue under a reader that does not keep up (depth 3 here):
// progress reports of one registration coalesce into the newest; a full
// queue gives up a progress report, never a completion, to take a
// completion; a new report that finds it full of completions is dropped.
v1::Completion Progress(const std::string& request_id, uint64_t pinned) {
  v1::Completion c;
  c.set_kind(v1::Completion::REGISTRATION_PROGRESS);
  c.set_request_id(request_id);
  c.set_buffer(1);
  c.set_length(uint64_t{1} << 30);
  c.set_bytes_pinned(pinned);
  return c;
}

v1::Completion FastRegistered(uint64_t context) {
  v1::Completion c;
  c.set_kind(v1::Completion::FAST_REGISTER);
  c.set_request_context(context);
  return c;
}

TEST(CompletionQueueTest, ProgressReportsCoalesceAndNeverPushCompletionsOut) {
  core::Session session(
      1, "token", core::SessionKind::kFd,
      /*completion_depth=*/3, core::Identity{},
      std::make_shared<core::Tenant>("t", core::TenantQuota{}));
  session.Push(Progress("a", 1));
  session.Push(FastRegistered(10));
  session.Push(Progress("a", 2));  // replaces the first report of "a"
  session.Push(Progress("b", 5));
  // Full (a, 10, b): a completion pushes out the oldest report, "a".
  session.Push(FastRegistered(11));
  // Full of (10, b, 11): a report of "b" still coalesces...
  session.Push(Progress("b", 6));
  // ...and one of a new registration is dropped, not a completion.
  session.Push(Progress("c", 1));
  // A completion now pushes out "b", the last report.
  session.Push(FastRegistered(12));
  // Full of completions only: the oldest goes.
  session.Push(FastRegistered(13));

  std::vector<uint64_t> contexts;
  for (std::optional<v1::Completion> c = session.PopCompletion(); c.has_value();
       c = session.PopCompletion()) {
    EXPECT_EQ(c->kind(), v1::Completion::FAST_REGISTER) << c->DebugString();
    contexts.push_back(c->request_context());
  }
  EXPECT_EQ(contexts, (std::vector<uint64_t>{11, 12, 13}));
  absl::MutexLock lock(&session.mu);
  // Dropped: "a" (2), "c", "b" (6) and completion 10.
  EXPECT_EQ(session.completions_dropped_locked(), 4u);
}

TEST(CompletionQueueTest, TheNewestReportOfARegistrationIsTheOneRead) {
  core::Session session(
      1, "token", core::SessionKind::kFd,
      /*completion_depth=*/8, core::Identity{},
      std::make_shared<core::Tenant>("t", core::TenantQuota{}));
  for (uint64_t pinned = 1; pinned <= 5; ++pinned) {
    session.Push(Progress("a", pinned << 20));
  }
  std::optional<v1::Completion> c = session.PopCompletion();
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->bytes_pinned(), uint64_t{5} << 20);
  EXPECT_FALSE(session.PopCompletion().has_value());
  absl::MutexLock lock(&session.mu);
  EXPECT_EQ(session.completions_dropped_locked(), 0u);  // superseded
}

// A session's published names, both ways: a deregistration takes the names
// of its own registration, an invalidate those of its MR object's mapping,
// and each leaves the others.
TEST(PublishedNamesTest, NamesAreFoundByNameByRegistrationAndByMr) {
  core::PublishedNames names;
  names.Set("a", {.registration = 7});
  names.Set("b", {.registration = 7});
  names.Set("c", {.registration = 9});
  names.Set("m", {.mr = 7, .rkey = 0x1234});  // an MR's id may equal one
  EXPECT_EQ(names.size(), 4u);
  EXPECT_TRUE(names.Names(7));
  EXPECT_TRUE(names.Names(9));
  EXPECT_FALSE(names.Names(8));
  // Named again for another registration: no longer 9's.
  names.Set("c", {.registration = 8});
  EXPECT_FALSE(names.Names(9));
  EXPECT_EQ(names.find("c")->second.registration, 8u);

  std::vector<std::string> gone;
  names.TakeNamesOf(7, &gone);
  EXPECT_EQ(gone, (std::vector<std::string>{"a", "b"}));
  EXPECT_FALSE(names.Names(7));
  EXPECT_FALSE(names.contains("a"));
  EXPECT_TRUE(names.contains("m"));  // MR 7's, not registration 7's
  EXPECT_EQ(names.size(), 2u);
  names.TakeNamesOf(7, &gone);  // none left
  EXPECT_EQ(gone.size(), 2u);
  names.TakeNamesOfMr(7, &gone);
  EXPECT_EQ(gone.back(), "m");
  EXPECT_FALSE(names.contains("m"));

  EXPECT_TRUE(names.Erase("c"));
  EXPECT_FALSE(names.Erase("c"));
  EXPECT_FALSE(names.Names(8));
  EXPECT_TRUE(names.empty());
}

}  // namespace
}  // namespace mrd::core_test
