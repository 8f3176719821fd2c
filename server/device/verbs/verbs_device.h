// VerbsDevice: mrd's device on a real RDMA adapter (libibverbs + librdmacm),
// e.g. a ConnectX NIC or Soft-RoCE (rdma_rxe). Peers are remote RC queue
// pairs that connect with librdmacm and do one-sided READ/WRITE; the adapter
// enforces keys, PDs, bounds and access rights, mrd only registers memory.
//
// Design:
// * Device: the rdma_cm listener is bound to peer_address first, and the
//   device is the one that address belongs to: its ibv_context is
//   librdmacm's own context for that device (listen_id->verbs), so every
//   rdma_cm id of the peer path shares it and the PDs mrd allocates can hold
//   their QPs. Only that device is opened (rdma_get_devices would open them
//   all). peer_address must therefore be an address of the RDMA device's
//   interface, not a wildcard. Attributes come from ibv_query_device and
//   ibv_query_port of the listener's port.
// * Registration: ibv_reg_mr_iova2(pd, host_address, length, iova =
//   base_address, access). Access: local read always; kAccessLocalWrite ->
//   LOCAL_WRITE; kAccessRemoteRead -> REMOTE_READ; kAccessRemoteWrite ->
//   REMOTE_WRITE | LOCAL_WRITE; kAccessReadSink needs nothing on verbs (an
//   RDMA READ sink only needs LOCAL_WRITE), hence
//   kAdapterFlagReadSinkNotRequired. DeregisterMr is ibv_dereg_mr: the rkey
//   is dead when it returns. The adapter translates whole pages, so the base
//   address must be at the same offset within its page as the memory
//   (INVALID_ARGUMENT "BASE_ADDRESS_MISALIGNED" otherwise); mrd's default
//   base addresses always are.
// * Read-only memory: kernels before 6.2 pin memory that is not to be
//   written with FOLL_FORCE, which a shared read-only mapping refuses
//   (EFAULT). When a registration without write access fails that way, the
//   device registers a writable view of the same file pages instead (mmap
//   MAP_SHARED of span.fd; mrd never writes through it, and the access
//   flags still say what peers may do). A file that cannot be mapped
//   writable (read-only fd, F_SEAL_WRITE) cannot be registered on such
//   kernels: INVALID_ARGUMENT "READ_ONLY_MEMORY_NOT_PINNABLE".
// * Pinning: the kernel pins per registration (ib_umem), not per page: two
//   registrations of one page pin it twice. PinnedBytes() therefore counts
//   each live verbs registration's page-rounded span (normal MRs, LAMs and
//   fast-registration remaps), which is what the kernel charges to
//   pinned_vm.
// * LAMs: BuildLam maps the span's pages into a logical address space
//   (IovaSpace, shared with the software device: random non-zero start,
//   guard gaps, never reused) and pins them with a local-only registration
//   whose iova is the LAM's first logical address plus FBO. That
//   registration's lkey is the LAM's privileged token (L9): usable in local
//   work at the logical addresses, refused by the adapter on the wire (it
//   grants no remote access).
// * Fast registration: user-space verbs has no REG_MR work request, so the
//   device does what the NIC would, on the worker thread: it builds a
//   contiguous remap of the named pages (mmap PROT_NONE to reserve the
//   range, then mmap MAP_FIXED|MAP_SHARED of each run of pages from the
//   LAM's file; writable when the file allows, see read-only memory) and
//   registers it with ibv_reg_mr_iova2 at base_address. The MR's new rkey
//   is that registration's; one that happens to get the previous rkey again
//   is redone, so every fast registration gets a different key.
//   Invalidation is ibv_dereg_mr plus munmap. Limitation: pages of hugetlbfs
//   files cannot be remapped one base page at a time; such a fast
//   registration completes with an error.
// * The device model (device_model.h) holds the PD, MR, LAM and connection
//   tables, the work queue and its ordering (the same as the software
//   device's, written once) and the rules; this provider adds the verbs
//   calls, the connection manager and the async events.
// * Peer path: an rdma_cm listener (RDMA_PS_TCP) on peer_address. A connect
//   request's private data carries the ticket (CreatePeerTicket: 32 hex
//   characters, NUL-padded by the transport). Unknown ticket: rdma_reject
//   with private data "BAD_TICKET". Known: an RC QP in the ticket's PD (own
//   CQ; mrd never posts on it), accepted with responder_resources /
//   initiator_depth of the request bounded by the device's limits and
//   private data = {uint64 connection id, uint64 max message size}, both
//   little-endian (kAcceptPrivateDataBytes). ESTABLISHED -> OnPeerConnected;
//   DISCONNECTED or a connection error -> OnPeerDisconnected, after queued
//   work is flushed with STATUS_CONNECTION_INVALID "FLUSHED" completions.
//   Every rdma_cm id and QP is created and destroyed on the connection-
//   manager thread only; other threads hand it commands.
// * Health: a thread reads the device's async events. QP errors mark the
//   connection in error (posts fail) and disconnect it. PORT_ERR makes
//   Health() unhealthy until PORT_ACTIVE; requests are still attempted.
// * Device loss: DEVICE_FATAL, or the rdma_cm DEVICE_REMOVAL event (all a
//   Soft-RoCE device gets when it is deleted). Health() is unhealthy for
//   good, and requests that need the adapter fail with UNAVAILABLE
//   "DEVICE_LOST". The kernel cannot finish removing a device while a
//   process holds it open, so the device then lets go of everything on it:
//   connections (sinks hear OnPeerDisconnected), the listener, every MR, LAM
//   pin and verbs PD (their ids stay valid for DeregisterMr, ReleaseLam and
//   DeallocatePd, which then have nothing left to undo), and librdmacm's
//   context (rdma_get_devices + rdma_free_devices make librdmacm notice the
//   device is gone and close it; as a side effect librdmacm opens the other
//   RDMA devices, if any). PinnedBytes() is 0 afterwards.
//
// Thread safety: every method may be called from any thread (Device
// contract). Sinks must not call back into the device synchronously.
#ifndef MRD_SERVER_DEVICE_VERBS_VERBS_DEVICE_H_
#define MRD_SERVER_DEVICE_VERBS_VERBS_DEVICE_H_

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "mrd/unique_fd.h"
#include "server/common/thread.h"
#include "server/device/device.h"
#include "server/device/device_model.h"

