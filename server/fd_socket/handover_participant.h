// The fd socket's part in a live handover (server/handover/participant.h):
// its listener and every session's connection move to the new process,
// which serves them as if nothing happened; a handover that fails serves
// them here again.
#ifndef MRD_SERVER_FD_SOCKET_HANDOVER_PARTICIPANT_H_
#define MRD_SERVER_FD_SOCKET_HANDOVER_PARTICIPANT_H_

#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "mrd/unique_fd.h"
#include "mrd/v1/handover.pb.h"
#include "server/fd_socket/fd_server.h"
#include "server/handover/participant.h"

namespace mrd::fd_socket {

// What a snapshot hands over of the fd socket, its fds taken out of `fds`,
// for FdServer::Adopt.
DetachedFdServer DetachedFromSnapshot(const v1::HandoverSnapshot& snapshot,
                                      std::vector<UniqueFd>& fds);

class FdSocketParticipant final : public handover::Participant {
 public:
  // `server` is the running FdServer, replaced by Thaw with one adopting
  // what Freeze detached (made with `options` for `handler`); `served`
  // learns of each new one. Before the handover thread starts.
  void Attach(std::unique_ptr<FdServer>* server, const FdServerOptions& options,
              FdSessionHandler* handler,
              std::function<void(FdServer*)> served) {
    server_ = server;
    options_ = options;
    handler_ = handler;
    served_ = std::move(served);
  }

  absl::Status Freeze() override;
  absl::Status Export(v1::HandoverSnapshot* snapshot,
                      std::vector<UniqueFd>* fds) override;
  void Thaw() override;

 private:
  std::unique_ptr<FdServer>* server_ = nullptr;
  FdServerOptions options_;
  FdSessionHandler* handler_ = nullptr;
  std::function<void(FdServer*)> served_;
  std::optional<DetachedFdServer> detached_;  // Freeze's, for Thaw
};

}  // namespace mrd::fd_socket

#endif  // MRD_SERVER_FD_SOCKET_HANDOVER_PARTICIPANT_H_
