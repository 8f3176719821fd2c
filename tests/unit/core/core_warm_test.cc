// Warm pins and the registration cache's sharing rules, through the core on
// the fake device: after the last DeregisterMr no token works, but the pages
// may stay pinned (as a LAM only the core knows) so that registering the
// same range again pins nothing anew and gets a new key; warm pins obey
// their caps (least recently kept evicted first), give way before any
// pinned-bytes limit refuses, and go with their buffer and session. Tokens
// are shared only for exactly the same request (W5); a range inside another
// registration gets its own key, bounded to what it asked for.
#include <atomic>
#include <cstdint>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "tests/unit/core/core_test_util.h"

namespace mrd::core_test {
namespace {

using fake::FakeDevice;

class WarmTest : public CoreTest {
 protected:
  void Configure(core::CoreOptions& options,
                 fake::FakeDeviceOptions&) override {
    options.warm_pin_bytes_per_session = 4 * page_;
    options.warm_pin_bytes_total = 6 * page_;
    options.max_session_pinned_bytes = 8 * page_;
    options.max_total_pinned_bytes = 12 * page_;
  }
  void SetUp() override {
    CoreTest::SetUp();
    session_ = Connect();
    buffer_ = Import(session_, 16 * page_);
  }

  absl::StatusOr<v1::RegisterMrResponse> Reg(uint64_t offset, uint64_t length,
                                             uint32_t flags = kMrRemoteRead) {
    return Register(session_, buffer_.buffer(), offset, length, flags);
  }
  // Registers and deregisters [offset, offset + length): leaves a warm pin.
  uint32_t RegisterAndRelease(uint64_t offset, uint64_t length) {
    absl::StatusOr<v1::RegisterMrResponse> r = Reg(offset, length);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return 0;
    absl::StatusOr<uint32_t> left = Deregister(session_, r->registration());
    EXPECT_TRUE(left.ok()) << left.status();
    EXPECT_EQ(left.value_or(99), 0u);
    return r->rkey();
  }
  uint64_t SessionPinned(const std::string& session) {
    v1::GetSessionRequest get;
    get.set_session(session);
    v1::SessionInfo info;
    EXPECT_OK(core_->GetSession(get, &info));
    return info.pinned_bytes();
  }
  cache::WarmPinStats Warm() { return core_->Stats().warm; }

  std::string session_;
  v1::BufferInfo buffer_;
};

TEST_F(WarmTest, ReleasedRegistrationKeepsItsPagesButNotItsKey) {
  absl::StatusOr<v1::RegisterMrResponse> r = Reg(0, 2 * page_);
  ASSERT_TRUE(r.ok()) << r.status();
  const uint64_t base = r->base_address();
  EXPECT_OK(fake_->PeerAccess(r->rkey(), base, 2 * page_, false));
  ASSERT_TRUE(Deregister(session_, r->registration()).ok());
  // The key is dead when DeregisterMr has returned, at every address.
  EXPECT_FALSE(fake_->IsKeyValid(r->rkey()));
  EXPECT_FALSE(fake_->PeerAccess(r->rkey(), base, 1, false).ok());
  EXPECT_EQ(fake_->LiveRegisteredMrCount(), 0u);
  // The pages are held by one LAM the client never sees.
  EXPECT_EQ(fake_->LiveLamCount(), 1u);
  EXPECT_EQ(fake_->PinnedBytes(), 2 * page_);
  ExpectAccountingMatchesDevice();
  EXPECT_EQ(SessionPinned(session_), 2 * page_);
  absl::StatusOr<v1::ListRegistrationsResponse> list = List(session_);
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->registrations_size(), 0);
  EXPECT_EQ(list->lams_size(), 0);
  cache::WarmPinStats warm = Warm();
  EXPECT_EQ(warm.pins, 1u);
  EXPECT_EQ(warm.bytes, 2 * page_);
  EXPECT_EQ(warm.kept, 1u);
}

TEST_F(WarmTest, ReRegistrationIsServedFromTheWarmPinWithANewKey) {
  const uint32_t old_rkey = RegisterAndRelease(0, 2 * page_);
  const uint64_t lams_built = fake_->Calls(FakeDevice::Op::kBuildLam);
  absl::StatusOr<v1::RegisterMrResponse> again = Reg(0, 2 * page_);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->cache_hit()) << "a new registration, not a W5 hit";
  EXPECT_NE(again->rkey(), old_rkey);
  EXPECT_FALSE(fake_->IsKeyValid(old_rkey));
  EXPECT_TRUE(fake_->IsKeyValid(again->rkey()));
  EXPECT_FALSE(
      fake_->PeerAccess(old_rkey, again->base_address(), 1, false).ok());
  EXPECT_OK(fake_->PeerAccess(again->rkey(), again->base_address(), 2 * page_,
                              false));
  // The warm LAM was given up once the registration held the pages.
  EXPECT_EQ(fake_->LiveLamCount(), 0u);
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kBuildLam), lams_built);
  EXPECT_EQ(fake_->PinnedBytes(), 2 * page_);
  ExpectAccountingMatchesDevice();
  cache::WarmPinStats warm = Warm();
  EXPECT_EQ(warm.hits, 1u);
  EXPECT_EQ(warm.pins, 0u);
  EXPECT_EQ(warm.bytes, 0u);
  // Every cycle gets yet another key.
  ASSERT_TRUE(Deregister(session_, again->registration()).ok());
  absl::StatusOr<v1::RegisterMrResponse> third = Reg(0, 2 * page_);
  ASSERT_TRUE(third.ok());
  EXPECT_NE(third->rkey(), again->rkey());
  EXPECT_NE(third->rkey(), old_rkey);
  EXPECT_FALSE(fake_->IsKeyValid(again->rkey()));
  EXPECT_EQ(Warm().hits, 2u);
}

