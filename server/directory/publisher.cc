#include "server/directory/publisher.h"

#include <algorithm>
#include <deque>
#include <map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "mrd/status.h"
#include "server/common/log.h"
#include "server/common/thread.h"

namespace mrd::directory {

namespace {

// An etcd call that may go through on a later attempt: etcd unreachable.
bool Retryable(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status);
}

bool LeaseGone(const absl::Status& status) {
  return absl::IsNotFound(status) &&
         GetErrorDetail(status).reason() == "ETCD_LEASE_NOT_FOUND";
}

Publisher::Done NotifiedDone() {
  auto done = std::make_shared<absl::Notification>();
  done->Notify();
  return done;
}

}  // namespace

absl::string_view DirectoryStateName(DirectoryState state) {
  switch (state) {
    case DirectoryState::kConnecting:
      return "connecting";
    case DirectoryState::kServing:
      return "serving";
    case DirectoryState::kUnavailable:
      return "unavailable";
  }
  return "unknown";
}

absl::string_view KeyStateName(KeyState state) {
  switch (state) {
    case KeyState::kPending:
      return "pending";
    case KeyState::kPublished:
      return "published";
    case KeyState::kConflict:
      return "conflict";
  }
  return "unknown";
}

struct Publisher::Impl {
  // One key: wanted (with its value) or a delete not yet done.
  struct Entry {
    bool wanted = true;
    std::string value;
    KeyState state = KeyState::kPending;
    bool queued = false;   // in `queue`, once
    absl::Time queued_at;  // when it joined `queue`
    // A put was sent under the current lease (it may have gone through): an
    // unpublish must delete it on etcd.
    bool maybe_written = false;
    // Bumped by every Publish and Unpublish that changes what is wanted: a
    // write that went out before is not taken as done.
    uint64_t version = 0;
    std::vector<Done> done;  // of the Unpublish calls waiting
  };

  explicit Impl(PublisherOptions opts) : options(std::move(opts)) {}

  void Run();
  // Holds a lease (granting, adopting, or replacing a lost one); false if
  // not (after backing off) or stopping.
  bool EnsureLease();
  // The keys at the head of the queue: together in one transaction when
  // they can be (WriteBatch), else one at a time (WriteHead); false if a
  // write failed and the worker should back off.
  bool WriteQueued();
  enum class BatchResult { kDone, kOneByOne, kFailed };
  // Up to EtcdClient::kMaxWritesPerTxn keys at the head of the queue in one
  // transaction, if every put's key is absent and every delete's key is
  // this lease's (nearly every write). kOneByOne: they were not, or one was
  // refused; `singles` of them go one at a time.
  BatchResult WriteBatch();
  // One write of the key at the head of the queue; false if it failed and
  // the worker should back off.
  bool WriteHead();
  // Waits `*backoff` unless stopping (then false), and doubles it.
  bool Backoff(absl::Duration* backoff);
  void Failed(const absl::Status& status, bool unavailable)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void LeaseLost(int64_t lease, const absl::Status& status);
  // Stops the worker (waits for a write in flight).
  void StopWorker();

  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return stopping || lost || lease == 0 || !queue.empty();
  }
  // What ends options.write_delay early.
  bool WriteNow() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return stopping || lost || lease == 0 || urgent ||
           queue.size() >= EtcdClient::kMaxWritesPerTxn;
  }
  void Enqueue(const std::string& key, Entry& entry)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (entry.queued) return;
    entry.queued = true;
    entry.queued_at = absl::Now();
    queue.push_back(key);
  }
  // When the head of the queue has waited options.write_delay (the queue
  // is FIFO: no name in it waited longer). The queue is not empty; every
  // name in it has its entry.
  absl::Time HeadDue() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = entries.find(queue.front());
    if (it == entries.end()) return absl::InfinitePast();
    return it->second.queued_at + options.write_delay;
  }

  const PublisherOptions options;
  // Declared first: destroyed after the keeper (which must go before it).
  std::unique_ptr<EtcdClient> client;
  // Serializes joining the worker (Stop, Handover, the destructor): none
  // returns while it still runs.
  absl::Mutex join_mu;
  Thread worker ABSL_GUARDED_BY(join_mu);

  mutable absl::Mutex mu;
  std::map<std::string, Entry> entries ABSL_GUARDED_BY(mu);
  std::deque<std::string> queue ABSL_GUARDED_BY(mu);  // dirty keys, FIFO
  // An Unpublish waits for a delete queued: no write delay until the queue
  // is empty again.
  bool urgent ABSL_GUARDED_BY(mu) = false;
  bool stopping ABSL_GUARDED_BY(mu) = false;  // the worker is to stop
  bool stopped ABSL_GUARDED_BY(mu) = false;   // Stop or Handover was called
  bool adopt_tried ABSL_GUARDED_BY(mu) = false;
  bool ever_leased ABSL_GUARDED_BY(mu) = false;
  int64_t lease ABSL_GUARDED_BY(mu) = 0;
  bool lost ABSL_GUARDED_BY(mu) = false;  // the lease is to be replaced
  std::unique_ptr<EtcdLeaseKeeper> keeper ABSL_GUARDED_BY(mu);
  size_t singles = 0;  // the worker's: keys to write one at a time first
  DirectoryState state ABSL_GUARDED_BY(mu) = DirectoryState::kConnecting;
  uint64_t writes ABSL_GUARDED_BY(mu) = 0;
  uint64_t transactions ABSL_GUARDED_BY(mu) = 0;
  uint64_t failed_writes ABSL_GUARDED_BY(mu) = 0;
  uint64_t leases_granted ABSL_GUARDED_BY(mu) = 0;
  absl::Status last_error ABSL_GUARDED_BY(mu);
};

