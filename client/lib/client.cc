#include "client/lib/client.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/lib/client_core.h"
#include "client/lib/deferred_release.h"
#include "client/lib/retry_policy.h"  // generated
#include "client/lib/status.h"
#include "mrd/status.h"
#include "mrd/unique_fd.h"

namespace mrd::client {
namespace internal {

void ClientCore::PrepareUnary(grpc::ClientContext* context) const {
  if (options.rpc_timeout > absl::ZeroDuration() &&
      options.rpc_timeout != absl::InfiniteDuration()) {
    context->set_deadline(
        absl::ToChronoTime(absl::Now() + options.rpc_timeout));
  }
}

}  // namespace internal

namespace {

using Stub = v1::MemoryRegistration::Stub;

template <typename Request, typename Response>
using SyncMethod = grpc::Status (Stub::*)(grpc::ClientContext*, const Request&,
                                          Response*);

template <typename Request, typename Response>
absl::StatusOr<Response> CallUnary(const internal::ClientCore& core,
                                   SyncMethod<Request, Response> method,
                                   const Request& request) {
  grpc::ClientContext context;
  core.PrepareUnary(&context);
  Response response;
  grpc::Status status =
      (core.stub.get()->*method)(&context, request, &response);
  if (!status.ok()) return StatusFromGrpc(status, context);
  return response;
}

// One asynchronous unary call: owns what gRPC needs until the callback.
template <typename Request, typename Response>
struct AsyncCall {
  // Keeps the channel alive until the callback has run.
  std::shared_ptr<const internal::ClientCore> core;
  grpc::ClientContext context;
  Request request;
  Response response;
  ResponseCallback<Response> done;
};

template <typename Request, typename Response, typename StartFn>
void CallUnaryAsync(std::shared_ptr<const internal::ClientCore> core,
                    Request request, ResponseCallback<Response> done,
                    StartFn start) {
  auto* call = new AsyncCall<Request, Response>();
  core->PrepareUnary(&call->context);
  call->core = std::move(core);
  call->request = std::move(request);
  call->done = std::move(done);
  start(&call->context, &call->request, &call->response,
        [call](grpc::Status status) {
          if (status.ok()) {
            std::move(call->done)(std::move(call->response));
          } else {
            std::move(call->done)(StatusFromGrpc(status, call->context));
          }
          // The call (its channel reference, the callback and what it
          // captured) may hold the last reference to the client: it must not
          // be destroyed on this gRPC callback thread.
          internal::DeferRelease(
              std::shared_ptr<const void>(call, [](const void* p) {
                delete static_cast<const AsyncCall<Request, Response>*>(p);
              }));
        });
}

// gRPC retries a Unix socket that is missing or has nobody listening until
// the deadline; a plain connect() tells at once, and says why.
absl::Status ProbeUnixSocket(const std::string& path,
                             const std::string& target) {
  int err = 0;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_SOCKET_PATH",
                    absl::StrCat("socket path too long: ", path));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!probe.valid()) return absl::OkStatus();  // let gRPC try
  if (::connect(probe.get(), reinterpret_cast<const sockaddr*>(&addr),
                sizeof(addr)) == 0) {
    return absl::OkStatus();
  }
  err = errno;
  if (err == EINTR || err == EAGAIN) return absl::OkStatus();
  absl::string_view hint = "";
  if (err == ENOENT) {
    hint = " (is mrd running? see --socket and MRD_RUNTIME_DIR)";
  } else if (err == ECONNREFUSED) {
    hint = " (nobody listens: a stale socket of a stopped mrd?)";
  }
  return MrdError(err == EACCES || err == EPERM
                      ? absl::StatusCode::kPermissionDenied
                      : absl::StatusCode::kUnavailable,
                  "CANNOT_CONNECT",
                  absl::StrCat("cannot connect to mrd at ", target, ": ",
                               std::strerror(err), hint));
}

}  // namespace

absl::string_view ServingStatusName(ServingStatus status) {
  switch (status) {
    case ServingStatus::kServing:
      return "SERVING";
    case ServingStatus::kNotServing:
      return "NOT_SERVING";
    case ServingStatus::kServiceUnknown:
      return "SERVICE_UNKNOWN";
    case ServingStatus::kUnknown:
      break;
  }
  return "UNKNOWN";
}

