// Core registration: RegisterMr / DeregisterMr through the reference-counted
// cache (W5), the argument rules (R2, R8, W2, R3, W6), MR objects (R4),
// idempotent retries, read-only buffers and buffer release (W11).
#include "server/core/core.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "gtest/gtest.h"
#include "mrd/status.h"
#include "tests/unit/core/core_test_util.h"

namespace mrd::core_test {
namespace {

using fake::FakeDevice;

uint64_t ReadLe(const std::string& bytes, size_t at, int width) {
  uint64_t v = 0;
  for (int i = width - 1; i >= 0; --i) {
    v = (v << 8) |
        static_cast<unsigned char>(bytes[at + static_cast<size_t>(i)]);
  }
  return v;
}

class RegistrationTest : public CoreTest {
 protected:
  void SetUp() override {
    CoreTest::SetUp();
    session_ = Connect();
    buffer_ = Import(session_, 16 * page_);
  }

  absl::StatusOr<v1::RegisterMrResponse> Reg(uint64_t offset, uint64_t length,
                                             uint32_t flags = kMrRemoteRead) {
    return Register(session_, buffer_.buffer(), offset, length, flags);
  }

  std::string session_;
  v1::BufferInfo buffer_;
};

// --- W5: the cache
// ---------------------------------------------------------------

TEST_F(RegistrationTest, SecondRegisterOfSameRangeReturnsSameDescriptor) {
  absl::StatusOr<v1::RegisterMrResponse> first = Reg(0, 2 * page_);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->references(), 1u);
  EXPECT_FALSE(first->cache_hit());
  absl::StatusOr<v1::RegisterMrResponse> second = Reg(0, 2 * page_);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->registration(), first->registration());
  EXPECT_EQ(second->references(), 2u);
  EXPECT_TRUE(second->cache_hit());
  EXPECT_EQ(second->rkey(), first->rkey());
  EXPECT_EQ(second->lkey(), first->lkey());
  EXPECT_EQ(second->rdma_descriptor(), first->rdma_descriptor());
  // One device registration for both.
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kRegisterMr), 1u);
  EXPECT_EQ(fake_->LiveRegisteredMrCount(), 1u);
  EXPECT_EQ(core_->Stats().cache.hits, 1u);
  ExpectAccountingMatchesDevice();
}

// --- the forms that never block (answered on a gRPC thread) -----------------

TEST_F(RegistrationTest, TryRegisterHitAnswersOnlyHits) {
  v1::RegisterMrRequest req =
      RegisterRequest(session_, buffer_.buffer(), 0, 2 * page_, kMrRemoteRead);
  v1::RegisterMrResponse out;
  // A miss would pin: not answered, and nothing was done.
  EXPECT_FALSE(core_->TryRegisterMrHit(req, &out).has_value());
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kRegisterMr), 0u);
  EXPECT_EQ(core_->Stats().registrations, 0u);
  absl::StatusOr<v1::RegisterMrResponse> first = Register(req);
  ASSERT_OK(first.status());
  std::optional<absl::Status> hit = core_->TryRegisterMrHit(req, &out);
  ASSERT_TRUE(hit.has_value());
  ASSERT_OK(*hit);
  EXPECT_TRUE(out.cache_hit());
  EXPECT_EQ(out.references(), 2u);
  EXPECT_EQ(out.registration(), first->registration());
  EXPECT_EQ(out.rdma_descriptor(), first->rdma_descriptor());
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kRegisterMr), 1u);
  // An error found before anything is pinned is answered too.
  v1::RegisterMrRequest bad = req;
  bad.set_buffer(987654);
  std::optional<absl::Status> refused = core_->TryRegisterMrHit(bad, &out);
  ASSERT_TRUE(refused.has_value());
  EXPECT_TRUE(
      IsMrdError(*refused, absl::StatusCode::kNotFound, "UNKNOWN_BUFFER"));
  ExpectAccountingMatchesDevice();
}