void Publisher::Impl::Failed(const absl::Status& status, bool unavailable) {
  ++failed_writes;
  // etcd refusing mrd's user does not pass by itself: said once (the
  // error names the user and the password's file, never the password).
  if (GetErrorDetail(status).reason() == "ETCD_AUTH_FAILED" &&
      GetErrorDetail(last_error).reason() != "ETCD_AUTH_FAILED") {
    LogWarning("directory: ", status.message(), "; trying again");
  }
  last_error = status;
  if (unavailable && ever_leased) state = DirectoryState::kUnavailable;
}

void Publisher::Impl::LeaseLost(int64_t lost_lease,
                                const absl::Status& status) {
  absl::MutexLock lock(&mu);
  if (lease != lost_lease) return;
  lost = true;
  last_error = status;
}

bool Publisher::Impl::Backoff(absl::Duration* backoff) {
  absl::MutexLock lock(&mu);
  mu.AwaitWithTimeout(absl::Condition(&stopping), *backoff);
  *backoff = std::min(*backoff * 2, options.retry_max);
  return !stopping;
}

void Publisher::Impl::Run() {
  absl::Duration backoff = options.retry_min;
  while (true) {
    bool need_lease = false;
    {
      absl::MutexLock lock(&mu);
      if (queue.empty()) urgent = false;  // the deletes waited for are done
      mu.Await(absl::Condition(this, &Impl::HasWork));
      // The head's delay, counted from its own queueing: a name that left
      // the queue meanwhile leaves the next one its own full delay, and a
      // queue emptied meanwhile goes back to waiting for work.
      bool emptied = false;
      while (!WriteNow() && options.write_delay > absl::ZeroDuration()) {
        if (queue.empty()) {
          emptied = true;
          break;
        }
        const absl::Time due = HeadDue();
        if (absl::Now() >= due) break;
        mu.AwaitWithDeadline(absl::Condition(this, &Impl::WriteNow), due);
      }
      if (stopping) return;
      if (emptied) continue;
      need_lease = lost || lease == 0;
    }
    const bool ok = need_lease ? EnsureLease() : WriteQueued();
    if (ok) {
      backoff = options.retry_min;
    } else if (!Backoff(&backoff)) {
      return;
    }
  }
}

