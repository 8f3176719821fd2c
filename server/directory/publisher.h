// Publisher: the keys one mrd process keeps on etcd, each alive exactly as
// long as that process (or the one it hands over to) serves (issue 27,
// docs/DIRECTORY.md).
//
// Every key is attached to the process's one lease, which a keeper renews
// while the process runs: a process killed with SIGKILL loses its keys
// within the lease's TTL, with nothing left to clean up. A clean stop
// revokes the lease (every key goes at once); a live handover passes the
// lease id on instead (Handover), and the new process adopts it.
//
// Writing never blocks the caller on etcd. Publish and Unpublish record
// what the caller wants and return; one worker thread makes etcd agree,
// key by key in the order they were asked for, retrying with backoff while
// etcd is unreachable. What is wanted is bounded (options.max_keys: keys
// wanted plus deletes not yet done); past it Publish is refused with
// RESOURCE_EXHAUSTED DIRECTORY_FULL. A caller that must know a key is gone
// before it answers (a deregistration) waits on Unpublish's Done, bounded:
// while etcd is unreachable the delete stays queued and happens as soon as
// etcd is back, and the lease bounds how long a dead process's key can
// outlive it.
//
// A key is claimed, never taken: it is written only if it is absent or
// already this lease's (etcd transactions), so two publishers of one name
// cannot overwrite each other. A key another lease holds is in state
// kConflict: left alone, not retried, until the caller publishes it again
// or unpublishes it.
//
// When the lease is lost (etcd says it is gone, or no renewal was
// acknowledged for a whole TTL), the worker revokes it (a lease that was in
// fact still alive then takes its keys along), retrying while etcd is
// unreachable, so that no key of the old lease is left beside its new copy;
// once etcd confirms (the revoke, or that the lease is gone) the deletes
// queued are done, and the worker grants a new lease and writes every wanted
// key again (a kConflict stays one).
//
// Thread safety: thread-safe. Its mutex is a leaf: no etcd call is made
// while it is held.
#ifndef MRD_SERVER_DIRECTORY_PUBLISHER_H_
#define MRD_SERVER_DIRECTORY_PUBLISHER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "server/directory/etcd_client.h"

namespace mrd::directory {

struct PublisherOptions {
  EtcdClientOptions etcd;
  // The lease's TTL: how long the keys of a process killed outright may
  // outlive it. Renewed every third of it.
  absl::Duration lease_ttl = absl::Seconds(10);
  // Keys wanted plus deletes not yet done, at most.
  size_t max_keys = 65536;
  // Backoff between attempts while etcd is unreachable.
  absl::Duration retry_min = absl::Milliseconds(50);
  absl::Duration retry_max = absl::Seconds(2);
  // A lease handed over by the process before (0: grant a new one). The
  // keys it holds are this process's: written again with their new values.
  int64_t adopt_lease = 0;
  // How long a put waits in the queue before it is sent (0: at once),
  // unless a full transaction's worth is queued or an Unpublish waits for a
  // delete. The call that queued it answers first, without the writer's
  // etcd request competing for its core, and the names queued meanwhile
  // join it in one transaction. Each name's delay counts from its own
  // queueing: one published and unpublished within it never reaches etcd.
  absl::Duration write_delay = absl::Milliseconds(1);
};

// The directory as a whole, as GetSession, metrics and health report it.
enum class DirectoryState {
  kConnecting,   // no lease yet (etcd not reached since the start: a
                 // failure before the first lease leaves it here)
  kServing,      // a lease is kept and the last write went through
  kUnavailable,  // etcd unreachable: writes queued, retried
};
absl::string_view DirectoryStateName(DirectoryState state);  // "serving", ...

// One key, as ListPublished reports it.
enum class KeyState {
  kPending,    // wanted, not yet written (or rewritten) on etcd
  kPublished,  // on etcd under this process's lease, with the value wanted
  kConflict,   // another lease holds the key: not written
};
absl::string_view KeyStateName(KeyState state);  // "pending", ...

struct PublisherStats {
  DirectoryState state = DirectoryState::kConnecting;
  int64_t lease = 0;  // the lease kept now; 0: none
  size_t published = 0;
  size_t pending = 0;  // puts and deletes not yet done
  size_t conflicts = 0;
  uint64_t writes = 0;         // puts and deletes etcd acknowledged
  uint64_t transactions = 0;   // etcd transactions sent (a batch is one)
  uint64_t failed_writes = 0;  // attempts that failed (to be retried)
  uint64_t leases_granted = 0;
  absl::Status last_error;  // the last failure, OK if none yet
};

class Publisher {
 public:
  // Starts the worker (and the lease's keeper once it has a lease); does
  // not wait for etcd. Errors: the client's (ETCD_BAD_ENDPOINT, ...),
  // INVALID_ARGUMENT DIRECTORY_BAD_OPTIONS for a TTL under 1 s, max_keys 0,
  // a retry backoff not positive (or retry_max < retry_min), a negative
  // adopt_lease or a negative write_delay.
  static absl::StatusOr<std::unique_ptr<Publisher>> Start(
      PublisherOptions options);
  // Stops the worker and the keeper. Does not revoke the lease: Stop or
  // Handover first says what becomes of the keys.
  ~Publisher();
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  // Wants `key` = `value` on etcd under the lease; queued. Publishing a key
  // again with another value rewrites it (and retries a kConflict).
  // INVALID_ARGUMENT DIRECTORY_BAD_KEY for an empty key; RESOURCE_EXHAUSTED
  // DIRECTORY_FULL past max_keys; FAILED_PRECONDITION DIRECTORY_STOPPED
  // after Stop or Handover. Never waits for etcd. A delete of the key not
  // yet done is superseded (its Done is notified).
  absl::Status Publish(const std::string& key, std::string value);

  // Done once etcd confirmed a delete (or the key was never written; or the
  // lease it was under is gone: replaced after a loss, or revoked by Stop;
  // or a Publish of the key superseded the delete). A delete not done by a
  // Handover, or by the destruction, is never notified.
  using Done = std::shared_ptr<absl::Notification>;
  // Wants `key` gone; queued (deleted only if it is this lease's: a
  // kConflict key stays its holder's). A key not wanted is already done, as
  // is every key after Stop or Handover. Never waits: the caller may wait
  // on the Done, bounded.
  Done Unpublish(const std::string& key);

  // The key's state; NOT_FOUND DIRECTORY_NO_KEY if it is not wanted.
  absl::StatusOr<KeyState> StateOf(const std::string& key) const;
  // Walks every key: for metrics. State() alone is a field.
  PublisherStats Stats() const;
  DirectoryState State() const;

  // A clean stop: revokes the lease (etcd deletes every key at once),
  // within the client's call timeout, then stops the worker (waiting for a
  // write in flight, which the revoke makes fail: up to another call
  // timeout) and the keeper. UNAVAILABLE ETCD_UNAVAILABLE if etcd could not
  // be reached (the keys then go with the lease's TTL). Stop after Handover
  // revokes the lease handed over (a handover given up).
  absl::Status Stop();
  // A live handover: stops writing (waits for a write in flight, so that
  // none lands after the next process's) and returns the lease, kept alive
  // until this object is destroyed; the next process adopts it
  // (PublisherOptions::adopt_lease) with every key under it, including any
  // whose delete was still queued here. 0 if there is none (or it was
  // lost).
  int64_t Handover();

  // For reads (resolving names, watching them): the publisher's own client.
  EtcdClient& client();

 private:
  Publisher() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mrd::directory

#endif  // MRD_SERVER_DIRECTORY_PUBLISHER_H_
