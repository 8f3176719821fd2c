// EtcdClient: mrd's client of etcd's v3 API, the foundation of the directory
// (issue 27, docs/DIRECTORY.md): leases, keys put under them, deletes,
// prefix reads and prefix watches, against a list of etcd members
// ("host:port" each), with failover between them.
//
// Transport: etcd's own gRPC API (KV, Lease, Watch, and Auth's
// Authenticate: proto/etcd, built from the .proto files Debian installs) over
// the gRPC mrd already links; no other client library. gRPC stays inside
// etcd_client.cc: this header names none of its types.
//
// Failover: one channel per member, chosen explicitly, rather than gRPC's
// round_robin policy over a static list. round_robin picks a connected
// member for the next call but fails the call in hand, and it counts a
// member that is up but cut off from the quorum ("etcdserver: no leader",
// "leader changed", "request timed out": all UNAVAILABLE) as healthy. Here a
// call that gets UNAVAILABLE (or runs out of its attempt's time) from one
// member is retried on the next, within the call's own deadline; calls stick
// to the member that answered last, so a member that went down costs one
// failed attempt, not one call in N, and a member whose connection is
// failing is skipped while another is not; and a watch's stream, which must
// move to another member when its own goes, knows which member it is on.
// The channels reconnect with a short backoff (options.reconnect_backoff_max,
// where gRPC's own grows to 120 s), so a member that comes back is used
// again within about that time; HTTP/2 keepalive pings find a member that
// vanished without closing its connections.
//
// A synchronous gRPC client makes progress on a connection only while a
// call waits on it: a fail-fast call on a member that is reconnecting fails
// at once and leaves nothing polling, and the member never comes back. So
// every attempt waits for its member's connection (wait_for_ready) up to its
// own deadline, and a watch connects (bounded) before it opens its stream.
//
// Deadlines: every call takes at most options.call_timeout in all, and each
// attempt on one member at most options.attempt_timeout (a keeper's renewal
// at most a quarter of the TTL on one member). A call that finds no member
// to answer fails with UNAVAILABLE ETCD_UNAVAILABLE, naming the members'
// last errors; nothing waits without a bound.
//
// Retries happen only on UNAVAILABLE and an attempt's DEADLINE_EXCEEDED, so
// a write whose first attempt took effect may be applied again: a retried
// Put writes the same value a second time (a second revision; a watcher may
// see both), a retried Delete deletes nothing more. Grant chooses the lease
// id itself, so that a retry whose first attempt went through is recognized
// (etcd's "lease already exists") instead of granting a second lease.
//
// Errors (mrd/status.h, MrdError): INVALID_ARGUMENT ETCD_BAD_ENDPOINT and
// ETCD_BAD_CREDENTIALS (Create) and ETCD_BAD_ARGUMENT; UNAUTHENTICATED
// ETCD_AUTH_FAILED (etcd refused the user and password); UNAVAILABLE
// ETCD_UNAVAILABLE; ALREADY_EXISTS ETCD_KEY_EXISTS (PutIfAbsent,
// PutIfAbsentOrOwned); NOT_FOUND ETCD_LEASE_NOT_FOUND (expired or revoked);
// OUT_OF_RANGE ETCD_COMPACTED (a watch's start revision is gone);
// PERMISSION_DENIED ETCD_PERMISSION_DENIED (the user's roles do not let it
// watch the prefix); UNAVAILABLE
// ETCD_LEASE_LOST (a keeper's lease went unrenewed for its TTL); any other
// answer of etcd keeps etcd's code, with reason ETCD_ERROR and etcd's message.
//
// Thread safety: an EtcdClient is thread-safe; any thread may call any
// method, at once. EtcdLeaseKeeper and EtcdWatch each run one thread of
// their own that calls into the client, and call their callbacks on it.
//
// Ownership: the caller owns the client and every keeper and watch; keepers
// and watches must be destroyed before their client (its destructor checks
// and aborts otherwise). A callback must not destroy its own keeper or
// watch (that would join the thread it runs on).
//
// Security: TLS when options name a CA bundle or a client certificate
// (grpc::SslCredentials: the member's certificate is checked against the CA
// for the endpoint's host, an IP address in its SAN when the endpoint is
// one), and mutual TLS with a client certificate and key. etcd's
// user/password authentication when options name a user: the password is
// read from a file (a flag would show it in ps), the client asks each
// member for a token of its own (Auth.Authenticate on that member, when it
// is first called there: etcd keeps simple tokens in each member's memory,
// another member knows one only once it has applied the sign-in, and a
// member that restarted has forgotten them all) and sends it with every
// call, keeper renewal and watch. A token etcd no longer takes ("invalid
// auth token": expired, or the member restarted) is replaced and the call
// tried once more. Every PEM file and the password file are read at Create;
// no password, token or key is ever written to a log or an error.
#ifndef MRD_SERVER_DIRECTORY_ETCD_CLIENT_H_
#define MRD_SERVER_DIRECTORY_ETCD_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/common/thread.h"

