// Core BuildLam / ReleaseLam (L1-L8): page arrays, FBO, the caller's space
// for the mapping (BUFFER_TOO_SMALL with the required size), pinning.
#include <cstdint>
#include <set>
#include <string>

#include "gtest/gtest.h"
#include "mrd/status.h"
#include "tests/unit/core/core_test_util.h"

namespace mrd::core_test {
namespace {

using fake::FakeDevice;

class LamTest : public CoreTest {
 protected:
  void SetUp() override {
    CoreTest::SetUp();
    session_ = Connect();
    buffer_ = Import(session_, 16 * page_);
  }
  std::string session_;
  v1::BufferInfo buffer_;
};

TEST_F(LamTest, BuildLamReturnsAlignedPagesAndFirstByteOffset) {
  absl::StatusOr<v1::BuildLamResponse> lam =
      BuildLam(session_, buffer_.buffer(), page_ + 24, 2 * page_);
  ASSERT_TRUE(lam.ok()) << lam.status();
  // [page+24, 3*page+24) touches three pages.
  ASSERT_EQ(lam->pages_size(), 3);
  EXPECT_EQ(lam->fbo(), 24u);
  EXPECT_EQ(lam->length(), 2 * page_);
  EXPECT_EQ(lam->lam_size(), 8u + 8u * 3u);
  std::set<uint64_t> distinct;
  for (uint64_t p : lam->pages()) {
    EXPECT_EQ(p % page_, 0u) << "logical page 0x" << std::hex << p;
    distinct.insert(p);
  }
  EXPECT_EQ(distinct.size(), 3u);
  // L4: the pages are pinned while the mapping exists.
  EXPECT_EQ(fake_->LiveLamCount(), 1u);
  EXPECT_EQ(fake_->PinnedBytes(), 3 * page_);
  ExpectAccountingMatchesDevice();
  absl::StatusOr<v1::ListRegistrationsResponse> list = List(session_);
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->lams_size(), 1);
  EXPECT_EQ(list->lams(0).lam(), lam->lam());
  EXPECT_EQ(list->lams(0).page_count(), 3u);
  EXPECT_EQ(list->lams(0).fbo(), 24u);
}

TEST_F(LamTest, PageAlignedRegionHasZeroFbo) {
  absl::StatusOr<v1::BuildLamResponse> lam =
      BuildLam(session_, buffer_.buffer(), 2 * page_, page_);
  ASSERT_TRUE(lam.ok()) << lam.status();
  EXPECT_EQ(lam->pages_size(), 1);
  EXPECT_EQ(lam->fbo(), 0u);
  EXPECT_EQ(lam->lam_size(), 16u);
}

TEST_F(LamTest, TooSmallLamCapacityIsBufferTooSmallWithRequiredSize) {
  // Three pages need 8 + 3 * 8 = 32 bytes.
  absl::Status s =
      BuildLam(session_, buffer_.buffer(), 100, 2 * page_, /*lam_capacity=*/31)
          .status();
  EXPECT_TRUE(IsSeedErrorWithSize(s, absl::StatusCode::kOutOfRange,
                                  ::mrd::STATUS_BUFFER_TOO_SMALL,
                                  "LAM_SPACE_TOO_SMALL", 32));
  s = BuildLam(session_, buffer_.buffer(), 100, 2 * page_, 8).status();
  EXPECT_TRUE(IsSeedErrorWithSize(s, absl::StatusCode::kOutOfRange,
                                  ::mrd::STATUS_BUFFER_TOO_SMALL,
                                  "LAM_SPACE_TOO_SMALL", 32));
  // Nothing was pinned or mapped for it.
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kBuildLam), 0u);
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 0u);
  EXPECT_EQ(core_->Stats().lams, 0u);
  // Exactly enough space works and says how much it wrote.
  absl::StatusOr<v1::BuildLamResponse> lam =
      BuildLam(session_, buffer_.buffer(), 100, 2 * page_, 32);
  ASSERT_TRUE(lam.ok()) << lam.status();
  EXPECT_EQ(lam->lam_size(), 32u);
}

TEST_F(LamTest, RegionOutsideTheBufferIsInvalidParameter) {
  EXPECT_TRUE(IsSeedError(
      BuildLam(session_, buffer_.buffer(), 0, 16 * page_ + 1).status(),
      absl::StatusCode::kInvalidArgument, ::mrd::STATUS_INVALID_PARAMETER,
      "LENGTH_PAST_BUFFER"));
  EXPECT_TRUE(
      IsSeedError(BuildLam(session_, buffer_.buffer(), 16 * page_, 1).status(),
                  absl::StatusCode::kInvalidArgument,
                  ::mrd::STATUS_INVALID_PARAMETER, "OFFSET_PAST_END"));
  EXPECT_TRUE(IsSeedError(BuildLam(session_, buffer_.buffer(), 0, 0).status(),
                          absl::StatusCode::kInvalidArgument,
                          ::mrd::STATUS_INVALID_PARAMETER, "ZERO_LENGTH"));
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kBuildLam), 0u);
}

