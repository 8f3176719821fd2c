// The gRPC edge's part in a live handover (server/handover/participant.h):
// the call gate holds new calls and drains those in flight, and the gRPC
// acceptor's listening socket moves to the new process. Established gRPC
// connections stay here and end with this process.
#ifndef MRD_SERVER_SERVICE_HANDOVER_PARTICIPANTS_H_
#define MRD_SERVER_SERVICE_HANDOVER_PARTICIPANTS_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mrd/unique_fd.h"
#include "mrd/v1/handover.pb.h"
#include "server/handover/participant.h"
#include "server/service/call_gate.h"
#include "server/service/grpc_acceptor.h"

namespace mrd::service {

// Freeze pauses the gate (UNAVAILABLE HANDOVER_BUSY when the calls in
// flight do not end within `drain`, --handover_drain_timeout), Thaw runs
// the held calls, Retire answers them HANDED_OVER.
class CallGateParticipant final : public handover::Participant {
 public:
  explicit CallGateParticipant(absl::Duration drain) : drain_(drain) {}
  // Before the handover thread starts.
  void SetGate(CallGate* gate) { gate_ = gate; }

  absl::Status Freeze() override;
  void Thaw() override;
  void Retire() override;

 private:
  const absl::Duration drain_;
  CallGate* gate_ = nullptr;
};

// Owns the gRPC socket's acceptor, which a handover that fails replaces
// (Thaw adopts the socket Freeze detached into a new one).
class GrpcAcceptorParticipant final : public handover::Participant {
 public:
  // Before the handover thread starts: the acceptor, made with `options`.
  void Set(const GrpcAcceptorOptions& options,
           std::unique_ptr<GrpcAcceptor> acceptor) ABSL_LOCKS_EXCLUDED(mu_);
  // Starts accepting for `server`, which a new acceptor serves too.
  absl::Status Start(grpc::Server* server) ABSL_LOCKS_EXCLUDED(mu_);
  GrpcAcceptorStats Stats() const ABSL_LOCKS_EXCLUDED(mu_);
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

  absl::Status Freeze() override ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Export(v1::HandoverSnapshot* snapshot,
                      std::vector<UniqueFd>* fds) override;
  void Thaw() override ABSL_LOCKS_EXCLUDED(mu_);

 private:
  GrpcAcceptorOptions options_;
  grpc::Server* server_ = nullptr;
  UniqueFd detached_;  // Freeze's, for Thaw
  mutable absl::Mutex mu_;
  std::unique_ptr<GrpcAcceptor> acceptor_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mrd::service

#endif  // MRD_SERVER_SERVICE_HANDOVER_PARTICIPANTS_H_
