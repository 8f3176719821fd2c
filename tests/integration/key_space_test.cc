// Issue 8, item 5 (device part), against the real mrd on the software
// device: the key table had 65,536 slots, as many as one session may hold
// registrations (--max_session_registrations), so one session registered
// 65,535 and every other workload got KEYS_EXHAUSTED. Now the key space
// covers the global limits: a session holding its whole allowance is
// stopped by its own limit, and a bystander keeps registering and reading.
#include <gtest/gtest.h>
#include <pthread.h>
#include <sys/wait.h>

#include <atomic>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "tests/integration/test_env.h"

namespace mrd::testing {
namespace {

constexpr uint64_t kSessionRegistrations = 65536;  // the default limit

class KeySpaceTest : public MrdTest {};

TEST_F(KeySpaceTest, ASessionAtItsRegistrationLimitLeavesKeysForOthers) {
  if (TestDeviceKind() != "software") {
    GTEST_SKIP() << "the NIC's key space is the hardware's";
  }
  client::Session greedy = OpenFdSession();
  // 16 pages, registered as 65,536 distinct ranges [0, length): one set of
  // pins, one key each.
  client::Buffer buffer = NewBuffer(greedy, 65536, "g");
  const std::string token = greedy.token();
  const uint64_t buffer_id = buffer.id();

  struct Work {
    const client::Client* client;
    std::string token;
    uint64_t buffer;
    uint64_t first, last;  // lengths [first, last]
    std::atomic<uint64_t>* ok;
    std::string error;
  };
  constexpr int kThreads = 4;
  std::atomic<uint64_t> ok{0};
  std::vector<Work> work;
  for (int t = 0; t < kThreads; ++t) {
    uint64_t per = kSessionRegistrations / kThreads;
    work.push_back(Work{client_.get(), token, buffer_id, 1 + t * per,
                        (t + 1) * per, &ok, ""});
  }
  auto run = [](void* arg) -> void* {
    Work& w = *static_cast<Work*>(arg);
    for (uint64_t length = w.first; length <= w.last; ++length) {
      client::RegisterOptions o;
      o.buffer = w.buffer;
      o.length = length;
      o.flags = kRemoteRead;
      absl::StatusOr<v1::RegisterMrResponse> r =
          w.client->RegisterMr(client::ToRequest(w.token, o));
      if (!r.ok()) {
        w.error = absl::StrCat("length ", length, ": ", r.status().ToString());
        return nullptr;
      }
      w.ok->fetch_add(1);
    }
    return nullptr;
  };
  std::vector<pthread_t> threads(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_EQ(pthread_create(&threads[t], nullptr, run, &work[t]), 0);
  }
  for (pthread_t thread : threads) pthread_join(thread, nullptr);
  for (const Work& w : work) EXPECT_EQ(w.error, "");
  ASSERT_EQ(ok.load(), kSessionRegistrations);

  // One more is the session's own limit, not the device's keys.
  {
    client::RegisterOptions o;
    o.buffer = buffer_id;
    o.offset = 4096;
    o.length = 1;
    o.flags = kRemoteRead;
    ExpectError(client_->RegisterMr(client::ToRequest(token, o)).status(),
                absl::StatusCode::kResourceExhausted,
                ::mrd::STATUS_INSUFFICIENT_RESOURCES,
                "LIMIT_SESSION_REGISTRATIONS");
  }

  // The bystander registers and a peer reads what it registered.
  client::Session bystander = OpenFdSession();
  client::Buffer mine = NewBuffer(bystander, 4096, "bystander");
  std::vector<client::Registration> held;
  for (uint64_t length = 1; length <= 1000; ++length) {
    client::RegisterOptions o;
    o.buffer = mine.id();
    o.length = length;
    o.flags = kRemoteRead;
    absl::StatusOr<client::Registration> r =
        client::Registration::Register(bystander, o);
    ASSERT_TRUE(r.ok()) << "bystander " << length << ": " << r.status();
    held.push_back(std::move(*r));
  }
  std::unique_ptr<peer::Peer> peer = ConnectPeer(bystander);
  ASSERT_NE(peer, nullptr);
  absl::StatusOr<std::string> read =
      peer->Read(held.back().rkey(), held.back().base_address(), 9);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "bystander");

  peer.reset();
  held.clear();
  EXPECT_TRUE(greedy.Close().ok());  // releases its 65,536 registrations
}

// Totals the 24-bit key index cannot cover are refused at start, not found
// out later as KEYS_EXHAUSTED.
TEST(KeySpaceFlagsTest, TotalsBeyondTheKeySpaceAreRefusedAtStart) {
  if (TestDeviceKind() != "software") GTEST_SKIP() << "software device only";
  MrdProcessOptions options;
  options.extra_flags = {"--max_total_registrations=16777216"};
  absl::StatusOr<MrdExit> exit = MrdProcess::RunToExit(options);
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_TRUE(WIFEXITED(exit->status) && WEXITSTATUS(exit->status) == 1)
      << exit->log;
  EXPECT_TRUE(absl::StrContains(exit->log,
                                "exceeds the software device's "
                                "16777215 memory keys"))
      << exit->log;
}

}  // namespace
}  // namespace mrd::testing