bool Publisher::Impl::EnsureLease() {
  int64_t old_lease = 0;
  std::unique_ptr<EtcdLeaseKeeper> old_keeper;
  int64_t adopt = 0;
  {
    absl::MutexLock lock(&mu);
    if (lost && lease == 0) lost = false;  // nothing to replace
    if (lost) {
      old_lease = lease;
      old_keeper = std::move(keeper);
    } else if (!adopt_tried) {
      adopt_tried = true;
      adopt = options.adopt_lease;
    }
  }
  if (old_lease != 0) {
    // Its keeper (done already, or still renewing a lease that a write found
    // gone) stops first: this thread, not the keeper's, holds no lock.
    old_keeper.reset();
    // Best effort, and before any key is written under a new lease: a lease
    // that was in fact still alive takes its keys along now, rather than
    // leaving them beside their new copies until its TTL.
    absl::Status revoked = client->Revoke(old_lease);
    std::vector<Done> done;
    {
      absl::MutexLock lock(&mu);
      if (!revoked.ok() && !LeaseGone(revoked)) {
        Failed(revoked, Retryable(revoked));
        return false;
      }
      LogInfo("directory: etcd lease ", old_lease,
              " lost; its keys are gone, writing them under a new lease");
      lease = 0;
      lost = false;
      // Every key of the old lease is gone: the deletes are done, and every
      // key wanted is written again (in the order queued, then the rest).
      for (auto it = entries.begin(); it != entries.end();) {
        Entry& entry = it->second;
        entry.maybe_written = false;
        if (!entry.wanted) {
          for (Done& d : entry.done) done.push_back(std::move(d));
          if (entry.queued) {
            queue.erase(std::find(queue.begin(), queue.end(), it->first));
          }
          it = entries.erase(it);
          continue;
        }
        if (entry.state == KeyState::kPublished) {
          entry.state = KeyState::kPending;
        }
        if (entry.state == KeyState::kPending) Enqueue(it->first, entry);
        ++it;
      }
    }
    for (Done& d : done) d->Notify();
  }

  EtcdLease granted;
  bool adopted = false;
  if (adopt != 0) {
    absl::StatusOr<absl::Duration> ttl = client->KeepAliveOnce(adopt);
    if (ttl.ok()) {
      granted.id = adopt;
      granted.ttl = *ttl;
      adopted = true;
    } else if (LeaseGone(ttl.status())) {
      LogWarning("directory: etcd lease ", adopt,
                 " handed over is gone; granting a new one");
    } else {
      absl::MutexLock lock(&mu);
      adopt_tried = false;  // try it again next time
      Failed(ttl.status(), Retryable(ttl.status()));
      return false;
    }
  }
  if (!adopted) {
    absl::StatusOr<EtcdLease> lease_or = client->Grant(options.lease_ttl);
    if (!lease_or.ok()) {
      absl::MutexLock lock(&mu);
      Failed(lease_or.status(), Retryable(lease_or.status()));
      return false;
    }
    granted = *lease_or;
  }
  const int64_t id = granted.id;
  absl::StatusOr<std::unique_ptr<EtcdLeaseKeeper>> new_keeper =
      client->KeepAlive(
          granted, [this, id](absl::Status status) { LeaseLost(id, status); });
  if (!new_keeper.ok()) {
    if (!adopted) (void)client->Revoke(id);  // unused: best effort
    absl::MutexLock lock(&mu);
    Failed(new_keeper.status(), false);
    return false;
  }
  absl::MutexLock lock(&mu);
  // Kept even if stopping now: Stop revokes it, Handover passes it on.
  lease = id;
  keeper = *std::move(new_keeper);
  if (!adopted) ++leases_granted;
  ever_leased = true;
  state = DirectoryState::kServing;
  return true;
}

bool Publisher::Impl::WriteQueued() {
  if (singles > 0) {
    --singles;
    return WriteHead();
  }
  switch (WriteBatch()) {
    case BatchResult::kDone:
      return true;
    case BatchResult::kOneByOne:
      --singles;
      return WriteHead();
    case BatchResult::kFailed:
      return false;
  }
  return false;
}

