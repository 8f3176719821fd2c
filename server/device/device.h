// The device layer: what mrd needs from an RDMA adapter, as one pure-virtual
// interface with two implementations: the software device (software/, the
// embedded default, no NIC needed) and the verbs device (verbs/, libibverbs).
//
// The device knows nothing of sessions, gRPC or seed flag encodings: the
// service core translates seed flags into AccessBits and validates the seed
// rules that do not depend on the device. The device enforces what hardware
// enforces: keys, protection domains, bounds, access rights, page arrays that
// name pages it mapped, MR object states, and connection state.
//
// Objects are named by device-wide integer ids (never reused within one
// device's lifetime; MR ids: not before 2^40 MRs were made). Every object
// belongs to one protection domain (PD); the core gives each session its own
// PD, so a peer connected to one session can never reach another session's
// memory (W8).
//
// Thread safety: every method may be called from any thread concurrently.
// Event sinks are called from device threads, never while a caller's call into
// the device is on the stack of that thread, and must not block.
#ifndef MRD_SERVER_DEVICE_DEVICE_H_
#define MRD_SERVER_DEVICE_DEVICE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "mrd/unique_fd.h"
#include "server/common/progress.h"

namespace mrd::device {

class DeviceHandover;

using PdId = uint64_t;
using MrId = uint64_t;
using LamId = uint64_t;
using ConnectionId = uint64_t;

// Access rights of a memory region, device terms.
enum AccessBits : uint32_t {
  kAccessLocalRead = 0,  // always granted
  kAccessLocalWrite = 1u << 0,
  kAccessRemoteRead = 1u << 1,
  kAccessRemoteWrite = 1u << 2,  // the core always adds kAccessLocalWrite
  kAccessReadSink = 1u << 3,     // R9/F3: memory may be an RDMA-read sink
};

// Work-request flags the device honours (values are the seed's NDK_OP_FLAG_*).
enum WorkFlags : uint32_t {
  kWorkSilentSuccess = 0x1,
  kWorkReadFence = 0x2,
  kWorkDefer = 0x200,
};

// NDK_ADAPTER_FLAG_RDMA_READ_SINK_NOT_REQUIRED.
inline constexpr uint32_t kAdapterFlagReadSinkNotRequired = 0x2;

struct DeviceAttributes {
  std::string name;        // "software", or the verbs device name
  std::string kind;        // "software" | "verbs"
  uint64_t page_size = 0;  // L5: every adapter page is this size
  uint64_t max_mr_size = 0;
  uint32_t max_page_list_length = 0;  // fast-register page arrays
  uint32_t adapter_flags = 0;
  std::string peer_address;  // host:port where peers connect
  // Verbs: the GID peers address (xx:xx:...:xx, 16 bytes) and the port's
  // LID; the software device has neither ("" and 0).
  std::string gid;
  uint32_t lid = 0;
  // Where the adapter sits (verbs: sysfs), for placing registrations near
  // their memory: its NUMA node (-1 unknown; the software device), its PCI
  // address ("" for the software device) and its port's link layer
  // ("InfiniBand", "Ethernet"; "" for the software device).
  int32_t numa_node = -1;
  std::string pci_address;
  std::string link_layer;
  // The adapter supports memory windows (verbs: IBV_DEVICE_MEM_WINDOW or
  // max_mw > 0). mrd does not use them; reported for inspection.
  bool supports_memory_windows = false;
  // Registrations of the same pages share one pin (the software device's
  // page refcounts): a page already pinned costs nothing to register again,
  // which is what makes the core's warm pins worth keeping. Verbs pins per
  // registration, so there a warm pin would only add a registration.
  bool shares_pins = false;
  // Memory maps (VMA splits) one pin may cost mrd's process, of read-only
  // and of writable memory (the software device mlocks what io_uring
  // cannot pin, and mlock of a part of a mapping splits it: at most two per
  // pin), and how many the device allows in all (--pin_max_map_splits);
  // 0: pins cost none.
  uint32_t map_splits_per_read_only_pin = 0;
  uint32_t map_splits_per_writable_pin = 0;
  uint64_t max_map_splits = 0;
};

struct DeviceHealth {
  bool healthy = true;
  std::string message;
};

// The peer path's gauges, where a device keeps them (the software device's
// TCP listener; docs/RELIABILITY.md, "Peer path").
struct PeerPathCounts {
  uint64_t connections = 0;      // open now
  uint64_t unauthenticated = 0;  // open now, no hello yet
  uint64_t buffered_bytes = 0;   // frame and response memory now
  uint64_t threads = 0;          // serving the peer path
  uint64_t accepted = 0;         // totals from the start
  uint64_t refused = 0;          // at the total cap with nobody to shed
  uint64_t shed = 0;             // closed to admit a new connection
  uint64_t hello_timeouts = 0;
  uint64_t stall_timeouts = 0;
  uint64_t session_limit_refusals = 0;  // hellos refused: PD at its cap
  // The limits in force.
  uint64_t max_connections = 0;
  uint64_t max_unauthenticated = 0;
  uint64_t max_buffer_bytes = 0;
  uint64_t max_session_connections = 0;
};

// Client memory as the device sees it: mrd's own mapping of part of a file.
// `host_address` is page-aligned minus nothing: it may point anywhere inside
// a page; the mapping itself is page-aligned and covers whole pages. The
// device pins through host_address (mlock / ibv_reg_mr) and the software
// device moves data through (fd, file_offset) so that a file truncated behind
// its back gives an error, never SIGBUS. The device reads and writes through
// `fd` until DeregisterMr / ReleaseLam / DeallocatePd returns: keep it open.
//
// `progress` (optional, owned by the caller, alive for the call): the device
// adds the bytes it pinned as it goes, and checks progress->Cancelled()
// between steps; cancelled, it undoes the pin and fails with CANCELLED.
//
// `pages`: whether the file is in huge pages (hugetlbfs), when whoever made
// the span knows (fd_socket::MappedFile does, once per mapping); kUnknown
// makes a device that cares ask the file system at every pin.
enum class SpanPages : uint8_t { kUnknown, kBase, kHuge };

struct MemorySpan {
  void* host_address = nullptr;
  uint64_t length = 0;
  int fd = -1;
  uint64_t file_offset = 0;
  WorkProgress* progress = nullptr;
  SpanPages pages = SpanPages::kUnknown;
};

struct MrKeys {
  MrId mr = 0;
  uint32_t lkey = 0;
  uint32_t rkey = 0;
};

struct LogicalMapping {
  LamId lam = 0;
  std::vector<uint64_t> pages;  // logical addresses, page_size-aligned
  uint32_t fbo = 0;             // host_address % page_size
  // L9: the privileged memory token for using these logical addresses
  // directly in local work. Local-only: the device refuses it on the wire,
  // whatever address a peer names with it.
  uint32_t privileged_key = 0;
};

struct FastRegisterWork {
  MrId mr = 0;                  // from AllocateFastRegisterMr, same PD
  std::vector<uint64_t> pages;  // logical addresses from BuildLam, same PD
  uint32_t fbo = 0;
  uint64_t length = 0;
  uint64_t base_address = 0;
  uint32_t access = 0;  // AccessBits
  uint32_t flags = 0;   // WorkFlags
  uint64_t request_context = 0;
};

struct InvalidateWork {
  MrId mr = 0;
  uint32_t flags = 0;  // WorkFlags
  uint64_t request_context = 0;
};

struct WorkCompletion {
  enum class Kind { kFastRegister, kInvalidate };
  Kind kind = Kind::kFastRegister;
  ConnectionId connection = 0;
  uint64_t work_request = 0;
  uint64_t request_context = 0;
  MrId mr = 0;
  uint32_t rkey = 0;    // kFastRegister success: the MR's new remote token
  absl::Status status;  // failure reason; failures are always delivered
};

// Receives what happens asynchronously in one PD. Called on device threads;
// must not block and must not call back into the device synchronously.
class PdEventSink {
 public:
  virtual ~PdEventSink() = default;
  virtual void OnCompletion(const WorkCompletion& completion) = 0;
  virtual void OnPeerConnected(ConnectionId connection,
                               const std::string& peer) = 0;
  virtual void OnPeerDisconnected(ConnectionId connection) = 0;
  // Asked before a peer connection is bound to this PD (a successful
  // hello), under the device's lock: must not block or call the device. A
  // refusal is sent to the peer as a resource refusal with the status's
  // message. Every admitted connection is later matched by one
  // OnPeerDisconnected, unless the PD is deallocated first.
  virtual absl::Status AdmitPeerConnection() { return absl::OkStatus(); }
};

// Work a device combines across the calls that one thread makes in a batch
// (Device::BeginBatch); what it deferred is done when this is destroyed.
class DeviceBatch {
 public:
  virtual ~DeviceBatch() = default;
};

// Pages a device pinned ahead of the registrations a batch call is about to
// make of them (Device::PinForBatch); unpinned when this is destroyed, after
// which each page stays pinned exactly as long as a registration holds it.
class BatchPin {
 public:
  virtual ~BatchPin() = default;
};

class Device {
 public:
  virtual ~Device() = default;

