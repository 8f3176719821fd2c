#include "server/core/session.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/string_view.h"
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
      if (!mr.fast_register || mr.device_mr != wc.mr ||
          mr.device != DeviceOfConnection(wc.connection)) {
        continue;
      }
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
          mr.access = params.access;
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

namespace {

// A session's PD on a device other than the core's first: its events reach
// the session with their connection ids tagged by the device.
class TaggedSink final : public device::PdEventSink {
 public:
  TaggedSink(Session* session, size_t device)
      : session_(session), device_(device) {}
  void OnCompletion(const device::WorkCompletion& completion) override {
    device::WorkCompletion tagged = completion;
    tagged.connection =
        Session::ConnectionOnDevice(device_, completion.connection);
    session_->OnCompletion(tagged);
  }
  void OnPeerConnected(device::ConnectionId connection,
                       const std::string& peer) override {
    session_->OnPeerConnected(Session::ConnectionOnDevice(device_, connection),
                              peer);
  }
  void OnPeerDisconnected(device::ConnectionId connection) override {
    session_->OnPeerDisconnected(
        Session::ConnectionOnDevice(device_, connection));
  }
  absl::Status AdmitPeerConnection() override {
    return session_->AdmitPeerConnection();
  }

 private:
  Session* const session_;
  const size_t device_;
};

}  // namespace

device::PdEventSink* Session::SinkFor(size_t device) {
  if (device == 0) return this;
  absl::MutexLock lock(&sinks_mu_);
  if (device_sinks_.size() < device) device_sinks_.resize(device);
  std::unique_ptr<device::PdEventSink>& sink = device_sinks_[device - 1];
  if (sink == nullptr) sink = std::make_unique<TaggedSink>(this, device);
  return sink.get();
}

std::string Session::PeerTicketLocked(size_t device) const {
  if (device == 0) return peer_ticket_;
  if (device_tickets_.size() < device) return "";
  return device_tickets_[device - 1];
}