TEST_F(LamTest, ReleaseLamUnpinsAndForgetsItsPages) {
  absl::StatusOr<v1::BuildLamResponse> lam =
      BuildLam(session_, buffer_.buffer(), 0, 2 * page_);
  ASSERT_TRUE(lam.ok());
  EXPECT_OK(ReleaseLam(session_, lam->lam()));
  EXPECT_EQ(fake_->LiveLamCount(), 0u);
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 0u);
  EXPECT_TRUE(IsMrdError(ReleaseLam(session_, lam->lam()),
                         absl::StatusCode::kNotFound, "UNKNOWN_LAM"));
  // Its logical addresses mean nothing any more (F2 page checks).
  absl::StatusOr<v1::MrInfo> mr = CreateMr(session_, true, true);
  ASSERT_TRUE(mr.ok());
  device::ConnectionId connection = ConnectPeer(session_);
  EXPECT_TRUE(IsSeedError(
      FastRegister(
          FastRegisterRequest(session_, connection, mr->mr(), *lam, 0, 1))
          .status(),
      absl::StatusCode::kInvalidArgument, ::mrd::STATUS_INVALID_PARAMETER,
      "UNKNOWN_LOGICAL_ADDRESS"));
}

TEST_F(LamTest, EveryLamPinsItsOwnPages) {
  absl::StatusOr<v1::BuildLamResponse> a =
      BuildLam(session_, buffer_.buffer(), 0, page_);
  absl::StatusOr<v1::BuildLamResponse> b =
      BuildLam(session_, buffer_.buffer(), 0, page_);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->lam(), b->lam());
  EXPECT_NE(a->pages(0), b->pages(0));
  EXPECT_EQ(fake_->LiveLamCount(), 2u);
  ExpectAccountingMatchesDevice();
  EXPECT_OK(ReleaseLam(session_, a->lam()));
  EXPECT_EQ(fake_->PinnedBytes(), page_);
  ExpectAccountingMatchesDevice();
}

TEST_F(LamTest, UnknownBufferIsNotFound) {
  EXPECT_TRUE(
      IsMrdError(BuildLam(session_, buffer_.buffer() + 99, 0, page_).status(),
                 absl::StatusCode::kNotFound, "UNKNOWN_BUFFER"));
}

class LamLimitTest : public LamTest {
 protected:
  void Configure(core::CoreOptions& options,
                 fake::FakeDeviceOptions&) override {
    options.max_session_lams = 2;
  }
};

TEST_F(LamLimitTest, SessionLamLimitIsInsufficientResources) {
  ASSERT_TRUE(BuildLam(session_, buffer_.buffer(), 0, page_).ok());
  absl::StatusOr<v1::BuildLamResponse> second =
      BuildLam(session_, buffer_.buffer(), 0, page_);
  ASSERT_TRUE(second.ok());
  EXPECT_TRUE(
      IsSeedError(BuildLam(session_, buffer_.buffer(), 0, page_).status(),
                  absl::StatusCode::kResourceExhausted,
                  ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_SESSION_LAMS"));
  EXPECT_EQ(fake_->LiveLamCount(), 2u);
  EXPECT_OK(ReleaseLam(session_, second->lam()));
  EXPECT_TRUE(BuildLam(session_, buffer_.buffer(), 0, page_).ok());
}

// The server-wide caps on buffers, LAMs and MR objects hold across
// sessions, and what one session gives back another may take.
class TotalObjectLimitTest : public CoreTest {
 protected:
  void Configure(core::CoreOptions& options,
                 fake::FakeDeviceOptions&) override {
    options.max_total_buffers = 2;
    options.max_total_lams = 1;
    options.max_total_mrs = 1;
  }
};

TEST_F(TotalObjectLimitTest, CapsHoldAcrossSessions) {
  const std::string a = Connect(1000);
  const std::string b = Connect(1001);
  v1::BufferInfo buffer_a = Import(a, page_);
  v1::BufferInfo buffer_b = Import(b, page_);
  EXPECT_TRUE(IsSeedError(
      TryImport(b, page_).status(), absl::StatusCode::kResourceExhausted,
      ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_TOTAL_BUFFERS"));

  absl::StatusOr<v1::BuildLamResponse> lam =
      BuildLam(a, buffer_a.buffer(), 0, page_);
  ASSERT_TRUE(lam.ok()) << lam.status();
  EXPECT_TRUE(IsSeedError(BuildLam(b, buffer_b.buffer(), 0, page_).status(),
                          absl::StatusCode::kResourceExhausted,
                          ::mrd::STATUS_INSUFFICIENT_RESOURCES,
                          "LIMIT_TOTAL_LAMS"));
  EXPECT_OK(ReleaseLam(a, lam->lam()));
  EXPECT_TRUE(BuildLam(b, buffer_b.buffer(), 0, page_).ok());

  absl::StatusOr<v1::MrInfo> mr = CreateMr(a, /*fast_register=*/false);
  ASSERT_TRUE(mr.ok()) << mr.status();
  EXPECT_TRUE(IsSeedError(
      CreateMr(b, false).status(), absl::StatusCode::kResourceExhausted,
      ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_TOTAL_MRS"));
  EXPECT_OK(CloseMr(a, mr->mr()));
  EXPECT_TRUE(CreateMr(b, false).ok());
}

}  // namespace
}  // namespace mrd::core_test