TEST_F(RegistrationTest, TryDeregisterAnswersOnlyWhatLeavesReferences) {
  absl::StatusOr<v1::RegisterMrResponse> first = Reg(0, page_);
  ASSERT_OK(first.status());
  v1::DeregisterMrRequest req;
  req.set_session(session_);
  req.set_registration(first->registration());
  v1::DeregisterMrResponse out;
  // The last reference deregisters on the device: not answered here, and
  // the registration is untouched.
  EXPECT_FALSE(core_->TryDeregisterMrNotLast(req, &out).has_value());
  EXPECT_EQ(fake_->LiveRegisteredMrCount(), 1u);
  ASSERT_OK(Reg(0, page_).status());  // a second reference
  std::optional<absl::Status> dropped =
      core_->TryDeregisterMrNotLast(req, &out);
  ASSERT_TRUE(dropped.has_value());
  ASSERT_OK(*dropped);
  EXPECT_EQ(out.references(), 1u);
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kDeregisterMr), 0u);
  absl::StatusOr<v1::ListRegistrationsResponse> list = List(session_);
  ASSERT_OK(list.status());
  ASSERT_EQ(list->registrations_size(), 1);
  EXPECT_EQ(list->registrations(0).references(), 1u);
  // Now the last one again: the worker path, which deregisters.
  EXPECT_FALSE(core_->TryDeregisterMrNotLast(req, &out).has_value());
  absl::StatusOr<uint32_t> left = Deregister(session_, first->registration());
  ASSERT_OK(left.status());
  EXPECT_EQ(*left, 0u);
  EXPECT_EQ(fake_->LiveRegisteredMrCount(), 0u);
}

TEST_F(RegistrationTest, OnlyTheLastDeregisterRevokesTheKey) {
  absl::StatusOr<v1::RegisterMrResponse> first = Reg(0, page_);
  absl::StatusOr<v1::RegisterMrResponse> second = Reg(0, page_);
  ASSERT_TRUE(first.ok() && second.ok());
  const uint32_t rkey = first->rkey();
  EXPECT_TRUE(fake_->IsKeyValid(rkey));

  absl::StatusOr<uint32_t> left = Deregister(session_, first->registration());
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(*left, 1u);
  EXPECT_TRUE(fake_->IsKeyValid(rkey)) << "revoked while still referenced";
  EXPECT_EQ(fake_->PinnedBytes(), page_);

  left = Deregister(session_, first->registration());
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(*left, 0u);
  EXPECT_FALSE(fake_->IsKeyValid(rkey));
  EXPECT_EQ(fake_->LiveMrCount(), 0u);
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 0u);

  EXPECT_TRUE(IsMrdError(Deregister(session_, first->registration()).status(),
                         absl::StatusCode::kNotFound, "UNKNOWN_REGISTRATION"));
}

TEST_F(RegistrationTest, RegisterAfterLastDeregisterGetsAFreshKey) {
  absl::StatusOr<v1::RegisterMrResponse> first = Reg(0, page_);
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(Deregister(session_, first->registration()).ok());
  absl::StatusOr<v1::RegisterMrResponse> again = Reg(0, page_);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->cache_hit());
  EXPECT_NE(again->registration(), first->registration());
  EXPECT_NE(again->rkey(), first->rkey());
  EXPECT_FALSE(fake_->IsKeyValid(first->rkey()));
  EXPECT_TRUE(fake_->IsKeyValid(again->rkey()));
}

TEST_F(RegistrationTest, DifferentAccessMakesADifferentRegistration) {
  absl::StatusOr<v1::RegisterMrResponse> read = Reg(0, page_, kMrRemoteRead);
  absl::StatusOr<v1::RegisterMrResponse> write = Reg(0, page_, kMrRemoteWrite);
  ASSERT_TRUE(read.ok() && write.ok());
  EXPECT_NE(read->registration(), write->registration());
  EXPECT_NE(read->rkey(), write->rkey());
  EXPECT_FALSE(write->cache_hit());
  EXPECT_EQ(write->references(), 1u);
  EXPECT_EQ(fake_->LiveRegisteredMrCount(), 2u);
}

TEST_F(RegistrationTest, DifferentRangeMakesADifferentRegistration) {
  absl::StatusOr<v1::RegisterMrResponse> a = Reg(0, page_);
  absl::StatusOr<v1::RegisterMrResponse> b = Reg(0, page_ + 1);
  absl::StatusOr<v1::RegisterMrResponse> c = Reg(1, page_);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_NE(a->registration(), b->registration());
  EXPECT_NE(a->registration(), c->registration());
  EXPECT_NE(b->registration(), c->registration());
  EXPECT_EQ(fake_->LiveRegisteredMrCount(), 3u);
  ExpectAccountingMatchesDevice();
}

