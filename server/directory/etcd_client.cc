#include "server/directory/etcd_client.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"
#include "mrd/net.h"
#include "mrd/status.h"
#include "mrd/unique_fd.h"
#include "server/common/log.h"

namespace mrd::directory {

namespace pb = etcdserverpb;

namespace {

constexpr int64_t kPageSize = 1000;  // keys per Range answer
constexpr absl::Duration kFirstBackoff = absl::Milliseconds(50);
constexpr absl::Duration kMaxBackoff = absl::Milliseconds(500);
// etcd refuses a watch stream on a member that has no leader when the
// stream asks for one (rpctypes.MetadataRequireLeaderKey): a member cut off
// from the quorum ends the stream, and the watch moves on.
constexpr char kRequireLeaderKey[] = "hasleader";
constexpr char kRequireLeaderValue[] = "true";
constexpr absl::string_view kLeaseNotFound = "requested lease not found";
constexpr absl::string_view kLeaseExists = "lease already exists";
// etcd's authentication (rpctypes): the token goes in this metadata.
constexpr char kTokenKey[] = "token";
constexpr absl::string_view kAuthNotEnabled = "authentication is not enabled";
// Answers that mean the token sent is no good (any more), not the request.
constexpr absl::string_view kTokenRefusals[] = {
    "invalid auth token",             // expired, or the member restarted
    "revision of auth store is old",  // users or roles changed since
    "user name is empty",             // no token: auth enabled since
};
// A watch the user's roles do not allow is cancelled with this reason.
constexpr absl::string_view kPermissionDenied = "permission denied";
constexpr size_t kMaxPemBytes = size_t{1} << 20;
constexpr size_t kMaxPasswordBytes = 4096;

absl::Status BadCredentials(absl::string_view message) {
  return MrdError(absl::StatusCode::kInvalidArgument, "ETCD_BAD_CREDENTIALS",
                  message);
}

// The whole of a small file; the error names `what` and the path, never
// what the file holds.
absl::StatusOr<std::string> ReadSecretFile(absl::string_view what,
                                           const std::string& path,
                                           size_t max_bytes) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    return BadCredentials(
        absl::StrCat(what, " '", path, "' cannot be read: ", strerror(errno)));
  }
  std::string text;
  char chunk[4096];
  while (true) {
    const ssize_t n = ::read(fd.get(), chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return BadCredentials(absl::StrCat(
          what, " '", path, "' cannot be read: ", strerror(errno)));
    }
    if (n == 0) break;
    text.append(chunk, static_cast<size_t>(n));
    if (text.size() > max_bytes) {
      return BadCredentials(absl::StrCat(what, " '", path, "' is larger than ",
                                         max_bytes, " bytes"));
    }
  }
  return text;
}

// A PEM file holding at least one block whose label ends with `label`
// ("CERTIFICATE", "PRIVATE KEY": "EC PRIVATE KEY" too).
absl::StatusOr<std::string> ReadPem(absl::string_view what,
                                    const std::string& path,
                                    absl::string_view label) {
  MRD_ASSIGN_OR_RETURN(std::string text,
                       ReadSecretFile(what, path, kMaxPemBytes));
  const size_t begin = text.find("-----BEGIN ");
  const size_t end = begin == std::string::npos
                         ? std::string::npos
                         : text.find(absl::StrCat(label, "-----"), begin);
  if (end == std::string::npos ||
      text.find("-----END ", end) == std::string::npos) {
    return BadCredentials(
        absl::StrCat(what, " '", path, "' is not PEM (no ", label, " block)"));
  }
  return text;
}

bool TokenRefused(const grpc::Status& status) {
  if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED) return true;
  if (status.error_code() != grpc::StatusCode::INVALID_ARGUMENT) return false;
  for (absl::string_view refusal : kTokenRefusals) {
    if (absl::StrContains(status.error_message(), refusal)) return true;
  }
  return false;
}

absl::Status BadArgument(absl::string_view message) {
  return MrdError(absl::StatusCode::kInvalidArgument, "ETCD_BAD_ARGUMENT",
                  message);
}

absl::Status LeaseNotFound(int64_t lease) {
  return MrdError(
      absl::StatusCode::kNotFound, "ETCD_LEASE_NOT_FOUND",
      absl::StrCat("etcd lease ", lease, " is gone (expired or revoked)"));
}

