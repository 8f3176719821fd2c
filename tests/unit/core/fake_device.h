// FakeDevice: an in-memory, deterministic device::Device for unit tests of the
// core (and of anything above it). It keeps the device's bookkeeping exactly
// (PDs, MRs with keys, LAMs with logical pages, fast-register MR states, peer
// tickets and connections, posted work) and enforces what device.h says the
// device enforces, but pins nothing and moves no data.
//
// Posted work (PostFastRegister, PostInvalidate) is queued and executed by
// RunPostedWork(): from the calling thread (the default, so a test decides
// exactly when completions arrive) or, with
// FakeDeviceOptions::run_work_on_device_thread, on a device-owned thread that
// runs whenever work is queued. Either way the sinks are called with no lock
// of the fake held, never from inside a Device method, and never for a PD
// after DeallocatePd(pd) has returned (DeallocatePd waits for a delivery to
// that PD that is under way).
//
// Test controls: FailNext(op, status) makes the next call of `op` fail with
// `status` before changing anything; FailNextWork(status) makes the next
// executed work request complete with `status`; SetDelay(op, d) makes every
// call of `op` sleep `d` (without any lock held) to widen race windows;
// ConnectPeer / ConnectPeerWithTicket / DisconnectPeer play a remote peer.
//
// Queries describe what the device holds right now, and what a remote peer
// would be able to do with a key (IsKeyValid, PeerAccess).
//
// Thread safety: every method may be called from any thread concurrently.
#ifndef MRD_TESTS_UNIT_CORE_FAKE_DEVICE_H_
#define MRD_TESTS_UNIT_CORE_FAKE_DEVICE_H_

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/device/device.h"

namespace mrd::fake {

struct FakeDeviceOptions {
  uint64_t page_size = 0;  // 0 = the host page size
  uint64_t max_mr_size = uint64_t{1} << 40;
  uint32_t max_page_list_length = 64;
  uint32_t adapter_flags = 0;
  // Execute posted work on a device thread instead of in RunPostedWork().
  bool run_work_on_device_thread = false;
};

class FakeDevice final : public device::Device {
 public:
  // Operations that FailNext, SetDelay and Calls address.
  enum class Op {
    kAllocatePd,
    kDeallocatePd,
    kRegisterMr,
    kDeregisterMr,
    kBuildLam,
    kReleaseLam,
    kAllocateFastRegisterMr,
    kFreeFastRegisterMr,
    kCreatePeerTicket,
    kPostFastRegister,
    kPostInvalidate,
  };

  explicit FakeDevice(FakeDeviceOptions options = {});
  ~FakeDevice() override;
  FakeDevice(const FakeDevice&) = delete;
  FakeDevice& operator=(const FakeDevice&) = delete;

  // --- device::Device ---
  const device::DeviceAttributes& Attributes() const override {
    return attributes_;
  }
  device::DeviceHealth Health() const override;
  // Page-rounded bytes of the live MRs plus the live LAMs (each object
  // counted on its own, as the core's limits count them).
  uint64_t PinnedBytes() const override;
  absl::Status Start() override;
  void Shutdown() override;
  absl::StatusOr<device::PdId> AllocatePd(device::PdEventSink* sink) override;
  absl::Status DeallocatePd(device::PdId pd) override;
  absl::StatusOr<device::MrKeys> RegisterMr(device::PdId pd,
                                            const device::MemorySpan& span,
                                            uint64_t base_address,
                                            uint32_t access) override;
  absl::Status DeregisterMr(device::MrId mr) override;
  absl::StatusOr<device::LogicalMapping> BuildLam(
      device::PdId pd, const device::MemorySpan& span) override;
  absl::Status ReleaseLam(device::LamId lam) override;
  absl::StatusOr<device::MrKeys> AllocateFastRegisterMr(
      device::PdId pd, bool allow_remote, uint32_t max_pages) override;
  absl::Status FreeFastRegisterMr(device::MrId mr) override;
  absl::StatusOr<device::MrKeys> QueryMr(device::MrId mr) const override;
  absl::StatusOr<std::string> CreatePeerTicket(device::PdId pd) override;
  absl::StatusOr<uint64_t> PostFastRegister(
      device::ConnectionId connection,
      const device::FastRegisterWork& work) override;
  absl::StatusOr<uint64_t> PostInvalidate(
      device::ConnectionId connection,
      const device::InvalidateWork& work) override;

