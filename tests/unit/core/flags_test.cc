// The device-independent seed rules: NDK_MR_FLAG_* / MEM_* decoding (R3, W6),
// NDK_OP_FLAG_* decoding for FastRegister (F3), and the fast-register page
// array checks (F2, F6).
#include "server/core/flags.h"

#include <cstdint>
#include <limits>
#include <vector>

#include "google/protobuf/repeated_field.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "server/device/device.h"
#include "server/device/fast_register_rules.h"
#include "tests/unit/core/core_test_util.h"

namespace mrd::core_test {
namespace {

using core::FastRegisterAccess;
using core::FlagsFromAccess;
using core::RegistrationAccess;

constexpr uint32_t kLW = device::kAccessLocalWrite;
constexpr uint32_t kRR = device::kAccessRemoteRead;
constexpr uint32_t kRW = device::kAccessRemoteWrite;
constexpr uint32_t kSink = device::kAccessReadSink;

// --- NDK_MR_FLAG_* (R3)
// -------------------------------------------------------

TEST(RegistrationAccessTest, EachNdkMrFlagMapsToItsAccessBits) {
  struct Case {
    uint32_t flags;
    uint32_t access;
  };
  for (const Case& c : std::vector<Case>{
           {v1::NDK_MR_FLAG_ALLOW_LOCAL_READ, 0},
           {v1::NDK_MR_FLAG_ALLOW_LOCAL_WRITE, kLW},
           {v1::NDK_MR_FLAG_ALLOW_REMOTE_READ, kRR},
           {v1::NDK_MR_FLAG_ALLOW_REMOTE_WRITE, kLW | kRW},
           {v1::NDK_MR_FLAG_RDMA_READ_SINK, kSink},
       }) {
    absl::StatusOr<uint32_t> access = RegistrationAccess(c.flags, 0);
    ASSERT_TRUE(access.ok())
        << "flags 0x" << std::hex << c.flags << ": " << access.status();
    EXPECT_EQ(*access, c.access) << "flags 0x" << std::hex << c.flags;
  }
}

TEST(RegistrationAccessTest, EveryCombinationOfDefinedBitsIsDecodedOrRejected) {
  // All 16 values of the four defined bits: 0x4 exists only inside 0x5.
  for (uint32_t flags = 0; flags <= 0xF; ++flags) {
    absl::StatusOr<uint32_t> access = RegistrationAccess(flags, 0);
    if ((flags & 0x4) && !(flags & 0x1)) {
      EXPECT_TRUE(IsSeedError(access.status(),
                              absl::StatusCode::kInvalidArgument,
                              ::mrd::STATUS_INVALID_PARAMETER, "UNKNOWN_FLAGS"))
          << "flags 0x" << std::hex << flags;
      continue;
    }
    ASSERT_TRUE(access.ok())
        << "flags 0x" << std::hex << flags << ": " << access.status();
    uint32_t expected = 0;
    if (flags & 0x1) expected |= kLW;
    if (flags & 0x2) expected |= kRR;
    if (flags & 0x4) expected |= kRW;
    if (flags & 0x8) expected |= kSink;
    EXPECT_EQ(*access, expected) << "flags 0x" << std::hex << flags;
    // The display form gives the same flags back.
    EXPECT_EQ(FlagsFromAccess(*access), flags)
        << "flags 0x" << std::hex << flags;
  }
}

TEST(RegistrationAccessTest, BitFourAloneIsRejected) {
  EXPECT_TRUE(IsSeedError(RegistrationAccess(0x4, 0).status(),
                          absl::StatusCode::kInvalidArgument,
                          ::mrd::STATUS_INVALID_PARAMETER, "UNKNOWN_FLAGS"));
  EXPECT_TRUE(IsSeedError(RegistrationAccess(0x4 | 0x2 | 0x8, 0).status(),
                          absl::StatusCode::kInvalidArgument,
                          ::mrd::STATUS_INVALID_PARAMETER, "UNKNOWN_FLAGS"));
}

TEST(RegistrationAccessTest, RemoteWriteWithReadAndSinkCombines) {
  absl::StatusOr<uint32_t> access = RegistrationAccess(
      v1::NDK_MR_FLAG_ALLOW_REMOTE_WRITE | v1::NDK_MR_FLAG_ALLOW_REMOTE_READ |
          v1::NDK_MR_FLAG_RDMA_READ_SINK,
      0);
  ASSERT_TRUE(access.ok()) << access.status();
  EXPECT_EQ(*access, kLW | kRR | kRW | kSink);
}

TEST(RegistrationAccessTest, UnknownNdkBitsAreInvalidParameter) {
  for (uint32_t flags :
       {0x10u, 0x20u, 0x100u, 0x80000000u, 0x11u, 0xFFFFFFFFu}) {
    EXPECT_TRUE(IsSeedError(RegistrationAccess(flags, 0).status(),
                            absl::StatusCode::kInvalidArgument,
                            ::mrd::STATUS_INVALID_PARAMETER, "UNKNOWN_FLAGS"))
        << "flags 0x" << std::hex << flags;
  }
}

// --- MEM_* (W6)
// ----------------------------------------------------------------

TEST(RegistrationAccessTest, MemFlagsMapToRemoteAccess) {
  absl::StatusOr<uint32_t> read = RegistrationAccess(0, v1::MEM_READ);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, kRR);
  // W7: a remote-write target needs write access (and local write with it).
  absl::StatusOr<uint32_t> write = RegistrationAccess(0, v1::MEM_WRITE);
  ASSERT_TRUE(write.ok()) << write.status();
  EXPECT_EQ(*write, kRW | kLW);
  // W10: MEM_WRITE alone is never remotely readable.
  EXPECT_EQ(*write & kRR, 0u);
  absl::StatusOr<uint32_t> both = RegistrationAccess(0, v1::MEM_READWRITE);
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(*both, kRR | kRW | kLW);
}

TEST(RegistrationAccessTest, UnknownMemFlagsAreWsaeinval) {
  for (uint32_t mem : {0x4u, 0x7u, 0x8u, 0x80000000u}) {
    EXPECT_TRUE(IsSeedError(RegistrationAccess(0, mem).status(),
                            absl::StatusCode::kInvalidArgument,
                            ::mrd::WSAEINVAL, "UNKNOWN_MEM_FLAGS"))
        << "mem_flags 0x" << std::hex << mem;
  }
}

TEST(RegistrationAccessTest, BothFlagFormsAreWsaeinval) {
  EXPECT_TRUE(IsSeedError(
      RegistrationAccess(v1::NDK_MR_FLAG_ALLOW_REMOTE_READ, v1::MEM_READ)
          .status(),
      absl::StatusCode::kInvalidArgument, ::mrd::WSAEINVAL, "BOTH_FLAG_FORMS"));
  EXPECT_TRUE(IsSeedError(
      RegistrationAccess(v1::NDK_MR_FLAG_ALLOW_LOCAL_WRITE, v1::MEM_WRITE)
          .status(),
      absl::StatusCode::kInvalidArgument, ::mrd::WSAEINVAL, "BOTH_FLAG_FORMS"));
}

// --- NDK_OP_FLAG_* (F3)
// ---------------------------------------------------------

TEST(FastRegisterAccessTest, EachOpFlagMapsToItsAccessBits) {
  struct Case {
    uint32_t flags;
    uint32_t access;
  };
  for (const Case& c : std::vector<Case>{
           {v1::NDK_OP_FLAG_NONE, 0},
           {v1::NDK_OP_FLAG_SILENT_SUCCESS, 0},
           {v1::NDK_OP_FLAG_READ_FENCE, 0},
           {v1::NDK_OP_FLAG_DEFER, 0},
           {v1::NDK_OP_FLAG_ALLOW_REMOTE_READ, kRR},
           {v1::NDK_OP_FLAG_ALLOW_LOCAL_WRITE, kLW},
           {v1::NDK_OP_FLAG_ALLOW_REMOTE_WRITE, kLW | kRW},
           {v1::NDK_OP_FLAG_RDMA_READ_SINK, kSink},
       }) {
    absl::StatusOr<uint32_t> access = FastRegisterAccess(c.flags);
    ASSERT_TRUE(access.ok())
        << "flags 0x" << std::hex << c.flags << ": " << access.status();
    EXPECT_EQ(*access, c.access) << "flags 0x" << std::hex << c.flags;
  }
}

TEST(FastRegisterAccessTest, WorkFlagsGrantNoAccess) {
  absl::StatusOr<uint32_t> access =
      FastRegisterAccess(v1::NDK_OP_FLAG_SILENT_SUCCESS |
                         v1::NDK_OP_FLAG_READ_FENCE | v1::NDK_OP_FLAG_DEFER);
  ASSERT_TRUE(access.ok()) << access.status();
  EXPECT_EQ(*access, 0u);
}

TEST(FastRegisterAccessTest, EveryCombinationOfDefinedBitsIsDecodedOrRejected) {
  const std::vector<uint32_t> bits = {0x1, 0x2, 0x8, 0x10, 0x20, 0x40, 0x200};
  for (uint32_t mask = 0; mask < (1u << bits.size()); ++mask) {
    uint32_t flags = 0;
    for (size_t i = 0; i < bits.size(); ++i) {
      if (mask & (1u << i)) flags |= bits[i];
    }
    absl::StatusOr<uint32_t> access = FastRegisterAccess(flags);
    if ((flags & 0x20) && !(flags & 0x10)) {
      EXPECT_TRUE(IsSeedError(access.status(),
                              absl::StatusCode::kInvalidArgument,
                              ::mrd::STATUS_INVALID_PARAMETER, "UNKNOWN_FLAGS"))
          << "flags 0x" << std::hex << flags;
      continue;
    }
    ASSERT_TRUE(access.ok())
        << "flags 0x" << std::hex << flags << ": " << access.status();
    uint32_t expected = 0;
    if (flags & 0x8) expected |= kRR;
    if (flags & 0x10) expected |= kLW;
    if (flags & 0x20) expected |= kRW;
    if (flags & 0x40) expected |= kSink;
    EXPECT_EQ(*access, expected) << "flags 0x" << std::hex << flags;
  }
}

TEST(FastRegisterAccessTest, UnknownOpBitsAreInvalidParameter) {
  for (uint32_t flags :
       {0x4u, 0x80u, 0x100u, 0x400u, 0x80000000u, 0x4u | 0x8u}) {
    EXPECT_TRUE(IsSeedError(FastRegisterAccess(flags).status(),
                            absl::StatusCode::kInvalidArgument,
                            ::mrd::STATUS_INVALID_PARAMETER, "UNKNOWN_FLAGS"))
        << "flags 0x" << std::hex << flags;
  }
}

// --- page arrays (F2, F6)
// -------------------------------------------------------

class PageArrayTest : public ::testing::TestWithParam<uint64_t> {
 protected:
  uint64_t page() const { return GetParam(); }
  google::protobuf::RepeatedField<uint64_t> Pages(
      std::vector<uint64_t> page_numbers) const {
    google::protobuf::RepeatedField<uint64_t> out;
    for (uint64_t n : page_numbers) out.Add(n * page());
    return out;
  }
  absl::Status Check(const google::protobuf::RepeatedField<uint64_t>& pages,
                     uint32_t fbo, uint64_t length, uint64_t base,
                     uint32_t max_pages = 16) const {
    return device::ValidatePageArray(
        page(), max_pages, absl::MakeConstSpan(pages.data(), pages.size()), fbo,
        length, base);
  }
  ::testing::AssertionResult Rejected(const absl::Status& s,
                                      absl::string_view reason) const {
    return IsSeedError(s, absl::StatusCode::kInvalidArgument,
                       ::mrd::STATUS_INVALID_PARAMETER, reason);
  }
};

TEST_P(PageArrayTest, WholePagesAtPageAlignedBaseAreAccepted) {
  EXPECT_OK(Check(Pages({1, 2, 3}), 0, 3 * page(), 7 * page()));
}

TEST_P(PageArrayTest, PagesNeedNotBeConsecutive) {
  EXPECT_OK(Check(Pages({9, 2, 40}), 0, 3 * page(), page()));
}

TEST_P(PageArrayTest, MisalignedPageIsRejected) {
  google::protobuf::RepeatedField<uint64_t> pages = Pages({1, 2});
  pages.Add(3 * page() + 8);
  EXPECT_TRUE(Rejected(Check(pages, 0, page(), page()), "MISALIGNED_PAGE"));
}

TEST_P(PageArrayTest, EmptyPageArrayIsRejected) {
  EXPECT_TRUE(
      Rejected(Check(Pages({}), 0, page(), page()), "EMPTY_PAGE_ARRAY"));
}

TEST_P(PageArrayTest, MoreThanMaxPagesIsRejectedAndMaxIsAccepted) {
  EXPECT_OK(Check(Pages({1, 2, 3, 4}), 0, page(), page(), /*max_pages=*/4));
  EXPECT_TRUE(Rejected(
      Check(Pages({1, 2, 3, 4, 5}), 0, page(), page(), /*max_pages=*/4),
      "PAGE_ARRAY_TOO_LONG"));
}

TEST_P(PageArrayTest, FboOfAPageOrMoreIsRejected) {
  const uint32_t p = static_cast<uint32_t>(page());
  EXPECT_TRUE(
      Rejected(Check(Pages({1, 2}), p, 1, 2 * page()), "FBO_TOO_LARGE"));
  EXPECT_TRUE(Rejected(Check(Pages({1, 2}), p + 1, 1, 2 * page() + 1),
                       "FBO_TOO_LARGE"));
  EXPECT_OK(Check(Pages({1, 2}), p - 1, 1, 2 * page() + p - 1));
}

TEST_P(PageArrayTest, ZeroLengthIsRejected) {
  EXPECT_TRUE(Rejected(Check(Pages({1}), 0, 0, page()), "ZERO_LENGTH"));
}

TEST_P(PageArrayTest,
       LengthUpToCountPagesMinusFboIsAcceptedAndOneMoreRejected) {
  const uint32_t fbo = 100;
  const uint64_t capacity = 3 * page() - fbo;
  EXPECT_OK(Check(Pages({1, 2, 3}), fbo, capacity, page() + fbo));
  EXPECT_TRUE(Rejected(Check(Pages({1, 2, 3}), fbo, capacity + 1, page() + fbo),
                       "LENGTH_EXCEEDS_PAGES"));
}

TEST_P(PageArrayTest, ZeroBaseAddressIsRejectedEvenWithZeroFbo) {
  // F6: zero-based virtual addressing is not supported.
  EXPECT_TRUE(Rejected(Check(Pages({1}), 0, page(), 0), "ZERO_BASED_ADDRESS"));
}

TEST_P(PageArrayTest, BaseNotAtFboIsRejected) {
  EXPECT_TRUE(
      Rejected(Check(Pages({1}), 16, 64, 5 * page() + 17), "BASE_NOT_AT_FBO"));
  EXPECT_TRUE(
      Rejected(Check(Pages({1}), 0, 64, 5 * page() + 1), "BASE_NOT_AT_FBO"));
  EXPECT_TRUE(
      Rejected(Check(Pages({1}), 16, 64, 5 * page()), "BASE_NOT_AT_FBO"));
}

TEST_P(PageArrayTest, BaseAtFboPlusWholePagesIsAccepted) {
  // n = 0: the base is the FBO itself (non-zero because the FBO is).
  EXPECT_OK(Check(Pages({1}), 16, 64, 16));
  EXPECT_OK(Check(Pages({1}), 16, 64, 5 * page() + 16));
  EXPECT_OK(Check(Pages({1}), 16, 64, (uint64_t{1} << 40) + 16));
}

TEST_P(PageArrayTest, BasePlusLengthOverflowIsRejected) {
  const uint32_t fbo = 8;
  const uint64_t top_page =
      std::numeric_limits<uint64_t>::max() / page() * page();
  const uint64_t base = top_page + fbo;
  // Fits exactly: the last byte is UINT64_MAX.
  EXPECT_OK(Check(Pages({1}), fbo, page() - fbo - 1, base));
  EXPECT_TRUE(Rejected(Check(Pages({1}), fbo, page() - fbo, base),
                       "BASE_ADDRESS_OVERFLOW"));
}

INSTANTIATE_TEST_SUITE_P(PageSizes, PageArrayTest,
                         ::testing::Values(uint64_t{4096}, uint64_t{65536}));

}  // namespace
}  // namespace mrd::core_test