TEST_F(WarmTest, AWarmPinServesAnyAccessAndBaseButOnlyItsOwnRange) {
  RegisterAndRelease(0, 2 * page_);
  // Another access and another base address: same pages, so a warm hit;
  // the new key grants exactly the new access.
  v1::RegisterMrRequest req =
      RegisterRequest(session_, buffer_.buffer(), 0, 2 * page_, kMrRemoteWrite);
  req.set_base_address(0x7000000);
  absl::StatusOr<v1::RegisterMrResponse> write = Register(req);
  ASSERT_TRUE(write.ok()) << write.status();
  EXPECT_EQ(Warm().hits, 1u);
  EXPECT_OK(fake_->PeerAccess(write->rkey(), 0x7000000, 2 * page_, true));
  EXPECT_FALSE(fake_->PeerAccess(write->rkey(), 0x7000000, 1, false).ok());
  ASSERT_TRUE(Deregister(session_, write->registration()).ok());
  // A different range is not served from it (the pin stays warm).
  ASSERT_TRUE(Reg(0, page_).ok());
  ASSERT_TRUE(Reg(page_, 2 * page_).ok());
  EXPECT_EQ(Warm().hits, 1u);
  EXPECT_EQ(Warm().pins, 1u);
  ExpectAccountingMatchesDevice();
}

TEST_F(WarmTest, AHitWhileReferencedIsTheW5HitNotAWarmOne) {
  absl::StatusOr<v1::RegisterMrResponse> a = Reg(0, page_);
  absl::StatusOr<v1::RegisterMrResponse> b = Reg(0, page_);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(b->cache_hit());
  EXPECT_EQ(b->rkey(), a->rkey());
  // The first deregistration leaves a reference: no warm pin yet.
  ASSERT_EQ(Deregister(session_, a->registration()).value_or(99), 1u);
  EXPECT_EQ(Warm().pins, 0u);
  EXPECT_TRUE(fake_->IsKeyValid(a->rkey()));
  ASSERT_EQ(Deregister(session_, b->registration()).value_or(99), 0u);
  EXPECT_EQ(Warm().pins, 1u);
  EXPECT_FALSE(fake_->IsKeyValid(a->rkey()));
  core::CoreStats stats = core_->Stats();
  EXPECT_EQ(stats.cache.hits, 1u);
  EXPECT_EQ(stats.cache.misses, 1u);
}

