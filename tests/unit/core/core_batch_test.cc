// RegisterMrBatch and DeregisterMrBatch in the core: each item is the single
// call it stands for (W5 sharing, W2 sizes, request ids, limits), with its
// own result; a failed item leaves nothing behind and stops nothing; the
// call fails as a whole only for its session or its size.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "mrd/status_proto.h"
#include "server/core/core.h"
#include "tests/unit/core/core_test_util.h"

namespace mrd::core_test {
namespace {

using fake::FakeDevice;

class BatchTest : public CoreTest {
 protected:
  void Configure(core::CoreOptions& options,
                 fake::FakeDeviceOptions&) override {
    options.max_batch_items = 8;
    options.max_session_registrations = 6;
  }

  void SetUp() override {
    CoreTest::SetUp();
    session_ = Connect();
    buffer_ = Import(session_, 16 * page_);
  }

  v1::RegisterMrRequest Item(uint64_t offset, uint64_t length,
                             uint32_t flags = kMrRemoteRead) const {
    // Items name no session: the batch does.
    return RegisterRequest("", buffer_.buffer(), offset, length, flags);
  }

  absl::StatusOr<v1::RegisterMrBatchResponse> RegisterBatch(
      const std::vector<v1::RegisterMrRequest>& items) {
    v1::RegisterMrBatchRequest req;
    req.set_session(session_);
    for (const auto& item : items) *req.add_items() = item;
    v1::RegisterMrBatchResponse out;
    MRD_RETURN_IF_ERROR(core_->RegisterMrBatch(req, &out));
    return out;
  }

  absl::StatusOr<v1::DeregisterMrBatchResponse> DeregisterBatch(
      const std::vector<uint64_t>& registrations) {
    v1::DeregisterMrBatchRequest req;
    req.set_session(session_);
    for (uint64_t id : registrations) req.add_items()->set_registration(id);
    v1::DeregisterMrBatchResponse out;
    MRD_RETURN_IF_ERROR(core_->DeregisterMrBatch(req, &out));
    return out;
  }