bool Retryable(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE ||
         status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

// etcd's answer as mrd's error: etcd's code, a reason for the answers mrd
// tells apart.
absl::Status FromEtcd(absl::string_view what, absl::string_view endpoint,
                      const grpc::Status& status) {
  const auto code = static_cast<absl::StatusCode>(status.error_code());
  absl::string_view reason = "ETCD_ERROR";
  if (code == absl::StatusCode::kNotFound &&
      absl::StrContains(status.error_message(), kLeaseNotFound)) {
    reason = "ETCD_LEASE_NOT_FOUND";
  } else if (code == absl::StatusCode::kOutOfRange &&
             absl::StrContains(status.error_message(), "compacted")) {
    reason = "ETCD_COMPACTED";
  }
  return MrdError(code, reason,
                  absl::StrCat(what, " on etcd member ", endpoint, ": ",
                               status.error_message()));
}

// The end of the range of keys that start with `prefix` (etcd's
// clientv3.GetPrefixRangeEnd): the prefix with its last byte below 0xff
// incremented and what follows cut; "\0" (every key from the start) when
// there is none.
std::string PrefixEnd(absl::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    auto last = static_cast<unsigned char>(end.back());
    if (last < 0xff) {
      end.back() = static_cast<char>(last + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');
}

// At least 1 s, at most etcd's largest TTL (and never an infinite double).
int64_t WholeSeconds(absl::Duration d) {
  constexpr int64_t kMaxTtlSeconds = 9'000'000'000;  // etcd's MaxLeaseTTL
  if (d >= absl::Seconds(kMaxTtlSeconds)) return kMaxTtlSeconds;
  return std::max<int64_t>(
      1, static_cast<int64_t>(std::ceil(absl::ToDoubleSeconds(d))));
}

EtcdKeyValue FromProto(const mvccpb::KeyValue& kv) {
  EtcdKeyValue out;
  out.key = kv.key();
  out.value = kv.value();
  out.lease = kv.lease();
  out.create_revision = kv.create_revision();
  out.mod_revision = kv.mod_revision();
  return out;
}

}  // namespace

struct EtcdClient::Endpoint {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::KV::Stub> kv;
  std::unique_ptr<pb::Lease::Stub> lease;
  std::unique_ptr<pb::Watch::Stub> watch;
  std::unique_ptr<pb::Auth::Stub> auth;
  // This member's token (authenticating only); never logged.
  mutable absl::Mutex mu;
  mutable bool has_token ABSL_GUARDED_BY(mu) = false;
  mutable std::string token ABSL_GUARDED_BY(mu);  // "": etcd's auth is off
};

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Create(
    EtcdClientOptions options) {
  if (options.endpoints.empty()) {
    return MrdError(absl::StatusCode::kInvalidArgument, "ETCD_BAD_ENDPOINT",
                    "no etcd endpoint given");
  }
  for (const std::string& endpoint : options.endpoints) {
    absl::StatusOr<std::pair<std::string, std::string>> split =
        peer::SplitHostPort(endpoint);
    if (!split.ok() || split->first.empty() || split->second.empty()) {
      return MrdError(
          absl::StatusCode::kInvalidArgument, "ETCD_BAD_ENDPOINT",
          absl::StrCat("etcd endpoint '", endpoint, "' is not host:port"));
    }
  }
  if (options.call_timeout <= absl::ZeroDuration() ||
      options.attempt_timeout <= absl::ZeroDuration() ||
      options.reconnect_backoff_max <= absl::ZeroDuration()) {
    return BadArgument("etcd client timeouts must be positive");
  }
  if (options.cert_file.empty() != options.key_file.empty()) {
    return BadCredentials(
        options.cert_file.empty()
            ? "an etcd client key without its certificate (cert_file)"
            : "an etcd client certificate without its key (key_file)");
  }
  if (options.user.empty() != options.password_file.empty()) {
    return BadCredentials(options.user.empty()
                              ? "an etcd password file without a user"
                              : "an etcd user without a password file");
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (options.ca_file.empty() && options.cert_file.empty()) {
    credentials = grpc::InsecureChannelCredentials();
  } else {
    grpc::SslCredentialsOptions ssl;
    if (!options.ca_file.empty()) {
      MRD_ASSIGN_OR_RETURN(
          ssl.pem_root_certs,
          ReadPem("etcd CA file", options.ca_file, "CERTIFICATE"));
    }
    if (!options.cert_file.empty()) {
      MRD_ASSIGN_OR_RETURN(ssl.pem_cert_chain,
                           ReadPem("etcd client certificate file",
                                   options.cert_file, "CERTIFICATE"));
      MRD_ASSIGN_OR_RETURN(
          ssl.pem_private_key,
          ReadPem("etcd client key file", options.key_file, "PRIVATE KEY"));
    }
    credentials = grpc::SslCredentials(ssl);
  }
  std::string password;
  if (!options.user.empty()) {
    MRD_ASSIGN_OR_RETURN(
        password, ReadSecretFile("etcd password file", options.password_file,
                                 kMaxPasswordBytes));
    // The first line: an editor's (or echo's) newline is no part of it.
    password = password.substr(0, password.find('\n'));
    if (!password.empty() && password.back() == '\r') password.pop_back();
    if (password.empty()) {
      return BadCredentials(absl::StrCat("etcd password file '",
                                         options.password_file,
                                         "' holds no password"));
    }
  }
  return std::unique_ptr<EtcdClient>(
      new EtcdClient(std::move(options), std::move(password), credentials));
}

EtcdClient::EtcdClient(
    EtcdClientOptions options, std::string password,
    const std::shared_ptr<grpc::ChannelCredentials>& credentials)
    : options_(std::move(options)), password_(std::move(password)) {
  const int backoff_max_ms = static_cast<int>(std::max<int64_t>(
      100, absl::ToInt64Milliseconds(options_.reconnect_backoff_max)));
  for (const std::string& address : options_.endpoints) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
                std::min(100, backoff_max_ms));
    // gRPC takes this as the time a connection attempt may take as well:
    // not shorter than a TCP and HTTP/2 handshake on a busy host.
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 2'000);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, backoff_max_ms);
    // A member that vanished without closing its connections (a host gone,
    // a partition) is noticed by pings; etcd permits one every 5 s.
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10'000);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5'000);
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    // Each member its own connection, even if two channels look alike.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto endpoint = std::make_unique<Endpoint>();
    endpoint->address = address;
    endpoint->channel = grpc::CreateCustomChannel(address, credentials, args);
    endpoint->kv = pb::KV::NewStub(endpoint->channel);
    endpoint->lease = pb::Lease::NewStub(endpoint->channel);
    endpoint->watch = pb::Watch::NewStub(endpoint->channel);
    endpoint->auth = pb::Auth::NewStub(endpoint->channel);
    endpoints_.push_back(std::move(endpoint));
  }
}