TEST_F(RegistrationTest, DescriptorCarriesRkeyBaseAndLength) {
  absl::StatusOr<v1::RegisterMrResponse> r = Reg(3 * page_ + 5, 1000);
  ASSERT_TRUE(r.ok()) << r.status();
  const uint64_t base = buffer_.address() + 3 * page_ + 5;
  EXPECT_EQ(r->base_address(), base);
  EXPECT_EQ(r->length(), 1000u);
  const std::string& d = r->rdma_descriptor();
  ASSERT_EQ(d.size(), 24u);
  EXPECT_EQ(ReadLe(d, 0, 4), r->rkey());
  EXPECT_EQ(ReadLe(d, 4, 4), 0u);
  EXPECT_EQ(ReadLe(d, 8, 8), base);
  EXPECT_EQ(ReadLe(d, 16, 8), 1000u);
  // The device registered exactly that window at that base (R7).
  EXPECT_OK(fake_->PeerAccess(r->rkey(), base, 1000, /*write=*/false));
  EXPECT_FALSE(fake_->PeerAccess(r->rkey(), base + 1000, 1, false).ok());
  EXPECT_FALSE(fake_->PeerAccess(r->rkey(), base - 1, 1, false).ok());
}

TEST_F(RegistrationTest, ExplicitBaseAddressIsTheRegionsAddress) {
  v1::RegisterMrRequest req =
      RegisterRequest(session_, buffer_.buffer(), 0, page_, kMrRemoteRead);
  req.set_base_address(0xabc000);
  absl::StatusOr<v1::RegisterMrResponse> r = Register(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->base_address(), 0xabc000u);
  EXPECT_OK(fake_->PeerAccess(r->rkey(), 0xabc000, page_, false));
  // Another base is another registration.
  req.set_base_address(0xdef000);
  absl::StatusOr<v1::RegisterMrResponse> other = Register(req);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(other->registration(), r->registration());
}

// W10: what is registered for remote read only is never remotely writable,
// and the other way round.
TEST_F(RegistrationTest, RemoteAccessIsExactlyWhatWasAskedFor) {
  v1::RegisterMrRequest req =
      RegisterRequest(session_, buffer_.buffer(), 0, page_, 0);
  req.set_mem_flags(v1::MEM_READ);
  absl::StatusOr<v1::RegisterMrResponse> read = Register(req);
  req.set_mem_flags(v1::MEM_WRITE);
  absl::StatusOr<v1::RegisterMrResponse> write = Register(req);
  ASSERT_TRUE(read.ok() && write.ok());
  const uint64_t base = read->base_address();
  EXPECT_OK(fake_->PeerAccess(read->rkey(), base, page_, /*write=*/false));
  EXPECT_FALSE(fake_->PeerAccess(read->rkey(), base, page_, true).ok());
  EXPECT_OK(fake_->PeerAccess(write->rkey(), base, page_, /*write=*/true));
  EXPECT_FALSE(fake_->PeerAccess(write->rkey(), base, page_, false).ok());
  // Local-only flags give nothing remotely.
  absl::StatusOr<v1::RegisterMrResponse> local = Reg(0, page_, kMrLocalWrite);
  ASSERT_TRUE(local.ok());
  EXPECT_FALSE(fake_->PeerAccess(local->rkey(), base, 1, false).ok());
  EXPECT_FALSE(fake_->PeerAccess(local->rkey(), base, 1, true).ok());
}

TEST_F(RegistrationTest, PinnedBytesArePageRoundedPerRegistration) {
  // 100 bytes into page 0 up to page 1: two pages.
  ASSERT_TRUE(Reg(100, page_).ok());
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 2 * page_);
  v1::GetSessionRequest get;
  get.set_session(session_);
  v1::SessionInfo info;
  ASSERT_OK(core_->GetSession(get, &info));
  EXPECT_EQ(info.pinned_bytes(), 2 * page_);
  EXPECT_EQ(info.registrations(), 1u);
  ExpectAccountingMatchesDevice();
}

// --- R2, R8, W2, flags: refused before anything is registered
// ---------------------