namespace grpc {
class ChannelCredentials;
class ClientContext;
class Status;
}  // namespace grpc

namespace mrd::directory {

struct EtcdClientOptions {
  // The members, "host:port" each (no scheme: TLS or not is chosen below).
  std::vector<std::string> endpoints;
  // TLS, when ca_file or cert_file is set: PEM files, read at Create. The
  // CA bundle that signed the members' certificates (empty: the system's
  // roots), and for mutual TLS a client certificate and its key (both or
  // neither).
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
  // etcd's authentication, when user is set: the password is the first line
  // of password_file (its trailing newline dropped), read at Create.
  std::string user;
  std::string password_file;
  absl::Duration call_timeout = absl::Seconds(5);     // a call, in all
  absl::Duration attempt_timeout = absl::Seconds(1);  // on one member
  // The longest wait before a channel tries a member that was down again.
  absl::Duration reconnect_backoff_max = absl::Seconds(1);
};

struct EtcdLease {
  int64_t id = 0;
  absl::Duration ttl;  // as granted (etcd may round a short TTL up)
};

struct EtcdKeyValue {
  std::string key;
  std::string value;
  int64_t lease = 0;  // 0: none
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
};

struct EtcdRange {
  std::vector<EtcdKeyValue> kvs;  // in key order
  int64_t revision = 0;           // of the store when read: watch from +1
};

struct EtcdWatchEvent {
  enum class Type { kPut, kDelete };
  Type type = Type::kPut;
  std::string key;
  std::string value;  // empty for a delete
  int64_t lease = 0;
  int64_t mod_revision = 0;
};

// Events in revision order; or, once, the error that ended the watch for
// good (OUT_OF_RANGE ETCD_COMPACTED; PERMISSION_DENIED
// ETCD_PERMISSION_DENIED when the user may no longer read the prefix;
// UNAUTHENTICATED ETCD_AUTH_FAILED when
// etcd refused the user on a member it moved to), after which it is never
// called again.
using EtcdWatchCallback =
    absl::AnyInvocable<void(absl::StatusOr<std::vector<EtcdWatchEvent>>)>;

class EtcdLeaseKeeper;
class EtcdWatch;

class EtcdClient {
 public:
  // INVALID_ARGUMENT ETCD_BAD_ENDPOINT for no endpoint or one that is not
  // "host:port"; INVALID_ARGUMENT ETCD_BAD_ARGUMENT for a timeout that is
  // not positive; INVALID_ARGUMENT ETCD_BAD_CREDENTIALS for a PEM or
  // password file that cannot be read or holds no PEM (or no password), a
  // certificate without its key or the other way round, a password file
  // without a user or a user without one (each names the file or option,
  // never what a file holds). Connects lazily: a cluster that is down is no
  // error here, nor is a wrong password (the first call says so).
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Create(
      EtcdClientOptions options);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  // A new lease of `ttl` (whole seconds, rounded up; at least 1 s).
  absl::StatusOr<EtcdLease> Grant(absl::Duration ttl);
  // Ends the lease now, deleting every key attached to it. NOT_FOUND
  // ETCD_LEASE_NOT_FOUND if it is already gone.
  absl::Status Revoke(int64_t lease);
  // The lease's remaining time; NOT_FOUND ETCD_LEASE_NOT_FOUND if gone.
  absl::StatusOr<absl::Duration> TimeToLive(int64_t lease);
  // Renews the lease once; returns its TTL. NOT_FOUND ETCD_LEASE_NOT_FOUND
  // if it is gone (renewing cannot bring it back).
  absl::StatusOr<absl::Duration> KeepAliveOnce(int64_t lease);

