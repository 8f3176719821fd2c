// SoftwareDevice: the embedded default RDMA device. No NIC is needed, but
// nothing is faked: memory is really pinned (mlock, reference-counted per
// page), keys are laid out and drawn the way NICs do it, and remote peers
// reach registered memory over TCP (proto/mrd/v1/peer.proto) through the
// checks a NIC applies to incoming RDMA requests.
//
// Design:
// * Keys (key_table.h): lkey == rkey == (slot index << 8) | key byte; one key
//   per MR. The key byte is drawn from getrandom at every registration and
//   every fast registration, always different from the slot's previous one.
//   A fast registration's completion carries the new rkey; QueryMr reads the
//   current one (F5), which is how a caller learns it after SILENT_SUCCESS.
// * Logical addresses (iova_space.h): one logical page per host page, handed
//   out upwards from a random non-zero start with random guard gaps; never
//   reused.
// * Data path: a peer READ/WRITE moves bytes with pread/pwrite on span.fd at
//   span.file_offset + (va - base) (fast-registered MRs: through the page
//   array to each page's LAM), never through mrd's mapping, so a file
//   truncated underneath gives REMOTE_ACCESS_ERROR, not SIGBUS. Hence the
//   contract: span.fd stays open until DeregisterMr / ReleaseLam /
//   DeallocatePd returns.
// * Revocation vs. peers in flight: a peer op checks the key and takes an
//   in-flight reference on the MR under the device mutex, then does its I/O
//   without the mutex. Revoking (DeregisterMr, invalidation, FreeFast-
//   RegisterMr, DeallocatePd) makes the key unmatchable under the mutex and
//   then waits for the in-flight count to drain. So every peer op either
//   completes before the revoking call returns (or the invalidation's
//   completion is delivered) or fails.
// * Threads: a fixed set, whatever the number of peer connections: the peer
//   listener's reactor and its worker pool (peer_listener.h), which run
//   HandleRequest one frame at a time per connection, and one worker that
//   executes posted work in post
//   order and delivers every sink event (peer connected, completions, peer
//   disconnected). A PD's events therefore arrive in order, from one thread,
//   never with a caller's device call on the stack. Because the worker runs
//   a connection's work strictly in order, READ_FENCE holds trivially (and
//   this connection issues no RDMA reads of its own for a fence to wait on).
// * Pinning (pin_tracker.h) happens outside the device mutex, since mlock
//   faults every page in; the PD is held "busy" meanwhile so DeallocatePd
//   waits for it instead of racing it.
//
// Peer connections. The first request must be hello (anything else:
// PEER_REMOTE_INVALID_REQUEST, then close) with a ticket of a live PD (else
// PEER_BAD_TICKET, then close; a PD already at max_session_connections gets
// PEER_RESOURCE_EXHAUSTED "LIMIT_PEER_CONNECTIONS", then close); before it,
// frames over 4 KiB are refused. A
// READ/WRITE failing any check gets PEER_REMOTE_ACCESS_ERROR and the connection
// then closes (RC error state); queued work is flushed with
// STATUS_CONNECTION_INVALID "FLUSHED" completions, then OnPeerDisconnected.
// Zero-length and over-size
// (> max_message_size) requests get PEER_REMOTE_INVALID_REQUEST and the
// connection stays up; an oversize or unparsable frame gets it and closes.
//
// Thread safety: every method may be called from any thread (Device
// contract). Sinks must not call back into the device synchronously.
#ifndef MRD_SERVER_DEVICE_SOFTWARE_SOFTWARE_DEVICE_H_
#define MRD_SERVER_DEVICE_SOFTWARE_SOFTWARE_DEVICE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mrd/unique_fd.h"
#include "mrd/v1/peer.pb.h"
#include "server/common/thread.h"
#include "server/device/device.h"
#include "server/device/fault_points.h"
#include "server/device/iova_space.h"
#include "server/device/secure_random.h"
#include "server/device/software/kernel_pin_ops.h"
#include "server/device/software/key_table.h"
#include "server/device/software/peer_listener.h"
#include "server/device/software/pin_tracker.h"