TEST_F(RegistrationTest, LengthPastBufferIsInvalidParameter) {
  EXPECT_TRUE(IsSeedError(
      Reg(0, 16 * page_ + 1).status(), absl::StatusCode::kInvalidArgument,
      ::mrd::STATUS_INVALID_PARAMETER, "LENGTH_PAST_BUFFER"));
  EXPECT_TRUE(IsSeedError(
      Reg(15 * page_, page_ + 1).status(), absl::StatusCode::kInvalidArgument,
      ::mrd::STATUS_INVALID_PARAMETER, "LENGTH_PAST_BUFFER"));
  // Exactly to the end is fine.
  EXPECT_TRUE(Reg(15 * page_, page_).ok());
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kRegisterMr), 1u);
}

TEST_F(RegistrationTest, OffsetPastEndIsInvalidParameter) {
  EXPECT_TRUE(IsSeedError(Reg(16 * page_, 1).status(),
                          absl::StatusCode::kInvalidArgument,
                          ::mrd::STATUS_INVALID_PARAMETER, "OFFSET_PAST_END"));
  EXPECT_TRUE(IsSeedError(Reg(uint64_t{1} << 62, 1).status(),
                          absl::StatusCode::kInvalidArgument,
                          ::mrd::STATUS_INVALID_PARAMETER, "OFFSET_PAST_END"));
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kRegisterMr), 0u);
}

TEST_F(RegistrationTest, OffsetPlusLengthOverflowIsInvalidParameter) {
  EXPECT_TRUE(
      IsSeedError(Reg(page_, std::numeric_limits<uint64_t>::max()).status(),
                  absl::StatusCode::kInvalidArgument,
                  ::mrd::STATUS_INVALID_PARAMETER, "LENGTH_OVERFLOW"));
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kRegisterMr), 0u);
}

TEST_F(RegistrationTest, ZeroLengthIsInvalidParameter) {
  EXPECT_TRUE(IsSeedError(Reg(0, 0).status(),
                          absl::StatusCode::kInvalidArgument,
                          ::mrd::STATUS_INVALID_PARAMETER, "ZERO_LENGTH"));
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kRegisterMr), 0u);
}

TEST_F(RegistrationTest, ExplicitZeroBaseAddressIsRejected) {
  v1::RegisterMrRequest req =
      RegisterRequest(session_, buffer_.buffer(), 0, page_, kMrRemoteRead);
  req.set_base_address(0);
  EXPECT_TRUE(
      IsSeedError(Register(req).status(), absl::StatusCode::kInvalidArgument,
                  ::mrd::STATUS_INVALID_PARAMETER, "ZERO_BASED_ADDRESS"));
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kRegisterMr), 0u);
}

TEST_F(RegistrationTest, BaseAddressPlusLengthOverflowIsRejected) {
  v1::RegisterMrRequest req =
      RegisterRequest(session_, buffer_.buffer(), 0, page_, kMrRemoteRead);
  req.set_base_address(std::numeric_limits<uint64_t>::max() - page_ + 2);
  EXPECT_TRUE(
      IsSeedError(Register(req).status(), absl::StatusCode::kInvalidArgument,
                  ::mrd::STATUS_INVALID_PARAMETER, "BASE_ADDRESS_OVERFLOW"));
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kRegisterMr), 0u);
}

TEST_F(RegistrationTest, TooSmallDescriptorSpaceIsWsaefaultWithRequiredSize) {
  v1::RegisterMrRequest req =
      RegisterRequest(session_, buffer_.buffer(), 0, page_, kMrRemoteRead);
  req.set_descriptor_capacity(8);
  EXPECT_TRUE(
      IsSeedErrorWithSize(Register(req).status(), absl::StatusCode::kOutOfRange,
                          ::mrd::WSAEFAULT, "DESCRIPTOR_SPACE_TOO_SMALL", 24));
  req.set_descriptor_capacity(23);
  EXPECT_TRUE(
      IsSeedErrorWithSize(Register(req).status(), absl::StatusCode::kOutOfRange,
                          ::mrd::WSAEFAULT, "DESCRIPTOR_SPACE_TOO_SMALL", 24));
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kRegisterMr), 0u);
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
  EXPECT_EQ(core_->Stats().registrations, 0u);
  req.set_descriptor_capacity(24);
  EXPECT_TRUE(Register(req).ok());
}

