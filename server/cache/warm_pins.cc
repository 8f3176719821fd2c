#include "server/cache/warm_pins.h"

#include <iterator>
#include <utility>

namespace mrd::cache {

bool WarmPinSet::Admissible(uint64_t bytes) const {
  return bytes > 0 && bytes <= limits_.per_session_bytes &&
         bytes <= limits_.total_bytes;
}

WarmPin WarmPinSet::RemoveLocked(std::map<WarmKey, Node>::iterator it) {
  WarmPin pin = std::move(it->second.pin);
  const uint64_t age = it->second.age;
  by_age_.erase(age);
  by_session_age_.erase({pin.key.session, age});
  auto bytes = session_bytes_.find(pin.key.session);
  bytes->second -= pin.pinned_bytes;
  if (bytes->second == 0) session_bytes_.erase(bytes);
  stats_.bytes -= pin.pinned_bytes;
  --stats_.pins;
  by_key_.erase(it);
  return pin;
}

std::optional<WarmPin> WarmPinSet::EvictOldestLocked(
    std::optional<uint64_t> session) {
  WarmKey key;
  if (session.has_value()) {
    auto it = by_session_age_.lower_bound({*session, 0});
    if (it == by_session_age_.end() || it->first.first != *session) {
      return std::nullopt;
    }
    key = it->second;
  } else {
    if (by_age_.empty()) return std::nullopt;
    key = by_age_.begin()->second;
  }
  ++stats_.evictions;
  return RemoveLocked(by_key_.find(key));
}

std::vector<WarmPin> WarmPinSet::Put(WarmPin pin) {
  std::vector<WarmPin> out;
  absl::MutexLock lock(&mu_);
  if (!Admissible(pin.pinned_bytes)) {
    ++stats_.drops;
    out.push_back(std::move(pin));
    return out;
  }
  if (auto it = by_key_.find(pin.key); it != by_key_.end()) {
    // The same pages are warm already: keep one pin, freshly used.
    by_age_.erase(it->second.age);
    by_session_age_.erase({pin.key.session, it->second.age});
    it->second.age = next_age_++;
    by_age_.emplace(it->second.age, pin.key);
    by_session_age_.emplace(std::make_pair(pin.key.session, it->second.age),
                            pin.key);
    ++stats_.drops;
    out.push_back(std::move(pin));
    return out;
  }
  const uint64_t session = pin.key.session;
  auto session_bytes = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = session_bytes_.find(session);
    return it == session_bytes_.end() ? 0 : it->second;
  };
  while (session_bytes() + pin.pinned_bytes > limits_.per_session_bytes) {
    std::optional<WarmPin> victim = EvictOldestLocked(session);
    if (!victim.has_value()) break;  // unreachable: Admissible checked
    out.push_back(std::move(*victim));
  }
  while (stats_.bytes + pin.pinned_bytes > limits_.total_bytes) {
    std::optional<WarmPin> victim = EvictOldestLocked(std::nullopt);
    if (!victim.has_value()) break;
    out.push_back(std::move(*victim));
  }
  const uint64_t age = next_age_++;
  const WarmKey key = pin.key;
  session_bytes_[session] += pin.pinned_bytes;
  stats_.bytes += pin.pinned_bytes;
  ++stats_.pins;
  ++stats_.kept;
  by_age_.emplace(age, key);
  by_session_age_.emplace(std::make_pair(session, age), key);
  by_key_.emplace(key, Node{std::move(pin), age});
  return out;
}

std::optional<WarmPin> WarmPinSet::Take(const WarmKey& key) {
  absl::MutexLock lock(&mu_);
  auto it = by_key_.find(key);
  if (it == by_key_.end()) return std::nullopt;
  ++stats_.hits;
  return RemoveLocked(it);
}

std::optional<WarmPin> WarmPinSet::EvictOldest(
    std::optional<uint64_t> session) {
  absl::MutexLock lock(&mu_);
  return EvictOldestLocked(session);
}

std::vector<WarmPin> WarmPinSet::DropBuffer(uint64_t session, uint64_t buffer) {
  absl::MutexLock lock(&mu_);
  std::vector<WarmPin> out;
  // Keys order by session, then buffer: the buffer's pins are one run.
  auto it = by_key_.lower_bound(WarmKey{session, buffer, 0, 0});
  while (it != by_key_.end() && it->first.session == session &&
         it->first.buffer == buffer) {
    auto next = std::next(it);
    out.push_back(RemoveLocked(it));
    ++stats_.drops;
    it = next;
  }
  return out;
}

std::vector<WarmPin> WarmPinSet::DropSession(uint64_t session) {
  absl::MutexLock lock(&mu_);
  std::vector<WarmPin> out;
  for (auto it = by_session_age_.lower_bound({session, 0});
       it != by_session_age_.end() && it->first.first == session;
       it = by_session_age_.lower_bound({session, 0})) {
    out.push_back(RemoveLocked(by_key_.find(it->second)));
    ++stats_.drops;
  }
  return out;
}

void WarmPinSet::CountDrop() {
  absl::MutexLock lock(&mu_);
  ++stats_.drops;
}

WarmPinStats WarmPinSet::Stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

std::vector<std::pair<WarmKey, uint64_t>> WarmPinSet::Kept() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<WarmKey, uint64_t>> kept;
  kept.reserve(by_age_.size());
  for (const auto& [age, key] : by_age_) {
    kept.emplace_back(key, by_key_.find(key)->second.pin.pinned_bytes);
  }
  return kept;
}

uint64_t WarmPinSet::SessionBytes(uint64_t session) const {
  absl::MutexLock lock(&mu_);
  auto it = session_bytes_.find(session);
  return it == session_bytes_.end() ? 0 : it->second;
}

}  // namespace mrd::cache