TEST_F(WarmTest, SessionCapEvictsTheLeastRecentlyReleased) {
  RegisterAndRelease(0, 2 * page_);          // A
  RegisterAndRelease(2 * page_, 2 * page_);  // B: the cap (4 pages) is full
  RegisterAndRelease(4 * page_, 2 * page_);  // C evicts A
  cache::WarmPinStats warm = Warm();
  EXPECT_EQ(warm.pins, 2u);
  EXPECT_EQ(warm.bytes, 4 * page_);
  EXPECT_EQ(warm.evictions, 1u);
  EXPECT_EQ(fake_->LiveLamCount(), 2u);
  ExpectAccountingMatchesDevice();
  // A is cold, C and B are warm.
  ASSERT_TRUE(Reg(0, 2 * page_).ok());
  EXPECT_EQ(Warm().hits, 0u);
  ASSERT_TRUE(Reg(4 * page_, 2 * page_).ok());
  ASSERT_TRUE(Reg(2 * page_, 2 * page_).ok());
  EXPECT_EQ(Warm().hits, 2u);
  ExpectAccountingMatchesDevice();
}

TEST_F(WarmTest, TotalCapEvictsAcrossSessions) {
  std::string other = Connect();
  v1::BufferInfo theirs = Import(other, 8 * page_);
  RegisterAndRelease(0, 3 * page_);  // ours, oldest
  absl::StatusOr<v1::RegisterMrResponse> t =
      Register(other, theirs.buffer(), 0, 3 * page_, kMrRemoteRead);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(Deregister(other, t->registration()).ok());
  EXPECT_EQ(Warm().bytes, 6 * page_);  // the total cap
  // One more page of theirs: the total cap evicts our older pin.
  absl::StatusOr<v1::RegisterMrResponse> u =
      Register(other, theirs.buffer(), 4 * page_, page_, kMrRemoteRead);
  ASSERT_TRUE(u.ok());
  ASSERT_TRUE(Deregister(other, u->registration()).ok());
  EXPECT_EQ(Warm().evictions, 1u);
  EXPECT_EQ(Warm().bytes, 4 * page_);
  EXPECT_EQ(SessionPinned(session_), 0u);
  EXPECT_EQ(SessionPinned(other), 4 * page_);
  ExpectAccountingMatchesDevice();
}