EtcdClient::~EtcdClient() {
  absl::MutexLock lock(&mu_);
  MRD_CHECK(handles_ == 0);  // a keeper or watch outlives its client
}

int64_t EtcdClient::authentications() const {
  absl::MutexLock lock(&mu_);
  return authentications_;
}

size_t EtcdClient::Preferred() const {
  absl::MutexLock lock(&mu_);
  return preferred_;
}

void EtcdClient::Failed(size_t index) {
  absl::MutexLock lock(&mu_);
  if (preferred_ == index) preferred_ = (index + 1) % endpoints_.size();
}

void EtcdClient::AddHandle() {
  absl::MutexLock lock(&mu_);
  ++handles_;
}

void EtcdClient::RemoveHandle() {
  absl::MutexLock lock(&mu_);
  --handles_;
}

absl::Status EtcdClient::Call(absl::string_view what, absl::Time deadline,
                              Attempt attempt) {
  return CallWithin(what, deadline, options_.attempt_timeout, attempt);
}

absl::Status EtcdClient::CallWithin(absl::string_view what, absl::Time deadline,
                                    absl::Duration attempt_timeout,
                                    Attempt attempt) {
  const size_t n = endpoints_.size();
  const size_t start = Preferred();
  // Members whose connection is failing now are skipped in the first round
  // (while another is not), so that a member known to be down costs no
  // attempt's wait; later rounds try them too.
  std::vector<bool> failing(n);
  size_t failing_count = 0;
  for (size_t i = 0; i < n; ++i) {
    failing[i] = endpoints_[i]->channel->GetState(false) ==
                 GRPC_CHANNEL_TRANSIENT_FAILURE;
    if (failing[i]) ++failing_count;
  }
  std::vector<std::string> last_errors(n);
  absl::Duration backoff = kFirstBackoff;
  for (int tries = 0;; ++tries) {
    const absl::Time now = absl::Now();
    if (now >= deadline) break;
    const size_t index = (start + static_cast<size_t>(tries)) % n;
    const Endpoint& endpoint = *endpoints_[index];
    if (static_cast<size_t>(tries) < n && failing[index] && failing_count < n) {
      last_errors[index] =
          absl::StrCat(endpoint.address, ": its connection is failing");
      continue;
    }
    absl::Status auth_failure;
    grpc::Status status =
        AttemptOn(endpoint, std::min(deadline, now + attempt_timeout), attempt,
                  tries, &auth_failure);
    if (!auth_failure.ok()) return auth_failure;
    if (status.ok()) {
      absl::MutexLock lock(&mu_);
      preferred_ = index;
      return absl::OkStatus();
    }
    if (!Retryable(status)) return FromEtcd(what, endpoint.address, status);
    last_errors[index] =
        absl::StrCat(endpoint.address, ": ", status.error_message());
    Failed(index);
    // A round with no answer: wait a little before the next, so that a
    // cluster that is down or electing is not hammered.
    if ((static_cast<size_t>(tries) + 1) % n == 0) {
      absl::SleepFor(std::min(backoff, deadline - absl::Now()));
      backoff = std::min(backoff * 2, kMaxBackoff);
    }
  }
  std::vector<std::string> errors;
  for (std::string& error : last_errors) {
    if (!error.empty()) errors.push_back(std::move(error));
  }
  return MrdError(
      absl::StatusCode::kUnavailable, "ETCD_UNAVAILABLE",
      absl::StrCat(what, ": no etcd member answered in time (",
                   errors.empty() ? "no attempt" : absl::StrJoin(errors, "; "),
                   ")"));
}

grpc::Status EtcdClient::AttemptOn(const Endpoint& endpoint,
                                   absl::Time deadline, Attempt attempt,
                                   int tries, absl::Status* auth_failure) {
  for (int round = 0;; ++round) {
    std::string token;
    bool fresh = false;
    if (!options_.user.empty()) {
      grpc::Status got =
          TokenFor(endpoint, deadline, &token, &fresh, auth_failure);
      if (!got.ok()) return got;
    }
    grpc::ClientContext context;
    // A synchronous client makes progress on a connection only while a call
    // waits on it: a fail-fast call would leave a member that is coming
    // back unconnected. So every attempt waits for its member, up to its
    // deadline.
    context.set_wait_for_ready(true);
    context.set_deadline(absl::ToChronoTime(deadline));
    if (!token.empty()) context.AddMetadata(kTokenKey, token);
    grpc::Status status = attempt(endpoint, context, tries);
    // A token the member no longer takes: a new one, and once more (a
    // token just fetched that is refused is the member's answer).
    if (options_.user.empty() || round > 0 || fresh || !TokenRefused(status)) {
      return status;
    }
    LogDebug("directory: etcd member ", endpoint.address,
             " refused its token (", status.error_message(),
             "): authenticating again");
    ForgetToken(endpoint, token);
  }
}