TEST_F(RegistrationTest, BadFlagsAreRejectedBeforeAnythingIsRegistered) {
  EXPECT_TRUE(IsSeedError(Reg(0, page_, 0x10).status(),
                          absl::StatusCode::kInvalidArgument,
                          ::mrd::STATUS_INVALID_PARAMETER, "UNKNOWN_FLAGS"));
  EXPECT_TRUE(IsSeedError(Reg(0, page_, 0x4).status(),
                          absl::StatusCode::kInvalidArgument,
                          ::mrd::STATUS_INVALID_PARAMETER, "UNKNOWN_FLAGS"));
  v1::RegisterMrRequest req =
      RegisterRequest(session_, buffer_.buffer(), 0, page_, kMrRemoteRead);
  req.set_mem_flags(v1::MEM_READ);
  EXPECT_TRUE(IsSeedError(Register(req).status(),
                          absl::StatusCode::kInvalidArgument, ::mrd::WSAEINVAL,
                          "BOTH_FLAG_FORMS"));
  req.set_flags(0);
  req.set_mem_flags(0x4);
  EXPECT_TRUE(IsSeedError(Register(req).status(),
                          absl::StatusCode::kInvalidArgument, ::mrd::WSAEINVAL,
                          "UNKNOWN_MEM_FLAGS"));
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kRegisterMr), 0u);
}

TEST_F(RegistrationTest, UnknownBufferIsNotFound) {
  EXPECT_TRUE(IsMrdError(
      Register(session_, buffer_.buffer() + 1000, 0, page_, kMrRemoteRead)
          .status(),
      absl::StatusCode::kNotFound, "UNKNOWN_BUFFER"));
}

TEST_F(RegistrationTest, DeregisterWithoutTargetIsInvalidParameter) {
  v1::DeregisterMrRequest req;
  req.set_session(session_);
  v1::DeregisterMrResponse out;
  EXPECT_TRUE(IsSeedError(core_->DeregisterMr(req, &out),
                          absl::StatusCode::kInvalidArgument,
                          ::mrd::STATUS_INVALID_PARAMETER, "NO_TARGET"));
}

// --- read-only buffers (W6)
// ---------------------------------------------------

TEST_F(RegistrationTest, ReadOnlyBufferRefusesWriteAccess) {
  v1::BufferInfo ro = Import(session_, 4 * page_, /*writable=*/false);
  EXPECT_FALSE(ro.writable());
  for (uint32_t flags :
       {kMrLocalWrite, kMrRemoteWrite, kMrRemoteWrite | kMrRemoteRead}) {
    EXPECT_TRUE(
        IsSeedError(Register(session_, ro.buffer(), 0, page_, flags).status(),
                    absl::StatusCode::kInvalidArgument,
                    ::mrd::STATUS_INVALID_PARAMETER, "BUFFER_READ_ONLY"))
        << "flags 0x" << std::hex << flags;
  }
  v1::RegisterMrRequest req =
      RegisterRequest(session_, ro.buffer(), 0, page_, 0);
  req.set_mem_flags(v1::MEM_WRITE);
  EXPECT_TRUE(IsSeedError(Register(req).status(),
                          absl::StatusCode::kInvalidArgument,
                          ::mrd::STATUS_INVALID_PARAMETER, "BUFFER_READ_ONLY"));
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kRegisterMr), 0u);
  // Reading is fine.
  absl::StatusOr<v1::RegisterMrResponse> read =
      Register(session_, ro.buffer(), 0, page_, kMrRemoteRead);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_FALSE(
      fake_->PeerAccess(read->rkey(), read->base_address(), 1, true).ok());
}

// --- idempotent retries
// -----------------------------------------------------------

TEST_F(RegistrationTest, RetryWithSameRequestIdTakesNoSecondReference) {
  v1::RegisterMrRequest req =
      RegisterRequest(session_, buffer_.buffer(), 0, page_, kMrRemoteRead);
  req.set_request_id("req-1");
  absl::StatusOr<v1::RegisterMrResponse> first = Register(req);
  absl::StatusOr<v1::RegisterMrResponse> retry = Register(req);
  ASSERT_TRUE(first.ok() && retry.ok());
  EXPECT_EQ(retry->registration(), first->registration());
  EXPECT_EQ(retry->rkey(), first->rkey());
  EXPECT_EQ(retry->references(), 1u);
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kRegisterMr), 1u);
  // One deregistration releases it: the retry took no reference.
  absl::StatusOr<uint32_t> left = Deregister(session_, first->registration());
  ASSERT_TRUE(left.ok());
  EXPECT_EQ(*left, 0u);
  EXPECT_FALSE(fake_->IsKeyValid(first->rkey()));
  // Another request id is a real second registration call.
  req.set_request_id("req-2");
  absl::StatusOr<v1::RegisterMrResponse> other = Register(req);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(other->registration(), first->registration());
}