absl::StatusOr<Client> Client::Connect(const ClientOptions& options) {
  auto core = std::make_shared<internal::ClientCore>();
  core->options = options;
  core->target = TargetFor(options);
  std::string unix_path = UnixPathOfTarget(core->target);
  if (!unix_path.empty()) {
    MRD_RETURN_IF_ERROR(ProbeUnixSocket(unix_path, core->target));
  }
  grpc::ChannelArguments args;
  // ListRegistrations of a busy session can exceed the 4 MiB default.
  args.SetMaxReceiveMessageSize(64 << 20);
  // A live handover (docs/ARCHITECTURE.md) answers the calls it held
  // UNAVAILABLE HANDED_OVER with a retry hint: retried here, on the
  // channel's new connection to the new process, they cost a short pause.
  // mrd marks every other UNAVAILABLE answer final (a negative hint).
  args.SetServiceConfigJSON(internal::kRetryServiceConfig);
  // A connection of its own: gRPC would otherwise share one between the
  // Clients of a process, and mrd bounds a connection's open calls.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  core->channel = grpc::CreateCustomChannel(
      core->target, grpc::InsecureChannelCredentials(), args);
  if (core->channel == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot create a channel to ", core->target));
  }
  core->stub = v1::MemoryRegistration::NewStub(core->channel);
  core->health_stub = grpc::health::v1::Health::NewStub(core->channel);
  if (options.connect_timeout > absl::ZeroDuration()) {
    absl::Time deadline = options.connect_timeout == absl::InfiniteDuration()
                              ? absl::InfiniteFuture()
                              : absl::Now() + options.connect_timeout;
    if (!core->channel->WaitForConnected(absl::ToChronoTime(deadline))) {
      return MrdError(
          absl::StatusCode::kUnavailable, "CANNOT_CONNECT",
          absl::StrCat("cannot connect to mrd at ", core->target, " within ",
                       absl::FormatDuration(options.connect_timeout)));
    }
  }
  return Client(std::move(core));
}

const ClientOptions& Client::options() const { return core_->options; }
const std::string& Client::target() const { return core_->target; }

absl::StatusOr<v1::DeviceInfo> Client::GetDeviceInfo() const {
  return CallUnary(*core_, &Stub::GetDeviceInfo, v1::GetDeviceInfoRequest());
}

absl::StatusOr<ServingStatus> Client::Health(absl::string_view service) const {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(std::string(service));
  grpc::health::v1::HealthCheckResponse response;
  grpc::ClientContext context;
  core_->PrepareUnary(&context);
  grpc::Status status = core_->health_stub->Check(&context, request, &response);
  if (!status.ok()) return StatusFromGrpc(status, context);
  switch (response.status()) {
    case grpc::health::v1::HealthCheckResponse::SERVING:
      return ServingStatus::kServing;
    case grpc::health::v1::HealthCheckResponse::NOT_SERVING:
      return ServingStatus::kNotServing;
    case grpc::health::v1::HealthCheckResponse::SERVICE_UNKNOWN:
      return ServingStatus::kServiceUnknown;
    default:
      return ServingStatus::kUnknown;
  }
}