Publisher::Impl::BatchResult Publisher::Impl::WriteBatch() {
  struct Item {
    uint64_t version;
    bool wanted;
  };
  std::vector<EtcdClient::Write> batch;
  std::vector<Item> items;
  int64_t lease_id = 0;
  {
    absl::MutexLock lock(&mu);
    // A few hundred kilobytes at most, far below etcd's request limit
    // (--max-request-bytes, 1.5 MiB by default).
    constexpr size_t kMaxBytes = 256 << 10;
    size_t bytes = 0;
    for (const std::string& key : queue) {
      if (batch.size() == EtcdClient::kMaxWritesPerTxn) break;
      auto it = entries.find(key);
      if (it == entries.end()) break;  // not expected: WriteHead drops it
      Entry& entry = it->second;
      bytes += key.size() + entry.value.size();
      if (!batch.empty() && bytes > kMaxBytes) break;
      EtcdClient::Write& write = batch.emplace_back();
      write.key = key;
      if (entry.wanted) write.value = entry.value;
      items.push_back({entry.version, entry.wanted});
    }
    if (batch.size() < 2) {
      singles = 1;
      return BatchResult::kOneByOne;
    }
    for (const EtcdClient::Write& write : batch) {
      Entry& entry = entries.find(write.key)->second;
      if (entry.wanted) entry.maybe_written = true;
    }
    lease_id = lease;
    ++transactions;
  }
  absl::StatusOr<bool> written = client->WriteAllIfFresh(batch, lease_id);
  std::vector<Done> done;
  BatchResult result = BatchResult::kDone;
  {
    absl::MutexLock lock(&mu);
    if (lease != lease_id) return BatchResult::kDone;  // written again
    if (written.ok() && *written) {
      writes += batch.size();
      state = DirectoryState::kServing;
      // The batch's keys are still the first of the queue (others only
      // join at its end; a key leaves it here, or unwritten).
      absl::flat_hash_set<absl::string_view> finished;
      for (size_t i = 0; i < batch.size(); ++i) {
        auto it = entries.find(batch[i].key);
        Entry& entry = it->second;
        if (entry.version != items[i].version) continue;  // changed since
        finished.insert(it->first);
        entry.queued = false;
        if (items[i].wanted) {
          entry.state = KeyState::kPublished;
        } else {
          for (Done& d : entry.done) done.push_back(std::move(d));
          entry.done.clear();
        }
      }
      const size_t head = std::min(queue.size(), batch.size());
      queue.erase(std::remove_if(queue.begin(), queue.begin() + head,
                                 [&](const std::string& key) {
                                   return finished.contains(key);
                                 }),
                  queue.begin() + head);
      for (size_t i = 0; i < batch.size(); ++i) {
        if (items[i].wanted) continue;
        auto it = entries.find(batch[i].key);
        if (it != entries.end() && !it->second.queued) entries.erase(it);
      }
    } else if (written.ok()) {
      singles = batch.size();  // a key was not fresh: one at a time
      result = BatchResult::kOneByOne;
    } else if (LeaseGone(written.status())) {
      lost = true;
      Failed(written.status(), false);
    } else if (Retryable(written.status())) {
      Failed(written.status(), true);
      result = BatchResult::kFailed;
    } else {
      // Refused as a whole (too large, ...): one at a time, where a key
      // refused goes behind the others.
      singles = batch.size();
      result = BatchResult::kOneByOne;
    }
  }
  for (Done& d : done) d->Notify();
  return result;
}

bool Publisher::Impl::WriteHead() {
  std::string key;
  bool wanted = false;
  std::string value;
  uint64_t version = 0;
  int64_t lease_id = 0;
  {
    absl::MutexLock lock(&mu);
    if (queue.empty()) return true;
    key = queue.front();
    auto it = entries.find(key);
    if (it == entries.end()) {  // not expected: every erase unqueues
      queue.pop_front();
      return true;
    }
    Entry& entry = it->second;
    wanted = entry.wanted;
    value = entry.value;
    version = entry.version;
    lease_id = lease;
    if (wanted) entry.maybe_written = true;
    ++transactions;
  }
  absl::StatusOr<int64_t> written =
      wanted ? client->PutIfAbsentOrOwned(key, value, lease_id)
             : client->DeleteIfOwned(key, lease_id);
  std::vector<Done> done;
  bool ok = true;
  {
    absl::MutexLock lock(&mu);
    if (lease != lease_id) return true;  // replaced meanwhile: written again
    auto it = entries.find(key);
    Entry& entry = it->second;
    const bool current = entry.version == version;
    if (written.ok()) {
      ++writes;
      state = DirectoryState::kServing;
      if (current) {
        queue.pop_front();
        entry.queued = false;
        if (wanted) {
          entry.state = KeyState::kPublished;
        } else {
          done = std::move(entry.done);
          entries.erase(it);
        }
      }
    } else if (absl::IsAlreadyExists(written.status())) {
      if (current) {
        queue.pop_front();
        entry.queued = false;
        entry.state = KeyState::kConflict;
        LogWarning("directory: ", written.status().message(), "; not written");
      }
    } else if (LeaseGone(written.status())) {
      lost = true;
      Failed(written.status(), false);
    } else if (Retryable(written.status())) {
      Failed(written.status(), true);
      ok = false;
    } else {
      // Refused for this key (too large, ...): the others go first.
      LogWarning("directory: etcd write of '", key,
                 "' failed: ", written.status().message());
      Failed(written.status(), false);
      queue.pop_front();
      queue.push_back(key);
      ok = false;
    }
  }
  for (Done& d : done) d->Notify();
  return ok;
}

