// CallGate, the live handover's hold on gRPC calls: calls held while paused
// go on when the handover fails (or its drain times out) and are refused
// when it succeeds; a pause waits for the calls in flight.

#include "server/service/call_gate.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace mrd::service {
namespace {

TEST(CallGateTest, APauseWaitsForTheCallsInFlight) {
  CallGate gate;
  ASSERT_TRUE(gate.Enter());
  std::thread leaver([&] {
    absl::SleepFor(absl::Milliseconds(50));
    gate.Leave();
  });
  EXPECT_TRUE(gate.Pause(absl::Seconds(10)));
  EXPECT_EQ(gate.in_flight(), 0u);
  EXPECT_FALSE(gate.Enter());
  leaver.join();
  gate.Resume();
  EXPECT_TRUE(gate.Enter());
  gate.Leave();
}

TEST(CallGateTest, CallsHeldWhilePausedGoOnWhenTheHandoverFails) {
  CallGate gate;
  ASSERT_TRUE(gate.Pause(absl::Seconds(1)));
  std::vector<bool> answers;
  for (int i = 0; i < 3; ++i) {
    ASSERT_FALSE(gate.Enter());
    gate.Defer([&](bool admitted) { answers.push_back(admitted); });
  }
  EXPECT_EQ(gate.held(), 3u);
  EXPECT_TRUE(answers.empty());
  gate.Resume();
  EXPECT_EQ(answers, std::vector<bool>({true, true, true}));
  EXPECT_EQ(gate.in_flight(), 3u);  // each goes on as an entered call
  for (int i = 0; i < 3; ++i) gate.Leave();
  EXPECT_EQ(gate.held(), 0u);
}

TEST(CallGateTest, CallsHeldWhilePausedAreRefusedWhenItHandsOver) {
  CallGate gate;
  ASSERT_TRUE(gate.Pause(absl::Seconds(1)));
  std::vector<bool> answers;
  gate.Defer([&](bool admitted) { answers.push_back(admitted); });
  gate.HandOver();
  EXPECT_EQ(answers, std::vector<bool>({false}));
  EXPECT_EQ(gate.in_flight(), 0u);
  // And every later call at once.
  EXPECT_FALSE(gate.Enter());
  gate.Defer([&](bool admitted) { answers.push_back(admitted); });
  EXPECT_EQ(answers, std::vector<bool>({false, false}));
  gate.Resume();  // no effect once handed over
  EXPECT_EQ(gate.state(), CallGate::State::kHandedOver);
}

TEST(CallGateTest, ADrainThatTimesOutOpensAgainAndRunsWhatWasHeld) {
  CallGate gate;
  ASSERT_TRUE(gate.Enter());  // never leaves in time
  std::atomic<bool> ran{false};
  std::thread caller([&] {
    // Arrives during the drain: held, then run when the drain gives up.
    while (gate.state() != CallGate::State::kPaused)
      absl::SleepFor(absl::Milliseconds(1));
    if (gate.Enter()) {
      ran = true;  // the drain had given up already: it goes on at once
    } else {
      gate.Defer([&](bool admitted) { ran = admitted; });
    }
  });
  EXPECT_FALSE(gate.Pause(absl::Milliseconds(500)));
  caller.join();
  EXPECT_TRUE(ran);
  EXPECT_EQ(gate.state(), CallGate::State::kOpen);
  EXPECT_EQ(gate.held(), 0u);
  gate.Leave();
  gate.Leave();
}

}  // namespace
}  // namespace mrd::service