TEST_F(WarmTest, WarmPinsGiveWayBeforeTheSessionLimitRefuses) {
  RegisterAndRelease(0, 2 * page_);          // A (oldest)
  RegisterAndRelease(2 * page_, 2 * page_);  // B
  EXPECT_EQ(SessionPinned(session_), 4 * page_);
  // 6 pages with 4 warm exceeds the 8-page session limit by 2: A goes.
  absl::StatusOr<v1::RegisterMrResponse> big = Reg(8 * page_, 6 * page_);
  ASSERT_TRUE(big.ok()) << big.status();
  cache::WarmPinStats warm = Warm();
  EXPECT_EQ(warm.evictions, 1u);
  EXPECT_EQ(warm.pins, 1u);
  EXPECT_EQ(SessionPinned(session_), 8 * page_);
  ASSERT_TRUE(Reg(2 * page_, 2 * page_).ok());  // B is still warm
  EXPECT_EQ(Warm().hits, 1u);
  ExpectAccountingMatchesDevice();
  // Nothing warm is left and the limit is reached: refused, naming it.
  EXPECT_TRUE(IsSeedError(
      Reg(0, page_).status(), absl::StatusCode::kResourceExhausted,
      ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_SESSION_PINNED_BYTES"));
}

TEST_F(WarmTest, NoWarmPinIsEvictedWhenEvictingAllWouldNotMakeRoom) {
  RegisterAndRelease(0, 2 * page_);
  ASSERT_TRUE(Reg(2 * page_, 4 * page_).ok());
  // 2 live pages + 2 warm + 5 asked = 9 > 8 even without the warm ones.
  EXPECT_TRUE(IsSeedError(
      Reg(8 * page_, 5 * page_).status(), absl::StatusCode::kResourceExhausted,
      ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_SESSION_PINNED_BYTES"));
  EXPECT_EQ(Warm().evictions, 0u);
  EXPECT_EQ(Warm().pins, 1u);
  ExpectAccountingMatchesDevice();
}

TEST_F(WarmTest, WarmPinsGiveWayBeforeTheTotalLimitRefuses) {
  std::string other = Connect();
  v1::BufferInfo theirs = Import(other, 16 * page_);
  RegisterAndRelease(0, 4 * page_);             // 4 warm pages of ours
  ASSERT_TRUE(Reg(8 * page_, 2 * page_).ok());  // and 2 live ones
  absl::StatusOr<v1::RegisterMrResponse> t =
      Register(other, theirs.buffer(), 0, 6 * page_, kMrRemoteRead);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 12 * page_);  // the limit
  // Their LAM needs a page more: our warm pin goes, not their request.
  absl::StatusOr<v1::BuildLamResponse> lam =
      BuildLam(other, theirs.buffer(), 8 * page_, page_);
  ASSERT_TRUE(lam.ok()) << lam.status();
  EXPECT_EQ(Warm().evictions, 1u);
  EXPECT_EQ(Warm().pins, 0u);
  EXPECT_EQ(SessionPinned(session_), 2 * page_);
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 9 * page_);
  ExpectAccountingMatchesDevice();
  // With nothing warm left, the total limit refuses and names itself.
  std::string third = Connect();
  v1::BufferInfo mine = Import(third, 8 * page_);
  EXPECT_TRUE(IsSeedError(
      Register(third, mine.buffer(), 0, 4 * page_, kMrRemoteRead).status(),
      absl::StatusCode::kResourceExhausted,
      ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_TOTAL_PINNED_BYTES"));
}

TEST_F(WarmTest, ADeviceOutOfResourcesGetsTheWarmPinsFirst) {
  RegisterAndRelease(0, 2 * page_);
  fake_->FailNext(FakeDevice::Op::kRegisterMr,
                  SeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "PIN_FAILED",
                            "mlock: out of memory"));
  absl::StatusOr<v1::RegisterMrResponse> r = Reg(4 * page_, page_);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Warm().evictions, 1u);
  EXPECT_EQ(Warm().pins, 0u);
  ExpectAccountingMatchesDevice();
  // With nothing left to evict, the device's refusal is the answer.
  fake_->FailNext(FakeDevice::Op::kRegisterMr,
                  SeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "PIN_FAILED",
                            "mlock: out of memory"));
  EXPECT_TRUE(IsSeedError(Reg(8 * page_, page_).status(),
                          absl::StatusCode::kResourceExhausted,
                          ::mrd::STATUS_INSUFFICIENT_RESOURCES, "PIN_FAILED"));
  ExpectAccountingMatchesDevice();
}

TEST_F(WarmTest, FailedWarmHitRegistrationReleasesThePinAndItsBytes) {
  RegisterAndRelease(0, 2 * page_);
  fake_->FailNext(FakeDevice::Op::kRegisterMr,
                  absl::InvalidArgumentError("injected"));
  EXPECT_FALSE(Reg(0, 2 * page_).ok());
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
  EXPECT_EQ(fake_->LiveLamCount(), 0u);
  EXPECT_EQ(SessionPinned(session_), 0u);
  ExpectAccountingMatchesDevice();
}

TEST_F(WarmTest, FailedWarmPinStillDeregisters) {
  absl::StatusOr<v1::RegisterMrResponse> r = Reg(0, 2 * page_);
  ASSERT_TRUE(r.ok());
  fake_->FailNext(FakeDevice::Op::kBuildLam,
                  absl::ResourceExhaustedError("injected"));
  ASSERT_EQ(Deregister(session_, r->registration()).value_or(99), 0u);
  EXPECT_FALSE(fake_->IsKeyValid(r->rkey()));
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
  EXPECT_EQ(Warm().pins, 0u);
  ExpectAccountingMatchesDevice();
}

TEST_F(WarmTest, ReleaseBufferDropsItsWarmPins) {
  v1::BufferInfo other = Import(session_, 4 * page_);
  RegisterAndRelease(0, 2 * page_);
  absl::StatusOr<v1::RegisterMrResponse> o =
      Register(session_, other.buffer(), 0, page_, kMrRemoteRead);
  ASSERT_TRUE(o.ok());
  ASSERT_TRUE(Deregister(session_, o->registration()).ok());
  EXPECT_EQ(Warm().pins, 2u);
  ASSERT_TRUE(ReleaseBuffer(session_, buffer_.buffer()).ok());
  EXPECT_EQ(Warm().pins, 1u);
  EXPECT_EQ(Warm().drops, 1u);
  EXPECT_EQ(fake_->LiveLamCount(), 1u);
  EXPECT_EQ(fake_->PinnedBytes(), page_);
  EXPECT_EQ(SessionPinned(session_), page_);
  ExpectAccountingMatchesDevice();
  ASSERT_TRUE(ReleaseBuffer(session_, other.buffer()).ok());
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 0u);
}

