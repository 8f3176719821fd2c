// Publications: the names under which sessions publish their registrations
// on the directory (issue 27, docs/DIRECTORY.md), kept in step with the
// registrations they name.
//
// A session publishes a registration it holds (or the current mapping of a
// fast-register MR object it holds) under a name of its choice;
// the entry (node, address, length, flags, one token per device, epoch) goes
// under its tenant's part of the directory,
//   <root>/v1/<cluster>/tenants/<tenant>/names/<name>
// as proto3 JSON of v1::PublishedEntry, written by the directory's
// Publisher in the background, attached to mrd's lease. A name is the
// tenant's on this mrd: a second Publish of it, from any session of the
// tenant, is ALREADY_EXISTS NAME_TAKEN until the first is gone. mrd builds
// every key from the session's own tenant, so a tenant can write nowhere
// but under its own prefix.
//
// Names follow their registrations: Sync, called after anything that may
// have taken a registration out of a session (its last DeregisterMr,
// ReleaseBuffer, CloseMr), unpublishes every name whose registration is
// gone (or whose MR object's mapping is), DropMr the names of an MR object
// whose mapping an InvalidateMr ends, and DropAll every name of a session
// that ends. Both wait, at most
// options.unpublish_wait and only while etcd is reachable, for etcd to
// confirm the deletes: the call that ended a registration answers after
// its entry is gone. With etcd unreachable the deletes stay queued (the
// Publisher retries them) and the lease bounds how long an entry can
// outlive its token.
//
// Thread safety: thread-safe. Lock order: a session's `mu`, then `mu_`; no
// lock is held while waiting for etcd.
#ifndef MRD_SERVER_CORE_PUBLICATIONS_H_
#define MRD_SERVER_CORE_PUBLICATIONS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "mrd/v1/mrd.pb.h"
#include "server/core/registrations.h"
#include "server/core/session.h"
#include "server/device/device.h"
#include "server/directory/publisher.h"

namespace mrd::core {

struct DirectoryOptions {
  std::string root = "/mrd";        // --directory_root
  std::string cluster = "default";  // --directory_cluster
  std::string node;                 // --node_name
  // 1 for a process started afresh, one more for each live handover.
  uint64_t epoch = 1;
  // How long a call that ends a registration waits for etcd to delete its
  // entry (--directory_unpublish_wait).
  absl::Duration unpublish_wait = absl::Seconds(2);
  // WatchName streams at once, at most (--directory_max_watches); a tenant
  // may hold a quarter of them.
  size_t max_watches = 256;
  // --directory_mooncake_prefix: "" (off), or the prefix of the Mooncake
  // layout's keys ("mooncake/"): each name is also a Mooncake segment,
  // <prefix>ram/<name> (mooncake_layout.h).
  std::string mooncake_prefix;
};

// A name's etcd key: "<root>/v1/<cluster>/tenants/<tenant>/names/<name>",
// with any '/' or '%' of the tenant written as %2F, %25.
std::string PublishedKey(const DirectoryOptions& options,
                         absl::string_view tenant, absl::string_view name);
// This mrd's node entry's key: "<root>/v1/<cluster>/nodes/<node>".
std::string NodeKey(const DirectoryOptions& options);
// OK for 1 to 128 characters of [A-Za-z0-9._:-]; INVALID_ARGUMENT
// BAD_PUBLISH_NAME otherwise.
absl::Status CheckPublishName(absl::string_view name);

class Publications {
 public:
  // `registrations` and `devices` must outlive this.
  Publications(Registrations* registrations,
               const std::vector<device::Device*>& devices)
      : registrations_(registrations), devices_(devices) {}
  Publications(const Publications&) = delete;
  Publications& operator=(const Publications&) = delete;

  // Turns the directory on, before any call (the publisher outlives this),
  // and publishes this mrd's node entry (NodeKey: the devices and their
  // peer addresses, the epoch) under the publisher's lease.
  void Configure(directory::Publisher* publisher, DirectoryOptions options);
  bool enabled() const { return publisher_ != nullptr; }
  const DirectoryOptions& options() const { return options_; }

  absl::Status Publish(Session& session, const v1::PublishRequest& req,
                       v1::PublishedEntry* out) ABSL_LOCKS_EXCLUDED(session.mu);
  // Before a registration published at its making (publish_name): the
  // directory is on, the name is good and no other session has it.
  absl::Status CheckPublishable(Session& session, const std::string& name);
  absl::Status Unpublish(Session& session, const v1::UnpublishRequest& req,
                         v1::UnpublishResponse* out)
      ABSL_LOCKS_EXCLUDED(session.mu);
  absl::Status List(Session& session, v1::ListPublishedResponse* out)
      ABSL_LOCKS_EXCLUDED(session.mu);
  // Reads etcd (at most the etcd client's call timeout).
  absl::Status Resolve(const Session& session, const v1::ResolveRequest& req,
                       v1::PublishedEntry* out);