  virtual const DeviceAttributes& Attributes() const = 0;
  virtual DeviceHealth Health() const = 0;
  // Bytes pinned by the device right now (each page counted once).
  virtual uint64_t PinnedBytes() const = 0;
  // The peer path's gauges; nullopt from a device that keeps none.
  virtual std::optional<PeerPathCounts> PeerPath() const {
    return std::nullopt;
  }

  // Opens a batch on the calling thread (DeregisterMrBatch, a session's
  // end): until the object returned is destroyed, on this thread, the
  // device may defer and combine work that no result of this thread's calls
  // waits for (the software device: emptying the io_uring slots of the
  // pages it unpins, kernel_pin_ops.h's ClearBatch). nullptr: nothing to
  // combine (the default).
  virtual std::unique_ptr<DeviceBatch> BeginBatch() { return nullptr; }

  // Pins `span`, the adjacent small ranges of one buffer that a batch's
  // items are about to register, ahead of them: a device that counts pins
  // per page (the software device) then pins them with a few kernel calls
  // instead of one or more per item, and the items' registrations only
  // count their pages. nullptr: nothing to gain on this device (the
  // default), or the pin failed (each item then pins its own pages, and
  // says why if it cannot).
  virtual std::unique_ptr<BatchPin> PinForBatch(const MemorySpan& span) {
    (void)span;
    return nullptr;
  }