// Request ids are remembered per session: a long one is refused before
// anything is kept (1 MiB ids once cost mrd 2 MiB each).
TEST_F(RegistrationTest, OverlongRequestIdIsRefusedAndKeepsNothing) {
  v1::RegisterMrRequest req =
      RegisterRequest(session_, buffer_.buffer(), 0, page_, kMrRemoteRead);
  req.set_request_id(std::string(128, 'r'));
  ASSERT_TRUE(Register(req).ok());
  req.set_request_id(std::string(129, 'r'));
  absl::StatusOr<v1::RegisterMrResponse> refused = Register(req);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GetErrorDetail(refused.status()).reason(), "REQUEST_ID_TOO_LONG");
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kRegisterMr), 1u);
}

TEST_F(RegistrationTest, RetryAfterReleaseRegistersAnew) {
  v1::RegisterMrRequest req =
      RegisterRequest(session_, buffer_.buffer(), 0, page_, kMrRemoteRead);
  req.set_request_id("req-1");
  absl::StatusOr<v1::RegisterMrResponse> first = Register(req);
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(Deregister(session_, first->registration()).ok());
  absl::StatusOr<v1::RegisterMrResponse> retry = Register(req);
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_NE(retry->registration(), first->registration());
  EXPECT_TRUE(fake_->IsKeyValid(retry->rkey()));
  EXPECT_EQ(retry->references(), 1u);
}

// --- MR objects (R4)
// ----------------------------------------------------------------

TEST_F(RegistrationTest, RegisterOnFastRegisterMrIsInvalidParameter) {
  absl::StatusOr<v1::MrInfo> mr = CreateMr(session_, /*fast_register=*/true);
  ASSERT_TRUE(mr.ok()) << mr.status();
  v1::RegisterMrRequest req =
      RegisterRequest(session_, buffer_.buffer(), 0, page_, kMrRemoteRead);
  req.set_mr(mr->mr());
  EXPECT_TRUE(
      IsSeedError(Register(req).status(), absl::StatusCode::kInvalidArgument,
                  ::mrd::STATUS_INVALID_PARAMETER, "MR_IS_FAST_REGISTER"));
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kRegisterMr), 0u);
}

TEST_F(RegistrationTest, MrObjectHoldsOneRegistrationAndDeregistersThroughIt) {
  absl::StatusOr<v1::MrInfo> mr = CreateMr(session_, /*fast_register=*/false);
  ASSERT_TRUE(mr.ok()) << mr.status();
  EXPECT_EQ(mr->state(), "free");
  v1::RegisterMrRequest req =
      RegisterRequest(session_, buffer_.buffer(), 0, page_, kMrRemoteRead);
  req.set_mr(mr->mr());
  absl::StatusOr<v1::RegisterMrResponse> r = Register(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->mr(), mr->mr());
  v1::MrInfo state = MrState(session_, mr->mr());
  EXPECT_EQ(state.state(), "registered");
  EXPECT_EQ(state.registration(), r->registration());
  EXPECT_EQ(state.rkey(), r->rkey());

  // A second registration on the same object is refused.
  v1::RegisterMrRequest again =
      RegisterRequest(session_, buffer_.buffer(), page_, page_, kMrRemoteRead);
  again.set_mr(mr->mr());
  EXPECT_TRUE(IsMrdError(Register(again).status(),
                         absl::StatusCode::kFailedPrecondition,
                         "MR_ALREADY_REGISTERED"));

  absl::StatusOr<uint32_t> left = DeregisterByMr(session_, mr->mr());
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(*left, 0u);
  EXPECT_FALSE(fake_->IsKeyValid(r->rkey()));
  EXPECT_EQ(MrState(session_, mr->mr()).state(), "free");
  EXPECT_TRUE(IsMrdError(DeregisterByMr(session_, mr->mr()).status(),
                         absl::StatusCode::kFailedPrecondition,
                         "MR_NOT_REGISTERED"));
  // Free again: it can register anew.
  EXPECT_TRUE(Register(again).ok());
}

