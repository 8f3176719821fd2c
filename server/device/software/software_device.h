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
// * The device model (device_model.h) holds the PD, MR, LAM and connection
//   tables, the work queue and its ordering, and the NIC's checks of a peer
//   request (BeginPeerAccess); this provider adds pinning, keys and the TCP
//   peer path.
// * Revocation vs. peers in flight: a peer op finds the MR its key names and
//   takes an in-flight reference on it through the model, then does its I/O
//   without any lock; revoking waits for those references (device_model.h).
// * Threads: a fixed set, whatever the number of peer connections: the peer
//   listener's reactor and its worker pool (peer_listener.h), which run
//   HandleRequest one frame at a time per connection, and the model's
//   worker. This connection issues no RDMA reads of its own for a
//   READ_FENCE to wait on.
// * Pinning (pin_tracker.h) happens outside the device mutex, since mlock
//   faults every page in.
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
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mrd/v1/peer.pb.h"
#include "server/device/device.h"
#include "server/device/device_model.h"
#include "server/device/fault_points.h"
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

class SoftwareDevice;

struct SoftwareDeviceOptions {
  // Numeric host:port for the peer listener; port 0 picks a free one, which
  // Attributes().peer_address then reports.
  std::string peer_listen_address = "127.0.0.1:0";
  // Handover: a TCP socket already bound and listening (the old process's
  // device's StopPeerAccepting), which the peer listener uses instead of
  // binding peer_listen_address (then ignored); Attributes().peer_address
  // is its bound address. Not owned: Create duplicates it, so the caller
  // closes its own fd whenever it likes. -1: bind as usual.
  int inherited_peer_listener = -1;
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
  // The device's name (DeviceAttributes::name): mrd runs several software
  // devices as "software", "software1", ... (--software_devices).
  std::string name = "software";
  // The NUMA node it reports (DeviceAttributes::numa_node): -1, none; tests
  // place devices on nodes to choose the nearest.
  int32_t numa_node = -1;
  // DeviceModelOptions::connection_id_base.
  uint64_t connection_id_base = 0;
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
  // Another software device whose pins this one shares: a page either
  // registers is pinned once, and stays pinned while either holds it (the
  // software devices of one mrd all share the first's). Its pin options,
  // pin_ops and fault points for pins apply, not these. Not owned; what
  // they share lives as long as either device.
  const SoftwareDevice* share_pins_with = nullptr;
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

class SoftwareDevice final : public DeviceModel {
 public:
  // Validates `options` (INVALID_ARGUMENT "BAD_OPTION"), binds and listens
  // on the peer address (errors of ListenTcp), or takes the inherited
  // listener (INVALID_ARGUMENT "BAD_PEER_LISTENER" when it is not a
  // listening TCP socket). Threads start in Start().
  static absl::StatusOr<std::unique_ptr<SoftwareDevice>> Create(
      const SoftwareDeviceOptions& options);
  // Shutdown(), then releases whatever PDs are left (nothing stays pinned),
  // without calling their sinks.
  ~SoftwareDevice() override;

  DeviceHealth Health() const override;
  uint64_t PinnedBytes() const override;
  // Empties the io_uring slots of what the batch unpins together (its own
  // KernelPinOps only; a device given `pin_ops` combines nothing).
  std::unique_ptr<DeviceBatch> BeginBatch() override;
  // Pins the span in io_uring slots of kBatchPinPieceBytes (not for huge
  // pages, which take one pin whatever their length).
  std::unique_ptr<BatchPin> PinForBatch(const MemorySpan& span) override;
  // The slots of PinForBatch: releasing one item's pages re-pins at most
  // the rest of its slot (within a DeregisterMrBatch, nothing).
  static constexpr uint64_t kBatchPinPieceBytes = uint64_t{64} << 10;

  // What the device holds right now, for leak checks in tests.
  // The model's counts, and the key table's.
  struct ResourceCounts : ModelCounts {
    size_t keys = 0;             // key-table slots in use (MRs and LAMs)
    size_t key_slots_grown = 0;  // key-table slots allocated (lazily)
  };
  ResourceCounts CountResources() const;

  // The peer path's gauges, counters and limits (for metrics and tests).
  struct PeerPathStats {
    PeerListenerStats listener;
    uint64_t max_session_connections = 0;
    uint64_t session_limit_refusals = 0;  // hellos refused: PD at its cap
  };
  PeerPathStats PeerStats() const;

