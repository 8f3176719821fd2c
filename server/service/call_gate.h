// CallGate: how a live handover (server/handover) stops the gRPC service
// taking new calls and waits for the calls in flight to finish, so that
// the state it hands over changes no more. Each unary call Enters before it
// touches the core and Leaves once answered. A call that arrives while the
// gate is paused is held (Defer), without a thread: it goes on as if
// nothing happened when the handover fails (Resume), and is refused when
// it succeeds (HandOver), having touched nothing, so that the client
// retries it against the new process (UNAVAILABLE HANDED_OVER, with a
// retry hint that gRPC's retry policy honours).
//
// Thread-safe.
#ifndef MRD_SERVER_SERVICE_CALL_GATE_H_
#define MRD_SERVER_SERVICE_CALL_GATE_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace mrd::service {

class CallGate {
 public:
  enum class State { kOpen, kPaused, kHandedOver };

  // True: the call may go on (and must Leave). False: the gate is paused or
  // the process handed over; answer the call with the refusal.
  bool Enter() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (state_ != State::kOpen) return false;
    ++in_flight_;
    return true;
  }
  // After Enter returned false: `go` is called with true once the call may
  // go on (it has Entered then, and must Leave), or with false when it is
  // refused; at once when the gate opened meanwhile or handed over, or
  // else by Resume or HandOver.
  void Defer(absl::AnyInvocable<void(bool)> go) ABSL_LOCKS_EXCLUDED(mu_) {
    bool admitted = false;
    {
      absl::MutexLock lock(&mu_);
      if (state_ == State::kPaused) {
        held_.push_back(std::move(go));
        return;
      }
      if (state_ == State::kOpen) {
        ++in_flight_;
        admitted = true;
      }
    }
    go(admitted);
  }
  void Leave() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    --in_flight_;
  }

  // Refuses new calls and waits until none is in flight. False when some
  // still were after `timeout`: the gate is open again.
  bool Pause(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      state_ = State::kPaused;
      if (mu_.AwaitWithTimeout(
              absl::Condition(
                  +[](uint64_t* n) { return *n == 0; }, &in_flight_),
              timeout)) {
        return true;
      }
    }
    Open(State::kOpen);  // and the calls held meanwhile go on
    return false;
  }
  // The handover failed: the held calls go on, and so do new ones.
  void Resume() ABSL_LOCKS_EXCLUDED(mu_) { Open(State::kOpen); }
  // The new process serves: the held calls and every new one are refused.
  void HandOver() ABSL_LOCKS_EXCLUDED(mu_) { Open(State::kHandedOver); }

  State state() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return state_;
  }
  uint64_t in_flight() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return in_flight_;
  }
  uint64_t held() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return held_.size();
  }

 private:
  void Open(State state) ABSL_LOCKS_EXCLUDED(mu_) {
    std::vector<absl::AnyInvocable<void(bool)>> held;
    {
      absl::MutexLock lock(&mu_);
      if (state == State::kOpen && state_ != State::kPaused) return;
      state_ = state;
      held.swap(held_);
      if (state == State::kOpen) in_flight_ += held.size();
    }
    for (auto& go : held) go(state == State::kOpen);
  }

  mutable absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kOpen;
  uint64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<absl::AnyInvocable<void(bool)>> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mrd::service

#endif  // MRD_SERVER_SERVICE_CALL_GATE_H_
