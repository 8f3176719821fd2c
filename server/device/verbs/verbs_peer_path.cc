// The verbs device's connection manager (verbs_device.h, "Peer path"):
// the rdma_cm thread, connect requests and their queue pairs, closing.
#include <arpa/inet.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"
#include "server/common/log.h"
#include "server/device/verbs/verbs_device.h"
#include "server/device/verbs/verbs_internal.h"

namespace mrd::device {
namespace {

using verbs_internal::DrainWake;
using verbs_internal::FormatSockaddr;
using verbs_internal::WaitReadable;
using verbs_internal::Wake;

// RC connect private data (CM REQ) has room for 56 bytes after rdma_cm's
// own header.
constexpr size_t kMaxConnectPrivateData = 56;

void PutLe64(uint8_t* out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(value >> (8 * i));
}

// A connect request refused: the rejection's private data is the reason.
absl::Status Refused(absl::string_view data, absl::string_view why) {
  return MrdError(absl::StatusCode::kUnavailable, data, why);
}

}  // namespace

namespace verbs_internal {

std::string FormatGid(const uint8_t (&raw)[16]) {
  std::string out;
  out.reserve(47);
  for (size_t i = 0; i < 16; ++i) {
    if (i > 0) out += ':';
    absl::StrAppend(&out, absl::Hex(raw[i], absl::kZeroPad2));
  }
  return out;
}

std::string FormatSockaddr(const sockaddr* addr) {
  if (addr == nullptr) return "unknown";
  char host[INET6_ADDRSTRLEN] = {};
  if (addr->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(addr);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    return absl::StrCat(host, ":", ntohs(in->sin_port));
  }
  if (addr->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(addr);
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    return absl::StrCat("[", host, "]:", ntohs(in6->sin6_port));
  }
  return absl::StrCat("address family ", addr->sa_family);
}

}  // namespace verbs_internal

void VerbsDevice::ProviderCloseConnectionsLocked(
    const std::vector<ConnectionId>& connections) {
  absl::MutexLock lock(&verbs_mu_);
  CmCommand command;
  for (ConnectionId id : connections) {
    if (auto it = links_.find(id); it != links_.end()) {
      command.ids.push_back(it->second.id);
    }
  }
  // Without links there is nothing to close (and no cm thread may be
  // running to do it).
  if (!command.ids.empty()) CommandCmLocked(std::move(command));
}

void VerbsDevice::CommandCmLocked(CmCommand command) {
  cm_commands_.push_back(std::move(command));
  Wake(cm_wake_.get());
}

void VerbsDevice::CmLoop() {
  while (true) {
    RunCmCommands();
    {
      absl::MutexLock lock(&verbs_mu_);
      if (cm_stop_) break;
    }
    while (true) {
      rdma_cm_event* event = nullptr;
      if (rdma_get_cm_event(adapter_->channel, &event) != 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          LogError("verbs device: rdma_get_cm_event: ", std::strerror(errno));
        }
        break;
      }
      CmEvent copy;
      copy.type = event->event;
      copy.id = event->id;
      copy.status = event->status;
      if (event->event == RDMA_CM_EVENT_CONNECT_REQUEST) {
        const rdma_conn_param& param = event->param.conn;
        if (param.private_data != nullptr) {
          copy.private_data.assign(static_cast<const char*>(param.private_data),
                                   param.private_data_len);
        }
        copy.responder_resources = param.responder_resources;
        copy.initiator_depth = param.initiator_depth;
      }
      // Acknowledged before handling: destroying an id waits for its
      // events to be acknowledged.
      rdma_ack_cm_event(event);
      HandleCmEvent(copy);
    }
    WaitReadable(adapter_->channel->fd, cm_wake_.get());
    DrainWake(cm_wake_.get());
  }
  // Stopping: every connection closes (sinks hear of it through the
  // worker), then the listener goes, unless a device release owns it now.
  bool released = false;
  {
    absl::MutexLock lock(&verbs_mu_);
    released = cm_released_;
  }
  CloseAllCmIds(/*listener=*/!released);
  absl::MutexLock lock(&verbs_mu_);
  cm_running_ = false;
}