 protected:
  // Handover: every object of this device is its key (lkey == rkey) and
  // model state, so another process's software device can re-create it:
  // ProviderCanHandOver is OK. AdoptMr, AdoptLam and AdoptFastRegisterMr claim
  // exactly the key (KeyTable::Claim; INVALID_ARGUMENT "BAD_KEY" when
  // lkey != rkey or the key names no slot of this table,
  // FAILED_PRECONDITION "KEY_IN_USE" when held); an adopted
  // fast-registered MR object needs nothing else, since its mapping is
  // the model's page array and its key.
  // StopPeerAccepting hands over the peer listener's socket
  // (PeerListener::StopAccepting; FAILED_PRECONDITION
  // "PEER_LISTENER_STOPPED" once shut down), and a device created with it
  // as options.inherited_peer_listener accepts on the same address.
  // DuplicatePeerListener gives the same socket without stopping
  // (PeerListener::DuplicateSocket).
  absl::Status ProviderCanHandOver() const override;
  // PeerStats, as the device's peer path gauges.
  std::optional<PeerPathCounts> ProviderPeerPath() const override;
  absl::StatusOr<UniqueFd> ProviderStopPeerAccepting() override;
  absl::StatusOr<UniqueFd> ProviderDuplicatePeerListener() override;
  void ProviderResumePeerAccepting() override;
  // Established connections move too (PeerListener::FreezeConnections):
  // those past hello in a ready state (DeviceModel::MovableConnection).
  // Adopted ones wait in adopting_ until ThawPeers gives them to the model
  // and the listener, so a takeover that fails before commit never shuts
  // down a socket the old process still serves.
  absl::StatusOr<std::vector<HandedOverPeer>> ProviderFreezePeers(
      absl::Duration timeout) override;
  void ProviderThawPeers() override;
  void ProviderDropFrozenPeers() override;
  absl::Status ProviderAdoptPeer(PdId pd, HandedOverPeer peer) override;

  absl::Status ProviderStart() override;
  void ProviderStop() override;
  absl::Status ProviderPin(const MemorySpan& span) override;
  void ProviderUnpin(const MemorySpan& span) override;
  absl::StatusOr<Registration> ProviderRegister(ProviderState* pd,
                                                const MemorySpan& span,
                                                uint64_t iova, uint32_t access,
                                                uint64_t owner,
                                                bool lam) override;
  absl::StatusOr<Registration> ProviderAdoptRegister(
      ProviderState* pd, const MemorySpan& span, uint64_t iova, uint32_t access,
      uint64_t owner, uint32_t lkey, uint32_t rkey, bool lam) override;
  absl::StatusOr<Registration> ProviderAdoptFastMr(ProviderState* pd,
                                                   MrId owner, uint32_t lkey,
                                                   uint32_t rkey) override;
  absl::Status ProviderDeregisterKey(uint32_t lkey) override;
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
  struct Key;   // a ProviderState: one key of the key table
  struct Peer;  // one TCP connection of the peer path

  // The pins a device makes, shared with the devices that share them.
  struct Pins {
    Pins(uint64_t page_size, PinOps* ops, std::unique_ptr<KernelPinOps> own,
         FaultPoints* faults)
        : own_ops(std::move(own)),
          tracker(page_size, ops != nullptr ? ops : own_ops.get(), faults) {}
    // Before tracker, which uses it (when no PinOps was given).
    const std::unique_ptr<KernelPinOps> own_ops;
    PinTracker tracker;
  };

  SoftwareDevice(const SoftwareDeviceOptions& options, DeviceModelOptions model,
                 DeviceAttributes attributes,
                 std::unique_ptr<PeerListener> listener,
                 std::shared_ptr<Pins> pins);

  // A new key owned by `owner`; with a Key object as the registration's
  // state (LAMs and MR objects, whose key the object carries and a fast
  // registration reissues) or without (an MR: ProviderDeregisterKey).
  absl::StatusOr<Registration> NewKey(uint32_t owner, bool with_object)
      ABSL_LOCKS_EXCLUDED(keys_mu_);
  // NewKey with exactly `lkey` (== `rkey`: one key per object), another
  // process's key (KeyTable::Claim). `call` names the adoption in errors.
  absl::StatusOr<Registration> ClaimKey(absl::string_view call, uint32_t lkey,
                                        uint32_t rkey, uint32_t owner,
                                        bool with_object)
      ABSL_LOCKS_EXCLUDED(keys_mu_);

  // Peer path: open and close on the listener's reactor, frames on its
  // workers, one at a time per connection.
  std::shared_ptr<Peer> OpenConnection(int fd, const std::string& remote);
  PeerListener::Verdict HandleFrame(const std::shared_ptr<Peer>& peer,
                                    absl::StatusOr<std::string> body,
                                    std::string* out);
  // Fills `response`; false = close the connection after sending it.
  bool HandleRequest(const std::shared_ptr<Peer>& peer,
                     const v1::PeerRequest& request,
                     v1::PeerResponse* response);
  bool HandleHello(const std::shared_ptr<Peer>& peer,
                   const v1::PeerHello& hello, v1::PeerResponse* response);
  bool HandleData(const std::shared_ptr<Peer>& peer,
                  const v1::PeerRequest& request, v1::PeerResponse* response);
  void CloseConnection(const std::shared_ptr<Peer>& peer);

  const SoftwareDeviceOptions options_;
  const std::shared_ptr<Pins> pins_;
  const std::unique_ptr<PeerListener> listener_;

  mutable absl::Mutex keys_mu_;
  SecureRandomPool random_ ABSL_GUARDED_BY(keys_mu_);
  KeyTable keys_ ABSL_GUARDED_BY(keys_mu_);
  // Sockets of the connections the model knows, to shut them down when
  // their PD goes (ProviderCloseConnectionsLocked).
  absl::flat_hash_map<ConnectionId, int> sockets_ ABSL_GUARDED_BY(mu_);
  // Connections AdoptPeer took, for ThawPeers.
  std::vector<HandedOverPeer> adopting_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_SOFTWARE_SOFTWARE_DEVICE_H_
