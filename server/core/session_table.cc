#include "server/core/session_table.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"

namespace mrd::core {
namespace {

absl::Status ShuttingDown() {
  return MrdError(absl::StatusCode::kUnavailable, "SHUTTING_DOWN",
                  "mrd is shutting down");
}

}  // namespace

absl::StatusOr<uint64_t> SessionTable::Reserve() {
  absl::MutexLock lock(&mu_);
  if (closed_) return ShuttingDown();
  if (sessions_.size() + pending_ >= max_sessions_) {
    return SeedError(STATUS_INSUFFICIENT_RESOURCES, "LIMIT_SESSIONS",
                     absl::StrCat("the server holds its maximum of ",
                                  max_sessions_, " sessions"));
  }
  ++pending_;
  return next_id_++;
}

void SessionTable::Unreserve() {
  absl::MutexLock lock(&mu_);
  --pending_;
}

absl::Status SessionTable::Insert(std::shared_ptr<Session> session) {
  absl::MutexLock lock(&mu_);
  --pending_;
  // Lost a race with Close: nothing of the session may outlive it.
  if (closed_) return ShuttingDown();
  const std::string token = session->token();
  sessions_.emplace(token, std::move(session));
  ++opened_;
  return absl::OkStatus();
}

absl::Status SessionTable::Adopt(std::shared_ptr<Session> session) {
  absl::MutexLock lock(&mu_);
  if (closed_) return ShuttingDown();
  const std::string token = session->token();
  if (sessions_.contains(token)) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "SESSION_EXISTS",
                    absl::StrCat("session ", session->id(), " exists already"));
  }
  next_id_ = std::max(next_id_, session->id() + 1);
  sessions_.emplace(token, std::move(session));
  return absl::OkStatus();
}

void SessionTable::ContinueFrom(uint64_t next_id, uint64_t opened_total,
                                uint64_t closed_total) {
  absl::MutexLock lock(&mu_);
  next_id_ = std::max(next_id_, next_id);
  opened_ = opened_total;
  closed_total_ = closed_total;
}

uint64_t SessionTable::next_id() const {
  absl::MutexLock lock(&mu_);
  return next_id_;
}

std::shared_ptr<Session> SessionTable::Find(const std::string& token) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(token);
  return it == sessions_.end() ? nullptr : it->second;
}

std::shared_ptr<Session> SessionTable::Remove(const std::string& token) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(token);
  if (it == sessions_.end()) return nullptr;
  std::shared_ptr<Session> session = std::move(it->second);
  sessions_.erase(it);
  ++closed_total_;
  return session;
}

std::vector<std::shared_ptr<Session>> SessionTable::Close() {
  std::vector<std::shared_ptr<Session>> all;
  absl::MutexLock lock(&mu_);
  closed_ = true;
  for (auto& [token, session] : sessions_) all.push_back(std::move(session));
  sessions_.clear();
  closed_total_ += all.size();
  return all;
}

std::vector<std::shared_ptr<Session>> SessionTable::All() const {
  std::vector<std::shared_ptr<Session>> all;
  absl::MutexLock lock(&mu_);
  all.reserve(sessions_.size());
  for (const auto& [token, session] : sessions_) all.push_back(session);
  return all;
}

SessionCounts SessionTable::Counts() const {
  absl::MutexLock lock(&mu_);
  return SessionCounts{sessions_.size(), opened_, closed_total_};
}

}  // namespace mrd::core
