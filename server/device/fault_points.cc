#include "server/device/fault_points.h"

#include <utility>

#include "server/common/log.h"

namespace mrd::device {

void FaultPoints::Arm(int nth, absl::Status status) {
  MRD_CHECK(nth >= 1);
  MRD_CHECK(!status.ok());
  absl::MutexLock lock(&mu_);
  armed_at_ = static_cast<uint64_t>(nth);
  armed_status_ = std::move(status);
  count_ = 0;
  steps_.clear();
  fired_step_.clear();
  fired_ = false;
}

void FaultPoints::Reset() {
  absl::MutexLock lock(&mu_);
  armed_at_ = 0;
  armed_status_ = absl::OkStatus();
  count_ = 0;
  steps_.clear();
  fired_step_.clear();
  fired_ = false;
}

absl::Status FaultPoints::Hit(absl::string_view step) {
  absl::MutexLock lock(&mu_);
  ++count_;
  if (steps_.size() < kMaxRecordedSteps) steps_.emplace_back(step);
  if (armed_at_ == 0 || count_ != armed_at_) return absl::OkStatus();
  armed_at_ = 0;
  fired_ = true;
  fired_step_ = std::string(step);
  return std::exchange(armed_status_, absl::OkStatus());
}

std::vector<std::string> FaultPoints::Steps() const {
  absl::MutexLock lock(&mu_);
  return steps_;
}

uint64_t FaultPoints::StepCount() const {
  absl::MutexLock lock(&mu_);
  return count_;
}

bool FaultPoints::Fired() const {
  absl::MutexLock lock(&mu_);
  return fired_;
}

std::string FaultPoints::FiredStep() const {
  absl::MutexLock lock(&mu_);
  return fired_step_;
}

}  // namespace mrd::device