TEST_F(WarmTest, SessionEndDropsItsWarmPinsOnly) {
  std::string other = Connect();
  v1::BufferInfo theirs = Import(other, 4 * page_);
  RegisterAndRelease(0, 2 * page_);
  absl::StatusOr<v1::RegisterMrResponse> t =
      Register(other, theirs.buffer(), 0, page_, kMrRemoteRead);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(Deregister(other, t->registration()).ok());
  core_->OnDisconnect(session_);
  EXPECT_EQ(Warm().pins, 1u);
  EXPECT_EQ(fake_->PinnedBytes(), page_);
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, page_);
  v1::CloseSessionRequest close;
  close.set_session(other);
  ASSERT_OK(core_->CloseSession(close));
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
  EXPECT_EQ(fake_->LiveLamCount(), 0u);
  EXPECT_EQ(Warm().pins, 0u);
  EXPECT_EQ(Warm().drops, 2u);
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 0u);
}

TEST_F(WarmTest, RetryWithTheSameRequestIdTakesNoSecondReferenceOrPin) {
  v1::RegisterMrRequest req =
      RegisterRequest(session_, buffer_.buffer(), 0, page_, kMrRemoteRead);
  req.set_request_id("retry-1");
  absl::StatusOr<v1::RegisterMrResponse> first = Register(req);
  absl::StatusOr<v1::RegisterMrResponse> retry = Register(req);
  ASSERT_TRUE(first.ok() && retry.ok());
  EXPECT_EQ(retry->registration(), first->registration());
  EXPECT_EQ(retry->references(), 1u);
  ASSERT_EQ(Deregister(session_, first->registration()).value_or(99), 0u);
  // Released since: the same id registers anew, from the warm pin.
  absl::StatusOr<v1::RegisterMrResponse> later = Register(req);
  ASSERT_TRUE(later.ok());
  EXPECT_NE(later->registration(), first->registration());
  EXPECT_NE(later->rkey(), first->rkey());
  EXPECT_EQ(Warm().hits, 1u);
}

// --- sharing rules -----------------------------------------------------------

// A range inside a live registration of the same session, buffer and access
// gets its own key that reaches exactly that range; the container's key is
// not handed out, so no byte outside the request is exposed by it, and the
// container's key dies with the container's own last DeregisterMr.
TEST_F(WarmTest, ARangeInsideARegistrationGetsItsOwnBoundedKey) {
  absl::StatusOr<v1::RegisterMrResponse> outer = Reg(0, 4 * page_);
  ASSERT_TRUE(outer.ok());
  absl::StatusOr<v1::RegisterMrResponse> inner = Reg(2 * page_, page_);
  ASSERT_TRUE(inner.ok());
  EXPECT_FALSE(inner->cache_hit());
  EXPECT_NE(inner->registration(), outer->registration());
  EXPECT_NE(inner->rkey(), outer->rkey());
  const uint64_t inner_base = inner->base_address();
  EXPECT_EQ(inner_base, buffer_.address() + 2 * page_);
  EXPECT_OK(fake_->PeerAccess(inner->rkey(), inner_base, page_, false));
  // Not one byte on either side, and not the container's start.
  EXPECT_FALSE(fake_->PeerAccess(inner->rkey(), inner_base - 1, 1, false).ok());
  EXPECT_FALSE(
      fake_->PeerAccess(inner->rkey(), inner_base + page_, 1, false).ok());
  EXPECT_FALSE(
      fake_->PeerAccess(inner->rkey(), buffer_.address(), 1, false).ok());
  // The container goes: its key is dead at once, though the inner range
  // (which lies within it) is still registered.
  ASSERT_EQ(Deregister(session_, outer->registration()).value_or(99), 0u);
  EXPECT_FALSE(fake_->IsKeyValid(outer->rkey()));
  EXPECT_FALSE(fake_->PeerAccess(outer->rkey(), inner_base, 1, false).ok());
  EXPECT_OK(fake_->PeerAccess(inner->rkey(), inner_base, page_, false));
  ExpectAccountingMatchesDevice();
}

