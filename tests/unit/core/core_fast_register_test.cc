// Core FastRegister / InvalidateMr (F1-F6, C1, L8): posting on a session's
// peer connection, completions with the request context and the new token,
// MR object states, and everything that must be refused.
#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "mrd/status.h"
#include "tests/unit/core/core_test_util.h"

namespace mrd::core_test {
namespace {

using fake::FakeDevice;

class FastRegisterTest : public CoreTest {
 protected:
  void SetUp() override {
    CoreTest::SetUp();
    session_ = Connect();
    buffer_ = Import(session_, 16 * page_);
    absl::StatusOr<v1::BuildLamResponse> lam =
        BuildLam(session_, buffer_.buffer(), 100, 2 * page_);
    ASSERT_TRUE(lam.ok()) << lam.status();
    lam_ = *lam;
    absl::StatusOr<v1::MrInfo> mr =
        CreateMr(session_, /*fast_register=*/true, /*allow_remote=*/true);
    ASSERT_TRUE(mr.ok()) << mr.status();
    mr_ = *mr;
    connection_ = ConnectPeer(session_);
    std::vector<v1::Completion> events = Drain(session_);
    ASSERT_EQ(events.size(), 1u);
    EXPECT_EQ(events[0].kind(), v1::Completion::PEER_CONNECTED);
    EXPECT_EQ(events[0].connection(), connection_);
  }

  v1::FastRegisterRequest Request(uint32_t flags, uint64_t context = 42) {
    return FastRegisterRequest(session_, connection_, mr_.mr(), lam_, flags,
                               context);
  }

  // Fast-registers mr_ with remote read and returns the completion's rkey.
  uint32_t FastRegisterOk() {
    absl::StatusOr<v1::FastRegisterResponse> posted =
        FastRegister(Request(kOpRemoteRead));
    EXPECT_TRUE(posted.ok()) << posted.status();
    std::vector<v1::Completion> c = RunWorkAndDrain(session_);
    EXPECT_EQ(c.size(), 1u);
    if (c.size() != 1) return 0;
    EXPECT_EQ(c[0].status(), ::mrd::STATUS_SUCCESS) << c[0].message();
    return c[0].rkey();
  }

  std::string session_;
  v1::BufferInfo buffer_;
  v1::BuildLamResponse lam_;
  v1::MrInfo mr_;
  device::ConnectionId connection_ = 0;
};

TEST_F(FastRegisterTest, CompletionCarriesRequestContextAndNewRkey) {
  v1::FastRegisterRequest req = Request(kOpRemoteRead, /*context=*/0xfeed);
  absl::StatusOr<v1::FastRegisterResponse> posted = FastRegister(req);
  ASSERT_TRUE(posted.ok()) << posted.status();
  EXPECT_NE(posted->work_request(), 0u);
  // Posted is not done: nothing arrives before the work runs.
  EXPECT_TRUE(Drain(session_).empty());
  EXPECT_EQ(MrState(session_, mr_.mr()).state(), "free");

  std::vector<v1::Completion> c = RunWorkAndDrain(session_);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].kind(), v1::Completion::FAST_REGISTER);
  EXPECT_EQ(c[0].status(), ::mrd::STATUS_SUCCESS) << c[0].message();
  EXPECT_EQ(c[0].request_context(), 0xfeedu);
  EXPECT_EQ(c[0].work_request(), posted->work_request());
  EXPECT_EQ(c[0].connection(), connection_);
  EXPECT_EQ(c[0].mr(), mr_.mr());
  EXPECT_NE(c[0].rkey(), 0u);
  EXPECT_TRUE(fake_->IsKeyValid(c[0].rkey()));
  EXPECT_OK(fake_->PeerAccess(c[0].rkey(), req.base_address(), req.length(),
                              /*write=*/false));
  EXPECT_FALSE(
      fake_->PeerAccess(c[0].rkey(), req.base_address(), 1, /*write=*/true)
          .ok());