namespace mrd::device {

// 1 Mi registrations + 256 Ki LAMs + 256 Ki fast-register MRs: the core's
// default global limits.
inline constexpr uint32_t kDefaultMaxKeys =
    (1u << 20) + (1u << 18) + (1u << 18);

struct SoftwareDeviceOptions {
  // Numeric host:port for the peer listener; port 0 picks a free one, which
  // Attributes().peer_address then reports.
  std::string peer_listen_address = "127.0.0.1:0";
  uint64_t max_mr_size = uint64_t{1} << 40;  // 1 TiB
  uint32_t max_page_list_length = 4096;      // 16 MiB of 4 KiB pages
  // Key-table slots: MRs (registrations and fast-register MRs) and LAMs
  // alive at once, at most KeyTable::kMaxSlots. mrd sets it to the sum of
  // the core's global limits (--max_total_registrations, LAMs, fast-register
  // MRs) so that the key space covers everything the core allows; the table
  // grows in chunks of key_chunk_slots as keys are taken, so a large value
  // costs memory only when used (docs/RELIABILITY.md, "Key space").
  uint32_t max_keys = kDefaultMaxKeys;
  uint32_t key_chunk_slots = KeyTable::kDefaultChunkSlots;
  // Largest peer READ/WRITE (advertised in the hello reply), <= 1 GiB.
  uint64_t max_message_size = uint64_t{16} << 20;
  // Peer path limits (peer_listener.h, docs/RELIABILITY.md "Peer path").
  uint32_t max_connections = 4096;                 // open at once
  uint32_t max_unauthenticated_connections = 256;  // before hello
  uint32_t max_session_connections = 1024;         // bound to one PD
  absl::Duration peer_hello_timeout = absl::Seconds(5);
  absl::Duration peer_stall_timeout = absl::Seconds(30);  // inside a frame
  uint64_t peer_buffer_bytes = uint64_t{256} << 20;       // all frame buffers
  uint32_t peer_workers = 4;
  // How pages are pinned when `pin_ops` is nullptr (kernel_pin_ops.h):
  // io_uring fixed buffers (no VMA per pin) with an mlock fallback whose
  // VMA splits are budgeted. The device owns that KernelPinOps and logs
  // the method once.
  KernelPinOptions pin_options;
  // Tests substitute watching or failing ones. Not owned; nullptr means the
  // device's own KernelPinOps.
  PinOps* pin_ops = nullptr;
  // Tests only: called on a peer worker thread inside every peer READ/WRITE
  // after the checks passed and before the I/O, while the op is in flight.
  std::function<void()> peer_io_hook_for_test;
  // Tests only: failure injection (fault_points.h); not owned, must outlive
  // the device; nullptr (production) disables it. The steps, in the order an
  // operation reaches them:
  //   AllocatePd        pd.allocate
  //   CreatePeerTicket  random.ticket, ticket.insert
  //   RegisterMr        pin.mlock (once per run of pages not pinned yet),
  //                     keys.allocate, random.key_slot, random.key_byte,
  //                     mr.insert
  //   BuildLam          pin.mlock (per run), random.iova_guard,
  //                     iova.allocate, keys.allocate, random.key_slot,
  //                     random.key_byte, lam.insert
  //   AllocateFastRegisterMr  keys.allocate, random.key_slot,
  //                     random.key_byte, mr.insert
  //   PostFastRegister  work.post; then, on the worker, fast_register.execute,
  //                     random.key_byte, fast_register.map (a failure there
  //                     is the work's completion status)
  //   PostInvalidate    work.post
  //   Start             thread.create (the device worker, each peer
  //                     worker, the peer reactor)
  FaultPoints* fault_points = nullptr;
};

class SoftwareDevice final : public Device {
 public:
  // Validates `options` (INVALID_ARGUMENT "BAD_OPTION"), binds and listens
  // on the peer address (errors of ListenTcp). Threads start in Start().
  static absl::StatusOr<std::unique_ptr<SoftwareDevice>> Create(
      const SoftwareDeviceOptions& options);
  // Shutdown(), then releases whatever PDs are left (nothing stays pinned),
  // without calling their sinks.
  ~SoftwareDevice() override;
  SoftwareDevice(const SoftwareDevice&) = delete;
  SoftwareDevice& operator=(const SoftwareDevice&) = delete;

  const DeviceAttributes& Attributes() const override { return attributes_; }
  DeviceHealth Health() const override;
  uint64_t PinnedBytes() const override;

  // Errors: FAILED_PRECONDITION "ALREADY_STARTED".
  absl::Status Start() override;
  void Shutdown() override;

  absl::StatusOr<PdId> AllocatePd(PdEventSink* sink) override;
  absl::Status DeallocatePd(PdId pd) override;

  absl::StatusOr<MrKeys> RegisterMr(PdId pd, const MemorySpan& span,
                                    uint64_t base_address,
                                    uint32_t access) override;
  absl::Status DeregisterMr(MrId mr) override;

  absl::StatusOr<LogicalMapping> BuildLam(PdId pd,
                                          const MemorySpan& span) override;
  absl::Status ReleaseLam(LamId lam) override;

