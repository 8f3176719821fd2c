// VerbsPeer: a remote peer of mrd's verbs device, the real thing: an RC
// queue pair connected with librdmacm that issues one-sided RDMA READ and
// WRITE against (rkey, address) pairs handed out by mrd.
//
// Connect resolves the device's peer address, creates its own PD, CQ
// (with a completion channel) and QP, and connects with the ticket
// (CreatePeerTicket) as the connect private data. The device answers with
// {uint64 connection id, uint64 max message size}, little-endian, in the
// accept's private data, or rejects with "BAD_TICKET".
//
// Data moves through a bounce buffer registered once with LOCAL_WRITE and
// re-registered larger when a request needs more. Each Read/Write posts one
// signaled work request and waits for its completion (at most
// kOpTimeout).
//
// Errors (peer.h's contract):
//   PERMISSION_DENIED "REMOTE_ACCESS_ERROR"    IBV_WC_REM_ACCESS_ERR: bad
//                                              key, bounds, rights or PD
//   INVALID_ARGUMENT  "REMOTE_INVALID_REQUEST" zero length or longer than
//                                              max_message_size() (refused
//                                              here, the link stays up), or
//                                              IBV_WC_REM_INV_REQ_ERR
//   UNAUTHENTICATED   "BAD_TICKET"             Connect: rejected ticket
//   UNAVAILABLE       "PEER_CONNECTION_*"      connect failed
//                                              (PEER_CONNECTION_FAILED),
//                                              closed by the device
//                                              (PEER_CONNECTION_CLOSED),
//                                              failed earlier
//                                              (PEER_CONNECTION_BROKEN),
//                                              no completion in time
//                                              (PEER_CONNECTION_TIMEOUT)
// Any work completion error moves an RC QP to the error state, so after one
// the peer is broken: every later call fails with PEER_CONNECTION_BROKEN;
// the peer disconnects, and the device hears of it. Reconnect to go on.
//
// A watcher thread reads the connection's rdma_cm events: a disconnect by
// the device ends the connection (PEER_CONNECTION_CLOSED), and when the
// local RDMA device is being removed (DEVICE_REMOVAL) the peer releases
// every verbs object at once, so that the kernel can finish the removal
// (it waits for every process to let go of the device); it then makes
// librdmacm notice the removal (rdma_get_devices, which as a side effect
// opens the process's other RDMA devices) so that librdmacm closes its
// context of the removed device too.
//
// Thread safety: thread-safe; calls are serialized (one request in flight).
#ifndef MRD_CLIENT_PEER_VERBS_PEER_H_
#define MRD_CLIENT_PEER_VERBS_PEER_H_

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/peer/peer.h"

namespace mrd::peer {

class VerbsPeer final : public Peer {
 public:
  // How long a READ/WRITE may take before the peer gives up on it.
  static constexpr absl::Duration kOpTimeout = absl::Seconds(10);
  // How long address/route resolution and the connect handshake may take.
  static constexpr absl::Duration kConnectTimeout = absl::Seconds(20);

  // Connects to the verbs device at `host_port` (numeric ip:port, the
  // device's peer_address) with `ticket`.
  static absl::StatusOr<std::unique_ptr<VerbsPeer>> Connect(
      absl::string_view host_port, absl::string_view ticket);

  VerbsPeer(const VerbsPeer&) = delete;
  VerbsPeer& operator=(const VerbsPeer&) = delete;
  // Disconnects and releases every verbs object.
  ~VerbsPeer() override;

  absl::StatusOr<std::string> Read(uint32_t rkey, uint64_t address,
                                   uint64_t length) override;
  absl::Status Write(uint32_t rkey, uint64_t address,
                     absl::string_view data) override;

  uint64_t connection_id() const override { return connection_id_; }
  uint64_t max_message_size() const override { return max_message_size_; }

 private:
  VerbsPeer() = default;

  // Resolve, create the QP, connect. Fills connection_id_ and
  // max_message_size_.
  absl::Status Establish(absl::string_view host_port, absl::string_view ticket);
  // Waits for the next rdma_cm event on our channel (connect phase only;
  // the watcher reads them afterwards).
  absl::StatusOr<rdma_cm_event_type> WaitCmEvent(absl::Time deadline,
                                                 std::string* private_data,
                                                 int* status);
  void WatchLoop();
  // Destroys every verbs object (QP, bounce MR, CQ, PD, id). Idempotent.
  void ReleaseVerbsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status EnsureBounceLocked(uint64_t length)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Posts one signaled READ/WRITE of `length` bytes of the bounce buffer
  // and waits for its completion.
  absl::Status PostAndWaitLocked(ibv_wr_opcode opcode, uint32_t rkey,
                                 uint64_t address, uint64_t length)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckUsableLocked(absl::string_view op, uint64_t length)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the peer broken and disconnects (the QP is in error anyway).
  void BreakLocked(std::string reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Set by Establish, then immutable.
  rdma_event_channel* channel_ = nullptr;
  uint64_t connection_id_ = 0;
  uint64_t max_message_size_ = 0;
  int stop_fd_ = -1;    // eventfd: the watcher stops
  int notify_fd_ = -1;  // eventfd: the watcher saw a disconnect or removal
  std::thread watcher_;

  // Written by the watcher without mu_ (a request may hold mu_ while it
  // waits for its completion).
  std::atomic<bool> disconnected_{false};
  std::atomic<bool> removed_{false};

  absl::Mutex mu_;
  // Verbs objects: created by Establish, destroyed by ReleaseVerbsLocked.
  rdma_cm_id* id_ ABSL_GUARDED_BY(mu_) = nullptr;
  ibv_pd* pd_ ABSL_GUARDED_BY(mu_) = nullptr;
  ibv_comp_channel* comp_channel_ ABSL_GUARDED_BY(mu_) = nullptr;
  ibv_cq* cq_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool qp_created_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  std::string broken_reason_ ABSL_GUARDED_BY(mu_);
  void* bounce_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t bounce_size_ ABSL_GUARDED_BY(mu_) = 0;
  ibv_mr* bounce_mr_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t next_wr_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace mrd::peer

#endif  // MRD_CLIENT_PEER_VERBS_PEER_H_
