// Session: everything one client holds, and the device event sink of its
// protection domain. Owned by Core (shared_ptr, so that in-flight requests
// keep it alive while it is being torn down); fields are guarded by `mu`.
//
// Thread safety: `mu` guards all state. Device events arrive on device
// threads through the PdEventSink methods, which take `mu` briefly and call
// the completion-stream notifier outside it.
#ifndef MRD_SERVER_CORE_SESSION_H_
#define MRD_SERVER_CORE_SESSION_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mrd/v1/mrd.pb.h"
#include "server/core/tenants.h"
#include "server/device/device.h"
#include "server/fd_socket/memory_file.h"

namespace mrd::core {

enum class SessionKind { kFd, kLease };

struct BufferRecord {
  uint64_t id = 0;
  uint64_t address = 0;  // default base address on the wire (not mrd's pointer)
  std::shared_ptr<fd_socket::MappedFile> file;
};

// The session's view of one cache entry.
struct RegistrationRecord {
  uint64_t entry = 0;          // cache entry id = registration id
  uint32_t implicit_refs = 0;  // RegisterMr calls without an MR object
  uint32_t mr_refs = 0;        // MR objects holding it
  uint64_t buffer = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint32_t flags = 0;  // NDK_MR_FLAG_* as requested
  uint64_t base_address = 0;
  uint32_t lkey = 0;
  uint32_t rkey = 0;
};

struct PendingFastRegister {
  uint64_t base_address = 0;
  uint64_t length = 0;
  std::vector<uint64_t> lams;  // LAMs whose pages the request maps
  bool silent = false;         // SILENT_SUCCESS: no completion on success
};

struct MrObject {
  uint64_t id = 0;
  bool fast_register = false;
  bool allow_remote = false;
  // Normal MR objects: the registration they hold (0 = none).
  uint64_t registration = 0;
  // Fast-register MR objects.
  device::MrId device_mr = 0;
  uint32_t lkey = 0;
  uint32_t rkey = 0;
  bool fast_registered = false;
  uint64_t base_address = 0;
  uint64_t length = 0;
  std::vector<uint64_t> lams;  // LAMs mapped while fast-registered
  // Posted and not yet completed, in posting order (a connection executes
  // its work in order).
  std::deque<PendingFastRegister> pending;
  std::deque<bool> pending_invalidate_silent;
};

struct LamRecord {
  uint64_t id = 0;
  device::LamId device_lam = 0;
  uint64_t buffer = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  std::vector<uint64_t> pages;
  uint32_t fbo = 0;
  uint64_t pinned_bytes = 0;
  std::shared_ptr<fd_socket::MappedFile> file;  // keeps the pages mapped
};

class Session final : public device::PdEventSink {
 public:
  Session(uint64_t id, std::string token, SessionKind kind,
          size_t completion_depth, Identity identity,
          std::shared_ptr<Tenant> tenant)
      : id_(id),
        token_(std::move(token)),
        kind_(kind),
        completion_depth_(completion_depth),
        identity_(identity),
        tenant_(std::move(tenant)) {}

  uint64_t id() const { return id_; }
  const std::string& token() const { return token_; }
  SessionKind kind() const { return kind_; }
  // Who owns the session, and the tenant its use counts against.
  const Identity& identity() const { return identity_; }
  const std::shared_ptr<Tenant>& tenant() const { return tenant_; }

  // --- device::PdEventSink ---
  void OnCompletion(const device::WorkCompletion& completion) override;
  void OnPeerConnected(device::ConnectionId connection,
                       const std::string& peer) override;
  void OnPeerDisconnected(device::ConnectionId connection) override;
  // Charges the connection to the tenant's peer-connection quota.
  absl::Status AdmitPeerConnection() override;
  // Gives back what admitted connections still hold (the session ended, so
  // their disconnects will not come).
  void ReleasePeerConnections();

  // Completion stream plumbing.
  std::optional<v1::Completion> PopCompletion() ABSL_LOCKS_EXCLUDED(mu);
  bool ended() const ABSL_LOCKS_EXCLUDED(mu);
  void MarkEndedAndNotify() ABSL_LOCKS_EXCLUDED(mu);
  void Notify() ABSL_LOCKS_EXCLUDED(mu);

  mutable absl::Mutex mu;
  bool closing ABSL_GUARDED_BY(mu) = false;
  bool ended_ ABSL_GUARDED_BY(mu) = false;
  device::PdId pd ABSL_GUARDED_BY(mu) = 0;
  uint32_t peer_uid ABSL_GUARDED_BY(mu) = 0;
  uint32_t peer_pid ABSL_GUARDED_BY(mu) = 0;
  absl::Duration ttl ABSL_GUARDED_BY(mu) = absl::ZeroDuration();
  absl::Time expires ABSL_GUARDED_BY(mu) = absl::InfiniteFuture();
  uint64_t pinned_bytes ABSL_GUARDED_BY(mu) = 0;
  // Registrations made on the device for this session and not yet
  // deregistered (what the registration limit counts; cache hits are not).
  uint64_t device_registrations ABSL_GUARDED_BY(mu) = 0;
  // Memory the device may still point into until DeallocatePd returns: an MR
  // or LAM whose own release found the PD already being torn down (NOT_FOUND)
  // leaves its mapping here, and TearDown drops it once the PD is gone.
  std::vector<std::shared_ptr<const void>> memory_until_pd_gone
      ABSL_GUARDED_BY(mu);
  bool pd_gone ABSL_GUARDED_BY(mu) = false;
  std::string peer_ticket ABSL_GUARDED_BY(mu);
  // Buffers get default base addresses from a per-session space that says
  // nothing about mrd's own address layout.
  uint64_t next_buffer_address ABSL_GUARDED_BY(mu) = uint64_t{1} << 32;
  // Logical page address -> LAM id, for FastRegister page checks.
  std::map<uint64_t, uint64_t> page_to_lam ABSL_GUARDED_BY(mu);

  std::map<uint64_t, BufferRecord> buffers ABSL_GUARDED_BY(mu);
  std::map<uint64_t, RegistrationRecord> registrations ABSL_GUARDED_BY(mu);
  std::map<uint64_t, MrObject> mrs ABSL_GUARDED_BY(mu);
  std::map<uint64_t, LamRecord> lams ABSL_GUARDED_BY(mu);
  std::map<device::ConnectionId, std::string> connections ABSL_GUARDED_BY(mu);
  // Idempotency: request_id -> the response first returned.
  std::map<std::string, v1::RegisterMrResponse> request_ids ABSL_GUARDED_BY(mu);
  std::deque<std::string> request_id_order ABSL_GUARDED_BY(mu);

  std::deque<v1::Completion> completions ABSL_GUARDED_BY(mu);
  uint64_t completions_dropped ABSL_GUARDED_BY(mu) = 0;
  std::function<void()> notify ABSL_GUARDED_BY(mu);
  bool subscribed ABSL_GUARDED_BY(mu) = false;

 private:
  void Push(v1::Completion completion) ABSL_LOCKS_EXCLUDED(mu);

  const uint64_t id_;
  const std::string token_;
  const SessionKind kind_;
  const size_t completion_depth_;
  const Identity identity_;
  const std::shared_ptr<Tenant> tenant_;
  // Connections admitted and not yet disconnected (not under `mu`: admission
  // runs under the device's lock).
  std::atomic<uint64_t> admitted_peers_{0};
};

}  // namespace mrd::core

#endif  // MRD_SERVER_CORE_SESSION_H_