  // Writes key = value, attached to `lease` (0: none). Returns the store's
  // revision of the write. NOT_FOUND ETCD_LEASE_NOT_FOUND if the lease is
  // gone; INVALID_ARGUMENT ETCD_BAD_ARGUMENT for an empty key.
  absl::StatusOr<int64_t> Put(absl::string_view key, absl::string_view value,
                              int64_t lease = 0);
  // Writes key = value under `lease` only if the key does not exist (one
  // etcd transaction), so that two writers cannot overwrite each other's
  // key. Returns the revision of the write. A key that already holds this
  // value under this lease counts as written (a retry whose first attempt
  // went through); any other is ALREADY_EXISTS ETCD_KEY_EXISTS, untouched.
  absl::StatusOr<int64_t> PutIfAbsent(absl::string_view key,
                                      absl::string_view value, int64_t lease);
  // Writes key = value under `lease` if the key does not exist or is
  // already attached to `lease` (etcd transactions: create revision 0, else
  // lease equal), so that a holder of the lease may rewrite its own keys
  // (after a handover too) but never another's. Returns the revision of the
  // write (the key's own if it already holds this value under this lease:
  // nothing written). A key attached to no lease or another is
  // ALREADY_EXISTS ETCD_KEY_EXISTS, untouched; NOT_FOUND
  // ETCD_LEASE_NOT_FOUND if the lease is gone; INVALID_ARGUMENT
  // ETCD_BAD_ARGUMENT for an empty key or lease 0.
  absl::StatusOr<int64_t> PutIfAbsentOrOwned(absl::string_view key,
                                             absl::string_view value,
                                             int64_t lease);
  // Deletes the key; returns how many keys went (0 or 1).
  absl::StatusOr<int64_t> Delete(absl::string_view key);
  // Deletes the key only if it is attached to `lease` (one transaction);
  // returns how many keys went: 0 if it is absent or not the lease's.
  // INVALID_ARGUMENT ETCD_BAD_ARGUMENT for an empty key or lease 0.
  absl::StatusOr<int64_t> DeleteIfOwned(absl::string_view key, int64_t lease);
  // Many of those in one transaction, all or none: every put (value set)
  // written under `lease` and every delete (no value) done, if each put's
  // key is absent and each delete's key is attached to `lease`. true: all
  // done; false: a key was not so and nothing was written (write them one
  // at a time). At most kMaxWritesPerTxn writes (etcd's --max-txn-ops is
  // 128 by default); INVALID_ARGUMENT ETCD_BAD_ARGUMENT for more, none, an
  // empty key, a key twice or lease 0.
  struct Write {
    std::string key;
    std::optional<std::string> value;
  };
  static constexpr size_t kMaxWritesPerTxn = 64;
  absl::StatusOr<bool> WriteAllIfFresh(const std::vector<Write>& writes,
                                       int64_t lease);
  // Every key that starts with `prefix` (empty: every key), read at one
  // revision, in pages.
  absl::StatusOr<EtcdRange> Get(absl::string_view prefix);

  // Keeps `lease` alive from a thread of its own, renewing it every third
  // of its TTL, until the keeper is destroyed. `on_lost` runs once, on that
  // thread, when the lease is gone (NOT_FOUND ETCD_LEASE_NOT_FOUND) or went
  // unrenewed for a whole TTL (UNAVAILABLE ETCD_LEASE_LOST: its keys must be
  // taken as gone), and the keeper stops; grant a new lease then.
  absl::StatusOr<std::unique_ptr<EtcdLeaseKeeper>> KeepAlive(
      const EtcdLease& lease, absl::AnyInvocable<void(absl::Status)> on_lost);

  // Watches every key that starts with `prefix`, from `start_revision`
  // (0: from now; a Get's revision + 1: from that read on, nothing missed).
  // Returns once a member has created the watch (UNAVAILABLE ETCD_UNAVAILABLE
  // if none did within the call timeout); `callback` then runs on the
  // watch's thread for every batch of events. When its member goes, the
  // watch moves to another and resumes after the last event delivered:
  // nothing is delivered twice or lost, unless the revisions in between have
  // been compacted (then the callback gets ETCD_COMPACTED and the watch
  // ends). A user that may not read the prefix gets PERMISSION_DENIED
  // ETCD_PERMISSION_DENIED at once, not a retry until the call timeout.
  absl::StatusOr<std::unique_ptr<EtcdWatch>> Watch(absl::string_view prefix,
                                                   int64_t start_revision,
                                                   EtcdWatchCallback callback);

  size_t endpoint_count() const { return endpoints_.size(); }
  const EtcdClientOptions& options() const { return options_; }
  // How many tokens etcd gave this client (Authenticate calls that
  // succeeded): one per member called, and one per token replaced.
  int64_t authentications() const;

 private:
  friend class EtcdLeaseKeeper;
  friend class EtcdWatch;
  struct Endpoint;
  using Attempt = absl::FunctionRef<grpc::Status(
      const Endpoint& endpoint, grpc::ClientContext& context, int attempt)>;

  EtcdClient(EtcdClientOptions options, std::string password,
             const std::shared_ptr<grpc::ChannelCredentials>& credentials);