grpc::Status EtcdClient::TokenFor(const Endpoint& endpoint, absl::Time deadline,
                                  std::string* token, bool* fresh,
                                  absl::Status* auth_failure) {
  {
    absl::MutexLock lock(&endpoint.mu);
    if (endpoint.has_token) {
      *token = endpoint.token;
      *fresh = false;
      return grpc::Status::OK;
    }
  }
  // Not under the lock: two threads may both fetch one; either serves.
  pb::AuthenticateRequest request;
  request.set_name(options_.user);
  request.set_password(password_);
  pb::AuthenticateResponse response;
  grpc::ClientContext context;
  context.set_wait_for_ready(true);
  context.set_deadline(absl::ToChronoTime(deadline));
  grpc::Status status =
      endpoint.auth->Authenticate(&context, request, &response);
  if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION &&
      absl::StrContains(status.error_message(), kAuthNotEnabled)) {
    // etcd takes every call without a token then; once it is turned on,
    // the answer "user name is empty" brings a token.
    LogDebug("directory: etcd member ", endpoint.address,
             " has authentication off: calling it without a token");
    response.clear_token();
  } else if (Retryable(status)) {
    return status;
  } else if (!status.ok()) {
    *auth_failure = MrdError(
        absl::StatusCode::kUnauthenticated, "ETCD_AUTH_FAILED",
        absl::StrCat("etcd member ", endpoint.address, " refused user '",
                     options_.user, "' (password from '",
                     options_.password_file, "'): ", status.error_message()));
    return status;
  }
  if (!response.token().empty()) {
    absl::MutexLock lock(&mu_);
    ++authentications_;
  }
  absl::MutexLock lock(&endpoint.mu);
  endpoint.has_token = true;
  endpoint.token = response.token();
  *token = response.token();
  *fresh = true;
  return grpc::Status::OK;
}

void EtcdClient::ForgetToken(const Endpoint& endpoint,
                             const std::string& token) {
  absl::MutexLock lock(&endpoint.mu);
  // Another thread may have fetched a new one meanwhile: keep that.
  if (endpoint.has_token && endpoint.token == token) endpoint.has_token = false;
}

absl::StatusOr<EtcdLease> EtcdClient::Grant(absl::Duration ttl) {
  pb::LeaseGrantRequest request;
  request.set_ttl(WholeSeconds(ttl));
  // Our own id, so that a retry of a grant that went through is seen as
  // such (below) rather than granting a second lease. Positive, below 2^62.
  absl::BitGen random;
  request.set_id(absl::Uniform<int64_t>(random, 1, int64_t{1} << 62));
  pb::LeaseGrantResponse response;
  bool granted_before = false;
  MRD_RETURN_IF_ERROR(Call(
      "etcd LeaseGrant", absl::Now() + options_.call_timeout,
      [&](const Endpoint& endpoint, grpc::ClientContext& context, int attempt) {
        grpc::Status status =
            endpoint.lease->LeaseGrant(&context, request, &response);
        if (attempt > 0 &&
            status.error_code() == grpc::StatusCode::FAILED_PRECONDITION &&
            absl::StrContains(status.error_message(), kLeaseExists)) {
          granted_before = true;
          return grpc::Status::OK;
        }
        return status;
      }));
  if (!granted_before && !response.error().empty()) {
    return MrdError(absl::StatusCode::kUnknown, "ETCD_ERROR",
                    absl::StrCat("etcd LeaseGrant: ", response.error()));
  }
  EtcdLease lease;
  lease.id = request.id();
  lease.ttl = absl::Seconds(granted_before ? request.ttl() : response.ttl());
  return lease;
}

absl::Status EtcdClient::Revoke(int64_t lease) {
  pb::LeaseRevokeRequest request;
  request.set_id(lease);
  pb::LeaseRevokeResponse response;
  return Call("etcd LeaseRevoke", absl::Now() + options_.call_timeout,
              [&](const Endpoint& endpoint, grpc::ClientContext& context, int) {
                return endpoint.lease->LeaseRevoke(&context, request,
                                                   &response);
              });
}

absl::StatusOr<absl::Duration> EtcdClient::TimeToLive(int64_t lease) {
  pb::LeaseTimeToLiveRequest request;
  request.set_id(lease);
  pb::LeaseTimeToLiveResponse response;
  MRD_RETURN_IF_ERROR(Call(
      "etcd LeaseTimeToLive", absl::Now() + options_.call_timeout,
      [&](const Endpoint& endpoint, grpc::ClientContext& context, int) {
        return endpoint.lease->LeaseTimeToLive(&context, request, &response);
      }));
  if (response.ttl() < 0) return LeaseNotFound(lease);
  return absl::Seconds(response.ttl());
}

absl::StatusOr<absl::Duration> EtcdClient::KeepAliveOnce(int64_t lease) {
  return KeepAliveOnceUntil(lease, absl::Now() + options_.call_timeout,
                            options_.attempt_timeout);
}