namespace mrd::device {

struct VerbsDeviceOptions {
  // ibv device name (e.g. "mlx5_0", "rxe0"); empty = whichever device
  // peer_address belongs to. When set, peer_address must be on it.
  std::string device_name;
  // Numeric "ip:port" of the rdma_cm listener; port 0 picks a free one,
  // which Attributes().peer_address then reports. The address must be
  // configured on the RDMA device's network interface (not a wildcard).
  std::string peer_address;
  // Longest fast-register page array. User-space verbs does not report the
  // adapter's fast-register limit (fast registration here is a remap plus
  // ibv_reg_mr), so this is mrd's bound; it is also capped so that
  // pages * page_size never exceeds max_mr_size.
  uint32_t max_page_list_length = 4096;
  // Caps max_mr_size below the adapter's (0 = the adapter's).
  uint64_t max_mr_size_limit = 0;
  // Connected queue pairs at once; further connect requests are rejected.
  uint32_t max_connections = 1024;
  // DeviceModelOptions::connection_id_base (mrd's device i: i << 56).
  uint64_t connection_id_base = 0;
};

// Private data of the accept reply: two little-endian uint64s.
inline constexpr size_t kAcceptPrivateDataBytes = 16;
// Private data of a ticket rejection.
inline constexpr char kBadTicketRejectData[] = "BAD_TICKET";

// Names of the RDMA devices libibverbs sees (empty when there are none).
// Opens none of them.
std::vector<std::string> ListVerbsDevices();

class VerbsDevice final : public DeviceModel {
 public:
  // Binds the rdma_cm listener (which opens the device) and queries the
  // device. Errors: NOT_FOUND "NO_VERBS_DEVICE" / "UNKNOWN_VERBS_DEVICE"
  // (naming the devices there are), INVALID_ARGUMENT "BAD_HOST_PORT" /
  // "BAD_OPTION" / "PEER_ADDRESS_NOT_ON_DEVICE", or the errno of a
  // verbs/rdma_cm call.
  static absl::StatusOr<std::unique_ptr<VerbsDevice>> Create(
      const VerbsDeviceOptions& options);
  // Shutdown(), then releases whatever PDs are left (nothing stays pinned),
  // without calling their sinks.
  ~VerbsDevice() override;