  // F5: the token is readable from the MR object.
  v1::MrInfo state = MrState(session_, mr_.mr());
  EXPECT_EQ(state.state(), "fast_registered");
  EXPECT_EQ(state.rkey(), c[0].rkey());
  EXPECT_EQ(state.base_address(), req.base_address());
  EXPECT_EQ(state.length(), req.length());
}

TEST_F(FastRegisterTest, EachFastRegistrationGetsANewKey) {
  const uint32_t first = FastRegisterOk();
  ASSERT_TRUE(Invalidate(session_, connection_, mr_.mr(), 0, 1).ok());
  RunWorkAndDrain(session_);
  const uint32_t second = FastRegisterOk();
  EXPECT_NE(first, second);
  EXPECT_FALSE(fake_->IsKeyValid(first));
  EXPECT_TRUE(fake_->IsKeyValid(second));
}

TEST_F(FastRegisterTest, ReleaseLamWhileFastRegisteredIsLamInUse) {
  FastRegisterOk();
  EXPECT_TRUE(IsMrdError(ReleaseLam(session_, lam_.lam()),
                         absl::StatusCode::kFailedPrecondition, "LAM_IN_USE"));
  EXPECT_EQ(fake_->LiveLamCount(), 1u);
}

TEST_F(FastRegisterTest, InvalidateCompletesAndFreesTheMr) {
  const uint32_t rkey = FastRegisterOk();
  absl::StatusOr<v1::InvalidateMrResponse> posted =
      Invalidate(session_, connection_, mr_.mr(), 0, /*context=*/77);
  ASSERT_TRUE(posted.ok()) << posted.status();
  std::vector<v1::Completion> c = RunWorkAndDrain(session_);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].kind(), v1::Completion::INVALIDATE);
  EXPECT_EQ(c[0].status(), ::mrd::STATUS_SUCCESS);
  EXPECT_EQ(c[0].request_context(), 77u);
  EXPECT_EQ(c[0].work_request(), posted->work_request());
  EXPECT_EQ(c[0].mr(), mr_.mr());
  EXPECT_FALSE(fake_->IsKeyValid(rkey));
  v1::MrInfo state = MrState(session_, mr_.mr());
  EXPECT_EQ(state.state(), "free");
  EXPECT_EQ(state.rkey(), 0u);
  // The LAM is free to go now.
  EXPECT_OK(ReleaseLam(session_, lam_.lam()));
}

TEST_F(FastRegisterTest, ReadFenceAndDeferAreAccepted) {
  ASSERT_TRUE(
      FastRegister(Request(kOpRemoteRead | kOpReadFence | kOpDefer)).ok());
  std::vector<v1::Completion> c = RunWorkAndDrain(session_);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status(), ::mrd::STATUS_SUCCESS);
}

TEST_F(FastRegisterTest, NormalMrIsInvalidParameter) {
  absl::StatusOr<v1::MrInfo> normal = CreateMr(session_, false);
  ASSERT_TRUE(normal.ok());
  v1::FastRegisterRequest req = Request(0);
  req.set_mr(normal->mr());
  EXPECT_TRUE(IsSeedError(
      FastRegister(req).status(), absl::StatusCode::kInvalidArgument,
      ::mrd::STATUS_INVALID_PARAMETER, "MR_NOT_FAST_REGISTER"));
  EXPECT_TRUE(IsSeedError(
      Invalidate(session_, connection_, normal->mr(), 0, 1).status(),
      absl::StatusCode::kInvalidArgument, ::mrd::STATUS_INVALID_PARAMETER,
      "MR_NOT_FAST_REGISTER"));
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kPostFastRegister), 0u);
}