absl::StatusOr<absl::Duration> EtcdClient::KeepAliveOnceUntil(
    int64_t lease, absl::Time deadline, absl::Duration attempt_timeout) {
  // One short stream per renewal (as etcdctl lease keep-alive --once does):
  // a renewal every third of a TTL costs little, and no long stream can
  // hang on a member that stopped answering.
  pb::LeaseKeepAliveRequest request;
  request.set_id(lease);
  pb::LeaseKeepAliveResponse response;
  MRD_RETURN_IF_ERROR(CallWithin(
      "etcd LeaseKeepAlive", deadline, attempt_timeout,
      [&](const Endpoint& endpoint, grpc::ClientContext& context, int) {
        std::unique_ptr<grpc::ClientReaderWriter<pb::LeaseKeepAliveRequest,
                                                 pb::LeaseKeepAliveResponse>>
            stream = endpoint.lease->LeaseKeepAlive(&context);
        bool answered = stream->Write(request) && stream->WritesDone() &&
                        stream->Read(&response);
        grpc::Status status = stream->Finish();
        if (answered || !status.ok()) return status;
        return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                            "the keep-alive stream ended without an answer");
      }));
  if (response.ttl() <= 0) return LeaseNotFound(lease);
  return absl::Seconds(response.ttl());
}

absl::StatusOr<int64_t> EtcdClient::Put(absl::string_view key,
                                        absl::string_view value,
                                        int64_t lease) {
  if (key.empty()) return BadArgument("etcd Put of an empty key");
  pb::PutRequest request;
  request.set_key(std::string(key));
  request.set_value(std::string(value));
  request.set_lease(lease);
  pb::PutResponse response;
  MRD_RETURN_IF_ERROR(
      Call("etcd Put", absl::Now() + options_.call_timeout,
           [&](const Endpoint& endpoint, grpc::ClientContext& context, int) {
             return endpoint.kv->Put(&context, request, &response);
           }));
  return response.header().revision();
}

absl::StatusOr<int64_t> EtcdClient::PutIfAbsent(absl::string_view key,
                                                absl::string_view value,
                                                int64_t lease) {
  if (key.empty()) return BadArgument("etcd PutIfAbsent of an empty key");
  pb::TxnRequest request;
  pb::Compare* absent = request.add_compare();
  absent->set_key(std::string(key));
  absent->set_target(pb::Compare::CREATE);
  absent->set_result(pb::Compare::EQUAL);
  absent->set_create_revision(0);
  pb::PutRequest* put = request.add_success()->mutable_request_put();
  put->set_key(std::string(key));
  put->set_value(std::string(value));
  put->set_lease(lease);
  // Otherwise read the key, to tell our own earlier write from another's.
  request.add_failure()->mutable_request_range()->set_key(std::string(key));
  pb::TxnResponse response;
  MRD_RETURN_IF_ERROR(
      Call("etcd Txn", absl::Now() + options_.call_timeout,
           [&](const Endpoint& endpoint, grpc::ClientContext& context, int) {
             return endpoint.kv->Txn(&context, request, &response);
           }));
  if (response.succeeded()) return response.header().revision();
  if (response.responses_size() == 1 &&
      response.responses(0).has_response_range() &&
      response.responses(0).response_range().kvs_size() == 1) {
    const mvccpb::KeyValue& kv = response.responses(0).response_range().kvs(0);
    if (kv.value() == value && kv.lease() == lease) return kv.mod_revision();
  }
  return MrdError(absl::StatusCode::kAlreadyExists, "ETCD_KEY_EXISTS",
                  absl::StrCat("etcd key '", key, "' exists already"));
}

absl::StatusOr<int64_t> EtcdClient::PutIfAbsentOrOwned(absl::string_view key,
                                                       absl::string_view value,
                                                       int64_t lease) {
  if (key.empty()) {
    return BadArgument("etcd PutIfAbsentOrOwned of an empty key");
  }
  if (lease == 0) return BadArgument("etcd PutIfAbsentOrOwned of no lease");
  // etcd compares with AND only: absent, then (if it is this lease's)
  // owned, each a transaction that reads the key when it does not write.
  // A key deleted between the two is tried again as absent, a few times.
  constexpr int kRounds = 3;
  for (int round = 0; round < kRounds; ++round) {
    for (const bool owned : {false, true}) {
      pb::TxnRequest request;
      pb::Compare* compare = request.add_compare();
      compare->set_key(std::string(key));
      compare->set_result(pb::Compare::EQUAL);
      if (owned) {
        compare->set_target(pb::Compare::LEASE);
        compare->set_lease(lease);
      } else {
        compare->set_target(pb::Compare::CREATE);
        compare->set_create_revision(0);
      }
      pb::PutRequest* put = request.add_success()->mutable_request_put();
      put->set_key(std::string(key));
      put->set_value(std::string(value));
      put->set_lease(lease);
      request.add_failure()->mutable_request_range()->set_key(std::string(key));
      pb::TxnResponse response;
      MRD_RETURN_IF_ERROR(Call(
          "etcd Txn", absl::Now() + options_.call_timeout,
          [&](const Endpoint& endpoint, grpc::ClientContext& context, int) {
            return endpoint.kv->Txn(&context, request, &response);
          }));
      if (response.succeeded()) return response.header().revision();
      if (response.responses_size() != 1 ||
          !response.responses(0).has_response_range() ||
          response.responses(0).response_range().kvs_size() != 1) {
        break;  // gone in between: absent again
      }
      const mvccpb::KeyValue& kv =
          response.responses(0).response_range().kvs(0);
      if (kv.lease() != lease) {
        return MrdError(
            absl::StatusCode::kAlreadyExists, "ETCD_KEY_EXISTS",
            absl::StrCat("etcd key '", key, "' is held by another lease"));
      }
      // Ours already with this value (a retry that went through, or a
      // rewrite of the same): nothing to write.
      if (kv.value() == value) return kv.mod_revision();
      // Ours with another value: the owned transaction rewrites it.
    }
  }
  return MrdError(absl::StatusCode::kAborted, "ETCD_ERROR",
                  absl::StrCat("etcd key '", key,
                               "' kept changing under PutIfAbsentOrOwned"));
}

