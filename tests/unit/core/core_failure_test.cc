// Core under device failures (injected with FakeDevice::FailNext) and under
// sessions or buffers that go away in the middle of a request: nothing may
// stay pinned, mapped or accounted (L7), and the session keeps working.
#include <cstdint>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "tests/unit/core/core_test_util.h"

namespace mrd::core_test {
namespace {

using fake::FakeDevice;

class FailureTest : public CoreTest {
 protected:
  void SetUp() override {
    CoreTest::SetUp();
    session_ = Connect();
    buffer_ = Import(session_, 16 * page_);
  }
  // Registers 2 pages while the device takes 100 ms, and ends the session
  // 30 ms into it. Returns the registration's result.
  absl::Status RegisterWhileSessionEnds() {
    fake_->SetDelay(FakeDevice::Op::kRegisterMr, absl::Milliseconds(100));
    absl::Status result;
    std::thread thread([&] {
      result = Register(session_, buffer_.buffer(), 0, 2 * page_, kMrRemoteRead)
                   .status();
    });
    absl::SleepFor(absl::Milliseconds(30));  // the registration is in flight
    core_->OnDisconnect(session_);
    thread.join();
    return result;
  }

  std::string session_;
  v1::BufferInfo buffer_;
};

TEST_F(FailureTest, FailedDeviceRegistrationLeavesNothingPinnedOrAccounted) {
  absl::StatusOr<v1::RegisterMrResponse> kept =
      Register(session_, buffer_.buffer(), 0, page_, kMrRemoteRead);
  ASSERT_TRUE(kept.ok());
  const uint64_t accounted = core_->Stats().accounted_pinned_bytes;
  fake_->FailNext(FakeDevice::Op::kRegisterMr,
                  SeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "PIN_FAILED",
                            "cannot pin"));
  absl::Status s =
      Register(session_, buffer_.buffer(), page_, 4 * page_, kMrRemoteRead)
          .status();
  EXPECT_TRUE(IsSeedError(s, absl::StatusCode::kResourceExhausted,
                          ::mrd::STATUS_INSUFFICIENT_RESOURCES, "PIN_FAILED"));
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, accounted);
  EXPECT_EQ(core_->Stats().registrations, 1u);
  EXPECT_EQ(core_->Stats().cache.entries, 1u);
  ExpectAccountingMatchesDevice();
  v1::GetSessionRequest get;
  get.set_session(session_);
  v1::SessionInfo info;
  ASSERT_OK(core_->GetSession(get, &info));
  EXPECT_EQ(info.pinned_bytes(), page_);
  // The same request succeeds once the device does: no failed entry stuck in
  // the cache.
  absl::StatusOr<v1::RegisterMrResponse> retry =
      Register(session_, buffer_.buffer(), page_, 4 * page_, kMrRemoteRead);
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_FALSE(retry->cache_hit());
  EXPECT_TRUE(fake_->IsKeyValid(retry->rkey()));
}

TEST_F(FailureTest, FailedRegistrationThroughMrObjectLeavesItFree) {
  absl::StatusOr<v1::MrInfo> mr = CreateMr(session_, false);
  ASSERT_TRUE(mr.ok());
  fake_->FailNext(FakeDevice::Op::kRegisterMr,
                  absl::ResourceExhaustedError("no keys"));
  v1::RegisterMrRequest req =
      RegisterRequest(session_, buffer_.buffer(), 0, page_, kMrRemoteRead);
  req.set_mr(mr->mr());
  EXPECT_FALSE(Register(req).ok());
  EXPECT_EQ(MrState(session_, mr->mr()).state(), "free");
  EXPECT_TRUE(Register(req).ok());
  EXPECT_EQ(MrState(session_, mr->mr()).state(), "registered");
}

TEST_F(FailureTest, FailedBuildLamLeavesNothingPinnedOrMapped) {
  const uint64_t before = core_->Stats().accounted_pinned_bytes;
  fake_->FailNext(FakeDevice::Op::kBuildLam,
                  SeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "MAP_FAILED",
                            "no logical space"));
  EXPECT_TRUE(
      IsSeedError(BuildLam(session_, buffer_.buffer(), 0, 4 * page_).status(),
                  absl::StatusCode::kResourceExhausted,
                  ::mrd::STATUS_INSUFFICIENT_RESOURCES, "MAP_FAILED"));
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, before);
  EXPECT_EQ(core_->Stats().lams, 0u);
  EXPECT_EQ(fake_->LiveLamCount(), 0u);
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
  EXPECT_TRUE(BuildLam(session_, buffer_.buffer(), 0, 4 * page_).ok());
  ExpectAccountingMatchesDevice();
}

TEST_F(FailureTest, FailedReleaseLamKeepsTheLamAndItsAccounting) {
  absl::StatusOr<v1::BuildLamResponse> lam =
      BuildLam(session_, buffer_.buffer(), 0, 2 * page_);
  ASSERT_TRUE(lam.ok());
  fake_->FailNext(FakeDevice::Op::kReleaseLam, absl::UnavailableError("busy"));
  EXPECT_FALSE(ReleaseLam(session_, lam->lam()).ok());
  EXPECT_EQ(core_->Stats().lams, 1u);
  ExpectAccountingMatchesDevice();
  EXPECT_OK(ReleaseLam(session_, lam->lam()));
  ExpectAccountingMatchesDevice();
}