  absl::StatusOr<MrKeys> AllocateFastRegisterMr(PdId pd, bool allow_remote,
                                                uint32_t max_pages) override;
  absl::Status FreeFastRegisterMr(MrId mr) override;

  absl::StatusOr<std::string> CreatePeerTicket(PdId pd) override;

  absl::StatusOr<uint64_t> PostFastRegister(
      ConnectionId connection, const FastRegisterWork& work) override;
  absl::StatusOr<uint64_t> PostInvalidate(ConnectionId connection,
                                          const InvalidateWork& work) override;

  // Beyond Device:

  // The MR's current keys (NDK_FN_GET_REMOTE_TOKEN_FROM_MR, F5): after a
  // fast registration, the new rkey. Errors: NOT_FOUND "UNKNOWN_MR".
  absl::StatusOr<MrKeys> QueryMr(MrId mr) const override;
  // Hands the connection's deferred (kWorkDefer) work to the worker now, as
  // the next non-deferred post would. Errors: FAILED_PRECONDITION
  // (STATUS_CONNECTION_INVALID) as for posts.
  absl::Status FlushDeferred(ConnectionId connection);
  // Blocks until the worker has no task queued or running: every event due
  // so far has been delivered. For tests and orderly teardown; must not be
  // called from a sink. Returns at once when the device was never started.
  void WaitForWorkerIdle();

  // What the device holds right now, for leak checks in tests.
  struct ResourceCounts {
    size_t pds = 0;
    size_t mrs = 0;        // registered MRs and fast-register MR objects
    size_t valid_mrs = 0;  // registered or fast-registered: peers may use
    size_t lams = 0;
    size_t keys = 0;             // key-table slots in use (MRs and LAMs)
    size_t key_slots_grown = 0;  // key-table slots allocated (lazily)
    size_t iova_ranges = 0;      // logical address ranges mapped
    size_t tickets = 0;
    size_t lam_fast_register_refs = 0;  // sum of the LAMs' fast-reg users
    size_t pd_objects = 0;              // sum over PDs of their MR and LAM sets
  };
  ResourceCounts CountResources() const;

  // The peer path's gauges, counters and limits (for metrics and tests).
  struct PeerPathStats {
    PeerListenerStats listener;
    uint64_t max_session_connections = 0;
    uint64_t session_limit_refusals = 0;  // hellos refused: PD at its cap
  };
  PeerPathStats PeerStats() const;

 private:
  struct Pd;
  struct Mr;
  struct Lam;
  struct Connection;
  struct IoSegment;
  struct ResolvedPages;

  // One posted work request (a send-queue entry).
  struct Work {
    WorkCompletion::Kind kind = WorkCompletion::Kind::kFastRegister;
    uint64_t id = 0;
    ConnectionId connection = 0;
    PdId pd = 0;
    MrId mr = 0;
    uint32_t flags = 0;
    uint64_t request_context = 0;
    FastRegisterWork fast_register;  // kFastRegister only
  };
  // What the worker does next: run work, or deliver a connection event.
  struct Task {
    enum class Kind { kWork, kConnected, kDisconnected };
    Kind kind = Kind::kWork;
    PdId pd = 0;
    ConnectionId connection = 0;
    std::string remote;  // kConnected
    Work work;           // kWork
  };

  SoftwareDevice(const SoftwareDeviceOptions& options, uint64_t page_size,
                 std::unique_ptr<PeerListener> listener, uint64_t iova_start,
                 std::unique_ptr<KernelPinOps> own_pin_ops);

  absl::Status ValidateSpan(const MemorySpan& span,
                            absl::string_view call) const;