absl::StatusOr<int64_t> EtcdClient::DeleteIfOwned(absl::string_view key,
                                                  int64_t lease) {
  if (key.empty()) return BadArgument("etcd DeleteIfOwned of an empty key");
  if (lease == 0) return BadArgument("etcd DeleteIfOwned of no lease");
  pb::TxnRequest request;
  pb::Compare* owned = request.add_compare();
  owned->set_key(std::string(key));
  owned->set_target(pb::Compare::LEASE);
  owned->set_result(pb::Compare::EQUAL);
  owned->set_lease(lease);
  request.add_success()->mutable_request_delete_range()->set_key(
      std::string(key));
  pb::TxnResponse response;
  MRD_RETURN_IF_ERROR(
      Call("etcd Txn", absl::Now() + options_.call_timeout,
           [&](const Endpoint& endpoint, grpc::ClientContext& context, int) {
             return endpoint.kv->Txn(&context, request, &response);
           }));
  if (!response.succeeded() || response.responses_size() != 1) return 0;
  return response.responses(0).response_delete_range().deleted();
}

absl::StatusOr<bool> EtcdClient::WriteAllIfFresh(
    const std::vector<Write>& writes, int64_t lease) {
  if (writes.empty() || writes.size() > kMaxWritesPerTxn) {
    return BadArgument(absl::StrCat("etcd WriteAllIfFresh of ", writes.size(),
                                    " writes (1 to ", kMaxWritesPerTxn, ")"));
  }
  if (lease == 0) return BadArgument("etcd WriteAllIfFresh of no lease");
  absl::flat_hash_set<absl::string_view> keys;
  pb::TxnRequest request;
  for (const Write& write : writes) {
    if (write.key.empty()) {
      return BadArgument("etcd WriteAllIfFresh of an empty key");
    }
    if (!keys.insert(write.key).second) {
      return BadArgument(
          absl::StrCat("etcd WriteAllIfFresh of key '", write.key, "' twice"));
    }
    pb::Compare* compare = request.add_compare();
    compare->set_key(write.key);
    compare->set_result(pb::Compare::EQUAL);
    if (write.value.has_value()) {
      compare->set_target(pb::Compare::CREATE);
      compare->set_create_revision(0);
      pb::PutRequest* put = request.add_success()->mutable_request_put();
      put->set_key(write.key);
      put->set_value(*write.value);
      put->set_lease(lease);
    } else {
      compare->set_target(pb::Compare::LEASE);
      compare->set_lease(lease);
      request.add_success()->mutable_request_delete_range()->set_key(write.key);
    }
  }
  pb::TxnResponse response;
  MRD_RETURN_IF_ERROR(
      Call("etcd Txn", absl::Now() + options_.call_timeout,
           [&](const Endpoint& endpoint, grpc::ClientContext& context, int) {
             return endpoint.kv->Txn(&context, request, &response);
           }));
  return response.succeeded();
}

absl::StatusOr<int64_t> EtcdClient::Delete(absl::string_view key) {
  if (key.empty()) return BadArgument("etcd Delete of an empty key");
  pb::DeleteRangeRequest request;
  request.set_key(std::string(key));
  pb::DeleteRangeResponse response;
  MRD_RETURN_IF_ERROR(
      Call("etcd DeleteRange", absl::Now() + options_.call_timeout,
           [&](const Endpoint& endpoint, grpc::ClientContext& context, int) {
             return endpoint.kv->DeleteRange(&context, request, &response);
           }));
  return response.deleted();
}

absl::StatusOr<EtcdRange> EtcdClient::Get(absl::string_view prefix) {
  EtcdRange range;
  pb::RangeRequest request;
  request.set_key(prefix.empty() ? std::string(1, '\0') : std::string(prefix));
  request.set_range_end(PrefixEnd(prefix));
  request.set_limit(kPageSize);
  const absl::Time deadline = absl::Now() + options_.call_timeout;
  while (true) {
    pb::RangeResponse response;
    MRD_RETURN_IF_ERROR(
        Call("etcd Range", deadline,
             [&](const Endpoint& endpoint, grpc::ClientContext& context, int) {
               return endpoint.kv->Range(&context, request, &response);
             }));
    if (range.revision == 0) {
      // Every later page at the first one's revision: one consistent read.
      range.revision = response.header().revision();
      request.set_revision(range.revision);
    }
    for (const mvccpb::KeyValue& kv : response.kvs()) {
      range.kvs.push_back(FromProto(kv));
    }
    if (!response.more() || response.kvs().empty()) break;
    request.set_key(response.kvs(response.kvs_size() - 1).key() +
                    std::string(1, '\0'));
  }
  return range;
}

absl::StatusOr<std::unique_ptr<EtcdLeaseKeeper>> EtcdClient::KeepAlive(
    const EtcdLease& lease, absl::AnyInvocable<void(absl::Status)> on_lost) {
  if (lease.id == 0 || lease.ttl <= absl::ZeroDuration()) {
    return BadArgument("etcd KeepAlive of no lease");
  }
  std::unique_ptr<EtcdLeaseKeeper> keeper(
      new EtcdLeaseKeeper(this, lease, std::move(on_lost)));
  EtcdLeaseKeeper* raw = keeper.get();
  MRD_ASSIGN_OR_RETURN(keeper->thread_,
                       Thread::Start("etcd-keepalive", [raw] { raw->Run(); }));
  return keeper;
}

