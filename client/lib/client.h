// mrd::client::Client: a connection to mrd's gRPC service. Owns the channel
// and the generated stub; copies are cheap and share them (like a
// grpc::Channel), and the channel lives until the last copy, and the last
// Session or handle made from it, is gone.
//
// Thread-safe: every method may be called from any thread concurrently. A
// moved-from Client may only be assigned to or destroyed.
//
// The typed methods are one per RPC of mrd.v1.MemoryRegistration. They apply
// ClientOptions::rpc_timeout as the deadline, pass the request as given (the
// caller sets its `session` field; the RAII types in session.h, buffer.h, ...
// do that for you) and return the reply or the error converted by
// StatusFromGrpc (so mrd::GetErrorDetail() works on it). Codes are those of
// mrd.proto; UNAVAILABLE when mrd cannot be reached, DEADLINE_EXCEEDED when
// the timeout passed. WatchName is the one stream among them: it has no
// deadline, and its errors come from NameWatch::Next().
//
// One Client is one connection, and mrd bounds a connection's open calls
// (--grpc_max_streams_per_connection, 32 by default): its open NameWatch and
// CompletionStream streams count, and while they fill the bound every other
// call of the Client waits (until its timeout). A process that keeps more
// streams open makes another Client for them.
#ifndef MRD_CLIENT_LIB_CLIENT_H_
#define MRD_CLIENT_LIB_CLIENT_H_

#include <memory>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/lib/name_watch.h"
#include "client/lib/options.h"
#include "mrd/v1/mrd.pb.h"

namespace mrd::client {

namespace internal {
struct ClientCore;
}  // namespace internal

// grpc.health.v1.HealthCheckResponse.ServingStatus.
enum class ServingStatus {
  kUnknown = 0,
  kServing = 1,
  kNotServing = 2,
  kServiceUnknown = 3,
};
absl::string_view ServingStatusName(ServingStatus status);

template <typename Response>
using ResponseCallback = absl::AnyInvocable<void(absl::StatusOr<Response>) &&>;

class Client {
 public:
  // Creates the channel to TargetFor(options). With a Unix target nobody
  // listens on (no socket file, or a stale one): UNAVAILABLE at once, reason
  // CANNOT_CONNECT; PERMISSION_DENIED if the socket is not accessible. With
  // options.connect_timeout > 0, waits until the channel is ready:
  // UNAVAILABLE if it does not become ready in time.
  static absl::StatusOr<Client> Connect(const ClientOptions& options = {});

  Client(const Client&) = default;
  Client& operator=(const Client&) = default;
  Client(Client&&) noexcept = default;
  Client& operator=(Client&&) noexcept = default;
  ~Client() = default;

  const ClientOptions& options() const;
  const std::string& target() const;

  // GetDeviceInfo (no session).
  absl::StatusOr<v1::DeviceInfo> GetDeviceInfo() const;
  // grpc.health.v1.Health/Check for `service` ("" = the whole server).
  // NOT_FOUND when the server does not know `service`; UNIMPLEMENTED when
  // the server has no health service.
  absl::StatusOr<ServingStatus> Health(absl::string_view service = "") const;

  // One per RPC; see mrd.proto for each one's errors.
  absl::StatusOr<v1::SessionInfo> OpenLeaseSession(
      const v1::OpenLeaseSessionRequest& request) const;
  absl::StatusOr<v1::SessionInfo> GetSession(
      const v1::GetSessionRequest& request) const;
  // The devices a session's registrations use when they name none.
  absl::StatusOr<v1::SessionInfo> SetDefaultDevices(
      const v1::SetDefaultDevicesRequest& request) const;
  absl::StatusOr<v1::CloseSessionResponse> CloseSession(
      const v1::CloseSessionRequest& request) const;
  absl::StatusOr<v1::BufferInfo> ImportFile(
      const v1::ImportFileRequest& request) const;
  absl::StatusOr<v1::ReleaseBufferResponse> ReleaseBuffer(
      const v1::ReleaseBufferRequest& request) const;
  absl::StatusOr<v1::MrInfo> CreateMr(const v1::CreateMrRequest& request) const;
  absl::StatusOr<v1::CloseMrResponse> CloseMr(
      const v1::CloseMrRequest& request) const;
  absl::StatusOr<v1::RegisterMrResponse> RegisterMr(
      const v1::RegisterMrRequest& request) const;
  absl::StatusOr<v1::DeregisterMrResponse> DeregisterMr(
      const v1::DeregisterMrRequest& request) const;
  absl::StatusOr<v1::RegisterMrBatchResponse> RegisterMrBatch(
      const v1::RegisterMrBatchRequest& request) const;
  absl::StatusOr<v1::DeregisterMrBatchResponse> DeregisterMrBatch(
      const v1::DeregisterMrBatchRequest& request) const;
  absl::StatusOr<v1::BuildLamResponse> BuildLam(
      const v1::BuildLamRequest& request) const;
  absl::StatusOr<v1::ReleaseLamResponse> ReleaseLam(
      const v1::ReleaseLamRequest& request) const;
  absl::StatusOr<v1::FastRegisterResponse> FastRegister(
      const v1::FastRegisterRequest& request) const;
  absl::StatusOr<v1::InvalidateMrResponse> InvalidateMr(
      const v1::InvalidateMrRequest& request) const;
  absl::StatusOr<v1::PeerTicket> CreatePeerTicket(
      const v1::CreatePeerTicketRequest& request) const;
  absl::StatusOr<v1::ListRegistrationsResponse> ListRegistrations(
      const v1::ListRegistrationsRequest& request) const;
  // The directory (docs/DIRECTORY.md).
  absl::StatusOr<v1::PublishedEntry> Publish(
      const v1::PublishRequest& request) const;
  absl::StatusOr<v1::UnpublishResponse> Unpublish(
      const v1::UnpublishRequest& request) const;
  absl::StatusOr<v1::ListPublishedResponse> ListPublished(
      const v1::ListPublishedRequest& request) const;
  absl::StatusOr<v1::PublishedEntry> Resolve(
      const v1::ResolveRequest& request) const;
  // Watches a name as Resolve finds it (name_watch.h): returns at once with
  // the stream open; its events, and any error, come from Next().
  NameWatch WatchName(const v1::ResolveRequest& request) const;

  // Asynchronous forms on gRPC's callback API: return at once; `done` runs
  // exactly once, on a gRPC callback thread, when the reply (or error)
  // arrives. Any number may be in flight. `done` must not block for long.
  void RegisterMrAsync(v1::RegisterMrRequest request,
                       ResponseCallback<v1::RegisterMrResponse> done) const;
  void BuildLamAsync(v1::BuildLamRequest request,
                     ResponseCallback<v1::BuildLamResponse> done) const;

  // For the stream types in this library.
  const internal::ClientCore& core() const { return *core_; }

 private:
  explicit Client(std::shared_ptr<const internal::ClientCore> core)
      : core_(std::move(core)) {}

  std::shared_ptr<const internal::ClientCore> core_;
};

}  // namespace mrd::client

#endif  // MRD_CLIENT_LIB_CLIENT_H_
