// FaultPoints: failure injection at every step of a device operation, so that
// tests can prove L7 (a request that fails part-way leaves nothing pinned or
// mapped) for each place where a real device can fail, not only for the ones
// that are easy to provoke from outside.
//
// A device that supports injection takes a `FaultPoints*` in its options
// (nullptr in production) and marks each step where it can fail with
//
//   MRD_RETURN_IF_ERROR(FaultPoint(faults_, "pin.mlock"));
//
// placed *before* the step's effect when the step, failing, changes nothing
// (a table insertion, a key draw), and *after* it when a real failure can
// leave a partial effect behind (mlock locks the pages it reached before it
// fails), so that the caller's undo path is exercised with that effect in
// place. With no FaultPoints installed a fault point costs one well-predicted
// branch on a null pointer.
//
// Step names are short, stable, device-generic identifiers of the form
// "<what>.<action>" ("pin.mlock", "keys.allocate", "random.key_byte",
// "mr.insert", ...); docs/ and tests cite them. Name a step after what fails,
// not after the function it sits in.
//
// How a test uses it:
//
//   faults.Reset();                        // record, fail nothing
//   ASSERT_OK(RunOperation());
//   std::vector<std::string> steps = faults.Steps();   // N steps
//   for (int k = 1; k <= steps.size(); ++k) {
//     faults.Arm(k, injected);             // step k from now fails
//     EXPECT_EQ(RunOperation(), injected);
//     EXPECT_EQ(faults.FiredStep(), steps[k - 1]);
//     ... nothing pinned, mapped, or held ...
//   }
//
// The armed failure fires once: every step after it (undo paths included)
// succeeds again, so a failure surfaces exactly as the device reports it.
//
// Thread-safe: steps may be reached from any thread (device workers
// included); the order recorded is the order in which the calls to Hit
// took the lock.
#ifndef MRD_SERVER_DEVICE_FAULT_POINTS_H_
#define MRD_SERVER_DEVICE_FAULT_POINTS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/optimization.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace mrd::device {

class FaultPoints {
 public:
  // Step names kept for Steps(); steps beyond are counted (StepCount) but
  // their names are dropped, so that a FaultPoints left installed in a long
  // test cannot grow without bound.
  static constexpr size_t kMaxRecordedSteps = 4096;

  FaultPoints() = default;
  FaultPoints(const FaultPoints&) = delete;
  FaultPoints& operator=(const FaultPoints&) = delete;

  // Starts a new recording in which the `nth` step reached (1-based) fails
  // with `status`, which must not be OK. Replaces any armed failure.
  void Arm(int nth, absl::Status status);
  // Starts a new recording with nothing armed.
  void Reset();

  // Marks one step. Returns OK, or the armed status if this is the armed
  // step (which then is disarmed).
  absl::Status Hit(absl::string_view step);

  // Names of the steps reached since the last Arm/Reset, in order (at most
  // kMaxRecordedSteps of them).
  std::vector<std::string> Steps() const;
  // How many steps were reached since the last Arm/Reset.
  uint64_t StepCount() const;
  // Whether the armed failure fired since the last Arm, and at which step
  // ("" if it did not).
  bool Fired() const;
  std::string FiredStep() const;

 private:
  mutable absl::Mutex mu_;
  uint64_t armed_at_ ABSL_GUARDED_BY(mu_) = 0;  // 0 = nothing armed
  absl::Status armed_status_ ABSL_GUARDED_BY(mu_);
  uint64_t count_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> steps_ ABSL_GUARDED_BY(mu_);
  std::string fired_step_ ABSL_GUARDED_BY(mu_);
  bool fired_ ABSL_GUARDED_BY(mu_) = false;
};

// A fault point: OK when `faults` is null (production), else faults->Hit().
inline absl::Status FaultPoint(FaultPoints* faults, absl::string_view step) {
  if (ABSL_PREDICT_TRUE(faults == nullptr)) return absl::OkStatus();
  return faults->Hit(step);
}

}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_FAULT_POINTS_H_