  // Starts the peer listener and any device threads. Called once before use.
  virtual absl::Status Start() = 0;
  // Stops accepting peers and closes every connection. Idempotent.
  virtual void Shutdown() = 0;

  // A protection domain. `sink` must outlive the PD (until DeallocatePd
  // returns, after which the sink is never called again).
  virtual absl::StatusOr<PdId> AllocatePd(PdEventSink* sink) = 0;
  // Destroys the PD and everything still in it: connections are closed,
  // MRs deregistered, LAMs released; nothing stays pinned. Unknown PD:
  // NOT_FOUND.
  virtual absl::Status DeallocatePd(PdId pd) = 0;

  // Registers [span) at `base_address` (non-zero) with `access` (AccessBits).
  // Pins the pages. Errors: INVALID_ARGUMENT (zero base, bad span, length
  // over max_mr_size), RESOURCE_EXHAUSTED (pinning or keys), NOT_FOUND (PD),
  // CANCELLED (span.progress said so; nothing stays pinned).
  virtual absl::StatusOr<MrKeys> RegisterMr(PdId pd, const MemorySpan& span,
                                            uint64_t base_address,
                                            uint32_t access) = 0;
  // Revokes the keys (no peer access succeeds after this returns), then
  // unpins. NOT_FOUND for unknown MRs.
  virtual absl::Status DeregisterMr(MrId mr) = 0;

  // Pins [span) and maps its pages into the device's logical address space
  // (L1-L5). On failure (CANCELLED included) nothing stays pinned or mapped
  // (L7).
  virtual absl::StatusOr<LogicalMapping> BuildLam(PdId pd,
                                                  const MemorySpan& span) = 0;
  // Unmaps and unpins. FAILED_PRECONDITION while a fast-registered MR maps
  // any of its pages; NOT_FOUND for unknown LAMs.
  virtual absl::Status ReleaseLam(LamId lam) = 0;

  // An MR object for fast registration (C1), initially free (no mapping, no
  // valid token). `allow_remote` = may be fast-registered with remote access
  // (F4).
  virtual absl::StatusOr<MrKeys> AllocateFastRegisterMr(PdId pd,
                                                        bool allow_remote,
                                                        uint32_t max_pages) = 0;
  // Destroys it, invalidating any mapping at once.
  virtual absl::Status FreeFastRegisterMr(MrId mr) = 0;
  // The MR's current keys (NDK_FN_GET_REMOTE_TOKEN_FROM_MR, F5): after a fast
  // registration, its new rkey. NOT_FOUND for unknown MRs.
  virtual absl::StatusOr<MrKeys> QueryMr(MrId mr) const = 0;

  // A secret with which a peer connects to this PD on the peer path. Valid
  // until the PD is deallocated; any number of connections may use it.
  virtual absl::StatusOr<std::string> CreatePeerTicket(PdId pd) = 0;

  // Posts on a connection of the MR's PD. Returns the work-request id; the
  // completion goes to the PD's sink (successes only without
  // kWorkSilentSuccess). Errors now: FAILED_PRECONDITION (connection unknown,
  // closed, in error, or of another PD), INVALID_ARGUMENT (page array names
  // pages not mapped in this PD, misaligned, too long for the MR),
  // PERMISSION_DENIED (remote access on an MR allocated without it),
  // NOT_FOUND (MR).
  virtual absl::StatusOr<uint64_t> PostFastRegister(
      ConnectionId connection, const FastRegisterWork& work) = 0;
  virtual absl::StatusOr<uint64_t> PostInvalidate(
      ConnectionId connection, const InvalidateWork& work) = 0;

  // What this device does in a live handover (device_handover.h). The
  // default is a device that cannot hand over: every call is refused with
  // CanHandOver's error.
  virtual DeviceHandover& handover();
};

}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_DEVICE_H_