  DeviceHealth Health() const override;
  // Page-rounded bytes of every live verbs registration. Verbs pins per
  // registration, so overlapping registrations count twice (unlike the
  // software device, which counts each page once).
  uint64_t PinnedBytes() const override;

  // The largest peer READ/WRITE (the port's max_msg_sz), as advertised in
  // the accept reply.
  uint64_t max_message_size() const;

 protected:
  // Handover: never. Its objects are the adapter's (the ibv_context, PDs,
  // MRs and queue pairs of this process's rdma_cm id), and another process
  // could only take them over by importing them through the context's
  // command fd (ibv_import_device / ibv_import_pd / ibv_import_mr), which
  // rxe refuses (EOPNOTSUPP) on the kernels mrd runs on; nor can an MR be
  // registered again with a given rkey. So ProviderCanHandOver is
  // FAILED_PRECONDITION "HANDOVER_UNSUPPORTED_DEVICE", and AdoptMr,
  // AdoptPeerTicket and StopPeerAccepting refuse with it.
  absl::Status ProviderCanHandOver() const override;
  absl::Status ProviderStart() override;
  void ProviderStop() override;
  absl::Status ProviderUsable() const override;
  absl::Status ProviderCheckBase(const MemorySpan& span,
                                 uint64_t base_address) const override;
  absl::StatusOr<std::unique_ptr<ProviderState>> ProviderAllocatePd() override;
  absl::Status ProviderDeallocatePd(std::unique_ptr<ProviderState> pd) override;
  absl::StatusOr<Registration> ProviderRegister(ProviderState* pd,
                                                const MemorySpan& span,
                                                uint64_t iova, uint32_t access,
                                                uint64_t owner,
                                                bool lam) override;
  absl::Status ProviderDeregister(
      std::unique_ptr<ProviderState> state) override;
  absl::StatusOr<Registration> ProviderAllocateFastMr(ProviderState* pd,
                                                      MrId owner) override;
  absl::StatusOr<Registration> ProviderFastRegister(
      ProviderState* pd, ProviderState* object, MrId mr,
      const std::vector<PageRef>& pages, const FastRegisterWork& fr,
      uint32_t previous_rkey) override;
  void ProviderCloseConnectionsLocked(
      const std::vector<ConnectionId>& connections) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

 private:
  struct Adapter;  // the opened device: context, listener, limits
  struct VerbsPd;  // a ProviderState: an ibv_pd
  struct Memory;   // a ProviderState: one verbs registration
  // A connection's verbs objects, owned by the connection-manager thread.
  struct Link {
    rdma_cm_id* id = nullptr;
    ibv_cq* cq = nullptr;
    uint32_t qp_num = 0;
    bool error = false;  // a close is already on its way
  };
  // A connection-manager event, copied out before it is acknowledged.
  struct CmEvent;
  // What other threads ask of the connection-manager thread.
  struct CmCommand {
    enum class Kind { kClose, kReleaseAll };
    Kind kind = Kind::kClose;
    std::vector<rdma_cm_id*> ids;  // kClose
  };
  // What HandleAsyncEvent needs of an ibv_async_event, copied before the
  // event is acknowledged.
  struct AsyncEvent {
    ibv_event_type type = IBV_EVENT_DEVICE_FATAL;
    uint32_t qp_num = 0;   // QP events
    ibv_cq* cq = nullptr;  // CQ_ERR (compared, never dereferenced)
    int port_num = 0;      // port events
  };

  VerbsDevice(const VerbsDeviceOptions& options, DeviceModelOptions model,
              std::unique_ptr<Adapter> adapter);
  static absl::StatusOr<std::unique_ptr<Adapter>> OpenAdapter(
      const VerbsDeviceOptions& options, uint64_t page_size);
  // Binds the rdma_cm listener to the peer address, which opens the device
  // (`names`: the devices there are, for error messages).
  static absl::Status BindListener(const VerbsDeviceOptions& options,
                                   const std::vector<std::string>& names,
                                   Adapter* adapter);
  // The device's and port's limits and attributes.
  static absl::Status QueryAdapter(const VerbsDeviceOptions& options,
                                   uint64_t page_size, Adapter* adapter);

  // ibv_reg_mr_iova2 of [span) at `iova`, through a writable view of the
  // file when the kernel refuses to pin a read-only mapping (see above).
  absl::StatusOr<std::unique_ptr<Memory>> RegisterSpan(
      ibv_pd* pd, const MemorySpan& span, uint64_t iova, int access,
      absl::string_view what) const;
  // Deregisters and unmaps. Errors: ibv_dereg_mr's (the memory then stays
  // pinned and the view mapped).
  static absl::Status ReleaseMemory(const Memory& memory);
  void AddPinned(int64_t bytes) ABSL_LOCKS_EXCLUDED(verbs_mu_);