  // One attempt on `endpoint` until `deadline`, with its token when
  // authenticating (fetched first if the member has given none yet); a
  // token the member refuses is replaced and the attempt made once more.
  // An authentication etcd refused (not retryable) comes in *auth_failure.
  grpc::Status AttemptOn(const Endpoint& endpoint, absl::Time deadline,
                         Attempt attempt, int tries,
                         absl::Status* auth_failure);
  // The token for calls to `endpoint` ("" when not authenticating, or etcd's
  // authentication is off), from Authenticate on that member unless it has
  // one already. `fresh`: it was just fetched.
  grpc::Status TokenFor(const Endpoint& endpoint, absl::Time deadline,
                        std::string* token, bool* fresh,
                        absl::Status* auth_failure);
  // `token` was refused by `endpoint`: the next call there fetches another.
  static void ForgetToken(const Endpoint& endpoint, const std::string& token);

  // Runs `attempt` on the preferred member, then on the others in turn,
  // until one gives an answer other than UNAVAILABLE or `deadline` passes.
  absl::Status Call(absl::string_view what, absl::Time deadline,
                    Attempt attempt);
  // Call with each attempt's time other than options.attempt_timeout.
  absl::Status CallWithin(absl::string_view what, absl::Time deadline,
                          absl::Duration attempt_timeout, Attempt attempt);
  absl::StatusOr<absl::Duration> KeepAliveOnceUntil(
      int64_t lease, absl::Time deadline, absl::Duration attempt_timeout);
  size_t Preferred() const;
  // `index` failed: the next call starts at the member after it.
  void Failed(size_t index);
  void AddHandle();
  void RemoveHandle();

  const EtcdClientOptions options_;
  const std::string password_;  // options_.password_file's; never logged
  std::vector<std::unique_ptr<Endpoint>> endpoints_;  // fixed after Create
  mutable absl::Mutex mu_;
  size_t preferred_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t authentications_ ABSL_GUARDED_BY(mu_) = 0;
  int handles_ ABSL_GUARDED_BY(mu_) = 0;  // live keepers and watches
};

// Keeps one lease alive (EtcdClient::KeepAlive). Destroying it stops the
// renewals (it does not revoke the lease: that is Revoke's) and waits for
// the thread, at most for one renewal in flight (the client's call
// timeout).
class EtcdLeaseKeeper {
 public:
  ~EtcdLeaseKeeper();
  EtcdLeaseKeeper(const EtcdLeaseKeeper&) = delete;
  EtcdLeaseKeeper& operator=(const EtcdLeaseKeeper&) = delete;

  // OK while the lease is kept; the error given to on_lost once it is lost.
  absl::Status status() const;
  // The last time etcd acknowledged a renewal (the keeper's start at
  // first).
  absl::Time last_renewed() const;

 private:
  friend class EtcdClient;
  EtcdLeaseKeeper(EtcdClient* client, const EtcdLease& lease,
                  absl::AnyInvocable<void(absl::Status)> on_lost);
  void Run();

  EtcdClient* const client_;
  const int64_t lease_;
  absl::AnyInvocable<void(absl::Status)> on_lost_;  // keeper thread only
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  absl::Duration ttl_ ABSL_GUARDED_BY(mu_);
  absl::Time last_renewed_ ABSL_GUARDED_BY(mu_);
  Thread thread_;
};

// A watch of one prefix (EtcdClient::Watch). Destroying it cancels the
// stream and waits for the thread: for a callback that is running, and at
// most an attempt's time for a connection being made.
class EtcdWatch {
 public:
  ~EtcdWatch();
  EtcdWatch(const EtcdWatch&) = delete;
  EtcdWatch& operator=(const EtcdWatch&) = delete;

  // How many times the watch moved to a member after its stream broke.
  int64_t reconnects() const;
  // Cancels the stream and starts no other, without waiting: for a thread
  // that must not block (a gRPC callback). The destructor still waits for
  // the watch's thread; a callback already running may finish.
  void Stop();

 private:
  friend class EtcdClient;
  enum class State { kConnecting, kWatching, kEnded };
  EtcdWatch(EtcdClient* client, std::string prefix, int64_t start_revision,
            EtcdWatchCallback callback);
  void Run();
  // One stream on one member, until it breaks or the watch stops; false
  // when the watch has ended for good.
  bool WatchOn(size_t index);

  EtcdClient* const client_;
  const std::string prefix_;
  EtcdWatchCallback callback_;  // watch thread only
  int64_t next_revision_;       // watch thread only; 0: from now
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  State state_ ABSL_GUARDED_BY(mu_) = State::kConnecting;
  absl::Status end_status_ ABSL_GUARDED_BY(mu_);
  int64_t reconnects_ ABSL_GUARDED_BY(mu_) = 0;
  // The stream in flight, so that Stop can cancel it.
  std::shared_ptr<grpc::ClientContext> context_ ABSL_GUARDED_BY(mu_);
  Thread thread_;
};

}  // namespace mrd::directory

#endif  // MRD_SERVER_DIRECTORY_ETCD_CLIENT_H_