void Publisher::Impl::StopWorker() {
  {
    absl::MutexLock lock(&mu);
    stopping = true;
  }
  absl::MutexLock lock(&join_mu);
  worker.Join();  // no-op once joined
}

absl::StatusOr<std::unique_ptr<Publisher>> Publisher::Start(
    PublisherOptions options) {
  if (options.lease_ttl < absl::Seconds(1) || options.max_keys == 0 ||
      options.retry_min <= absl::ZeroDuration() ||
      options.retry_max < options.retry_min || options.adopt_lease < 0 ||
      options.write_delay < absl::ZeroDuration()) {
    return MrdError(absl::StatusCode::kInvalidArgument, "DIRECTORY_BAD_OPTIONS",
                    "publisher: lease TTL under 1 s, max_keys 0, a retry "
                    "backoff not positive, a negative lease to adopt or a "
                    "negative write delay");
  }
  auto impl = std::make_unique<Impl>(std::move(options));
  MRD_ASSIGN_OR_RETURN(impl->client, EtcdClient::Create(impl->options.etcd));
  Impl* raw = impl.get();
  {
    absl::MutexLock lock(&impl->join_mu);
    MRD_ASSIGN_OR_RETURN(impl->worker,
                         Thread::Start("dir-publisher", [raw] { raw->Run(); }));
  }
  std::unique_ptr<Publisher> publisher(new Publisher());
  publisher->impl_ = std::move(impl);
  return publisher;
}

Publisher::~Publisher() {
  impl_->StopWorker();
  std::unique_ptr<EtcdLeaseKeeper> keeper;
  {
    absl::MutexLock lock(&impl_->mu);
    keeper = std::move(impl_->keeper);
  }
  keeper.reset();  // before the client (impl_'s)
}

absl::Status Publisher::Publish(const std::string& key, std::string value) {
  if (key.empty()) {
    return MrdError(absl::StatusCode::kInvalidArgument, "DIRECTORY_BAD_KEY",
                    "publisher: empty key");
  }
  std::vector<Done> done;
  {
    absl::MutexLock lock(&impl_->mu);
    if (impl_->stopped) {
      return MrdError(
          absl::StatusCode::kFailedPrecondition, "DIRECTORY_STOPPED",
          absl::StrCat("publisher: stopped; '", key, "' not published"));
    }
    auto it = impl_->entries.find(key);
    if (it == impl_->entries.end()) {
      if (impl_->entries.size() >= impl_->options.max_keys) {
        return MrdError(absl::StatusCode::kResourceExhausted, "DIRECTORY_FULL",
                        absl::StrCat("publisher: ", impl_->options.max_keys,
                                     " keys wanted or being deleted already; '",
                                     key, "' not published"));
      }
      it = impl_->entries.emplace(key, Impl::Entry()).first;
    }
    Impl::Entry& entry = it->second;
    if (entry.wanted && entry.value == value &&
        entry.state != KeyState::kConflict && entry.version != 0) {
      return absl::OkStatus();  // written, or queued, already
    }
    // A delete not yet done is superseded: its waiters are let go.
    done = std::move(entry.done);
    entry.done.clear();
    entry.wanted = true;
    entry.value = std::move(value);
    entry.state = KeyState::kPending;
    ++entry.version;
    impl_->Enqueue(key, entry);
  }
  for (Done& d : done) d->Notify();
  return absl::OkStatus();
}

