// Concurrency: many threads register and deregister overlapping ranges (and
// build and release LAMs) in two sessions at once. Every reference a thread
// holds must keep its key valid, every deregistration of a held reference
// must succeed, and when everything is released nothing is left.
#include <atomic>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "mrd/status.h"
#include "tests/unit/core/core_test_util.h"

namespace mrd::core_test {
namespace {

class StressTest : public CoreTest {
 protected:
  void Configure(core::CoreOptions& options,
                 fake::FakeDeviceOptions&) override {
    options.max_session_registrations = 1 << 20;
    options.max_session_lams = 1 << 20;
  }
};

struct Held {
  uint64_t registration = 0;
  uint32_t rkey = 0;
  int session = 0;
};

TEST_F(StressTest,
       ConcurrentRegisterDeregisterOfOverlappingRangesLeavesNothing) {
  constexpr int kThreads = 8;
  constexpr int kOpsPerThread = 1000;
  constexpr int kRanges = 6;
  const std::string sessions[2] = {Connect(), Connect()};
  const v1::BufferInfo buffers[2] = {Import(sessions[0], 16 * page_),
                                     Import(sessions[1], 16 * page_)};

  std::atomic<int> register_errors{0};
  std::atomic<int> deregister_errors{0};
  std::atomic<int> dead_keys{0};
  std::atomic<int> lam_errors{0};
  std::atomic<int> registrations_made{0};
  std::vector<std::string> first_errors(kThreads);

  auto worker = [&](int index) {
    std::mt19937 rng(static_cast<uint32_t>(1234 + index));
    std::vector<Held> held;
    auto note = [&](const absl::Status& s) {
      if (first_errors[index].empty()) first_errors[index] = s.ToString();
    };
    auto drop = [&](size_t at) {
      Held h = held[at];
      held[at] = held.back();
      held.pop_back();
      absl::StatusOr<uint32_t> left =
          Deregister(sessions[h.session], h.registration);
      if (!left.ok()) {
        ++deregister_errors;
        note(left.status());
      }
    };
    for (int op = 0; op < kOpsPerThread; ++op) {
      const int s = static_cast<int>(rng() % 2);
      const uint32_t choice = rng() % 10;
      if (choice < 6 || held.empty()) {
        const uint64_t range = rng() % kRanges;
        const uint32_t flags = (rng() % 2) ? kMrRemoteRead : kMrRemoteWrite;
        absl::StatusOr<v1::RegisterMrResponse> r = Register(
            sessions[s], buffers[s].buffer(), range * page_, 4 * page_, flags);
        if (!r.ok()) {
          ++register_errors;
          note(r.status());
          continue;
        }
        ++registrations_made;
        // We hold a reference: the key must work.
        if (!fake_->IsKeyValid(r->rkey())) ++dead_keys;
        held.push_back({r->registration(), r->rkey(), s});
      } else if (choice < 9) {
        drop(rng() % held.size());
      } else {
        absl::StatusOr<v1::BuildLamResponse> lam = BuildLam(
            sessions[s], buffers[s].buffer(), (rng() % 8) * page_, 2 * page_);
        if (!lam.ok() || !ReleaseLam(sessions[s], lam->lam()).ok()) {
          ++lam_errors;
        }
      }
      // Everything still held must still work.
      if (op % 50 == 0) {
        for (const Held& h : held) {
          if (!fake_->IsKeyValid(h.rkey)) ++dead_keys;
        }
      }
    }
    while (!held.empty()) drop(held.size() - 1);
  };

  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(worker, i);
  for (auto& t : threads) t.join();

  EXPECT_GT(registrations_made.load(), kThreads * kOpsPerThread / 3);
  EXPECT_EQ(register_errors.load(), 0);
  EXPECT_EQ(deregister_errors.load(), 0);
  EXPECT_EQ(dead_keys.load(), 0) << "a held registration's key was revoked";
  EXPECT_EQ(lam_errors.load(), 0);
  for (int i = 0; i < kThreads; ++i) {
    EXPECT_TRUE(first_errors[i].empty())
        << "thread " << i << ": " << first_errors[i];
  }
  // Everything was released: the sessions hold nothing any more.
  EXPECT_EQ(fake_->LiveMrCount(), 0u);
  EXPECT_EQ(fake_->LiveLamCount(), 0u);
  EXPECT_EQ(fake_->PinnedBytes(), 0u);
  const core::CoreStats stats = core_->Stats();
  EXPECT_EQ(stats.accounted_pinned_bytes, 0u);
  EXPECT_EQ(stats.registrations, 0u);
  EXPECT_EQ(stats.cache.entries, 0u);
  EXPECT_EQ(stats.sessions, 2u);
  EXPECT_EQ(fake_->LivePdCount(), 2u);
}

// Completions arriving on a device thread while the sessions are used and
// closed concurrently.
class DeviceThreadStressTest : public CoreTest {
 protected:
  void Configure(core::CoreOptions&, fake::FakeDeviceOptions& device) override {
    device.run_work_on_device_thread = true;
  }
};

TEST_F(DeviceThreadStressTest, FastRegisterCyclesWhileSessionsComeAndGo) {
  constexpr int kThreads = 4;
  constexpr int kCycles = 40;
  std::atomic<int> errors{0};
  std::vector<std::string> first_errors(kThreads);
  auto worker = [&](int index) {
    auto fail = [&](const absl::Status& s) {
      ++errors;
      if (first_errors[index].empty()) first_errors[index] = s.ToString();
    };
    for (int cycle = 0; cycle < kCycles; ++cycle) {
      std::string session = Connect();
      absl::StatusOr<v1::BufferInfo> buffer = TryImport(session, 4 * page_);
      if (!buffer.ok()) {
        fail(buffer.status());
        continue;
      }
      absl::StatusOr<v1::BuildLamResponse> lam =
          BuildLam(session, buffer->buffer(), 0, 2 * page_);
      absl::StatusOr<v1::MrInfo> mr = CreateMr(session, true, true);
      if (!lam.ok() || !mr.ok()) {
        fail(lam.ok() ? mr.status() : lam.status());
        continue;
      }
      v1::CreatePeerTicketRequest treq;
      treq.set_session(session);
      v1::PeerTicket ticket;
      if (absl::Status s = core_->CreatePeerTicket(treq, &ticket); !s.ok()) {
        fail(s);
        continue;
      }
      absl::StatusOr<device::ConnectionId> peer =
          fake_->ConnectPeerWithTicket(ticket.ticket());
      if (!peer.ok()) {
        fail(peer.status());
        continue;
      }
      absl::StatusOr<v1::FastRegisterResponse> posted = FastRegister(
          FastRegisterRequest(session, *peer, mr->mr(), *lam, kOpRemoteRead,
                              static_cast<uint64_t>(cycle)));
      if (!posted.ok()) fail(posted.status());
      (void)Register(session, buffer->buffer(), 0, page_, kMrRemoteRead);
      // End the session with the completion possibly still in flight.
      core_->OnDisconnect(session);
    }
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(worker, i);
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  for (int i = 0; i < kThreads; ++i) {
    EXPECT_TRUE(first_errors[i].empty())
        << "thread " << i << ": " << first_errors[i];
  }
  EXPECT_EQ(core_->Stats().sessions, 0u);
  EXPECT_EQ(fake_->LivePdCount(), 0u);
}

}  // namespace
}  // namespace mrd::core_test