TEST_F(FailureTest, FailedPdAllocationOpensNoSession) {
  const uint64_t sessions = core_->Stats().sessions;
  fake_->FailNext(
      FakeDevice::Op::kAllocatePd,
      SeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "NO_PD", "out of PDs"));
  fd_socket::PeerCredentials creds;
  EXPECT_TRUE(IsSeedError(core_->OnConnect(creds).status(),
                          absl::StatusCode::kResourceExhausted,
                          ::mrd::STATUS_INSUFFICIENT_RESOURCES, "NO_PD"));
  fake_->FailNext(FakeDevice::Op::kAllocatePd,
                  absl::ResourceExhaustedError("out of PDs"));
  v1::OpenLeaseSessionRequest req;
  v1::SessionInfo info;
  EXPECT_FALSE(core_->OpenLeaseSession(req, &info).ok());
  EXPECT_EQ(core_->Stats().sessions, sessions);
  EXPECT_EQ(fake_->LivePdCount(), 1u);
}

TEST_F(FailureTest, FailedFastRegisterMrAllocationCreatesNoMrObject) {
  fake_->FailNext(
      FakeDevice::Op::kAllocateFastRegisterMr,
      SeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "NO_MR", "out of MRs"));
  EXPECT_TRUE(IsSeedError(CreateMr(session_, true, true).status(),
                          absl::StatusCode::kResourceExhausted,
                          ::mrd::STATUS_INSUFFICIENT_RESOURCES, "NO_MR"));
  EXPECT_EQ(core_->Stats().mrs, 0u);
  EXPECT_EQ(fake_->LiveFastRegisterMrCount(), 0u);
  EXPECT_TRUE(CreateMr(session_, true, true).ok());
}

// A DeregisterMr reply of "0 references left" promises that the token no
// longer works (R10, W9). If the device could not deregister, the reply must
// not claim that, and the core must not forget bytes the device still pins.
TEST_F(FailureTest, FailedDeviceDeregistrationIsNotReportedAsReleased) {
  absl::StatusOr<v1::RegisterMrResponse> reg =
      Register(session_, buffer_.buffer(), 0, page_, kMrRemoteRead);
  ASSERT_TRUE(reg.ok());
  fake_->FailNext(FakeDevice::Op::kDeregisterMr,
                  absl::UnavailableError("device busy"));
  absl::StatusOr<uint32_t> left = Deregister(session_, reg->registration());
  const bool key_still_valid = fake_->IsKeyValid(reg->rkey());
  EXPECT_FALSE(left.ok() && *left == 0 && key_still_valid)
      << "DeregisterMr reported the registration released while its key "
         "still works";
  ExpectAccountingMatchesDevice();
}

TEST_F(FailureTest, SessionClosedDuringRegistrationLeavesNothing) {
  absl::Status result = RegisterWhileSessionEnds();
  EXPECT_FALSE(result.ok());
  EXPECT_EQ(fake_->LivePdCount(), 0u);
  EXPECT_EQ(fake_->LiveMrCount(), 0u);
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 0u);
  EXPECT_EQ(core_->Stats().cache.entries, 0u);
}

// The proto: a closed session is WSAENOTCONN, whatever the device said about
// the protection domain that went with it.
TEST_F(FailureTest, RegistrationCutShortBySessionEndIsWsaenotconn) {
  absl::Status result = RegisterWhileSessionEnds();
  EXPECT_TRUE(IsSeedError(result, absl::StatusCode::kFailedPrecondition,
                          ::mrd::WSAENOTCONN, "SESSION_NOT_CONNECTED"));
}

TEST_F(FailureTest, BufferReleasedDuringRegistrationLeavesNothing) {
  fake_->SetDelay(FakeDevice::Op::kRegisterMr, absl::Milliseconds(100));
  absl::Status result;
  std::thread t([&] {
    result = Register(session_, buffer_.buffer(), 0, 2 * page_, kMrRemoteRead)
                 .status();
  });
  absl::SleepFor(absl::Milliseconds(30));
  absl::StatusOr<v1::ReleaseBufferResponse> released =
      ReleaseBuffer(session_, buffer_.buffer());
  t.join();
  ASSERT_TRUE(released.ok());
  EXPECT_TRUE(IsMrdError(result, absl::StatusCode::kNotFound, "UNKNOWN_BUFFER"))
      << result;
  EXPECT_EQ(fake_->LiveMrCount(), 0u);
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 0u);
  EXPECT_EQ(core_->Stats().registrations, 0u);
}

TEST_F(FailureTest, SessionClosedDuringBuildLamLeavesNothing) {
  fake_->SetDelay(FakeDevice::Op::kBuildLam, absl::Milliseconds(100));
  absl::Status result;
  std::thread t([&] {
    result = BuildLam(session_, buffer_.buffer(), 0, 2 * page_).status();
  });
  absl::SleepFor(absl::Milliseconds(30));
  core_->OnDisconnect(session_);
  t.join();
  EXPECT_FALSE(result.ok());
  EXPECT_EQ(fake_->LivePdCount(), 0u);
  EXPECT_EQ(fake_->LiveLamCount(), 0u);
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 0u);
}

}  // namespace
}  // namespace mrd::core_test