  // --- test controls ---
  // The next call of `op` returns `status` (queued: several calls fail in
  // order) and changes nothing.
  void FailNext(Op op, absl::Status status) ABSL_LOCKS_EXCLUDED(mu_);
  // The next executed work request completes with `status`.
  void FailNextWork(absl::Status status) ABSL_LOCKS_EXCLUDED(mu_);
  // Every call of `op` sleeps `delay` first, holding no lock.
  void SetDelay(Op op, absl::Duration delay) ABSL_LOCKS_EXCLUDED(mu_);
  void SetHealth(device::DeviceHealth health) ABSL_LOCKS_EXCLUDED(mu_);
  // Every call of `op` from now on waits, holding no lock, until
  // ReleaseCalls(op); AwaitHeldCalls waits (at most `timeout`) until `count`
  // calls wait so. For tests of what must go on while one call is stuck.
  void HoldCalls(Op op) ABSL_LOCKS_EXCLUDED(mu_);
  void ReleaseCalls(Op op) ABSL_LOCKS_EXCLUDED(mu_);
  bool AwaitHeldCalls(Op op, uint64_t count, absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(mu_);

  // A remote peer connects to `pd` (or to the PD of `ticket`): the PD's sink
  // gets OnPeerConnected on this thread. NOT_FOUND for an unknown PD/ticket.
  absl::StatusOr<device::ConnectionId> ConnectPeer(device::PdId pd)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<device::ConnectionId> ConnectPeerWithTicket(
      const std::string& ticket) ABSL_LOCKS_EXCLUDED(mu_);
  // The peer goes away: the sink gets OnPeerDisconnected on this thread.
  // Work still queued on the connection completes with an error (flushed).
  absl::Status DisconnectPeer(device::ConnectionId connection)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Executes every queued work request and delivers its completion. Returns
  // how many work requests were executed. Serialized with itself.
  int RunPostedWork() ABSL_LOCKS_EXCLUDED(mu_, run_mu_);

  // --- queries ---
  size_t LiveMrCount() const;  // registered MRs + fast-register MR objects
  size_t LiveRegisteredMrCount() const;
  size_t LiveFastRegisterMrCount() const;
  size_t LiveLamCount() const;
  size_t LivePdCount() const;
  size_t LiveConnectionCount() const;
  size_t PendingWorkCount() const;
  std::vector<device::PdId> LivePds() const;
  // PD ids are handed out in increasing order: the newest live PD.
  device::PdId NewestPd() const;
  // Calls of `op` so far, failed ones included.
  uint64_t Calls(Op op) const;

  // Whether a remote peer holding `rkey` can reach any memory now.
  bool IsKeyValid(uint32_t rkey) const;
  // What a remote peer gets for an RDMA read (`write` false) or write of
  // [address, address + length) with `rkey`: OK, or PERMISSION_DENIED
  // (bad key, out of bounds, access not granted).
  absl::Status PeerAccess(uint32_t rkey, uint64_t address, uint64_t length,
                          bool write) const;
  // Fast-register MR state, for tests: whether `mr` (a device MR id) is
  // fast-registered right now, and its current rkey.
  bool IsFastRegistered(device::MrId mr) const;
  // Whether every live MR and LAM still describes mapped memory of the file
  // it was made from (R6/L4: registered memory stays there while
  // registered). The error names the first object that does not.
  absl::Status CheckLiveMemory() const;

 private:
  struct PdState {
    device::PdEventSink* sink = nullptr;
    bool dying = false;
    int deliveries_in_flight = 0;
  };
  struct SpanIdentity {
    device::MemorySpan span;
    uint64_t file_device = 0;
    uint64_t file_inode = 0;
  };
  struct MrState {
    device::PdId pd = 0;
    bool fast_register = false;
    uint32_t lkey = 0;
    uint32_t rkey = 0;
    // Registered MRs.
    SpanIdentity memory;
    uint64_t base_address = 0;
    uint64_t length = 0;
    uint32_t access = 0;
    uint64_t pinned_bytes = 0;
    // Fast-register MRs.
    bool allow_remote = false;
    uint32_t max_pages = 0;
    bool fast_registered = false;
    std::vector<device::LamId> mapped_lams;
  };
  struct LamState {
    device::PdId pd = 0;
    SpanIdentity memory;
    std::vector<uint64_t> pages;
    uint64_t pinned_bytes = 0;
  };
  struct ConnectionState {
    device::PdId pd = 0;
    bool connected = true;
  };
  struct Work {
    device::WorkCompletion::Kind kind =
        device::WorkCompletion::Kind::kFastRegister;
    device::ConnectionId connection = 0;
    device::PdId pd = 0;
    uint64_t id = 0;
    device::FastRegisterWork fast_register;
    device::InvalidateWork invalidate;
  };
  struct Delivery {
    device::PdId pd = 0;
    enum class Kind { kCompletion, kConnected, kDisconnected };
    Kind kind = Kind::kCompletion;
    device::WorkCompletion completion;
    device::ConnectionId connection = 0;
    std::string peer;
  };

  // Counts the call, sleeps the configured delay (no lock held) and returns
  // the injected failure, if any.
  absl::Status Enter(Op op) ABSL_LOCKS_EXCLUDED(mu_);
  uint32_t NewKeyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t PageRound(uint64_t address, uint64_t length) const;
  absl::StatusOr<SpanIdentity> CheckSpan(const device::MemorySpan& span) const;
  absl::StatusOr<PdState*> LivePdLocked(device::PdId pd)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Executes one work request; returns the completion to deliver, if any.
  std::optional<device::WorkCompletion> ExecuteLocked(const Work& work)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Calls the PD's sink with `delivery` (no lock held during the call) unless
  // the PD is gone or going.
  void Deliver(const Delivery& delivery) ABSL_LOCKS_EXCLUDED(mu_);
  void DeviceThread();

  const FakeDeviceOptions options_;
  device::DeviceAttributes attributes_;

  mutable absl::Mutex mu_;
  device::DeviceHealth health_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_work_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint32_t next_key_ ABSL_GUARDED_BY(mu_) = 0x1000;
  uint64_t next_logical_page_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<device::PdId, PdState> pds_ ABSL_GUARDED_BY(mu_);
  std::map<device::MrId, MrState> mrs_ ABSL_GUARDED_BY(mu_);
  std::map<device::LamId, LamState> lams_ ABSL_GUARDED_BY(mu_);
  std::map<device::ConnectionId, ConnectionState> connections_
      ABSL_GUARDED_BY(mu_);
  std::map<std::string, device::PdId> tickets_ ABSL_GUARDED_BY(mu_);
  // rkey -> MR, for keys a peer may use right now.
  std::map<uint32_t, device::MrId> valid_rkeys_ ABSL_GUARDED_BY(mu_);
  // Logical page -> LAM.
  std::map<uint64_t, device::LamId> logical_pages_ ABSL_GUARDED_BY(mu_);
  std::deque<Work> work_ ABSL_GUARDED_BY(mu_);
  std::map<Op, std::deque<absl::Status>> failures_ ABSL_GUARDED_BY(mu_);
  std::deque<absl::Status> work_failures_ ABSL_GUARDED_BY(mu_);
  std::map<Op, absl::Duration> delays_ ABSL_GUARDED_BY(mu_);
  std::map<Op, uint64_t> calls_ ABSL_GUARDED_BY(mu_);
  std::set<Op> held_ ABSL_GUARDED_BY(mu_);                  // HoldCalls
  std::map<Op, uint64_t> held_calls_ ABSL_GUARDED_BY(mu_);  // waiting now
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;

  // Serializes RunPostedWork so that completions of one PD stay in order.
  absl::Mutex run_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::thread thread_;
};

}  // namespace mrd::fake

#endif  // MRD_TESTS_UNIT_CORE_FAKE_DEVICE_H_