TEST_F(WarmTest, ARangeInsideAWarmPinGetsItsOwnKeyAndTheOldOneStaysDead) {
  const uint32_t old_rkey = RegisterAndRelease(0, 4 * page_);
  absl::StatusOr<v1::RegisterMrResponse> inner = Reg(page_, page_);
  ASSERT_TRUE(inner.ok());
  EXPECT_NE(inner->rkey(), old_rkey);
  EXPECT_FALSE(fake_->IsKeyValid(old_rkey));
  EXPECT_FALSE(
      fake_->PeerAccess(inner->rkey(), buffer_.address(), 1, false).ok());
  // The pin of the whole range stays warm for a later exact request.
  EXPECT_EQ(Warm().pins, 1u);
  EXPECT_EQ(Warm().hits, 0u);
  ExpectAccountingMatchesDevice();
}

// --- registration limits -----------------------------------------------------

class RegistrationLimitTest : public WarmTest {
 protected:
  void Configure(core::CoreOptions& options,
                 fake::FakeDeviceOptions& device) override {
    WarmTest::Configure(options, device);
    options.max_session_registrations = 3;
    options.max_total_registrations = 4;
  }
};

TEST_F(RegistrationLimitTest, TotalRegistrationLimitNamesItself) {
  std::string other = Connect();
  v1::BufferInfo theirs = Import(other, 4 * page_);
  ASSERT_TRUE(Reg(0, 1).ok());
  ASSERT_TRUE(Reg(0, 2).ok());
  ASSERT_TRUE(Reg(0, 3).ok());
  EXPECT_TRUE(IsSeedError(
      Reg(0, 4).status(), absl::StatusCode::kResourceExhausted,
      ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_SESSION_REGISTRATIONS"));
  absl::StatusOr<v1::RegisterMrResponse> t =
      Register(other, theirs.buffer(), 0, 1, kMrRemoteRead);
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE(IsSeedError(
      Register(other, theirs.buffer(), 0, 2, kMrRemoteRead).status(),
      absl::StatusCode::kResourceExhausted,
      ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_TOTAL_REGISTRATIONS"));
  // A W5 hit is a reference, not a registration: still fine at the limit.
  absl::StatusOr<v1::RegisterMrResponse> hit = Reg(0, 1);
  ASSERT_TRUE(hit.ok());
  EXPECT_TRUE(hit->cache_hit());
  // A warm pin is not a registration either; a place freed is a place taken.
  ASSERT_TRUE(Deregister(other, t->registration()).ok());
  EXPECT_TRUE(Register(other, theirs.buffer(), 0, 2, kMrRemoteRead).ok());
}

// --- concurrency -------------------------------------------------------------

// Threads register and deregister overlapping ranges of two buffers while
// buffers are released and sessions end; the accounting must match the
// device throughout and everything must be gone at the end (TearDown).
TEST_F(WarmTest, ConcurrentCyclesKeepTheAccountingExact) {
  constexpr int kThreads = 4;
  constexpr int kRounds = 150;
  std::atomic<bool> failed{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < kRounds && !failed; ++round) {
        std::string session = Connect(1000, 100 + t);
        absl::StatusOr<v1::BufferInfo> a = TryImport(session, 8 * page_);
        absl::StatusOr<v1::BufferInfo> b = TryImport(session, 8 * page_);
        if (!a.ok() || !b.ok()) {
          failed = true;
          break;
        }
        for (int i = 0; i < 6; ++i) {
          const uint64_t buffer = i % 2 ? a->buffer() : b->buffer();
          const uint64_t offset = static_cast<uint64_t>((i + t) % 3) * page_;
          absl::StatusOr<v1::RegisterMrResponse> r =
              Register(session, buffer, offset, 2 * page_, kMrRemoteRead);
          if (!r.ok()) continue;  // a limit may refuse: that is fine
          (void)Deregister(session, r->registration());
        }
        if (round % 3 == 0) (void)ReleaseBuffer(session, a->buffer());
        core_->OnDisconnect(session);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_FALSE(failed.load());
  EXPECT_EQ(Warm().pins, 0u);
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 0u);
}

// --- the buffer's mapping outlives what was made on it -----------------------

// ReleaseBuffer deregisters the buffer's registrations after taking it out
// of the session; while the device is still deregistering, the registered
// memory must still be mapped and its fd still open (a closed fd number can
// be reused by another file at once, and the software device moves peer data
// through it).
TEST_F(WarmTest, MappingStaysUntilReleaseBufferHasDeregisteredEverything) {
  absl::StatusOr<v1::RegisterMrResponse> r = Reg(0, 2 * page_);
  ASSERT_TRUE(r.ok());
  fake_->SetDelay(FakeDevice::Op::kDeregisterMr, absl::Milliseconds(200));
  std::thread release(
      [&] { EXPECT_TRUE(ReleaseBuffer(session_, buffer_.buffer()).ok()); });
  absl::SleepFor(absl::Milliseconds(60));  // inside the device's DeregisterMr
  EXPECT_OK(fake_->CheckLiveMemory());
  release.join();
  fake_->SetDelay(FakeDevice::Op::kDeregisterMr, absl::ZeroDuration());
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
}

// --- off ---------------------------------------------------------------------

class WarmOffTest : public CoreTest {};  // CoreOptions' default: no warm pins

TEST_F(WarmOffTest, WithoutWarmPinsTheLastDeregisterUnpins) {
  std::string session = Connect();
  v1::BufferInfo buffer = Import(session, 4 * page_);
  absl::StatusOr<v1::RegisterMrResponse> r =
      Register(session, buffer.buffer(), 0, 2 * page_, kMrRemoteRead);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(Deregister(session, r->registration()).ok());
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
  EXPECT_EQ(fake_->LiveLamCount(), 0u);
  EXPECT_EQ(fake_->Calls(FakeDevice::Op::kBuildLam), 0u);
  EXPECT_EQ(core_->Stats().warm.kept, 0u);
}

// Mappings of this test's memfds in the process (/proc/self/maps names them
// "/memfd:mrd-core-test").
int TestMemfdMappings() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  int n = 0;
  while (std::getline(maps, line)) {
    if (line.find("/memfd:mrd-core-test") != std::string::npos) ++n;
  }
  return n;
}

// Registrations hold their buffer's mapping once per buffer, not each
// their own copy: the mapping still goes once the last of them is
// deregistered and the buffer released, in either order.
TEST_F(WarmOffTest, TheMappingGoesWithTheLastRegistrationOfItsBuffer) {
  const int before = TestMemfdMappings();
  std::string session = Connect();
  for (bool release_first : {false, true}) {
    v1::BufferInfo buffer = Import(session, 4 * page_);
    ASSERT_EQ(TestMemfdMappings(), before + 1);
    std::vector<uint64_t> registrations;
    for (uint64_t page = 0; page < 3; ++page) {
      absl::StatusOr<v1::RegisterMrResponse> r = Register(
          session, buffer.buffer(), page * page_, page_, kMrRemoteRead);
      ASSERT_TRUE(r.ok()) << r.status();
      registrations.push_back(r->registration());
    }
    if (release_first) {
      // Releasing the buffer deregisters what is left on it.
      ASSERT_TRUE(Deregister(session, registrations[0]).ok());
      ASSERT_TRUE(ReleaseBuffer(session, buffer.buffer()).ok());
    } else {
      for (uint64_t r : registrations) ASSERT_TRUE(Deregister(session, r).ok());
      EXPECT_EQ(TestMemfdMappings(), before + 1);  // the buffer still has it
      ASSERT_TRUE(ReleaseBuffer(session, buffer.buffer()).ok());
    }
    EXPECT_EQ(TestMemfdMappings(), before) << "release_first " << release_first;
    EXPECT_EQ(fake_->PinnedBytes(), 0u);
  }
}

}  // namespace
}  // namespace mrd::core_test