void VerbsDevice::CloseAllCmIds(bool listener) {
  std::vector<rdma_cm_id*> ids;
  {
    absl::MutexLock lock(&verbs_mu_);
    for (const auto& [id, connection] : by_cm_id_) ids.push_back(id);
  }
  for (rdma_cm_id* id : ids) CloseCmId(id);
  if (listener && adapter_->listen_id != nullptr) {
    rdma_destroy_id(adapter_->listen_id);
    adapter_->listen_id = nullptr;
  }
}

void VerbsDevice::RunCmCommands() {
  std::deque<CmCommand> commands;
  {
    absl::MutexLock lock(&verbs_mu_);
    commands.swap(cm_commands_);
  }
  for (const CmCommand& command : commands) {
    if (command.kind == CmCommand::Kind::kReleaseAll) {
      // The listener stays: its reference keeps librdmacm's context open
      // until ReleaseDevice has let go of everything else (another user of
      // librdmacm in this process could otherwise make it close the context
      // under our MRs), and ReleaseDevice destroys it.
      CloseAllCmIds(/*listener=*/false);
      absl::MutexLock lock(&verbs_mu_);
      cm_released_ = true;
      continue;
    }
    for (rdma_cm_id* id : command.ids) {
      bool known = false;
      {
        absl::MutexLock lock(&verbs_mu_);
        known = by_cm_id_.contains(id);
      }
      if (known) CloseCmId(id);  // not closed meanwhile
    }
  }
}

void VerbsDevice::HandleCmEvent(const CmEvent& event) {
  switch (event.type) {
    case RDMA_CM_EVENT_CONNECT_REQUEST:
      HandleConnectRequest(event);
      return;
    case RDMA_CM_EVENT_ESTABLISHED: {
      ConnectionId connection = 0;
      {
        absl::MutexLock lock(&verbs_mu_);
        auto it = by_cm_id_.find(event.id);
        if (it == by_cm_id_.end()) return;
        connection = it->second;
      }
      ConnectionEstablished(connection);
      return;
    }
    case RDMA_CM_EVENT_DISCONNECTED:
    case RDMA_CM_EVENT_CONNECT_ERROR:
    case RDMA_CM_EVENT_UNREACHABLE:
    case RDMA_CM_EVENT_REJECTED:
      LogDebug("verbs device: ", rdma_event_str(event.type), " (status ",
               event.status, ")");
      CloseCmId(event.id);
      return;
    case RDMA_CM_EVENT_DEVICE_REMOVAL:
      // Every id on the device gets one; the release closes them all.
      LoseDevice("the RDMA device is being removed (rdma_cm DEVICE_REMOVAL)");
      return;
    default:
      LogDebug("verbs device: rdma_cm event ", rdma_event_str(event.type));
      return;
  }
}

void VerbsDevice::HandleConnectRequest(const CmEvent& event) {
  rdma_cm_id* id = event.id;
  const std::string remote = FormatSockaddr(rdma_get_peer_addr(id));
  absl::StatusOr<Admitted> admitted = AdmitConnectRequest(event, remote);
  absl::Status status = admitted.status();
  if (status.ok()) status = CreateQueuePair(id, *admitted);
  if (!status.ok()) {
    const std::string data = GetErrorDetail(status).reason();
    LogInfo("verbs device: connect request from ", remote,
            " rejected: ", status.message());
    rdma_reject(id, data.data(), static_cast<uint8_t>(data.size()));
    rdma_destroy_id(id);
    return;
  }
  uint8_t reply[kAcceptPrivateDataBytes];
  PutLe64(reply, admitted->connection);
  PutLe64(reply + 8, adapter_->max_message_size);
  rdma_conn_param param{};
  param.private_data = reply;
  param.private_data_len = sizeof(reply);
  param.responder_resources = static_cast<uint8_t>(std::min<uint32_t>(
      event.responder_resources, adapter_->max_responder_resources));
  param.initiator_depth = static_cast<uint8_t>(
      std::min<uint32_t>(event.initiator_depth, adapter_->max_initiator_depth));
  param.rnr_retry_count = 7;
  if (rdma_accept(id, &param) != 0) {
    LogWarning("verbs device: rdma_accept for ", remote, ": ",
               std::strerror(errno));
    CloseCmId(id);
    return;
  }
  LogDebug("verbs device: accepted connection ", admitted->connection, " from ",
           remote, " (PD ", admitted->bound.pd, ", QP ", id->qp->qp_num, ")");
}

