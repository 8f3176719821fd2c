// Helpers for the core tests: status assertions on the seed outcome and
// reason, real sealed memfds, and CoreTest, a fixture that runs a Core on a
// FakeDevice with a FakeClock and checks in TearDown that nothing is left
// (every test is also a leak test).
#ifndef MRD_TESTS_UNIT_CORE_CORE_TEST_UTIL_H_
#define MRD_TESTS_UNIT_CORE_CORE_TEST_UTIL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "mrd/unique_fd.h"
#include "mrd/v1/mrd.pb.h"
#include "server/common/clock.h"
#include "server/core/core.h"
#include "tests/unit/core/fake_device.h"

namespace mrd::core_test {

// Passes if `status` has `code`, seed outcome `seed` and reason `reason` in
// its ErrorDetail.
::testing::AssertionResult IsSeedError(const absl::Status& status,
                                       absl::StatusCode code,
                                       ::mrd::SeedStatus seed,
                                       absl::string_view reason);
// As IsSeedError, also checking ErrorDetail.required_size.
::testing::AssertionResult IsSeedErrorWithSize(const absl::Status& status,
                                               absl::StatusCode code,
                                               ::mrd::SeedStatus seed,
                                               absl::string_view reason,
                                               uint64_t required_size);
// An error with no seed counterpart (SEED_STATUS_UNSPECIFIED) and `reason`.
::testing::AssertionResult IsMrdError(const absl::Status& status,
                                      absl::StatusCode code,
                                      absl::string_view reason);

// Passes if `status` is OK; the failure message shows the status.
::testing::AssertionResult IsOk(const absl::Status& status);

#define EXPECT_OK(expr) EXPECT_TRUE(::mrd::core_test::IsOk(expr))
#define ASSERT_OK(expr) ASSERT_TRUE(::mrd::core_test::IsOk(expr))

// A memfd of `size` zero bytes (MFD_ALLOW_SEALING) sealed with
// F_SEAL_SHRINK. Fails the test and returns an invalid fd on error.
UniqueFd MakeSealedMemfd(uint64_t size);

// An fd session of this process on `core` with one writable buffer: a
// sealed memfd of `size` bytes, filled with a pattern of letters, that the
// test keeps a descriptor of to check bytes through.
struct SessionWithBuffer {
  std::string session;
  UniqueFd memfd;
  std::string pattern;  // what the memfd holds
  v1::BufferInfo buffer;
};
absl::StatusOr<SessionWithBuffer> OpenSessionWithBuffer(core::Core& core,
                                                        uint64_t size);

// RegisterMr and DeregisterMr (one implicit reference; the references left)
// on `core`.
absl::StatusOr<v1::RegisterMrResponse> RegisterOn(
    core::Core& core, const v1::RegisterMrRequest& req);
absl::StatusOr<uint32_t> DeregisterOn(core::Core& core,
                                      const std::string& session,
                                      uint64_t registration);

// NDK_MR_FLAG_* and NDK_OP_FLAG_* values, for readable tests.
inline constexpr uint32_t kMrLocalRead = v1::NDK_MR_FLAG_ALLOW_LOCAL_READ;
inline constexpr uint32_t kMrLocalWrite = v1::NDK_MR_FLAG_ALLOW_LOCAL_WRITE;
inline constexpr uint32_t kMrRemoteRead = v1::NDK_MR_FLAG_ALLOW_REMOTE_READ;
inline constexpr uint32_t kMrRemoteWrite = v1::NDK_MR_FLAG_ALLOW_REMOTE_WRITE;
inline constexpr uint32_t kMrReadSink = v1::NDK_MR_FLAG_RDMA_READ_SINK;
inline constexpr uint32_t kOpSilent = v1::NDK_OP_FLAG_SILENT_SUCCESS;
inline constexpr uint32_t kOpReadFence = v1::NDK_OP_FLAG_READ_FENCE;
inline constexpr uint32_t kOpRemoteRead = v1::NDK_OP_FLAG_ALLOW_REMOTE_READ;
inline constexpr uint32_t kOpLocalWrite = v1::NDK_OP_FLAG_ALLOW_LOCAL_WRITE;
inline constexpr uint32_t kOpRemoteWrite = v1::NDK_OP_FLAG_ALLOW_REMOTE_WRITE;
inline constexpr uint32_t kOpReadSink = v1::NDK_OP_FLAG_RDMA_READ_SINK;
inline constexpr uint32_t kOpDefer = v1::NDK_OP_FLAG_DEFER;

class CoreTest : public ::testing::Test {
 protected:
  CoreTest();