absl::StatusOr<std::unique_ptr<EtcdWatch>> EtcdClient::Watch(
    absl::string_view prefix, int64_t start_revision,
    EtcdWatchCallback callback) {
  if (start_revision < 0) return BadArgument("etcd Watch from revision < 0");
  std::unique_ptr<EtcdWatch> watch(new EtcdWatch(
      this, std::string(prefix), start_revision, std::move(callback)));
  EtcdWatch* raw = watch.get();
  MRD_ASSIGN_OR_RETURN(watch->thread_,
                       Thread::Start("etcd-watch", [raw] { raw->Run(); }));
  EtcdWatch::State state;
  absl::Status end_status;
  {
    absl::MutexLock lock(&raw->mu_);
    const auto settled = [raw]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(raw->mu_) {
      return raw->state_ != EtcdWatch::State::kConnecting;
    };
    raw->mu_.AwaitWithTimeout(absl::Condition(&settled), options_.call_timeout);
    state = raw->state_;
    end_status = raw->end_status_;
  }
  // A watch that is not returned is destroyed here: its thread stops.
  switch (state) {
    case EtcdWatch::State::kWatching:
      return watch;
    case EtcdWatch::State::kEnded:
      return end_status;
    case EtcdWatch::State::kConnecting:
      break;
  }
  return MrdError(absl::StatusCode::kUnavailable, "ETCD_UNAVAILABLE",
                  absl::StrCat("etcd Watch of '", prefix,
                               "': no etcd member created it within ",
                               absl::FormatDuration(options_.call_timeout)));
}

// ---------------------------------------------------------------------------
// EtcdLeaseKeeper

EtcdLeaseKeeper::EtcdLeaseKeeper(EtcdClient* client, const EtcdLease& lease,
                                 absl::AnyInvocable<void(absl::Status)> on_lost)
    : client_(client),
      lease_(lease.id),
      on_lost_(std::move(on_lost)),
      ttl_(lease.ttl),
      last_renewed_(absl::Now()) {
  client_->AddHandle();
}

EtcdLeaseKeeper::~EtcdLeaseKeeper() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.Join();
  client_->RemoveHandle();
}

absl::Status EtcdLeaseKeeper::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

absl::Time EtcdLeaseKeeper::last_renewed() const {
  absl::MutexLock lock(&mu_);
  return last_renewed_;
}

void EtcdLeaseKeeper::Run() {
  absl::Duration wait;
  {
    absl::MutexLock lock(&mu_);
    wait = ttl_ / 3;
  }
  while (true) {
    absl::Time expiry;
    absl::Duration ttl;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), wait);
      if (stopping_) return;
      expiry = last_renewed_ + ttl_;
      ttl = ttl_;
    }
    // No renewal may outlast the lease: by its expiry the answer is known.
    // Each member gets a quarter of the TTL at most, so that a member that
    // does not answer leaves time to renew through the others.
    const absl::Time deadline =
        std::min(expiry, absl::Now() + client_->options().call_timeout);
    absl::StatusOr<absl::Duration> renewed = client_->KeepAliveOnceUntil(
        lease_, deadline,
        std::min(client_->options().attempt_timeout, ttl / 4));
    absl::Status lost;
    {
      absl::MutexLock lock(&mu_);
      if (renewed.ok()) {
        ttl_ = *renewed;
        last_renewed_ = absl::Now();
        wait = ttl_ / 3;
        continue;
      }
      if (absl::IsNotFound(renewed.status())) {
        lost = renewed.status();
      } else if (absl::Now() >= expiry) {
        lost = MrdError(
            absl::StatusCode::kUnavailable, "ETCD_LEASE_LOST",
            absl::StrCat("etcd lease ", lease_, " went unrenewed for its TTL (",
                         absl::FormatDuration(ttl_),
                         "); last error: ", renewed.status().message()));
      } else {
        // Try again soon, well before the lease runs out.
        wait = std::min(ttl_ / 10, absl::Milliseconds(200));
        continue;
      }
      status_ = lost;
    }
    LogWarning("directory: ", lost.message());
    if (on_lost_) on_lost_(std::move(lost));
    return;
  }
}

// ---------------------------------------------------------------------------
// EtcdWatch

EtcdWatch::EtcdWatch(EtcdClient* client, std::string prefix,
                     int64_t start_revision, EtcdWatchCallback callback)
    : client_(client),
      prefix_(std::move(prefix)),
      callback_(std::move(callback)),
      next_revision_(start_revision) {
  client_->AddHandle();
}

EtcdWatch::~EtcdWatch() {
  Stop();
  thread_.Join();
  client_->RemoveHandle();
}

int64_t EtcdWatch::reconnects() const {
  absl::MutexLock lock(&mu_);
  return reconnects_;
}

void EtcdWatch::Stop() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
  if (context_ != nullptr) context_->TryCancel();
}