void Session::SetPeerTicketLocked(size_t device, const std::string& ticket) {
  if (device == 0) {
    SetPeerTicketLocked(ticket);
    return;
  }
  if (device_tickets_.size() < device) device_tickets_.resize(device);
  if (device_tickets_[device - 1].empty()) device_tickets_[device - 1] = ticket;
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

void Session::AdoptPeerConnection(device::ConnectionId connection,
                                  const std::string& peer) {
  tenant_->Force(TenantResource::kPeerConnections, 1);
  admitted_peers_.fetch_add(1);
  absl::MutexLock lock(&mu);
  connections[connection] = peer;
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

void Session::KeepUntilPdGone(std::shared_ptr<const void> memory) {
  if (memory == nullptr) return;
  absl::MutexLock lock(&mu);
  // Once the PD is gone nothing of it points into the memory any more.
  if (pd_gone_) return;
  memory_until_pd_gone_.push_back(std::move(memory));
}

std::vector<std::shared_ptr<const void>> Session::MarkPdGone() {
  std::vector<std::shared_ptr<const void>> parked;
  absl::MutexLock lock(&mu);
  pd_gone_ = true;
  parked.swap(memory_until_pd_gone_);
  return parked;
}

void Session::RememberRequestLocked(const std::string& request_id,
                                    const v1::RegisterMrResponse& response,
                                    size_t memory) {
  request_ids_[request_id] = response;
  request_id_order_.push_back(request_id);
  if (request_id_order_.size() > memory) {
    request_ids_.erase(request_id_order_.front());
    request_id_order_.pop_front();
  }
}

void Session::StartLeaseLocked(absl::Duration ttl, absl::Time now) {
  ttl_ = ttl;
  expires_ = now + ttl;
}

bool Session::LeaseExpiredLocked(absl::Time now) const {
  return now >= expires_;
}

void Session::RenewLeaseLocked(absl::Time now) { expires_ = now + ttl_; }

void Session::SetPeerLocked(uint32_t uid, uint32_t pid) {
  peer_uid_ = uid;
  peer_pid_ = pid;
}

void Session::FillInfoLocked(v1::SessionInfo* out) const {
  out->set_session(token_);
  out->set_kind(kind_ == SessionKind::kFd ? "fd" : "lease");
  if (kind_ == SessionKind::kLease) {
    out->set_ttl_seconds(static_cast<uint32_t>(absl::ToInt64Seconds(ttl_)));
    out->set_expires_unix_ms(absl::ToUnixMillis(expires_));
  }
  out->set_peer_uid(peer_uid_);
  out->set_peer_pid(peer_pid_);
  out->set_pinned_bytes(pinned_bytes);
  out->set_registrations(static_cast<uint32_t>(registrations.size()));
  out->set_tenant(tenant_->name());
  out->set_verified(identity_.verified);
  if (default_devices.ByteSizeLong() != 0) {
    *out->mutable_default_devices() = default_devices;
  }
}

uint64_t Session::NextBufferAddressLocked(uint64_t size) {
  constexpr uint64_t kAlign = uint64_t{2} << 20;
  const uint64_t address = next_buffer_address_;
  next_buffer_address_ += (size + kAlign - 1) / kAlign * kAlign + kAlign;
  return address;
}

void Session::ExportLocked(absl::Time now, v1::HandedOverSession* out) const {
  out->set_id(id_);
  out->set_token(token_);
  out->set_lease(kind_ == SessionKind::kLease);
  out->set_verified(identity_.verified);
  out->set_uid(identity_.uid);
  out->set_gid(identity_.gid);
  out->set_tenant_key(identity_.tenant_key);
  out->set_pod_name(identity_.pod_name);
  out->set_peer_uid(peer_uid_);
  out->set_peer_pid(peer_pid_);
  if (kind_ == SessionKind::kLease) {
    out->set_lease_ttl_ms(absl::ToInt64Milliseconds(ttl_));
    out->set_lease_left_ms(
        std::max<int64_t>(0, absl::ToInt64Milliseconds(expires_ - now)));
  }
  out->set_peer_ticket(peer_ticket_);
  for (const std::string& ticket : device_tickets_) {
    out->add_device_tickets(ticket);
  }
  if (default_devices.names_size() > 0 || default_devices.all() ||
      default_devices.nearest()) {
    *out->mutable_default_devices() = default_devices;
  }
  out->set_next_buffer_address(next_buffer_address_);
  absl::flat_hash_set<absl::string_view> seen;
  for (const std::string& id : request_id_order_) {
    auto it = request_ids_.find(id);
    if (it == request_ids_.end() || !seen.insert(id).second) continue;
    v1::HandedOverRequest* request = out->add_requests();
    request->set_request_id(id);
    *request->mutable_response() = it->second;
  }
  for (const v1::Completion& completion : completions_) {
    *out->add_completions() = completion;
  }
  out->set_completions_dropped(completions_dropped_);
  out->set_pinned_bytes(pinned_bytes);
  out->set_device_registrations(device_registrations);
  for (const auto& [name, target] : published) {
    v1::HandedOverPublishedName* p = out->add_published();
    p->set_name(name);
    p->set_registration(target.registration);
    p->set_mr(target.mr);
    p->set_rkey(target.rkey);
  }
}

void Session::AdoptLocked(const v1::HandedOverSession& in, absl::Time now) {
  peer_uid_ = in.peer_uid();
  peer_pid_ = in.peer_pid();
  if (kind_ == SessionKind::kLease) {
    ttl_ = absl::Milliseconds(in.lease_ttl_ms());
    expires_ = now + absl::Milliseconds(in.lease_left_ms());
  }
  peer_ticket_ = in.peer_ticket();
  next_buffer_address_ = in.next_buffer_address();
  for (const v1::HandedOverRequest& request : in.requests()) {
    if (!request_ids_.emplace(request.request_id(), request.response())
             .second) {
      continue;
    }
    request_id_order_.push_back(request.request_id());
  }
  completions_.assign(in.completions().begin(), in.completions().end());
  completions_dropped_ = in.completions_dropped();
  // Published names (the directory's participant writes them again under
  // the new epoch, those whose registration came along).
  for (const v1::HandedOverPublishedName& p : in.published()) {
    published.Set(p.name(), {p.registration(), p.mr(), p.rkey()});
  }
}

void Session::SetPeerTicketLocked(const std::string& ticket) {
  if (peer_ticket_.empty()) peer_ticket_ = ticket;
}

const v1::RegisterMrResponse* Session::FindRequestLocked(
    const std::string& request_id) {
  auto seen = request_ids_.find(request_id);
  if (seen == request_ids_.end()) return nullptr;
  if (!registrations.contains(seen->second.registration())) {
    request_ids_.erase(seen);  // released since: register anew
    return nullptr;
  }
  return &seen->second;
}

uint64_t Session::Subscribe(std::function<void()> notify) {
  std::function<void()> replaced;
  uint64_t stream = 0;
  {
    absl::MutexLock lock(&mu);
    replaced = std::move(notify_);
    stream = ++last_stream_;
    stream_ = stream;
    notify_ = std::move(notify);
  }
  if (replaced) replaced();  // the stream before finds itself replaced
  return stream;
}

void Session::Unsubscribe(uint64_t stream) {
  absl::MutexLock lock(&mu);
  if (stream_ != stream) return;  // another took over
  stream_ = 0;
  notify_ = nullptr;
}

bool Session::stream_replaced(uint64_t stream) const {
  absl::MutexLock lock(&mu);
  return stream_ != stream;
}

namespace {

bool IsProgress(const v1::Completion& c) {
  return c.kind() == v1::Completion::REGISTRATION_PROGRESS;
}

// Two progress reports of the same registration (or LAM) in the making.
bool SameWork(const v1::Completion& a, const v1::Completion& b) {
  return a.request_id() == b.request_id() && a.buffer() == b.buffer() &&
         a.offset() == b.offset() && a.length() == b.length();
}

}  // namespace

void Session::Push(v1::Completion completion) {
  std::function<void()> to_notify;
  {
    absl::MutexLock lock(&mu);
    if (ended_) return;
    const bool progress = IsProgress(completion);
    // A progress report supersedes the one of the same work still queued:
    // a reader that falls behind finds one report per registration, the
    // newest, not a backlog of them.
    auto queued = completions_.end();
    if (progress) {
      queued = std::find_if(completions_.begin(), completions_.end(),
                            [&](const v1::Completion& c) {
                              return IsProgress(c) && SameWork(c, completion);
                            });
    }
    if (queued != completions_.end()) {
      *queued = std::move(completion);
    } else if (completions_.size() >= completion_depth_ && progress) {
      // Full: a progress report never pushes a completion out; it is the
      // one dropped (and counted).
      ++completions_dropped_;
      return;
    } else {
      if (completions_.size() >= completion_depth_) {
        // A full completion queue drops its oldest progress report, or
        // else its oldest entry, and counts it; a stuck reader must not
        // grow the server without bound.
        auto oldest =
            std::find_if(completions_.begin(), completions_.end(), IsProgress);
        completions_.erase(oldest != completions_.end() ? oldest
                                                        : completions_.begin());
        ++completions_dropped_;
      }
      completions_.push_back(std::move(completion));
    }
    to_notify = notify_;
  }
  if (to_notify) to_notify();
}

std::optional<v1::Completion> Session::PopCompletion() {
  absl::MutexLock lock(&mu);
  return PopLocked();
}

std::optional<v1::Completion> Session::PopCompletionFor(uint64_t stream) {
  absl::MutexLock lock(&mu);
  if (stream_ != stream) return std::nullopt;
  return PopLocked();
}

std::optional<v1::Completion> Session::PopLocked() {
  if (completions_.empty()) return std::nullopt;
  v1::Completion c = std::move(completions_.front());
  completions_.pop_front();
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
    to_notify = notify_;
  }
  if (to_notify) to_notify();
}

void Session::HoldStream(bool hold) {
  std::function<void()> to_notify;
  {
    absl::MutexLock lock(&mu);
    stream_held_ = hold;
    to_notify = notify_;
  }
  if (to_notify) to_notify();
}

void Session::MarkHandedOverAndNotify() {
  std::function<void()> to_notify;
  {
    absl::MutexLock lock(&mu);
    handed_over_ = true;
    to_notify = notify_;
  }
  if (to_notify) to_notify();
}

bool Session::stream_held() const {
  absl::MutexLock lock(&mu);
  return stream_held_;
}

bool Session::handed_over() const {
  absl::MutexLock lock(&mu);
  return handed_over_;
}

void Session::Notify() {
  std::function<void()> to_notify;
  {
    absl::MutexLock lock(&mu);
    to_notify = notify_;
  }
  if (to_notify) to_notify();
}

}  // namespace mrd::core