  // WatchName: `on_event` gets the name's state now (on this thread,
  // before this returns), then every change (on the watch's thread), and
  // once an error if the watch ends for good (ETCD_COMPACTED). The watch
  // holds a slot of options.max_watches (a tenant a quarter of them) until
  // it is destroyed. Errors as Resolve, RESOURCE_EXHAUSTED WATCH_LIMIT.
  class NameWatch;
  using NameEventCallback =
      absl::AnyInvocable<void(absl::StatusOr<v1::NameEvent>)>;
  absl::StatusOr<std::unique_ptr<NameWatch>> WatchName(
      const Session& session, const v1::ResolveRequest& req,
      NameEventCallback on_event);

  // Unpublishes the names whose registration left the session; waits
  // (bounded) for etcd.
  void Sync(Session& session) ABSL_LOCKS_EXCLUDED(session.mu);
  // The same for the names of `registrations` alone (those that left the
  // session), without walking the session's other names.
  void Sync(Session& session, absl::Span<const uint64_t> registrations)
      ABSL_LOCKS_EXCLUDED(session.mu);
  // MR object `mr`'s mapping is being invalidated (InvalidateMr posted):
  // its names go, waited for like Sync's.
  void DropMr(Session& session, uint64_t mr) ABSL_LOCKS_EXCLUDED(session.mu);
  // The session ended: all its names go. Waits (bounded) when `wait`.
  void DropAll(Session& session, bool wait) ABSL_LOCKS_EXCLUDED(session.mu);

  // "off", "connecting", "serving" or "unavailable".
  std::string StateName() const;
  // The publisher's counts; nullopt while the directory is off.
  std::optional<directory::PublisherStats> Stats() const;

  // A handover's new process (or an old one that serves on after a failed
  // one), once Configure gave it the publisher of the lease handed over:
  // writes every session's names again, with this epoch's entries; a name
  // whose registration did not come along is deleted.
  void RepublishAll(const std::vector<std::shared_ptr<Session>>& sessions);

 private:
  // One token per device the registration `view` is on.
  void AddTokens(const cache::EntryView& view, v1::PublishedEntry* entry) const;
  // The entry of `target` of the session under `name`; NOT_FOUND if the
  // session holds no such registration or MR object, FAILED_PRECONDITION
  // MR_NOT_MAPPED if the MR object's mapping is not live (or, when
  // target->rkey is set, is another one since). An MR object's target
  // without an rkey gets the mapping's.
  absl::StatusOr<v1::PublishedEntry> EntryLocked(const Session& session,
                                                 const std::string& name,
                                                 PublishedTarget* target) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu);
  // Whether what `target` names is still the session's, as published.
  static bool LiveLocked(const Session& session, const PublishedTarget& target)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu);
  // The name's Mooncake segment key; "" when that layout is off.
  std::string MooncakeKey(const std::string& name) const;
  // Queues the Mooncake segment of `entry` (a no-op when that layout is
  // off).
  absl::Status PublishMooncake(const v1::PublishedEntry& entry);
  // Queues the delete of each name's key and forgets the name; waits for
  // them (bounded) when `wait` and etcd is reachable.
  void Drop(const Session& session, const std::vector<std::string>& names,
            bool wait);

  Registrations* const registrations_;
  const std::vector<device::Device*> devices_;
  // Releases a watch's slot.
  void EndWatch(const std::string& tenant);
  // Forgets the key's owner and gives its tenant the name back.
  void EraseOwnerLocked(const std::string& key, Tenant& tenant)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  directory::Publisher* publisher_ = nullptr;  // fixed by Configure
  DirectoryOptions options_;                   // fixed by Configure
  // The client of reads and watches, its own (a watch must go before its
  // client, and watches may outlive a publisher a handover replaces).
  std::shared_ptr<directory::EtcdClient> reader_;  // fixed by Configure
  mutable absl::Mutex mu_;
  // Every key published on this mrd -> the id of the session holding it.
  absl::flat_hash_map<std::string, uint64_t> owners_ ABSL_GUARDED_BY(mu_);
  // Every Mooncake segment key -> the id of the session holding it (its
  // keys have no tenant: the first session to publish a name has it).
  absl::flat_hash_map<std::string, uint64_t> segments_ ABSL_GUARDED_BY(mu_);
  size_t watches_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, size_t> tenant_watches_ ABSL_GUARDED_BY(mu_);
};

// One WatchName's etcd watch and its slot.
class Publications::NameWatch {
 public:
  NameWatch(Publications* owner, std::string tenant,
            std::shared_ptr<directory::EtcdClient> client)
      : owner_(owner), tenant_(std::move(tenant)), client_(std::move(client)) {}
  ~NameWatch() {
    watch_.reset();  // joins its thread: no callback after this
    owner_->EndWatch(tenant_);
  }
  NameWatch(const NameWatch&) = delete;
  NameWatch& operator=(const NameWatch&) = delete;

  // Ends the watch's stream without waiting (EtcdWatch::Stop); the
  // destructor, which waits, may then run on a thread free to block.
  void Stop() {
    if (watch_ != nullptr) watch_->Stop();
  }

 private:
  friend class Publications;
  Publications* const owner_;
  const std::string tenant_;
  const std::shared_ptr<directory::EtcdClient> client_;  // outlives watch_
  std::unique_ptr<directory::EtcdWatch> watch_;
};

}  // namespace mrd::core

#endif  // MRD_SERVER_CORE_PUBLICATIONS_H_