TEST_F(FastRegisterTest, RemoteAccessOnLocalOnlyMrIsAccessViolation) {
  absl::StatusOr<v1::MrInfo> local =
      CreateMr(session_, /*fast_register=*/true, /*allow_remote=*/false);
  ASSERT_TRUE(local.ok());
  for (uint32_t flags :
       {kOpRemoteRead, kOpRemoteWrite, kOpRemoteRead | kOpLocalWrite}) {
    v1::FastRegisterRequest req = Request(flags);
    req.set_mr(local->mr());
    EXPECT_TRUE(IsSeedError(FastRegister(req).status(),
                            absl::StatusCode::kPermissionDenied,
                            ::mrd::STATUS_ACCESS_VIOLATION, "MR_NOT_REMOTE"))
        << "flags 0x" << std::hex << flags;
  }
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kPostFastRegister), 0u);
  // Local access is fine on it.
  v1::FastRegisterRequest req = Request(kOpLocalWrite);
  req.set_mr(local->mr());
  EXPECT_TRUE(FastRegister(req).ok());
  std::vector<v1::Completion> c = RunWorkAndDrain(session_);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status(), ::mrd::STATUS_SUCCESS);
}

TEST_F(FastRegisterTest, UnknownConnectionIsConnectionInvalid) {
  for (uint64_t connection : {uint64_t{0}, connection_ + 1000}) {
    v1::FastRegisterRequest req = Request(kOpRemoteRead);
    req.set_connection(connection);
    EXPECT_TRUE(IsSeedError(
        FastRegister(req).status(), absl::StatusCode::kFailedPrecondition,
        ::mrd::STATUS_CONNECTION_INVALID, "NO_SUCH_CONNECTION"));
    EXPECT_TRUE(
        IsSeedError(Invalidate(session_, connection, mr_.mr(), 0, 1).status(),
                    absl::StatusCode::kFailedPrecondition,
                    ::mrd::STATUS_CONNECTION_INVALID, "NO_SUCH_CONNECTION"));
  }
  // The device is the authority on connections and refused every post:
  // nothing was queued, so nothing completes.
  for (const v1::Completion& c : Drain(session_)) {
    EXPECT_NE(c.kind(), v1::Completion::FAST_REGISTER);
    EXPECT_NE(c.kind(), v1::Completion::INVALIDATE);
  }
}

TEST_F(FastRegisterTest, ConnectionOfAnotherSessionIsConnectionInvalid) {
  std::string other = Connect();
  device::ConnectionId theirs = ConnectPeer(other);
  v1::FastRegisterRequest req = Request(kOpRemoteRead);
  req.set_connection(theirs);
  EXPECT_TRUE(IsSeedError(
      FastRegister(req).status(), absl::StatusCode::kFailedPrecondition,
      ::mrd::STATUS_CONNECTION_INVALID, "NO_SUCH_CONNECTION"));
  // Refused by the device (the connection is in another PD): nothing
  // completes in either session.
  for (const std::string& s : {session_, other}) {
    for (const v1::Completion& c : Drain(s)) {
      EXPECT_NE(c.kind(), v1::Completion::FAST_REGISTER);
    }
  }
}

TEST_F(FastRegisterTest, DisconnectedPeerIsConnectionInvalidAndReported) {
  ASSERT_OK(fake_->DisconnectPeer(connection_));
  std::vector<v1::Completion> events = Drain(session_);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind(), v1::Completion::PEER_DISCONNECTED);
  EXPECT_EQ(events[0].connection(), connection_);
  EXPECT_TRUE(IsSeedError(FastRegister(Request(kOpRemoteRead)).status(),
                          absl::StatusCode::kFailedPrecondition,
                          ::mrd::STATUS_CONNECTION_INVALID,
                          "NO_SUCH_CONNECTION"));
  absl::StatusOr<v1::ListRegistrationsResponse> list = List(session_);
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->connections_size(), 0);
}