TEST_F(RegistrationTest, RegistrationHeldOnlyByMrObjectIsNotDeregisteredById) {
  absl::StatusOr<v1::MrInfo> mr = CreateMr(session_, false);
  ASSERT_TRUE(mr.ok());
  v1::RegisterMrRequest req =
      RegisterRequest(session_, buffer_.buffer(), 0, page_, kMrRemoteRead);
  req.set_mr(mr->mr());
  absl::StatusOr<v1::RegisterMrResponse> r = Register(req);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(IsMrdError(Deregister(session_, r->registration()).status(),
                         absl::StatusCode::kFailedPrecondition,
                         "HELD_BY_MR_OBJECT"));
  EXPECT_TRUE(fake_->IsKeyValid(r->rkey()));
}

TEST_F(RegistrationTest, MrObjectAndImplicitReferenceShareOneRegistration) {
  absl::StatusOr<v1::RegisterMrResponse> implicit = Reg(0, page_);
  ASSERT_TRUE(implicit.ok());
  absl::StatusOr<v1::MrInfo> mr = CreateMr(session_, false);
  ASSERT_TRUE(mr.ok());
  v1::RegisterMrRequest req =
      RegisterRequest(session_, buffer_.buffer(), 0, page_, kMrRemoteRead);
  req.set_mr(mr->mr());
  absl::StatusOr<v1::RegisterMrResponse> held = Register(req);
  ASSERT_TRUE(held.ok());
  EXPECT_EQ(held->registration(), implicit->registration());
  EXPECT_EQ(held->references(), 2u);
  absl::StatusOr<uint32_t> left =
      Deregister(session_, implicit->registration());
  ASSERT_TRUE(left.ok());
  EXPECT_EQ(*left, 1u);
  EXPECT_TRUE(fake_->IsKeyValid(held->rkey()));
  left = DeregisterByMr(session_, mr->mr());
  ASSERT_TRUE(left.ok());
  EXPECT_EQ(*left, 0u);
  EXPECT_FALSE(fake_->IsKeyValid(held->rkey()));
}

TEST_F(RegistrationTest, CloseMrReleasesItsRegistration) {
  absl::StatusOr<v1::MrInfo> mr = CreateMr(session_, false);
  ASSERT_TRUE(mr.ok());
  v1::RegisterMrRequest req =
      RegisterRequest(session_, buffer_.buffer(), 0, 2 * page_, kMrRemoteRead);
  req.set_mr(mr->mr());
  absl::StatusOr<v1::RegisterMrResponse> r = Register(req);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(fake_->PinnedBytes(), 2 * page_);
  EXPECT_OK(CloseMr(session_, mr->mr()));
  EXPECT_FALSE(fake_->IsKeyValid(r->rkey()));
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 0u);
  EXPECT_EQ(core_->Stats().registrations, 0u);
  EXPECT_TRUE(IsMrdError(CloseMr(session_, mr->mr()),
                         absl::StatusCode::kNotFound, "UNKNOWN_MR"));
}

// --- buffers going away (W11)
// ----------------------------------------------------