Publisher::Done Publisher::Unpublish(const std::string& key) {
  absl::MutexLock lock(&impl_->mu);
  auto it = impl_->entries.find(key);
  if (it == impl_->entries.end() || impl_->stopped) return NotifiedDone();
  Impl::Entry& entry = it->second;
  if (entry.wanted && !entry.maybe_written) {
    // Never sent to etcd: nothing to delete.
    if (entry.queued) {
      impl_->queue.erase(
          std::find(impl_->queue.begin(), impl_->queue.end(), key));
    }
    impl_->entries.erase(it);
    return NotifiedDone();
  }
  if (entry.wanted) {
    entry.wanted = false;
    entry.value.clear();
    entry.state = KeyState::kPending;
    ++entry.version;
    impl_->Enqueue(key, entry);
  }
  auto done = std::make_shared<absl::Notification>();
  entry.done.push_back(done);
  impl_->urgent = true;
  return done;
}

absl::StatusOr<KeyState> Publisher::StateOf(const std::string& key) const {
  absl::MutexLock lock(&impl_->mu);
  auto it = impl_->entries.find(key);
  if (it == impl_->entries.end() || !it->second.wanted) {
    return MrdError(absl::StatusCode::kNotFound, "DIRECTORY_NO_KEY",
                    absl::StrCat("publisher: '", key, "' is not published"));
  }
  return it->second.state;
}

PublisherStats Publisher::Stats() const {
  PublisherStats stats;
  absl::MutexLock lock(&impl_->mu);
  stats.state = impl_->state;
  stats.lease = impl_->lease;
  for (const auto& [key, entry] : impl_->entries) {
    if (!entry.wanted) {
      ++stats.pending;
      continue;
    }
    switch (entry.state) {
      case KeyState::kPending:
        ++stats.pending;
        break;
      case KeyState::kPublished:
        ++stats.published;
        break;
      case KeyState::kConflict:
        ++stats.conflicts;
        break;
    }
  }
  stats.writes = impl_->writes;
  stats.transactions = impl_->transactions;
  stats.failed_writes = impl_->failed_writes;
  stats.leases_granted = impl_->leases_granted;
  stats.last_error = impl_->last_error;
  return stats;
}

DirectoryState Publisher::State() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->state;
}

absl::Status Publisher::Stop() {
  int64_t lease = 0;
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->stopped = true;
    impl_->stopping = true;
    lease = impl_->lease;
  }
  // Revoked first, while a write may be in flight: nothing can be attached
  // to a revoked lease, so no key outlives this.
  absl::Status revoked = absl::OkStatus();
  if (lease != 0) revoked = impl_->client->Revoke(lease);
  impl_->StopWorker();
  std::unique_ptr<EtcdLeaseKeeper> keeper;
  int64_t granted_meanwhile = 0;
  std::vector<Done> done;
  {
    absl::MutexLock lock(&impl_->mu);
    keeper = std::move(impl_->keeper);
    if (impl_->lease != lease) granted_meanwhile = impl_->lease;
    impl_->lease = 0;
    impl_->lost = false;
    // The keys went with the lease: every delete is done.
    for (auto& [key, entry] : impl_->entries) {
      for (Done& d : entry.done) done.push_back(std::move(d));
      entry.done.clear();
    }
  }
  keeper.reset();
  // A lease the worker was granting as Stop began: it holds no key.
  if (granted_meanwhile != 0) (void)impl_->client->Revoke(granted_meanwhile);
  if (LeaseGone(revoked)) revoked = absl::OkStatus();
  if (!revoked.ok()) {
    // The keys go with the TTL: no delete is confirmed.
    return MrdError(absl::StatusCode::kUnavailable, "ETCD_UNAVAILABLE",
                    absl::StrCat("publisher: etcd lease ", lease,
                                 " not revoked (its keys go with its TTL): ",
                                 revoked.message()));
  }
  for (Done& d : done) d->Notify();
  return absl::OkStatus();
}

int64_t Publisher::Handover() {
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->stopped = true;
  }
  // Waits for a write in flight: none may land after the next process
  // has rewritten the key.
  impl_->StopWorker();
  // Deletes not yet done stay undone (their Done is never notified): the
  // keys are the next process's now.
  absl::MutexLock lock(&impl_->mu);
  return impl_->lost ? 0 : impl_->lease;
}

EtcdClient& Publisher::client() { return *impl_->client; }

}  // namespace mrd::directory
