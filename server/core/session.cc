#include "server/core/session.h"

#include <utility>

#include "mrd/status.h"
#include "mrd/status_proto.h"
#include "server/common/log.h"

namespace mrd::core {

void Session::OnCompletion(const device::WorkCompletion& wc) {
  v1::Completion c;
  c.set_kind(wc.kind == device::WorkCompletion::Kind::kFastRegister
                 ? v1::Completion::FAST_REGISTER
                 : v1::Completion::INVALIDATE);
  c.set_request_context(wc.request_context);
  c.set_connection(wc.connection);
  c.set_work_request(wc.work_request);
  if (wc.status.ok()) {
    c.set_status(v1::STATUS_SUCCESS);
  } else {
    const SeedStatus seed = GetErrorDetail(wc.status).seed_status();
    c.set_status(SeedStatusToProto(
        seed == SEED_STATUS_UNSPECIFIED ? STATUS_INVALID_PARAMETER : seed));
    c.set_message(std::string(wc.status.message()));
  }
  bool suppress = false;
  {
    absl::MutexLock lock(&mu);
    // Find the MR object by its device MR and update its token state.
    for (auto& [id, mr] : mrs) {
      if (!mr.fast_register || mr.device_mr != wc.mr) continue;
      c.set_mr(id);
      if (wc.kind == device::WorkCompletion::Kind::kFastRegister) {
        PendingFastRegister params;
        if (!mr.pending.empty()) {
          params = mr.pending.front();
          mr.pending.pop_front();
        }
        suppress = params.silent && wc.status.ok();
        if (wc.status.ok()) {
          mr.fast_registered = true;
          mr.rkey = wc.rkey;
          mr.base_address = params.base_address;
          mr.length = params.length;
          mr.lams = std::move(params.lams);
          c.set_rkey(wc.rkey);
        }
      } else {
        bool silent = false;
        if (!mr.pending_invalidate_silent.empty()) {
          silent = mr.pending_invalidate_silent.front();
          mr.pending_invalidate_silent.pop_front();
        }
        suppress = silent && wc.status.ok();
        if (!wc.status.ok()) break;
        mr.fast_registered = false;
        mr.base_address = 0;
        mr.length = 0;
        mr.lams.clear();
      }
      break;
    }
  }
  if (suppress) return;
  Push(std::move(c));
}

void Session::OnPeerConnected(device::ConnectionId connection,
                              const std::string& peer) {
  {
    absl::MutexLock lock(&mu);
    connections[connection] = peer;
  }
  v1::Completion c;
  c.set_kind(v1::Completion::PEER_CONNECTED);
  c.set_status(v1::STATUS_SUCCESS);
  c.set_connection(connection);
  c.set_message(peer);
  Push(std::move(c));
}

absl::Status Session::AdmitPeerConnection() {
  MRD_RETURN_IF_ERROR(tenant_->Reserve(TenantResource::kPeerConnections, 1));
  admitted_peers_.fetch_add(1);
  return absl::OkStatus();
}

void Session::ReleasePeerConnections() {
  tenant_->Release(TenantResource::kPeerConnections,
                   admitted_peers_.exchange(0));
}

void Session::OnPeerDisconnected(device::ConnectionId connection) {
  // One admitted connection is gone (never below zero: teardown may have
  // given them all back already).
  uint64_t admitted = admitted_peers_.load();
  while (admitted > 0 &&
         !admitted_peers_.compare_exchange_weak(admitted, admitted - 1)) {
  }
  if (admitted > 0) tenant_->Release(TenantResource::kPeerConnections, 1);
  {
    absl::MutexLock lock(&mu);
    connections.erase(connection);
  }
  v1::Completion c;
  c.set_kind(v1::Completion::PEER_DISCONNECTED);
  c.set_status(v1::STATUS_SUCCESS);
  c.set_connection(connection);
  Push(std::move(c));
}

void Session::Push(v1::Completion completion) {
  std::function<void()> to_notify;
  {
    absl::MutexLock lock(&mu);
    if (ended_) return;
    if (completions.size() >= completion_depth_) {
      // A full completion queue drops the oldest entry and counts it; a
      // stuck reader must not grow the server without bound.
      completions.pop_front();
      ++completions_dropped;
    }
    completions.push_back(std::move(completion));
    to_notify = notify;
  }
  if (to_notify) to_notify();
}

std::optional<v1::Completion> Session::PopCompletion() {
  absl::MutexLock lock(&mu);
  if (completions.empty()) return std::nullopt;
  v1::Completion c = std::move(completions.front());
  completions.pop_front();
  return c;
}

bool Session::ended() const {
  absl::MutexLock lock(&mu);
  return ended_;
}

void Session::MarkEndedAndNotify() {
  std::function<void()> to_notify;
  {
    absl::MutexLock lock(&mu);
    ended_ = true;
    to_notify = notify;
  }
  if (to_notify) to_notify();
}

void Session::Notify() {
  std::function<void()> to_notify;
  {
    absl::MutexLock lock(&mu);
    to_notify = notify;
  }
  if (to_notify) to_notify();
}

}  // namespace mrd::core