TEST_F(FastRegisterTest, UnknownLogicalPageIsInvalidParameter) {
  v1::FastRegisterRequest req = Request(kOpRemoteRead);
  req.set_pages(1, req.pages(1) + 1000 * page_);  // aligned, not a LAM's
  EXPECT_TRUE(IsSeedError(
      FastRegister(req).status(), absl::StatusCode::kInvalidArgument,
      ::mrd::STATUS_INVALID_PARAMETER, "UNKNOWN_LOGICAL_ADDRESS"));
  // Another session's LAM pages are unknown here too.
  std::string other = Connect();
  v1::BufferInfo their_buffer = Import(other, 4 * page_);
  absl::StatusOr<v1::BuildLamResponse> their_lam =
      BuildLam(other, their_buffer.buffer(), 0, page_);
  ASSERT_TRUE(their_lam.ok());
  v1::FastRegisterRequest cross = FastRegisterRequest(
      session_, connection_, mr_.mr(), *their_lam, kOpRemoteRead, 1);
  EXPECT_TRUE(IsSeedError(
      FastRegister(cross).status(), absl::StatusCode::kInvalidArgument,
      ::mrd::STATUS_INVALID_PARAMETER, "UNKNOWN_LOGICAL_ADDRESS"));
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kPostFastRegister), 0u);
}

TEST_F(FastRegisterTest, PageArrayRulesApplyThroughTheRpc) {
  v1::FastRegisterRequest req = Request(kOpRemoteRead);
  req.set_pages(0, req.pages(0) + 8);
  EXPECT_TRUE(IsSeedError(FastRegister(req).status(),
                          absl::StatusCode::kInvalidArgument,
                          ::mrd::STATUS_INVALID_PARAMETER, "MISALIGNED_PAGE"));
  req = Request(kOpRemoteRead);
  req.set_base_address(0);
  EXPECT_TRUE(IsSeedError(
      FastRegister(req).status(), absl::StatusCode::kInvalidArgument,
      ::mrd::STATUS_INVALID_PARAMETER, "ZERO_BASED_ADDRESS"));
  req = Request(kOpRemoteRead);
  req.set_length(3 * page_ - lam_.fbo() + 1);
  EXPECT_TRUE(IsSeedError(
      FastRegister(req).status(), absl::StatusCode::kInvalidArgument,
      ::mrd::STATUS_INVALID_PARAMETER, "LENGTH_EXCEEDS_PAGES"));
  req = Request(0x4);
  EXPECT_TRUE(IsSeedError(FastRegister(req).status(),
                          absl::StatusCode::kInvalidArgument,
                          ::mrd::STATUS_INVALID_PARAMETER, "UNKNOWN_FLAGS"));
  EXPECT_TRUE(
      IsSeedError(Invalidate(session_, connection_, mr_.mr(), 0x8, 1).status(),
                  absl::StatusCode::kInvalidArgument,
                  ::mrd::STATUS_INVALID_PARAMETER, "UNKNOWN_FLAGS"));
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kPostFastRegister), 0u);
}

TEST_F(FastRegisterTest, FailedPostLeavesNoTraceOnTheMr) {
  fake_->FailNext(FakeDevice::Op::kPostFastRegister,
                  SeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "QUEUE_FULL",
                            "send queue full"));
  v1::FastRegisterRequest first = Request(kOpRemoteRead);
  first.set_base_address(first.base_address() + 5 * page_);
  EXPECT_TRUE(IsSeedError(FastRegister(first).status(),
                          absl::StatusCode::kResourceExhausted,
                          ::mrd::STATUS_INSUFFICIENT_RESOURCES, "QUEUE_FULL"));
  // The next one is reported with its own parameters.
  v1::FastRegisterRequest second = Request(kOpRemoteRead);
  ASSERT_TRUE(FastRegister(second).ok());
  RunWorkAndDrain(session_);
  v1::MrInfo state = MrState(session_, mr_.mr());
  EXPECT_EQ(state.state(), "fast_registered");
  EXPECT_EQ(state.base_address(), second.base_address());
}

