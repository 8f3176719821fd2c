#include "server/fd_socket/handover_participant.h"

#include <utility>

#include "mrd/status.h"
#include "server/common/log.h"

namespace mrd::fd_socket {

DetachedFdServer DetachedFromSnapshot(const v1::HandoverSnapshot& snapshot,
                                      std::vector<UniqueFd>& fds) {
  DetachedFdServer detached;
  detached.listener = handover::TakeFd(fds, snapshot.fd_listener());
  for (const v1::HandedOverFdConnection& c : snapshot.fd_connections()) {
    DetachedConnection conn;
    conn.socket = handover::TakeFd(fds, c.fd());
    conn.session = c.session();
    conn.creds.pid = static_cast<pid_t>(c.pid());
    conn.creds.uid = c.uid();
    conn.creds.gid = c.gid();
    conn.pending_reply = c.pending_reply();
    if (conn.socket.valid()) detached.connections.push_back(std::move(conn));
  }
  return detached;
}

absl::Status FdSocketParticipant::Freeze() {
  absl::StatusOr<DetachedFdServer> detached = (*server_)->Detach();
  if (!detached.ok()) return detached.status();
  detached_ = std::move(*detached);
  return absl::OkStatus();
}

absl::Status FdSocketParticipant::Export(v1::HandoverSnapshot* snapshot,
                                         std::vector<UniqueFd>* fds) {
  MRD_ASSIGN_OR_RETURN(const int32_t listener,
                       handover::AddDuplicate(detached_->listener.get(), fds));
  snapshot->set_fd_listener(listener);
  for (const DetachedConnection& c : detached_->connections) {
    MRD_ASSIGN_OR_RETURN(const int32_t index,
                         handover::AddDuplicate(c.socket.get(), fds));
    v1::HandedOverFdConnection* conn = snapshot->add_fd_connections();
    conn->set_fd(index);
    conn->set_session(c.session);
    conn->set_pid(static_cast<uint32_t>(c.creds.pid));
    conn->set_uid(c.creds.uid);
    conn->set_gid(c.creds.gid);
    conn->set_pending_reply(c.pending_reply);
  }
  return absl::OkStatus();
}

void FdSocketParticipant::Thaw() {
  if (!detached_.has_value()) return;
  absl::StatusOr<std::unique_ptr<FdServer>> server =
      FdServer::Adopt(options_, handler_, std::move(*detached_));
  detached_.reset();
  if (!server.ok()) {
    LogError("handover failed and the fd socket cannot be served again: ",
             server.status().ToString());
    return;
  }
  *server_ = std::move(*server);
  served_(server_->get());
}

}  // namespace mrd::fd_socket
