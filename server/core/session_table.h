// SessionTable: the open sessions by token, the max_sessions limit, and the
// server's session counters. A session is added in two steps, because its
// protection domain is allocated between them: Reserve counts it against
// the limit (refusing LIMIT_SESSIONS, or SHUTTING_DOWN), Insert makes it
// findable (or refuses SHUTTING_DOWN when Shutdown came in between; the
// caller then undoes what it made), Unreserve gives a reservation back.
//
// Thread safety: thread-safe; nothing is called while its mutex is held.
#ifndef MRD_SERVER_CORE_SESSION_TABLE_H_
#define MRD_SERVER_CORE_SESSION_TABLE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/core/session.h"

namespace mrd::core {

struct SessionCounts {
  uint64_t open = 0;
  uint64_t opened_total = 0;
  uint64_t closed_total = 0;
};

class SessionTable {
 public:
  explicit SessionTable(uint64_t max_sessions) : max_sessions_(max_sessions) {}
  SessionTable(const SessionTable&) = delete;
  SessionTable& operator=(const SessionTable&) = delete;

  // Room for one more session; returns its id. Errors: UNAVAILABLE
  // "SHUTTING_DOWN", STATUS_INSUFFICIENT_RESOURCES "LIMIT_SESSIONS".
  absl::StatusOr<uint64_t> Reserve() ABSL_LOCKS_EXCLUDED(mu_);
  void Unreserve() ABSL_LOCKS_EXCLUDED(mu_);
  // Turns a reservation into a session findable by its token. Errors:
  // UNAVAILABLE "SHUTTING_DOWN" (the reservation is given back).
  absl::Status Insert(std::shared_ptr<Session> session)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Handover: a session another mrd process had, findable at once with
  // the id it had; later sessions get ids from `next_id` on (when larger),
  // and the counters continue from the other process's. Errors:
  // UNAVAILABLE "SHUTTING_DOWN", FAILED_PRECONDITION "SESSION_EXISTS" (its
  // token is taken). Not counted against max_sessions: nothing held is
  // refused.
  absl::Status Adopt(std::shared_ptr<Session> session) ABSL_LOCKS_EXCLUDED(mu_);
  void ContinueFrom(uint64_t next_id, uint64_t opened_total,
                    uint64_t closed_total) ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t next_id() const ABSL_LOCKS_EXCLUDED(mu_);

  // nullptr when there is none.
  std::shared_ptr<Session> Find(const std::string& token) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Takes the session out (nullptr when there was none).
  std::shared_ptr<Session> Remove(const std::string& token)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Refuses new sessions from now on and takes every session out.
  std::vector<std::shared_ptr<Session>> Close() ABSL_LOCKS_EXCLUDED(mu_);

  std::vector<std::shared_ptr<Session>> All() const ABSL_LOCKS_EXCLUDED(mu_);
  SessionCounts Counts() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const uint64_t max_sessions_;
  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Reserved, not inserted yet (they count against max_sessions).
  uint64_t pending_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, std::shared_ptr<Session>> sessions_
      ABSL_GUARDED_BY(mu_);
  uint64_t opened_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t closed_total_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace mrd::core

#endif  // MRD_SERVER_CORE_SESSION_TABLE_H_