TEST_F(FastRegisterTest, FailedCompletionIsDeliveredAndLeavesTheMrFree) {
  fake_->FailNextWork(SeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES,
                                "WORK_FAILED", "the work request failed"));
  ASSERT_TRUE(FastRegister(Request(kOpRemoteRead | kOpSilent, 9)).ok());
  std::vector<v1::Completion> c = RunWorkAndDrain(session_);
  ASSERT_EQ(c.size(), 1u) << "failures complete even with SILENT_SUCCESS";
  EXPECT_EQ(c[0].kind(), v1::Completion::FAST_REGISTER);
  EXPECT_EQ(c[0].status(), ::mrd::STATUS_INSUFFICIENT_RESOURCES);
  EXPECT_EQ(c[0].request_context(), 9u);
  EXPECT_EQ(c[0].rkey(), 0u);
  EXPECT_EQ(MrState(session_, mr_.mr()).state(), "free");
  EXPECT_OK(ReleaseLam(session_, lam_.lam()));
}

// F3: SILENT_SUCCESS only suppresses the completion entry. The registration
// itself happens, so the MR object must show it (F5: the token is read from
// the MR), and its LAM must count as in use.
TEST_F(FastRegisterTest, SilentSuccessStillMarksTheMrFastRegistered) {
  ASSERT_TRUE(FastRegister(Request(kOpRemoteRead | kOpSilent)).ok());
  EXPECT_TRUE(RunWorkAndDrain(session_).empty());
  v1::MrInfo state = MrState(session_, mr_.mr());
  EXPECT_EQ(state.state(), "fast_registered");
  EXPECT_NE(state.rkey(), 0u);
  EXPECT_TRUE(fake_->IsKeyValid(state.rkey()));
  EXPECT_TRUE(IsMrdError(ReleaseLam(session_, lam_.lam()),
                         absl::StatusCode::kFailedPrecondition, "LAM_IN_USE"));
}

TEST_F(FastRegisterTest, SilentInvalidateStillFreesTheMr) {
  FastRegisterOk();
  ASSERT_TRUE(Invalidate(session_, connection_, mr_.mr(), kOpSilent, 5).ok());
  EXPECT_TRUE(RunWorkAndDrain(session_).empty());
  EXPECT_EQ(MrState(session_, mr_.mr()).state(), "free");
  EXPECT_OK(ReleaseLam(session_, lam_.lam()));
}

// A fast registration that was posted but not yet completed when its buffer
// was released must not lend its parameters to a later fast registration of
// the same MR object.
TEST_F(FastRegisterTest, LaterFastRegisterReportsItsOwnParametersAfterRelease) {
  FastRegisterOk();
  // Posted while fast-registered: the device fails it when it runs.
  v1::FastRegisterRequest stale = Request(kOpRemoteRead);
  stale.set_base_address(stale.base_address() + 7 * page_);
  ASSERT_TRUE(FastRegister(stale).ok());
  absl::StatusOr<v1::ReleaseBufferResponse> released =
      ReleaseBuffer(session_, buffer_.buffer());
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(MrState(session_, mr_.mr()).state(), "free");
  RunWorkAndDrain(session_);

  v1::BufferInfo fresh = Import(session_, 4 * page_);
  absl::StatusOr<v1::BuildLamResponse> lam =
      BuildLam(session_, fresh.buffer(), 0, page_);
  ASSERT_TRUE(lam.ok());
  v1::FastRegisterRequest req = FastRegisterRequest(
      session_, connection_, mr_.mr(), *lam, kOpRemoteRead, 3);
  ASSERT_TRUE(FastRegister(req).ok());
  std::vector<v1::Completion> c = RunWorkAndDrain(session_);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status(), ::mrd::STATUS_SUCCESS) << c[0].message();
  v1::MrInfo state = MrState(session_, mr_.mr());
  EXPECT_EQ(state.state(), "fast_registered");
  EXPECT_EQ(state.base_address(), req.base_address());
  EXPECT_EQ(state.length(), req.length());
  // The fresh LAM is the one in use.
  EXPECT_TRUE(IsMrdError(ReleaseLam(session_, lam->lam()),
                         absl::StatusCode::kFailedPrecondition, "LAM_IN_USE"));
}

