#include "server/service/handover_participants.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"
#include "server/common/log.h"

namespace mrd::service {

absl::Status CallGateParticipant::Freeze() {
  if (!gate_->Pause(drain_)) {
    return MrdError(
        absl::StatusCode::kUnavailable, "HANDOVER_BUSY",
        absl::StrCat(gate_->in_flight(), " requests were still running after ",
                     absl::FormatDuration(drain_),
                     " (--handover_drain_timeout); try again"));
  }
  return absl::OkStatus();
}

void CallGateParticipant::Thaw() { gate_->Resume(); }

void CallGateParticipant::Retire() { gate_->HandOver(); }

void GrpcAcceptorParticipant::Set(const GrpcAcceptorOptions& options,
                                  std::unique_ptr<GrpcAcceptor> acceptor) {
  options_ = options;
  absl::MutexLock lock(&mu_);
  acceptor_ = std::move(acceptor);
}

absl::Status GrpcAcceptorParticipant::Start(grpc::Server* server) {
  server_ = server;
  absl::MutexLock lock(&mu_);
  return acceptor_->Start(server);
}

GrpcAcceptorStats GrpcAcceptorParticipant::Stats() const {
  absl::MutexLock lock(&mu_);
  return acceptor_->Stats();
}

void GrpcAcceptorParticipant::Shutdown() {
  absl::MutexLock lock(&mu_);
  acceptor_->Shutdown();
}

absl::Status GrpcAcceptorParticipant::Freeze() {
  absl::StatusOr<UniqueFd> socket;
  {
    absl::MutexLock lock(&mu_);
    socket = acceptor_->Detach();
  }
  if (!socket.ok()) return socket.status();
  detached_ = std::move(*socket);
  return absl::OkStatus();
}

absl::Status GrpcAcceptorParticipant::Export(v1::HandoverSnapshot* snapshot,
                                             std::vector<UniqueFd>* fds) {
  MRD_ASSIGN_OR_RETURN(const int32_t listener,
                       handover::AddDuplicate(detached_.get(), fds));
  snapshot->set_grpc_listener(listener);
  return absl::OkStatus();
}

void GrpcAcceptorParticipant::Thaw() {
  if (!detached_.valid()) return;
  absl::StatusOr<std::unique_ptr<GrpcAcceptor>> acceptor =
      GrpcAcceptor::Adopt(options_, std::move(detached_));
  absl::Status started =
      acceptor.ok() ? (*acceptor)->Start(server_) : acceptor.status();
  if (!started.ok()) {
    LogError("handover failed and the gRPC socket cannot be served again: ",
             started.ToString());
    return;
  }
  absl::MutexLock lock(&mu_);
  acceptor_ = std::move(*acceptor);
}

}  // namespace mrd::service