  // Tests that need other options change these before calling SetUp()
  // themselves (from their own SetUp, or by overriding Configure).
  virtual void Configure(core::CoreOptions& /*options*/,
                         fake::FakeDeviceOptions& /*device*/) {}

  void SetUp() override;
  // Shuts the core down, then checks that the device holds nothing (no PD,
  // MR, LAM, pinned byte) and that the core accounts no pinned byte.
  void TearDown() override;

  // A new fd session (Core::OnConnect, as the fd socket would).
  std::string Connect(uint32_t uid = 1000, int pid = 4242);
  // A new lease session.
  std::string OpenLease(uint32_t ttl_seconds);
  // Imports a fresh sealed memfd of `size` bytes into `session`.
  absl::StatusOr<v1::BufferInfo> TryImport(const std::string& session,
                                           uint64_t size, bool writable = true);
  v1::BufferInfo Import(const std::string& session, uint64_t size,
                        bool writable = true);
  // Imports a duplicate of `fd` (the same file again).
  v1::BufferInfo ImportDup(const std::string& session, int fd,
                           bool writable = true);

  static v1::RegisterMrRequest RegisterRequest(const std::string& session,
                                               uint64_t buffer, uint64_t offset,
                                               uint64_t length, uint32_t flags);
  absl::StatusOr<v1::RegisterMrResponse> Register(
      const v1::RegisterMrRequest& req);
  absl::StatusOr<v1::RegisterMrResponse> Register(const std::string& session,
                                                  uint64_t buffer,
                                                  uint64_t offset,
                                                  uint64_t length,
                                                  uint32_t flags);
  // DeregisterMr of one implicit reference; returns the references left.
  absl::StatusOr<uint32_t> Deregister(const std::string& session,
                                      uint64_t registration);
  absl::StatusOr<uint32_t> DeregisterByMr(const std::string& session,
                                          uint64_t mr);
  absl::StatusOr<v1::BuildLamResponse> BuildLam(const std::string& session,
                                                uint64_t buffer,
                                                uint64_t offset,
                                                uint64_t length,
                                                uint32_t lam_capacity = 0);
  absl::Status ReleaseLam(const std::string& session, uint64_t lam);
  absl::StatusOr<v1::MrInfo> CreateMr(const std::string& session,
                                      bool fast_register,
                                      bool allow_remote = false);
  absl::Status CloseMr(const std::string& session, uint64_t mr);
  absl::StatusOr<v1::ListRegistrationsResponse> List(
      const std::string& session);
  // The MrInfo of `mr` in ListRegistrations (default if absent).
  v1::MrInfo MrState(const std::string& session, uint64_t mr);
  absl::StatusOr<v1::ReleaseBufferResponse> ReleaseBuffer(
      const std::string& session, uint64_t buffer);

  // A remote peer connects with the session's peer ticket.
  device::ConnectionId ConnectPeer(const std::string& session);
  // FastRegister of a whole LAM (all its pages, its FBO and length) at base
  // address 16 * PAGE_SIZE + fbo.
  v1::FastRegisterRequest FastRegisterRequest(const std::string& session,
                                              device::ConnectionId connection,
                                              uint64_t mr,
                                              const v1::BuildLamResponse& lam,
                                              uint32_t flags,
                                              uint64_t request_context);
  absl::StatusOr<v1::FastRegisterResponse> FastRegister(
      const v1::FastRegisterRequest& req);
  absl::StatusOr<v1::InvalidateMrResponse> Invalidate(
      const std::string& session, device::ConnectionId connection, uint64_t mr,
      uint32_t flags, uint64_t request_context);

  // Runs the fake's posted work and returns the session's queued
  // completions (subscribing to its stream on first use).
  std::vector<v1::Completion> RunWorkAndDrain(const std::string& session);
  std::vector<v1::Completion> Drain(const std::string& session);

  // The core's pinned-byte accounting matches the device's, and every live
  // device object still describes mapped memory of its file.
  void ExpectAccountingMatchesDevice();

  uint64_t page_ = 0;
  core::CoreOptions options_;
  fake::FakeDeviceOptions device_options_;
  FakeClock clock_;
  std::unique_ptr<fake::FakeDevice> fake_;
  std::unique_ptr<core::Core> core_;
  // Set by tests that tear the core down themselves.
  bool skip_teardown_checks_ = false;

 private:
  std::map<std::string, core::CompletionSubscription> streams_;
};

}  // namespace mrd::core_test

#endif  // MRD_TESTS_UNIT_CORE_CORE_TEST_UTIL_H_