  // A live (not dying) PD. Errors: NOT_FOUND "UNKNOWN_PD".
  absl::StatusOr<Pd*> FindPdLocked(PdId pd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the PD busy: DeallocatePd waits until it is idle again. Used
  // around work on the PD's objects done outside the mutex (pinning, sink
  // calls) or across waits that release it.
  absl::Status BeginPdOp(PdId pd) ABSL_LOCKS_EXCLUDED(mu_);
  void EndPdOp(PdId pd) ABSL_LOCKS_EXCLUDED(mu_);
  void EndPdOpLocked(PdId pd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::StatusOr<MrKeys> RegisterPinned(PdId pd, const MemorySpan& span,
                                        uint64_t base_address, uint32_t access)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<LogicalMapping> MapPinned(PdId pd, const MemorySpan& span)
      ABSL_LOCKS_EXCLUDED(mu_);

  // An MR that is not being destroyed. Errors: NOT_FOUND "UNKNOWN_MR".
  absl::StatusOr<std::shared_ptr<Mr>> FindMrLocked(MrId mr) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes the MR's mapping unusable by peers and waits (releasing the mutex)
  // until no peer op is inside it. Returns the LAM references the mapping
  // held; the caller drops them with DropLamRefsLocked.
  std::vector<LamId> UnmapLocked(const std::shared_ptr<Mr>& mr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropLamRefsLocked(const std::vector<LamId>& lams)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Revokes the key, unmaps and erases the MR. Returns its span for
  // unpinning (normal MRs) or an empty span.
  MemorySpan DestroyMrLocked(std::shared_ptr<Mr> mr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Translates a fast-register page array that passed ValidatePageArray.
  // Errors: INVALID_ARGUMENT (STATUS_INVALID_PARAMETER "PAGE_NOT_MAPPED").
  absl::StatusOr<ResolvedPages> ResolvePagesLocked(
      PdId pd, const std::vector<uint64_t>& pages) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A connected queue pair of `pd`. Errors: FAILED_PRECONDITION
  // (STATUS_CONNECTION_INVALID "CONNECTION_INVALID").
  absl::StatusOr<Connection*> FindPostConnectionLocked(ConnectionId connection,
                                                       PdId pd) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t EnqueueLocked(Connection& connection, Work work)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseDeferredLocked(Connection& connection)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Worker.
  void WorkerLoop();
  // Runs one work request; nullopt = nothing to deliver (silent success).
  std::optional<WorkCompletion> Execute(const Work& work)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ExecuteFastRegisterLocked(const Work& work, uint32_t* rkey)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ExecuteInvalidateLocked(const Work& work)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool WorkerHasTask() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool WorkerIdle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Peer path: open and close on the listener's reactor, frames on its
  // workers, one at a time per connection.
  std::shared_ptr<Connection> OpenConnection(int fd, const std::string& remote)
      ABSL_LOCKS_EXCLUDED(mu_);
  PeerListener::Verdict HandleFrame(
      const std::shared_ptr<Connection>& connection,
      absl::StatusOr<std::string> body, std::string* out)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Fills `response`; false = close the connection after sending it.
  bool HandleRequest(const std::shared_ptr<Connection>& connection,
                     const v1::PeerRequest& request, v1::PeerResponse* response)
      ABSL_LOCKS_EXCLUDED(mu_);
  bool HandleHello(const std::shared_ptr<Connection>& connection,
                   const v1::PeerHello& hello, v1::PeerResponse* response)
      ABSL_LOCKS_EXCLUDED(mu_);
  bool HandleData(const std::shared_ptr<Connection>& connection,
                  const v1::PeerRequest& request, v1::PeerResponse* response)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The NIC's checks of an incoming READ/WRITE; on success the I/O plan and
  // the MR, whose in-flight count the caller then raises.
  absl::Status CheckPeerAccessLocked(const Connection& connection,
                                     uint32_t rkey, uint64_t address,
                                     uint64_t length, uint32_t need,
                                     std::vector<IoSegment>* plan,
                                     std::shared_ptr<Mr>* mr) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CloseConnection(const std::shared_ptr<Connection>& connection)
      ABSL_LOCKS_EXCLUDED(mu_);

  const SoftwareDeviceOptions options_;
  const uint64_t page_size_;
  DeviceAttributes attributes_;
  // Before pins_, which uses it (when options_.pin_ops is nullptr).
  const std::unique_ptr<KernelPinOps> own_pin_ops_;
  PinTracker pins_;
  const std::unique_ptr<PeerListener> listener_;

  mutable absl::Mutex mu_;
  Thread worker_ ABSL_GUARDED_BY(mu_);
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  bool worker_stop_ ABSL_GUARDED_BY(mu_) = false;
  bool worker_busy_ ABSL_GUARDED_BY(mu_) = false;
  SecureRandomPool random_ ABSL_GUARDED_BY(mu_);
  KeyTable keys_ ABSL_GUARDED_BY(mu_);
  IovaSpace iova_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<PdId, std::unique_ptr<Pd>> pds_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<MrId, std::shared_ptr<Mr>> mrs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<LamId, std::unique_ptr<Lam>> lams_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<ConnectionId, std::shared_ptr<Connection>> connections_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, PdId> tickets_ ABSL_GUARDED_BY(mu_);
  std::deque<Task> tasks_ ABSL_GUARDED_BY(mu_);
  uint64_t next_pd_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_mr_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_lam_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_connection_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_work_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t session_limit_refusals_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_SOFTWARE_SOFTWARE_DEVICE_H_