TEST_F(FastRegisterTest, ReleaseBufferRevokesFastRegistrationsOnItsLams) {
  const uint32_t rkey = FastRegisterOk();
  absl::StatusOr<v1::ReleaseBufferResponse> released =
      ReleaseBuffer(session_, buffer_.buffer());
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(released->released_lams(), 1u);
  EXPECT_FALSE(fake_->IsKeyValid(rkey));
  EXPECT_EQ(fake_->LiveLamCount(), 0u);
  EXPECT_EQ(MrState(session_, mr_.mr()).state(), "free");
  // The MR object stays usable.
  v1::BufferInfo fresh = Import(session_, 4 * page_);
  absl::StatusOr<v1::BuildLamResponse> lam =
      BuildLam(session_, fresh.buffer(), 0, page_);
  ASSERT_TRUE(lam.ok());
  ASSERT_TRUE(FastRegister(FastRegisterRequest(session_, connection_, mr_.mr(),
                                               *lam, kOpRemoteRead, 3))
                  .ok());
  std::vector<v1::Completion> c = RunWorkAndDrain(session_);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].status(), ::mrd::STATUS_SUCCESS) << c[0].message();
  EXPECT_EQ(c[0].mr(), mr_.mr());
}

TEST_F(FastRegisterTest, CloseMrRevokesItsFastRegistration) {
  const uint32_t rkey = FastRegisterOk();
  EXPECT_OK(CloseMr(session_, mr_.mr()));
  EXPECT_FALSE(fake_->IsKeyValid(rkey));
  EXPECT_EQ(fake_->LiveFastRegisterMrCount(), 0u);
  EXPECT_OK(ReleaseLam(session_, lam_.lam()));
}

// W6 for fast registration: a buffer imported read-only cannot be made
// writable (locally or remotely) through a LAM either.
TEST_F(FastRegisterTest, WriteAccessOnReadOnlyBufferIsRefused) {
  v1::BufferInfo ro = Import(session_, 4 * page_, /*writable=*/false);
  absl::StatusOr<v1::BuildLamResponse> lam =
      BuildLam(session_, ro.buffer(), 0, page_);
  ASSERT_TRUE(lam.ok()) << lam.status();
  for (uint32_t flags : {kOpRemoteWrite, kOpLocalWrite}) {
    v1::FastRegisterRequest req =
        FastRegisterRequest(session_, connection_, mr_.mr(), *lam, flags, 1);
    absl::Status s = FastRegister(req).status();
    EXPECT_TRUE(IsSeedError(s, absl::StatusCode::kInvalidArgument,
                            ::mrd::STATUS_INVALID_PARAMETER,
                            "BUFFER_READ_ONLY"))
        << "flags 0x" << std::hex << flags;
  }
  RunWorkAndDrain(session_);
}

TEST_F(FastRegisterTest, CompletionsGoOnlyToTheirSession) {
  std::string other = Connect();
  Drain(other);
  FastRegisterOk();
  EXPECT_TRUE(Drain(other).empty());
}

TEST_F(FastRegisterTest, CreateMrOfBothKindsStartsFree) {
  absl::StatusOr<v1::ListRegistrationsResponse> list = List(session_);
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->mrs_size(), 1);
  EXPECT_TRUE(list->mrs(0).fast_register());
  EXPECT_TRUE(list->mrs(0).allow_remote_access());
  EXPECT_EQ(list->mrs(0).state(), "free");
  EXPECT_EQ(fake_->LiveFastRegisterMrCount(), 1u);
  absl::StatusOr<v1::MrInfo> normal = CreateMr(session_, false);
  ASSERT_TRUE(normal.ok());
  EXPECT_FALSE(normal->fast_register());
  EXPECT_EQ(normal->state(), "free");
  // A normal MR object costs the device nothing until registered.
  EXPECT_EQ(fake_->LiveMrCount(), 1u);
}

}  // namespace
}  // namespace mrd::core_test
