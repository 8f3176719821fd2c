// The verbs device's async events (QP, CQ and port errors) and its release
// of everything after a device loss (verbs_device.h, "Health", "Device
// loss").
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/common/log.h"
#include "server/device/verbs/verbs_device.h"
#include "server/device/verbs/verbs_internal.h"

namespace mrd::device {

using verbs_internal::DrainWake;
using verbs_internal::WaitReadable;
using verbs_internal::Wake;

// --- device loss -------------------------------------------------------------

void VerbsDevice::LoseDevice(const std::string& reason) {
  {
    absl::MutexLock lock(&verbs_mu_);
    if (!lost_reason_.empty()) return;
    lost_reason_ = reason;  // from here ProviderUsable fails
    LogError("verbs device ", Attributes().name, " lost: ", reason,
             "; releasing everything on it");
    CmCommand command;
    command.kind = CmCommand::Kind::kReleaseAll;
    CommandCmLocked(std::move(command));
    Wake(async_wake_.get());
  }
  MarkAllConnectionsError();
}

void VerbsDevice::ReleaseDevice() {
  {
    // Every id is closed (so every QP and CQ is gone) before the PDs go.
    absl::MutexLock lock(&verbs_mu_);
    verbs_mu_.Await(absl::Condition(
        +[](VerbsDevice* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(d->verbs_mu_) {
          return d->cm_released_ || !d->cm_running_;
        },
        this));
  }
  // Then no verbs call on a PD's objects is in progress; new ones are
  // refused (DEVICE_LOST).
  Taken taken = TakeAllProviderState();
  uint64_t unpinned = 0;
  for (const std::unique_ptr<ProviderState>& state : taken.memory) {
    const Memory& memory = *static_cast<Memory*>(state.get());
    if (ReleaseMemory(memory).ok()) unpinned += memory.pinned;
  }
  for (const std::unique_ptr<ProviderState>& state : taken.pds) {
    if (int rc = ibv_dealloc_pd(static_cast<VerbsPd*>(state.get())->pd);
        rc != 0) {
      LogError("verbs device: ibv_dealloc_pd after device loss: ",
               std::strerror(rc));
    }
  }
  // The listener last (see kReleaseAll): then nothing of ours is left on
  // the device. librdmacm closes its context once it notices the device is
  // gone, which a device list sync does. The cm thread no longer touches
  // the listener once cm_released_ is set.
  if (adapter_->listen_id != nullptr) {
    rdma_destroy_id(adapter_->listen_id);
    adapter_->listen_id = nullptr;
  }
  int count = 0;
  if (ibv_context** list = rdma_get_devices(&count); list != nullptr) {
    rdma_free_devices(list);
  }
  absl::MutexLock lock(&verbs_mu_);
  pinned_bytes_ -= unpinned;
  released_ = true;
  LogInfo("verbs device ", Attributes().name, ": released after the loss (",
          taken.memory.size(), " registrations, ", taken.pds.size(), " PDs)");
}

// --- async events ------------------------------------------------------------

void VerbsDevice::FailLinks(const std::vector<ConnectionId>& connections,
                            const std::string& why) {
  std::vector<ConnectionId> failed;
  {
    absl::MutexLock lock(&verbs_mu_);
    CmCommand command;
    for (ConnectionId connection : connections) {
      auto it = links_.find(connection);
      if (it == links_.end() || it->second.error) continue;
      it->second.error = true;
      LogInfo("verbs device: connection ", connection, " in error: ", why);
      command.ids.push_back(it->second.id);
      failed.push_back(connection);
    }
    if (!command.ids.empty()) CommandCmLocked(std::move(command));
  }
  for (ConnectionId connection : failed) ConnectionError(connection);
}

void VerbsDevice::AsyncLoop() {
  bool readable = true;  // false once the device is lost
  while (true) {
    bool release = false;
    {
      absl::MutexLock lock(&verbs_mu_);
      if (!lost_reason_.empty() && !released_) {
        release = true;
      } else if (async_stop_) {
        return;
      }
    }
    if (release) {
      // The context closes during the release: never touch it again.
      readable = false;
      ReleaseDevice();
      continue;
    }
    while (readable) {
      ibv_async_event event{};
      if (ibv_get_async_event(adapter_->context, &event) != 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          int err = errno;
          readable = false;
          LoseDevice(absl::StrCat("reading async events failed: ",
                                  std::strerror(err)));
        }
        break;
      }
      // Copied and acknowledged first: destroying a QP waits for its
      // events to be acknowledged, and the QP may be gone afterwards.
      AsyncEvent copy;
      copy.type = event.event_type;
      switch (event.event_type) {
        case IBV_EVENT_QP_FATAL:
        case IBV_EVENT_QP_REQ_ERR:
        case IBV_EVENT_QP_ACCESS_ERR:
        case IBV_EVENT_PATH_MIG_ERR:
        case IBV_EVENT_COMM_EST:
        case IBV_EVENT_SQ_DRAINED:
        case IBV_EVENT_QP_LAST_WQE_REACHED:
          copy.qp_num = event.element.qp->qp_num;
          break;
        case IBV_EVENT_CQ_ERR:
          copy.cq = event.element.cq;
          break;
        case IBV_EVENT_PORT_ERR:
        case IBV_EVENT_PORT_ACTIVE:
        case IBV_EVENT_LID_CHANGE:
        case IBV_EVENT_GID_CHANGE:
        case IBV_EVENT_PKEY_CHANGE:
        case IBV_EVENT_SM_CHANGE:
        case IBV_EVENT_CLIENT_REREGISTER:
          copy.port_num = event.element.port_num;
          break;
        default:
          break;
      }
      ibv_ack_async_event(&event);
      HandleAsyncEvent(copy);
      if (copy.type == IBV_EVENT_DEVICE_FATAL) break;
    }
    WaitReadable(readable ? adapter_->context->async_fd : -1,
                 async_wake_.get());
    DrainWake(async_wake_.get());
  }
}

void VerbsDevice::HandleAsyncEvent(const AsyncEvent& event) {
  const char* name = ibv_event_type_str(event.type);
  switch (event.type) {
    case IBV_EVENT_QP_FATAL:
    case IBV_EVENT_QP_REQ_ERR:
    case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_PATH_MIG_ERR: {
      std::vector<ConnectionId> failed;
      {
        absl::MutexLock lock(&verbs_mu_);
        auto it = by_qp_num_.find(event.qp_num);
        if (it == by_qp_num_.end()) return;
        failed.push_back(it->second);
      }
      FailLinks(failed, name);
      return;
    }
    case IBV_EVENT_CQ_ERR: {
      std::vector<ConnectionId> failed;
      {
        absl::MutexLock lock(&verbs_mu_);
        for (const auto& [connection, link] : links_) {
          if (link.cq == event.cq) failed.push_back(connection);
        }
      }
      FailLinks(failed, name);
      return;
    }
    case IBV_EVENT_DEVICE_FATAL:
      LoseDevice("fatal device error (IBV_EVENT_DEVICE_FATAL)");
      return;
    case IBV_EVENT_PORT_ERR:
      if (event.port_num == adapter_->port_num) {
        absl::MutexLock lock(&verbs_mu_);
        port_problem_ =
            absl::StrCat("port ", event.port_num, " is down (", name, ")");
        LogWarning("verbs device ", Attributes().name, ": ", port_problem_);
      }
      return;
    case IBV_EVENT_PORT_ACTIVE:
      if (event.port_num == adapter_->port_num) {
        absl::MutexLock lock(&verbs_mu_);
        if (!port_problem_.empty()) {
          LogInfo("verbs device ", Attributes().name, ": port ", event.port_num,
                  " is active again");
        }
        port_problem_.clear();
      }
      return;
    case IBV_EVENT_COMM_EST:
    case IBV_EVENT_SQ_DRAINED:
    case IBV_EVENT_QP_LAST_WQE_REACHED:
      LogDebug("verbs device: async event ", name, " on QP ", event.qp_num);
      return;
    default:
      LogInfo("verbs device ", Attributes().name, ": async event ", name);
      return;
  }
}

}  // namespace mrd::device