TEST_F(RegistrationTest, ReleaseBufferInvalidatesItsRegistrationsAndLams) {
  v1::BufferInfo other = Import(session_, 4 * page_);
  absl::StatusOr<v1::RegisterMrResponse> a = Reg(0, page_);
  absl::StatusOr<v1::RegisterMrResponse> a2 = Reg(0, page_);  // refs 2
  absl::StatusOr<v1::RegisterMrResponse> b = Reg(page_, page_, kMrRemoteWrite);
  absl::StatusOr<v1::MrInfo> mr = CreateMr(session_, false);
  ASSERT_TRUE(mr.ok());
  v1::RegisterMrRequest held_req =
      RegisterRequest(session_, buffer_.buffer(), 2 * page_, page_, 0);
  held_req.set_mr(mr->mr());
  absl::StatusOr<v1::RegisterMrResponse> held = Register(held_req);
  absl::StatusOr<v1::BuildLamResponse> lam =
      BuildLam(session_, buffer_.buffer(), 0, 3 * page_);
  absl::StatusOr<v1::RegisterMrResponse> kept =
      Register(session_, other.buffer(), 0, page_, kMrRemoteRead);
  ASSERT_TRUE(a.ok() && a2.ok() && b.ok() && held.ok() && lam.ok() &&
              kept.ok());

  absl::StatusOr<v1::ReleaseBufferResponse> released =
      ReleaseBuffer(session_, buffer_.buffer());
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(released->invalidated_registrations(), 3u);
  EXPECT_EQ(released->released_lams(), 1u);
  for (uint32_t rkey : {a->rkey(), b->rkey(), held->rkey()}) {
    EXPECT_FALSE(fake_->IsKeyValid(rkey));
  }
  EXPECT_TRUE(fake_->IsKeyValid(kept->rkey()));
  EXPECT_EQ(fake_->LiveLamCount(), 0u);
  EXPECT_EQ(fake_->LiveRegisteredMrCount(), 1u);
  EXPECT_EQ(fake_->PinnedBytes(), page_);
  ExpectAccountingMatchesDevice();
  // The handles are gone with it.
  EXPECT_TRUE(IsMrdError(Deregister(session_, a->registration()).status(),
                         absl::StatusCode::kNotFound, "UNKNOWN_REGISTRATION"));
  EXPECT_TRUE(IsMrdError(ReleaseLam(session_, lam->lam()),
                         absl::StatusCode::kNotFound, "UNKNOWN_LAM"));
  EXPECT_EQ(MrState(session_, mr->mr()).state(), "free");
  EXPECT_TRUE(IsMrdError(ReleaseBuffer(session_, buffer_.buffer()).status(),
                         absl::StatusCode::kNotFound, "UNKNOWN_BUFFER"));
  EXPECT_TRUE(IsMrdError(Reg(0, page_).status(), absl::StatusCode::kNotFound,
                         "UNKNOWN_BUFFER"));
}

// The same memfd imported twice is one file: with the same explicit base the
// two buffers' registrations meet in the cache (the key is the file, not the
// buffer). Releasing the buffer the registration was made through must not
// leave the device holding a registration of memory that mrd has unmapped
// (R6: pinned and valid for as long as it is registered).
TEST_F(RegistrationTest, RegisteredMemoryStaysMappedWhenOneOfTwoImportsGoes) {
  UniqueFd fd = MakeSealedMemfd(4 * page_);
  v1::BufferInfo first = ImportDup(session_, fd.get());
  v1::BufferInfo second = ImportDup(session_, fd.get());
  v1::RegisterMrRequest req =
      RegisterRequest(session_, first.buffer(), 0, page_, kMrRemoteRead);
  req.set_base_address(0x700000);
  absl::StatusOr<v1::RegisterMrResponse> r1 = Register(req);
  req.set_buffer(second.buffer());
  absl::StatusOr<v1::RegisterMrResponse> r2 = Register(req);
  ASSERT_TRUE(r1.ok() && r2.ok());

  absl::StatusOr<v1::ReleaseBufferResponse> released =
      ReleaseBuffer(session_, first.buffer());
  ASSERT_TRUE(released.ok());
  // Whatever the device still holds must describe memory that is there.
  EXPECT_OK(fake_->CheckLiveMemory())
      << "the device holds a registration whose mapping mrd has released";
  // The second import's registration is still usable.
  EXPECT_TRUE(fake_->IsKeyValid(r2->rkey()));
}

TEST_F(RegistrationTest, ListRegistrationsShowsRegistrationsWithReferences) {
  absl::StatusOr<v1::RegisterMrResponse> r = Reg(page_, 2 * page_);
  ASSERT_TRUE(Reg(page_, 2 * page_).ok());
  ASSERT_TRUE(r.ok());
  absl::StatusOr<v1::ListRegistrationsResponse> list = List(session_);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->registrations_size(), 1);
  const v1::RegistrationInfo& info = list->registrations(0);
  EXPECT_EQ(info.registration(), r->registration());
  EXPECT_EQ(info.buffer(), buffer_.buffer());
  EXPECT_EQ(info.offset(), page_);
  EXPECT_EQ(info.length(), 2 * page_);
  EXPECT_EQ(info.flags(), kMrRemoteRead);
  EXPECT_EQ(info.rkey(), r->rkey());
  EXPECT_EQ(info.references(), 2u);
  ASSERT_EQ(list->buffers_size(), 1);
  EXPECT_EQ(list->buffers(0).size(), 16 * page_);
  EXPECT_EQ(list->session().registrations(), 1u);
}

}  // namespace
}  // namespace mrd::core_test