  std::string session_;
  v1::BufferInfo buffer_;
};

TEST_F(BatchTest, EachItemIsRegisteredAsASingleCallWouldBe) {
  absl::StatusOr<v1::RegisterMrBatchResponse> out =
      RegisterBatch({Item(0, page_), Item(page_, 2 * page_), Item(0, page_)});
  ASSERT_OK(out.status());
  ASSERT_EQ(out->items_size(), 3);
  for (const auto& item : out->items()) {
    EXPECT_EQ(item.status().code(), 0) << item.status().message();
  }
  // W5 within one batch: the third item is the first's range again.
  EXPECT_EQ(out->items(2).registration().registration(),
            out->items(0).registration().registration());
  EXPECT_TRUE(out->items(2).registration().cache_hit());
  EXPECT_EQ(out->items(2).registration().references(), 2u);
  EXPECT_NE(out->items(1).registration().registration(),
            out->items(0).registration().registration());
  EXPECT_EQ(out->items(1).registration().rdma_descriptor().size(), 24u);
  EXPECT_EQ(fake_->LiveRegisteredMrCount(), 2u);
  ExpectAccountingMatchesDevice();
  // The same tokens a single call would have given.
  absl::StatusOr<v1::RegisterMrResponse> single =
      Register(session_, buffer_.buffer(), page_, 2 * page_, kMrRemoteRead);
  ASSERT_OK(single.status());
  EXPECT_EQ(single->rkey(), out->items(1).registration().rkey());
}

TEST_F(BatchTest, AFailedItemLeavesNothingAndStopsNothing) {
  v1::RegisterMrRequest too_small = Item(0, page_);
  too_small.set_descriptor_capacity(8);
  v1::RegisterMrRequest zero_base = Item(page_, page_);
  zero_base.set_base_address(0);
  absl::StatusOr<v1::RegisterMrBatchResponse> out = RegisterBatch({
      Item(0, page_),
      Item(0, 0),                  // R2: length 0
      too_small,                   // W2: the size it needs comes back
      zero_base,                   // R8
      Item(15 * page_, 2 * page_)  // past the buffer
      ,
      Item(2 * page_, page_),
  });
  ASSERT_OK(out.status());
  ASSERT_EQ(out->items_size(), 6);
  EXPECT_OK(ItemStatusFromProto(out->items(0).status()));
  EXPECT_EQ(ItemStatusFromProto(out->items(1).status()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(IsSeedErrorWithSize(ItemStatusFromProto(out->items(2).status()),
                                  absl::StatusCode::kOutOfRange, WSAEFAULT,
                                  "DESCRIPTOR_SPACE_TOO_SMALL", 24));
  EXPECT_TRUE(IsSeedError(ItemStatusFromProto(out->items(3).status()),
                          absl::StatusCode::kInvalidArgument,
                          STATUS_INVALID_PARAMETER, "ZERO_BASED_ADDRESS"));
  EXPECT_FALSE(ItemStatusFromProto(out->items(4).status()).ok());
  EXPECT_OK(ItemStatusFromProto(out->items(5).status()));
  for (int i = 1; i <= 4; ++i) {
    EXPECT_FALSE(out->items(i).has_registration()) << i;
  }
  // Only the two good items exist, each with one reference.
  absl::StatusOr<v1::ListRegistrationsResponse> list = List(session_);
  ASSERT_OK(list.status());
  ASSERT_EQ(list->registrations_size(), 2);
  for (const auto& r : list->registrations()) EXPECT_EQ(r.references(), 1u);
  EXPECT_EQ(fake_->LiveRegisteredMrCount(), 2u);
  ExpectAccountingMatchesDevice();
}

TEST_F(BatchTest, RequestIdsAreRememberedPerItem) {
  v1::RegisterMrRequest a = Item(0, page_);
  a.set_request_id("first");
  absl::StatusOr<v1::RegisterMrBatchResponse> out = RegisterBatch({a, a});
  ASSERT_OK(out.status());
  // The retried item gets the first answer without a second reference.
  EXPECT_EQ(out->items(1).registration().registration(),
            out->items(0).registration().registration());
  EXPECT_EQ(out->items(1).registration().references(), 1u);
  // And so does a single call with the same id.
  absl::StatusOr<v1::RegisterMrResponse> again = Register([&] {
    v1::RegisterMrRequest r = a;
    r.set_session(session_);
    return r;
  }());
  ASSERT_OK(again.status());
  EXPECT_EQ(again->references(), 1u);
}

TEST_F(BatchTest, TheSessionLimitRefusesTheItemsPastItOnly) {
  std::vector<v1::RegisterMrRequest> items;
  for (int i = 0; i < 8; ++i) items.push_back(Item(i * page_, page_));
  absl::StatusOr<v1::RegisterMrBatchResponse> out = RegisterBatch(items);
  ASSERT_OK(out.status());
  for (int i = 0; i < 6; ++i) {
    EXPECT_OK(ItemStatusFromProto(out->items(i).status()));
  }
  for (int i = 6; i < 8; ++i) {
    EXPECT_TRUE(IsSeedError(ItemStatusFromProto(out->items(i).status()),
                            absl::StatusCode::kResourceExhausted,
                            STATUS_INSUFFICIENT_RESOURCES,
                            "LIMIT_SESSION_REGISTRATIONS"));
  }
  EXPECT_EQ(fake_->LiveRegisteredMrCount(), 6u);
  ExpectAccountingMatchesDevice();
}

TEST_F(BatchTest, TooManyItemsIsRefusedBeforeAnyIsTried) {
  std::vector<v1::RegisterMrRequest> items(9, Item(0, page_));
  absl::Status s = RegisterBatch(items).status();
  EXPECT_TRUE(IsSeedError(s, absl::StatusCode::kInvalidArgument,
                          STATUS_INVALID_PARAMETER, "BATCH_TOO_LARGE"));
  EXPECT_NE(s.message().find("at most 8"), std::string::npos) << s;
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kRegisterMr), 0u);
  std::vector<uint64_t> ids(9, 1);
  EXPECT_TRUE(IsSeedError(DeregisterBatch(ids).status(),
                          absl::StatusCode::kInvalidArgument,
                          STATUS_INVALID_PARAMETER, "BATCH_TOO_LARGE"));
}

TEST_F(BatchTest, AnItemOfAnotherSessionIsRefusedAndTheOthersGoOn) {
  std::string other = Connect();
  v1::RegisterMrRequest foreign = Item(0, page_);
  foreign.set_session(other);
  absl::StatusOr<v1::RegisterMrBatchResponse> out =
      RegisterBatch({foreign, Item(0, page_)});
  ASSERT_OK(out.status());
  EXPECT_TRUE(IsSeedError(ItemStatusFromProto(out->items(0).status()),
                          absl::StatusCode::kInvalidArgument,
                          STATUS_INVALID_PARAMETER, "ITEM_SESSION_MISMATCH"));
  EXPECT_OK(ItemStatusFromProto(out->items(1).status()));
  absl::StatusOr<v1::ListRegistrationsResponse> list = List(other);
  ASSERT_OK(list.status());
  EXPECT_EQ(list->registrations_size(), 0);
}

TEST_F(BatchTest, AnUnknownSessionFailsTheWholeCall) {
  v1::RegisterMrBatchRequest req;
  req.set_session("no-such-session");
  *req.add_items() = Item(0, page_);
  v1::RegisterMrBatchResponse out;
  EXPECT_TRUE(IsSeedError(core_->RegisterMrBatch(req, &out),
                          absl::StatusCode::kFailedPrecondition, WSAENOTCONN,
                          "SESSION_NOT_CONNECTED"));
  EXPECT_EQ(out.items_size(), 0);
}

TEST_F(BatchTest, DeregisterBatchDropsOneReferenceEachAndReportsEach) {
  absl::StatusOr<v1::RegisterMrBatchResponse> reg =
      RegisterBatch({Item(0, page_), Item(0, page_), Item(page_, page_)});
  ASSERT_OK(reg.status());
  const uint64_t shared = reg->items(0).registration().registration();
  const uint64_t alone = reg->items(2).registration().registration();
  absl::StatusOr<v1::DeregisterMrBatchResponse> out =
      DeregisterBatch({shared, alone, 999999, shared, shared});
  ASSERT_OK(out.status());
  ASSERT_EQ(out->items_size(), 5);
  EXPECT_OK(ItemStatusFromProto(out->items(0).status()));
  EXPECT_EQ(out->items(0).references(), 1u);
  EXPECT_EQ(out->items(1).references(), 0u);
  EXPECT_TRUE(IsMrdError(ItemStatusFromProto(out->items(2).status()),
                         absl::StatusCode::kNotFound, "UNKNOWN_REGISTRATION"));
  EXPECT_OK(ItemStatusFromProto(out->items(3).status()));
  EXPECT_EQ(out->items(3).references(), 0u);
  // Its last reference went with the item before.
  EXPECT_TRUE(IsMrdError(ItemStatusFromProto(out->items(4).status()),
                         absl::StatusCode::kNotFound, "UNKNOWN_REGISTRATION"));
  EXPECT_EQ(fake_->LiveRegisteredMrCount(), 0u);
  ExpectAccountingMatchesDevice();
}

TEST_F(BatchTest, AnEmptyBatchIsAnEmptyAnswer) {
  absl::StatusOr<v1::RegisterMrBatchResponse> out = RegisterBatch({});
  ASSERT_OK(out.status());
  EXPECT_EQ(out->items_size(), 0);
}

// A batch whose caller gives up stops before its next item: CANCELLED; the
// items done before stay (a retry with their request ids gets them back).
TEST_F(BatchTest, ACancelledBatchStopsBeforeItsNextItem) {
  v1::RegisterMrBatchRequest req;
  req.set_session(session_);
  for (uint64_t i = 0; i < 3; ++i) {
    v1::RegisterMrRequest item = Item(i * page_, page_);
    item.set_request_id(absl::StrCat("item-", i));
    *req.add_items() = item;
  }
  // Asked at each item's start (a small item is not asked again): the
  // caller gives up after the first item is answered.
  int asked = 0;
  v1::RegisterMrBatchResponse out;
  absl::Status s =
      core_->RegisterMrBatch(req, &out, [&asked] { return ++asked > 1; });
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_EQ(fake_->LiveRegisteredMrCount(), 1u);
  // The retry gets the first item back without a second reference.
  v1::RegisterMrBatchResponse retry;
  ASSERT_OK(core_->RegisterMrBatch(req, &retry));
  EXPECT_EQ(retry.items(0).registration().references(), 1u);
  EXPECT_EQ(fake_->LiveRegisteredMrCount(), 3u);
}

// A RegisterMr whose caller gave up by the time the registration is made
// gives it back: CANCELLED, and the session holds nothing of it.
TEST_F(BatchTest, ARegistrationMadeForACallerWhoLeftIsGivenBack) {
  int asked = 0;
  v1::RegisterMrResponse out;
  absl::Status s = core_->RegisterMr(
      RegisterRequest(session_, buffer_.buffer(), 0, page_, kMrRemoteRead),
      &out, [&asked] { return ++asked > 1; });
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_EQ(fake_->LiveRegisteredMrCount(), 0u);
  absl::StatusOr<v1::ListRegistrationsResponse> held = List(session_);
  ASSERT_OK(held.status());
  EXPECT_EQ(held->registrations_size(), 0);
  // Given up before it began: nothing is tried.
  s = core_->RegisterMr(
      RegisterRequest(session_, buffer_.buffer(), 0, page_, kMrRemoteRead),
      &out, [] { return true; });
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_EQ(fake_->LiveRegisteredMrCount(), 0u);
}

// The same for BuildLam: a LAM built for a caller who gave up by then is
// released before the answer (L7): CANCELLED, and nothing of it stays
// pinned, mapped or accounted.
TEST_F(BatchTest, ALamBuiltForACallerWhoLeftIsGivenBack) {
  const uint64_t accounted = core_->Stats().accounted_pinned_bytes;
  v1::BuildLamRequest req;
  req.set_session(session_);
  req.set_buffer(buffer_.buffer());
  req.set_offset(0);
  req.set_length(4 * page_);
  // Asked when the call begins and once more when the LAM is built.
  int asked = 0;
  v1::BuildLamResponse out;
  absl::Status s = core_->BuildLam(req, &out, [&asked] { return ++asked > 1; });
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_EQ(asked, 2);
  EXPECT_EQ(out.lam(), 0u);
  EXPECT_EQ(fake_->LiveLamCount(), 0u);
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
  EXPECT_EQ(core_->Stats().lams, 0u);
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, accounted);
  ExpectAccountingMatchesDevice();
  // Given up before it began: nothing is tried.
  s = core_->BuildLam(req, &out, [] { return true; });
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_EQ(fake_->LiveLamCount(), 0u);
  // And the same request, kept, builds a LAM as usual.
  ASSERT_OK(core_->BuildLam(req, &out));
  EXPECT_NE(out.lam(), 0u);
  EXPECT_EQ(fake_->LiveLamCount(), 1u);
  ExpectAccountingMatchesDevice();
}

}  // namespace
}  // namespace mrd::core_test