absl::StatusOr<v1::SessionInfo> Client::OpenLeaseSession(
    const v1::OpenLeaseSessionRequest& request) const {
  return CallUnary(*core_, &Stub::OpenLeaseSession, request);
}
absl::StatusOr<v1::SessionInfo> Client::GetSession(
    const v1::GetSessionRequest& request) const {
  return CallUnary(*core_, &Stub::GetSession, request);
}
absl::StatusOr<v1::SessionInfo> Client::SetDefaultDevices(
    const v1::SetDefaultDevicesRequest& request) const {
  return CallUnary(*core_, &Stub::SetDefaultDevices, request);
}
absl::StatusOr<v1::CloseSessionResponse> Client::CloseSession(
    const v1::CloseSessionRequest& request) const {
  return CallUnary(*core_, &Stub::CloseSession, request);
}
absl::StatusOr<v1::BufferInfo> Client::ImportFile(
    const v1::ImportFileRequest& request) const {
  return CallUnary(*core_, &Stub::ImportFile, request);
}
absl::StatusOr<v1::ReleaseBufferResponse> Client::ReleaseBuffer(
    const v1::ReleaseBufferRequest& request) const {
  return CallUnary(*core_, &Stub::ReleaseBuffer, request);
}
absl::StatusOr<v1::MrInfo> Client::CreateMr(
    const v1::CreateMrRequest& request) const {
  return CallUnary(*core_, &Stub::CreateMr, request);
}
absl::StatusOr<v1::CloseMrResponse> Client::CloseMr(
    const v1::CloseMrRequest& request) const {
  return CallUnary(*core_, &Stub::CloseMr, request);
}
absl::StatusOr<v1::RegisterMrResponse> Client::RegisterMr(
    const v1::RegisterMrRequest& request) const {
  return CallUnary(*core_, &Stub::RegisterMr, request);
}
absl::StatusOr<v1::DeregisterMrResponse> Client::DeregisterMr(
    const v1::DeregisterMrRequest& request) const {
  return CallUnary(*core_, &Stub::DeregisterMr, request);
}
absl::StatusOr<v1::RegisterMrBatchResponse> Client::RegisterMrBatch(
    const v1::RegisterMrBatchRequest& request) const {
  return CallUnary(*core_, &Stub::RegisterMrBatch, request);
}
absl::StatusOr<v1::DeregisterMrBatchResponse> Client::DeregisterMrBatch(
    const v1::DeregisterMrBatchRequest& request) const {
  return CallUnary(*core_, &Stub::DeregisterMrBatch, request);
}
absl::StatusOr<v1::BuildLamResponse> Client::BuildLam(
    const v1::BuildLamRequest& request) const {
  return CallUnary(*core_, &Stub::BuildLam, request);
}
absl::StatusOr<v1::ReleaseLamResponse> Client::ReleaseLam(
    const v1::ReleaseLamRequest& request) const {
  return CallUnary(*core_, &Stub::ReleaseLam, request);
}
absl::StatusOr<v1::FastRegisterResponse> Client::FastRegister(
    const v1::FastRegisterRequest& request) const {
  return CallUnary(*core_, &Stub::FastRegister, request);
}
absl::StatusOr<v1::InvalidateMrResponse> Client::InvalidateMr(
    const v1::InvalidateMrRequest& request) const {
  return CallUnary(*core_, &Stub::InvalidateMr, request);
}
absl::StatusOr<v1::PeerTicket> Client::CreatePeerTicket(
    const v1::CreatePeerTicketRequest& request) const {
  return CallUnary(*core_, &Stub::CreatePeerTicket, request);
}
absl::StatusOr<v1::ListRegistrationsResponse> Client::ListRegistrations(
    const v1::ListRegistrationsRequest& request) const {
  return CallUnary(*core_, &Stub::ListRegistrations, request);
}
absl::StatusOr<v1::PublishedEntry> Client::Publish(
    const v1::PublishRequest& request) const {
  return CallUnary(*core_, &Stub::Publish, request);
}
absl::StatusOr<v1::UnpublishResponse> Client::Unpublish(
    const v1::UnpublishRequest& request) const {
  return CallUnary(*core_, &Stub::Unpublish, request);
}
absl::StatusOr<v1::ListPublishedResponse> Client::ListPublished(
    const v1::ListPublishedRequest& request) const {
  return CallUnary(*core_, &Stub::ListPublished, request);
}
absl::StatusOr<v1::PublishedEntry> Client::Resolve(
    const v1::ResolveRequest& request) const {
  return CallUnary(*core_, &Stub::Resolve, request);
}
NameWatch Client::WatchName(const v1::ResolveRequest& request) const {
  return NameWatch(core_, request);
}

void Client::RegisterMrAsync(
    v1::RegisterMrRequest request,
    ResponseCallback<v1::RegisterMrResponse> done) const {
  Stub* stub = core_->stub.get();
  CallUnaryAsync(
      core_, std::move(request), std::move(done),
      [stub](grpc::ClientContext* context, const v1::RegisterMrRequest* req,
             v1::RegisterMrResponse* resp,
             std::function<void(grpc::Status)> on_done) {
        stub->async()->RegisterMr(context, req, resp, std::move(on_done));
      });
}

void Client::BuildLamAsync(v1::BuildLamRequest request,
                           ResponseCallback<v1::BuildLamResponse> done) const {
  Stub* stub = core_->stub.get();
  CallUnaryAsync(
      core_, std::move(request), std::move(done),
      [stub](grpc::ClientContext* context, const v1::BuildLamRequest* req,
             v1::BuildLamResponse* resp,
             std::function<void(grpc::Status)> on_done) {
        stub->async()->BuildLam(context, req, resp, std::move(on_done));
      });
}

}  // namespace mrd::client