absl::StatusOr<VerbsDevice::Admitted> VerbsDevice::AdmitConnectRequest(
    const CmEvent& event, const std::string& remote) {
  if (event.id->verbs != adapter_->context) {
    return Refused("WRONG_DEVICE", "it arrived on another RDMA device");
  }
  size_t ticket_length =
      std::min(event.private_data.size(), kMaxConnectPrivateData);
  ticket_length = strnlen(event.private_data.data(), ticket_length);
  const std::string ticket = event.private_data.substr(0, ticket_length);
  {
    absl::MutexLock lock(&verbs_mu_);
    if (!lost_reason_.empty()) {
      return Refused("UNAVAILABLE", "the device is lost");
    }
    if (links_.size() >= options_.max_connections) {
      return Refused("TOO_MANY_CONNECTIONS",
                     absl::StrCat("the device has its maximum of ",
                                  options_.max_connections, " connections"));
    }
  }
  std::optional<ConnectionId> connection = NewConnection(remote);
  if (!connection.has_value()) {
    return Refused("UNAVAILABLE", "the device is shutting down");
  }
  absl::StatusOr<BindResult> bound =
      BindConnection(*connection, ticket, /*ready=*/false);
  if (!bound.ok()) {
    ConnectionClosed(*connection);
    return Refused(bound.status().code() == absl::StatusCode::kNotFound
                       ? kBadTicketRejectData
                       : "TOO_MANY_CONNECTIONS",
                   bound.status().message());
  }
  // Before the QP exists: a PD that dies meanwhile finds the connection
  // here and has the cm thread (this one, next) close it.
  absl::MutexLock lock(&verbs_mu_);
  links_[*connection].id = event.id;
  by_cm_id_.emplace(event.id, *connection);
  return Admitted{*connection, *bound};
}

absl::Status VerbsDevice::CreateQueuePair(rdma_cm_id* id,
                                          const Admitted& admitted) {
  // A small RC QP with its own CQ: mrd never posts on it; the adapter
  // answers the peer's READ/WRITE from the PD's MRs. The PD's state stays
  // until the connection is reported closed.
  ibv_cq* cq = ibv_create_cq(adapter_->context, 2, nullptr, nullptr, 0);
  bool created = false;
  if (cq != nullptr) {
    ibv_qp_init_attr init{};
    init.send_cq = cq;
    init.recv_cq = cq;
    init.qp_type = IBV_QPT_RC;
    init.cap.max_send_wr = 1;
    init.cap.max_recv_wr = 1;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    ibv_pd* pd = static_cast<VerbsPd*>(admitted.bound.pd_state)->pd;
    created = rdma_create_qp(id, pd, &init) == 0;
  }
  if (!created) {
    const int err = errno;
    if (cq != nullptr) ibv_destroy_cq(cq);
    {
      absl::MutexLock lock(&verbs_mu_);
      links_.erase(admitted.connection);
      by_cm_id_.erase(id);
    }
    ConnectionClosed(admitted.connection);
    return Refused("NO_RESOURCES", absl::StrCat("creating the queue pair: ",
                                                std::strerror(err)));
  }
  absl::MutexLock lock(&verbs_mu_);
  Link& link = links_[admitted.connection];
  link.cq = cq;
  link.qp_num = id->qp->qp_num;
  by_qp_num_.emplace(link.qp_num, admitted.connection);
  return absl::OkStatus();
}

void VerbsDevice::CloseCmId(rdma_cm_id* id) {
  ConnectionId connection = 0;
  Link link;
  {
    absl::MutexLock lock(&verbs_mu_);
    auto by_id = by_cm_id_.find(id);
    if (by_id != by_cm_id_.end()) {
      connection = by_id->second;
      by_cm_id_.erase(by_id);
      auto it = links_.find(connection);
      link = it->second;
      links_.erase(it);
      if (link.cq != nullptr) by_qp_num_.erase(link.qp_num);
    }
  }
  if (link.cq != nullptr) {
    rdma_disconnect(id);  // harmless when the peer already disconnected
    rdma_destroy_qp(id);
    ibv_destroy_cq(link.cq);
  }
  rdma_destroy_id(id);
  // After the QP is gone: the PD may be deallocated once the model hears
  // this.
  if (connection != 0) {
    ConnectionClosed(connection);
    LogDebug("verbs device: connection ", connection, " closed");
  }
}

}  // namespace mrd::device