void EtcdWatch::Run() {
  size_t index = client_->Preferred();
  absl::Duration backoff = kFirstBackoff;
  const size_t n = client_->endpoint_count();
  for (size_t tries = 0;; ++tries) {
    if (!WatchOn(index)) return;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      ++reconnects_;
      // After a round of members with no stream: wait a little.
      if ((tries + 1) % n == 0) {
        mu_.AwaitWithTimeout(absl::Condition(&stopping_), backoff);
        if (stopping_) return;
        backoff = std::min(backoff * 2, kMaxBackoff);
      }
    }
    client_->Failed(index);
    index = (index + 1) % n;
  }
}

bool EtcdWatch::WatchOn(size_t index) {
  const EtcdClient::Endpoint& endpoint = *client_->endpoints_[index];
  // Connect first (this polls the connection, which a synchronous client
  // does only while it waits), for at most one attempt's time: the stream
  // itself fails fast on a member that is down, and has no deadline.
  if (!endpoint.channel->WaitForConnected(absl::ToChronoTime(
          absl::Now() + client_->options().attempt_timeout))) {
    return true;
  }
  std::string token;
  if (!client_->options().user.empty()) {
    bool fresh = false;
    absl::Status auth_failure;
    grpc::Status got = client_->TokenFor(
        endpoint, absl::Now() + client_->options().attempt_timeout, &token,
        &fresh, &auth_failure);
    if (!auth_failure.ok()) {  // etcd refused the user: for good
      {
        absl::MutexLock lock(&mu_);
        state_ = State::kEnded;
        end_status_ = auth_failure;
      }
      callback_(auth_failure);
      return false;
    }
    if (!got.ok()) return true;
  }
  auto context = std::make_shared<grpc::ClientContext>();
  context->AddMetadata(kRequireLeaderKey, kRequireLeaderValue);
  if (!token.empty()) context->AddMetadata(kTokenKey, token);
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return false;
    context_ = context;
  }
  std::unique_ptr<grpc::ClientReaderWriter<pb::WatchRequest, pb::WatchResponse>>
      stream = endpoint.watch->Watch(context.get());
  pb::WatchRequest request;
  pb::WatchCreateRequest* create = request.mutable_create_request();
  create->set_key(prefix_.empty() ? std::string(1, '\0') : prefix_);
  create->set_range_end(PrefixEnd(prefix_));
  create->set_start_revision(next_revision_);
  bool ended = false;  // for good: compacted, or not permitted
  bool left = false;   // this member's stream, still open
  absl::Status end_status;
  if (stream->Write(request)) {
    pb::WatchResponse response;
    while (stream->Read(&response)) {
      // A watch refused (its token, or permissions) comes created and
      // cancelled at once: no watch.
      if (response.created() && !response.canceled()) {
        // From now: the watch starts after the store's revision at its
        // creation, and resumes from there wherever it moves.
        if (next_revision_ == 0) {
          next_revision_ = response.header().revision() + 1;
        }
        absl::MutexLock lock(&mu_);
        state_ = State::kWatching;
      }
      if (response.compact_revision() > 0) {
        end_status = MrdError(
            absl::StatusCode::kOutOfRange, "ETCD_COMPACTED",
            absl::StrCat("etcd watch of '", prefix_, "' from revision ",
                         next_revision_, ": compacted up to revision ",
                         response.compact_revision()));
        ended = left = true;
        break;
      }
      if (response.canceled() &&
          absl::StrContains(response.cancel_reason(), kPermissionDenied)) {
        // Every member answers the same: the user may not read the prefix.
        end_status = MrdError(
            absl::StatusCode::kPermissionDenied, "ETCD_PERMISSION_DENIED",
            absl::StrCat("etcd watch of '", prefix_, "': etcd user '",
                         client_->options().user, "' may not read it (",
                         response.cancel_reason(), ")"));
        ended = left = true;
        break;
      }
      if (response.canceled()) {  // by the member: try another
        LogDebug("directory: etcd member ", endpoint.address,
                 " cancelled the watch of '", prefix_,
                 "': ", response.cancel_reason());
        if (!client_->options().user.empty() &&
            TokenRefused(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                      response.cancel_reason()))) {
          EtcdClient::ForgetToken(endpoint, token);  // the next has another
        }
        left = true;
        break;
      }
      if (response.events().empty()) continue;
      std::vector<EtcdWatchEvent> events;
      events.reserve(static_cast<size_t>(response.events_size()));
      for (const mvccpb::Event& event : response.events()) {
        EtcdWatchEvent out;
        out.type = event.type() == mvccpb::Event::DELETE
                       ? EtcdWatchEvent::Type::kDelete
                       : EtcdWatchEvent::Type::kPut;
        out.key = event.kv().key();
        out.value = event.kv().value();
        out.lease = event.kv().lease();
        out.mod_revision = event.kv().mod_revision();
        next_revision_ = std::max(next_revision_, out.mod_revision + 1);
        events.push_back(std::move(out));
      }
      callback_(std::move(events));
    }
  }
  if (left) context->TryCancel();  // not drained: Finish returns at once
  grpc::Status status = stream->Finish();
  {
    absl::MutexLock lock(&mu_);
    context_ = nullptr;
    if (ended) {
      state_ = State::kEnded;
      end_status_ = end_status;
    } else if (!stopping_ && !status.ok()) {
      LogDebug("directory: etcd watch of '", prefix_, "' on ", endpoint.address,
               " ended: ", status.error_message());
    }
  }
  if (ended) callback_(end_status);
  return !ended;
}

}  // namespace mrd::directory