  // Connection-manager thread.
  void CmLoop();
  void HandleCmEvent(const CmEvent& event);
  void HandleConnectRequest(const CmEvent& event);
  // A connect request the model bound to its ticket's PD (connecting).
  struct Admitted {
    ConnectionId connection = 0;
    BindResult bound;
  };
  // Errors carry the rejection's private data as their reason
  // ("BAD_TICKET", "TOO_MANY_CONNECTIONS", "UNAVAILABLE", ...).
  absl::StatusOr<Admitted> AdmitConnectRequest(const CmEvent& event,
                                               const std::string& remote);
  // The RC QP and CQ of an admitted request; on failure the connection is
  // forgotten again ("NO_RESOURCES").
  absl::Status CreateQueuePair(rdma_cm_id* id, const Admitted& admitted);
  // Closes the connection of `id` (if any): destroys its QP, CQ and the id
  // itself, then tells the model (flushes, OnPeerDisconnected).
  void CloseCmId(rdma_cm_id* id);
  // Closes every connection and, with `listener`, destroys the listener.
  void CloseAllCmIds(bool listener);
  void RunCmCommands();
  void CommandCmLocked(CmCommand command)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(verbs_mu_);

  // Device loss. LoseDevice marks the device lost (once) and starts letting
  // go of it: the cm thread closes every id (kReleaseAll), then the async
  // thread runs ReleaseDevice: every MR and LAM registration is
  // deregistered, every verbs PD deallocated, and librdmacm made to close
  // the device.
  void LoseDevice(const std::string& reason) ABSL_LOCKS_EXCLUDED(verbs_mu_);
  void ReleaseDevice() ABSL_LOCKS_EXCLUDED(verbs_mu_);

  // Async-event thread.
  void AsyncLoop();
  void HandleAsyncEvent(const AsyncEvent& event);
  // Puts the connections of these links in error and closes them.
  void FailLinks(const std::vector<ConnectionId>& connections,
                 const std::string& why) ABSL_LOCKS_EXCLUDED(verbs_mu_);

  const VerbsDeviceOptions options_;
  const std::unique_ptr<Adapter> adapter_;
  UniqueFd cm_wake_;     // eventfd: commands or stop
  UniqueFd async_wake_;  // eventfd: stop or device loss

  // Lock order: the model's mu_ before verbs_mu_ (the model calls
  // ProviderUsable and ProviderCloseConnectionsLocked under mu_); nothing
  // here calls the model while holding verbs_mu_.
  mutable absl::Mutex verbs_mu_;
  Thread cm_thread_ ABSL_GUARDED_BY(verbs_mu_);
  Thread async_thread_ ABSL_GUARDED_BY(verbs_mu_);
  bool cm_stop_ ABSL_GUARDED_BY(verbs_mu_) = false;
  bool cm_running_ ABSL_GUARDED_BY(verbs_mu_) = false;
  bool async_stop_ ABSL_GUARDED_BY(verbs_mu_) = false;
  std::string lost_reason_ ABSL_GUARDED_BY(verbs_mu_);   // non-empty: lost
  bool cm_released_ ABSL_GUARDED_BY(verbs_mu_) = false;  // every id closed
  bool released_ ABSL_GUARDED_BY(verbs_mu_) = false;     // ReleaseDevice done
  std::string port_problem_ ABSL_GUARDED_BY(verbs_mu_);  // non-empty: down
  uint64_t pinned_bytes_ ABSL_GUARDED_BY(verbs_mu_) = 0;
  absl::flat_hash_map<ConnectionId, Link> links_ ABSL_GUARDED_BY(verbs_mu_);
  absl::flat_hash_map<rdma_cm_id*, ConnectionId> by_cm_id_
      ABSL_GUARDED_BY(verbs_mu_);
  absl::flat_hash_map<uint32_t, ConnectionId> by_qp_num_
      ABSL_GUARDED_BY(verbs_mu_);
  std::deque<CmCommand> cm_commands_ ABSL_GUARDED_BY(verbs_mu_);
};

}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_VERBS_VERBS_DEVICE_H_
