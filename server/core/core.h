// Core: mrd's domain logic, free of gRPC. It owns the sessions and everything
// they hold (buffers, registrations through the cache, LAMs, MR objects, peer
// connections, completion queues), validates every seed rule that does not
// depend on the device, enforces limits, and drives the device.
//
// Core itself keeps the sessions (session_table.h) and their buffers, and
// hands each request to the part that owns its resource: registrations
// and the cache to Registrations (registrations.h), LAMs, MR objects and
// fast registration to FastRegistration (fast_registration.h), limits and
// quotas to Budgets (budgets.h).
//
// The gRPC service layer (server/service) is a thin adapter over these
// methods; the fd socket (server/fd_socket/FdServer) calls the FdSessionHandler
// methods. Each RPC-shaped method takes the request message and fills the
// response, returning OK or a status built with SeedError/MrdError.
//
// Thread safety: every public method may be called from any thread. Locking:
// the session table (session_table.h) and the budgets (budgets.h) have their
// own mutexes; each Session has its own mutex. No lock of
// the core is held while calling the device (the device may call the event
// sinks on its own threads at any time), and the cache's lock is never held
// across device calls either.
#ifndef MRD_SERVER_CORE_CORE_H_
#define MRD_SERVER_CORE_CORE_H_

#include <sys/stat.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mrd/unique_fd.h"
#include "mrd/v1/handover.pb.h"
#include "mrd/v1/mrd.pb.h"
#include "server/cache/registration_cache.h"
#include "server/cache/warm_pins.h"
#include "server/common/clock.h"
#include "server/common/fd_budget.h"
#include "server/common/memory.h"
#include "server/common/thread.h"
#include "server/core/budgets.h"
#include "server/core/fast_registration.h"
#include "server/core/progress_reporter.h"
#include "server/core/publications.h"
#include "server/core/registrations.h"
#include "server/core/session.h"
#include "server/core/session_table.h"
#include "server/core/tenants.h"
#include "server/device/device.h"
#include "server/device/device_handover.h"
#include "server/fd_socket/fd_server.h"

namespace mrd::core {

struct CoreOptions {
  // Shared-memory directory for ImportFile (lease sessions); empty = off.
  std::string shm_dir;
  std::vector<uint32_t> allowed_uids;  // owners allowed for ImportFile files
  absl::Duration default_lease_ttl = absl::Seconds(60);
  absl::Duration max_lease_ttl = absl::Hours(24);
  uint64_t max_sessions = 1024;
  uint64_t max_buffers_per_session = 4096;
  uint64_t max_buffer_size = uint64_t{1} << 40;
  uint64_t max_session_pinned_bytes = uint64_t{4} << 30;
  uint64_t max_total_pinned_bytes = uint64_t{16} << 30;
  uint64_t max_session_registrations = 65536;
  uint64_t max_total_registrations = uint64_t{1} << 20;
  uint64_t max_session_lams = 65536;
  uint64_t max_session_mrs = 65536;
  // Server-wide caps beside the totals above: buffers (each holds an fd and
  // a mapping), LAMs and MR objects (each holds a device key).
  uint64_t max_total_buffers = 32768;
  uint64_t max_total_lams = 262144;
  uint64_t max_total_mrs = 262144;
  // Tenants (server/core/tenants.h): their quotas. Null = every tenant may
  // use everything (the library default; mrd builds one from its flags).
  std::shared_ptr<TenantTable> tenants;
  // What an fd session's tenant is keyed by (--tenant_key): its pod, its
  // container, or its uid; a caller in no pod or container is its uid.
  TenantKeyKind tenant_key = TenantKeyKind::kPod;
  // The kubelet's pod log directory, where a pod's "<namespace>/<name>" is
  // found when the tenants file names pods so (KubeletPodName).
  std::string kubelet_pod_logs_dir = "/var/log/pods";
  // Who an anonymous lease session (no vouching fd session) may be: anyone
  // who can reach the gRPC socket. ImportFile opens for it only files such
  // a caller could open itself. kAnyone: only what "other" may open;
  // kGroupMember: what a member of group `anonymous_id` may (not owner);
  // kUser: what uid `anonymous_id` may (the socket is owner-only).
  enum class Reach { kAnyone, kGroupMember, kUser };
  Reach anonymous_reach = Reach::kAnyone;
  uint32_t anonymous_id = 0;
  // Warm pins (server/cache/warm_pins.h): pages of released registrations
  // kept pinned, without any key, so that registering the same range again
  // pins nothing anew. Bytes per session and in total; they count towards
  // the pinned-bytes limits and are evicted before those refuse anything.
  // 0 in either disables warm pins (the library default; mrd's flags turn
  // them on).
  uint64_t warm_pin_bytes_per_session = 0;
  uint64_t warm_pin_bytes_total = 0;
  // RegistrationOptions::parallel_devices_min_bytes.
  uint64_t parallel_devices_min_bytes =
      RegistrationOptions{}.parallel_devices_min_bytes;
  size_t completion_queue_depth = 65536;
  size_t request_id_memory = 4096;  // idempotency keys remembered per session
  // Items in one RegisterMrBatch or DeregisterMrBatch.
  size_t max_batch_items = 4096;
  // When long registrations report their progress (progress_reporter.h).
  ProgressOptions progress;
  // fd budget (docs/RELIABILITY.md, "File descriptors"): each imported
  // buffer's fd is charged to its session here. Not owned; null = none.
  FdBudget* fd_budget = nullptr;
};

// Tenant settings as the administrative call and the handover carry them:
// INVALID_ARGUMENT BAD_TENANT_RESOURCE for an unknown resource name.
absl::StatusOr<TenantSettings> TenantSettingsFromProto(
    const google::protobuf::RepeatedPtrField<v1::TenantQuotaValue>& quotas,
    uint32_t weight);

// One device as the core sees it now.
struct DeviceState {
  std::string name;
  bool healthy = true;
  std::string message;  // the device's own (why it is unhealthy)
  uint64_t pinned_bytes = 0;
};

struct CoreStats {
  uint64_t sessions = 0;
  uint64_t fd_sessions = 0;
  uint64_t lease_sessions = 0;
  uint64_t buffers = 0;
  uint64_t registrations = 0;
  uint64_t lams = 0;
  uint64_t mrs = 0;
  uint64_t connections = 0;
  uint64_t accounted_pinned_bytes = 0;  // limits' view (page-rounded)
  uint64_t device_pinned_bytes = 0;     // the device's own count
  uint64_t sessions_opened_total = 0;
  uint64_t sessions_closed_total = 0;
  uint64_t completions_dropped_total = 0;
  cache::CacheStats cache;
  cache::WarmPinStats warm;
};

// Live handover, the new process: the buffers of the old process's prepare
// frame (a snapshot taken while it still served), mapped by buffer id, with
// the page tables of their registered memory filled on the prefault threads
// — the longest part of adopting them, done before the old process pauses.
// A buffer whose fd cannot be mapped is left out (the snapshot's copy is
// mapped instead). With `device`, every registration, LAM and warm pin of
// a prepared buffer is also pinned ahead (Device::PinAhead), on a thread
// of its own while the next buffers' page tables fill, so that adopting
// them in the pause takes these pins over instead of pinning; a pin that
// fails is left to the adoption (which pins, or refuses, as before). The
// caller drops what no adoption took (Device::DropPinsAhead) before the
// prepared buffers are unmapped.
using PreparedBuffers =
    absl::flat_hash_map<uint64_t, std::unique_ptr<fd_socket::MappedFile>>;
PreparedBuffers PrepareBuffers(const v1::HandoverSnapshot& prepare,
                               std::vector<UniqueFd>& fds,
                               device::Device* device);

// The most devices one core serves.
inline constexpr uint32_t kMaxDevices = cache::kMaxCacheDevices;

class Core final : public fd_socket::FdSessionHandler {
 public:
  // `device` and `clock` must outlive the core; the device must be Started.
  Core(device::Device* device, const Clock* clock, CoreOptions options);
  // The same with several devices (at most cache::kMaxCacheDevices): every
  // session has a PD on each; registrations go on the devices they name
  // (all or none), everything else on the first.
  Core(std::vector<device::Device*> devices, const Clock* clock,
       CoreOptions options);
  ~Core() override;
  Core(const Core&) = delete;
  Core& operator=(const Core&) = delete;

  // Called with an fd session's token when the session ends other than by
  // its socket closing (CloseSession), so that the fd socket is hung up too.
  // Set before the gRPC server starts; must be thread-safe, must not block.
  void SetFdHangup(std::function<void(const std::string&)> hangup) {
    fd_hangup_ = std::move(hangup);
  }

  // Runs the teardown of a session that ended by its fd socket's hang-up or
  // its lease's expiry, later and on another thread: `teardown` releases
  // everything the session holds, `pinned_bytes` of pinned memory among it,
  // and is owed to `tenant` (the fair scheduler's queue of that tenant, in
  // mrd). Without a runner (the default) the teardown runs on the thread
  // that noticed the end: the fd socket's thread, which every tenant's
  // connects and imports wait for, or the lease reaper. Must not block, and
  // must run every teardown it is given.
  using TeardownRunner = std::function<void(
      const std::shared_ptr<Tenant>& tenant, uint64_t pinned_bytes,
      absl::AnyInvocable<void() &&> teardown)>;
  // Sets (or, with nullptr, clears) the runner, after waiting until every
  // teardown given to the one before has run. Until its teardown has run, a
  // session stays in the table, closing: its calls are refused
  // WSAENOTCONN "the session is closing" and what it holds still counts.
  void SetTeardownRunner(TeardownRunner runner)
      ABSL_LOCKS_EXCLUDED(teardown_mu_);
  // Waits, at most `timeout`, until no teardown given to the runner is
  // waiting or running. True when none is.
  bool AwaitTeardowns(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(teardown_mu_);

  // Starts the lease reaper and progress reporter threads. Errors:
  // THREAD_FAILED.
  absl::Status Start();
  // Ends every session (releasing everything) and refuses new ones. Idempotent.
  void Shutdown();

  // --- FdSessionHandler (called on the fd socket thread) ---
  absl::StatusOr<std::string> OnConnect(
      const fd_socket::PeerCredentials& creds) override;
  absl::StatusOr<v1::BufferInfo> OnImport(
      const std::string& session, UniqueFd fd,
      const v1::ImportMemfd& request) override;
  void OnDisconnect(const std::string& session) override;

  // --- RPCs ---
  absl::Status GetDeviceInfo(v1::DeviceInfo* out) const;
  // Every device now, in order.
  std::vector<DeviceState> DeviceStates() const;
  // The devices whose health changed since the last call (every device, on
  // the first): each change is logged and, after the first call, told to
  // every session (a DEVICE_HEALTH completion naming the device).
  std::vector<DeviceState> TakeDeviceHealthChanges()
      ABSL_LOCKS_EXCLUDED(health_mu_);
  absl::Status OpenLeaseSession(const v1::OpenLeaseSessionRequest& req,
                                v1::SessionInfo* out);
  absl::Status GetSession(const v1::GetSessionRequest& req,
                          v1::SessionInfo* out);
  absl::Status SetDefaultDevices(const v1::SetDefaultDevicesRequest& req,
                                 v1::SessionInfo* out);
  absl::Status CloseSession(const v1::CloseSessionRequest& req);
  absl::Status ImportFile(const v1::ImportFileRequest& req,
                          v1::BufferInfo* out);
  absl::Status ReleaseBuffer(const v1::ReleaseBufferRequest& req,
                             v1::ReleaseBufferResponse* out);
  // The bytes a call would unmap or unpin, for the fair scheduler's cost
  // (0 when the session or buffer is unknown: the call fails cheaply).
  // ReleaseBuffer: the buffer's mapping; CloseSession: the session's pins.
  uint64_t ReleaseBufferBytes(const v1::ReleaseBufferRequest& req);
  uint64_t CloseSessionBytes(const v1::CloseSessionRequest& req);
  absl::Status CreateMr(const v1::CreateMrRequest& req, v1::MrInfo* out);
  absl::Status CloseMr(const v1::CloseMrRequest& req);
  // `cancelled` (optional): the call's caller gave up (Registrations::
  // Register); RegisterMrBatch then stops before its next item.
  absl::Status RegisterMr(const v1::RegisterMrRequest& req,
                          v1::RegisterMrResponse* out,
                          const CancelCheck& cancelled = nullptr);
  absl::Status DeregisterMr(const v1::DeregisterMrRequest& req,
                            v1::DeregisterMrResponse* out);
  // RegisterMr / DeregisterMr when they can be answered without blocking
  // (a cache hit; a deregistration that leaves references; an error found
  // before anything is pinned): nullopt when they cannot, and the caller
  // must call RegisterMr / DeregisterMr on a thread that may block. For the
  // last reference, `last_bytes` (if given) gets the registration's length,
  // the work DeregisterMr will do (the fair scheduler's cost).
  std::optional<absl::Status> TryRegisterMrHit(const v1::RegisterMrRequest& req,
                                               v1::RegisterMrResponse* out);
  // RegisterMr of at most kInlineRegisterBytes (publishing a name or not),
  // made on the calling thread (a gRPC thread: pinning a few pages costs less
  // than the hop to a worker) while the session's tenant has fewer than
  // kInlinePerTenant such calls running; nullopt otherwise (a worker's).
  // TryDeregisterMrSmall: the same for the last reference of a registration
  // of at most kInlineRegisterBytes (`last_bytes`, from
  // TryDeregisterMrNotLast) that no name of the session is published for.
  static constexpr uint64_t kInlineRegisterBytes = 64 << 10;
  static constexpr int kInlinePerTenant = 2;
  std::optional<absl::Status> TryRegisterMrSmall(
      const v1::RegisterMrRequest& req, v1::RegisterMrResponse* out);
  std::optional<absl::Status> TryDeregisterMrSmall(
      const v1::DeregisterMrRequest& req, v1::DeregisterMrResponse* out,
      uint64_t last_bytes);
  std::optional<absl::Status> TryDeregisterMrNotLast(
      const v1::DeregisterMrRequest& req, v1::DeregisterMrResponse* out,
      uint64_t* last_bytes = nullptr);
  absl::Status RegisterMrBatch(const v1::RegisterMrBatchRequest& req,
                               v1::RegisterMrBatchResponse* out,
                               const CancelCheck& cancelled = nullptr);
  absl::Status DeregisterMrBatch(const v1::DeregisterMrBatchRequest& req,
                                 v1::DeregisterMrBatchResponse* out);
  absl::Status BuildLam(const v1::BuildLamRequest& req,
                        v1::BuildLamResponse* out,
                        const CancelCheck& cancelled = nullptr);
  absl::Status ReleaseLam(const v1::ReleaseLamRequest& req);
  absl::Status FastRegister(const v1::FastRegisterRequest& req,
                            v1::FastRegisterResponse* out);
  absl::Status InvalidateMr(const v1::InvalidateMrRequest& req,
                            v1::InvalidateMrResponse* out);
  absl::Status CreatePeerTicket(const v1::CreatePeerTicketRequest& req,
                                v1::PeerTicket* out);
  // The directory (publications.h); FAILED_PRECONDITION DIRECTORY_OFF
  // until SetDirectory.
  void SetDirectory(directory::Publisher* publisher, DirectoryOptions options) {
    publications_.Configure(publisher, std::move(options));
  }
  const Publications& publications() const { return publications_; }
  // After a handover (or a failed one), with the publisher of the lease
  // handed over: every session's names are written again.
  void RepublishDirectory() { publications_.RepublishAll(sessions_.All()); }
  absl::Status Publish(const v1::PublishRequest& req, v1::PublishedEntry* out);
  absl::Status Unpublish(const v1::UnpublishRequest& req,
                         v1::UnpublishResponse* out);
  absl::Status ListPublished(const v1::ListPublishedRequest& req,
                             v1::ListPublishedResponse* out);
  absl::Status Resolve(const v1::ResolveRequest& req, v1::PublishedEntry* out);
  absl::StatusOr<std::unique_ptr<Publications::NameWatch>> WatchName(
      const v1::ResolveRequest& req, Publications::NameEventCallback on_event);

  absl::Status ListRegistrations(const v1::ListRegistrationsRequest& req,
                                 v1::ListRegistrationsResponse* out);

  // Completion stream: attaches `notify` (called, on any thread, whenever a
  // completion is queued or the session ends; must not block) and returns
  // the session to pop from with the stream's number. One stream per
  // session at a time: a new one takes over, and the one before is
  // notified to find itself replaced (Session::Subscribe). Detach with the
  // returned handle.
  absl::StatusOr<CompletionSubscription> SubscribeCompletions(
      const std::string& token, std::function<void()> notify);
  void UnsubscribeCompletions(const CompletionSubscription& subscription);

  // The tenant whose queue a request naming session `token` waits in (the
  // fair scheduler in front of the workers); null for no live session.
  // Renews nothing.
  std::shared_ptr<Tenant> TenantOfSession(const std::string& token) const;

  // Forgets the tenants that hold nothing and no session refers to
  // (TenantTable::Prune); their names.
  std::vector<std::string> PruneTenants() { return tenants_->Prune(); }

  // The administrative calls (the TenantAdmin service; the caller was
  // proven to be root or mrd's own uid).
  absl::Status ListTenants(v1::ListTenantsResponse* out) const;
  absl::Status SetTenant(const v1::SetTenantRequest& req, v1::TenantInfo* out);
  absl::Status ClearTenant(const v1::ClearTenantRequest& req,
                           v1::TenantInfo* out);

  CoreStats Stats() const;
  // Every tenant seen so far, for metrics.
  std::vector<std::shared_ptr<Tenant>> Tenants() const {
    return tenants_->All();
  }
  const device::DeviceAttributes& attributes() const {
    return device_->Attributes();
  }

  // --- Handover (core/handover.cc; server/handover drives it) ---
  // The sessions and everything they hold, for a new mrd process: into
  // `out` (its sessions, id sequences and counters), with a duplicate of
  // each buffer's fd appended to `fds` (the snapshot names them by index).
  // The caller has stopped every request first, so nothing changes
  // meanwhile but peer work completing. Errors: UNAVAILABLE HANDOVER_BUSY
  // (an MR object has fast-register or invalidate work in flight on a peer
  // connection: those connections do not move; try again once it
  // completed), HANDOVER_FD (dup failed).
  absl::Status ExportState(v1::HandoverSnapshot* out,
                           std::vector<UniqueFd>* fds);
  // After ExportState: the peer connections the device froze
  // (Device::FreezePeers), each added to its session in `out` with its
  // socket appended to `fds`. A connection of a session not in `out` is
  // left out (it closes with this process).
  // `peers` by the core's device index.
  absl::Status ExportPeers(
      std::vector<std::vector<device::DeviceHandover::HandedOverPeer>> peers,
      v1::HandoverSnapshot* out, std::vector<UniqueFd>* fds);
  // The core's devices, in order (the handover's participant serves each).
  const std::vector<device::Device*>& devices() const { return devices_; }
  // Takes over the sessions of `in`: maps each buffer from `fds`, registers
  // each registration on the device with the keys it had, and restores
  // references, request ids, queued completions, leases and tickets, all
  // charged to the budgets whatever the limits say. Before any request is
  // served. On error, every session adopted so far is released again and
  // the error returned.
  // `prepared` (may be null): buffers PrepareBuffers mapped from the
  // prepare frame; each the snapshot names again (same id, same file) is
  // taken from there.
  absl::Status AdoptState(const v1::HandoverSnapshot& in,
                          std::vector<UniqueFd>& fds,
                          PreparedBuffers* prepared = nullptr);

  // Holds (or lets go) every session's completion stream while a handover
  // exports them; MarkHandedOver ends them with UNAVAILABLE HANDED_OVER.
  void HoldStreams(bool hold);
  void MarkHandedOver();

  // Reaps expired lease sessions now (the reaper thread calls this).
  void ReapExpiredLeases();

 private:
  absl::StatusOr<std::shared_ptr<Session>> NewSession(SessionKind kind,
                                                      const Identity& identity);
  // A PD for `session` on every device (each with its SinkFor), or none:
  // the first refusal deallocates the ones made.
  absl::StatusOr<std::vector<device::PdId>> AllocatePds(Session& session);
  // May the owner of `session` open a file with this owner, group and mode
  // for reading (and writing)? PERMISSION_DENIED "IDENTITY_DENIES_ACCESS"
  // naming who the session is and what the mode allows, otherwise.
  absl::Status CheckFileAccess(const Session& session, const struct stat& st,
                               bool writable) const;
  // Finds a live session by token and renews its lease.
  absl::StatusOr<std::shared_ptr<Session>> FindSession(
      const std::string& token);
  // Removes the session from the table and releases everything it holds.
  void EndSession(const std::string& token, absl::string_view why);
  void TearDown(const std::shared_ptr<Session>& session);
  // Ends the session through the teardown runner, if there is one: it is
  // marked closing at once and leaves the table once released.
  void EndSessionSoon(const std::string& token, absl::string_view why)
      ABSL_LOCKS_EXCLUDED(teardown_mu_);
  // Marks the session closing; false if it was already. Then, once:
  // ReleaseClosing releases everything it holds.
  static bool MarkClosing(Session& session);
  void ReleaseClosing(const std::shared_ptr<Session>& session);

  // Where AdoptState's time went, for its log line.
  struct AdoptTimes {
    absl::Duration prefault;       // PrefaultRuns
    absl::Duration registrations;  // adopting them one by one (pins)
  };
  // AdoptState for one session.
  absl::Status AdoptSession(const v1::HandedOverSession& in,
                            std::vector<UniqueFd>& fds,
                            PreparedBuffers* prepared, AdoptTimes* times);
  // Before AdoptSession adopts the session's registrations (each pins its
  // own pages): the registered memory of each of its buffers, in runs
  // (registrations that overlap or touch), prefaulted on several threads
  // (MappedFile::Prefault), so that the pins walk filled page tables
  // instead of faulting every page in one at a time on one thread. Runs
  // the buffer does not hold are left to the adoption, which refuses them.
  void PrefaultRuns(Session& session, const v1::HandedOverSession& in,
                    AdoptTimes* times);
  // The session's LAMs and MR objects, after its buffers and registrations
  // (AdoptSession): the LAMs at the logical addresses and with the
  // privileged keys they had, then the MR objects with their keys (and a
  // fast-register one's mapping over those LAMs).
  absl::Status AdoptLams(Session& session, const std::vector<device::PdId>& pds,
                         const v1::HandedOverSession& in);
  absl::Status AdoptMrObjects(Session& session,
                              const std::vector<device::PdId>& pds,
                              const v1::HandedOverSession& in);
  // The device a handed-over LAM, MR object or peer connection names by
  // index. Errors: INVALID_ARGUMENT HANDOVER_UNKNOWN_DEVICE.
  absl::StatusOr<device::Device*> HandedOverDevice(uint32_t index,
                                                   absl::string_view what,
                                                   uint64_t id) const;
  // ExportState for one session's LAMs and MR objects. The fast-register
  // MR objects' device state is asked of the device first, outside the
  // session's lock (DescribeFastMrs).
  using FastMrStates =
      absl::flat_hash_map<uint64_t, device::DeviceHandover::FastMrState>;
  absl::StatusOr<FastMrStates> DescribeFastMrs(Session& session);
  static absl::Status ExportFastRegistrationLocked(const Session& session,
                                                   const FastMrStates& fast,
                                                   v1::HandedOverSession* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu);

  // RegisterMr for a found session, and its publish_name: a registration
  // that cannot be published is undone.
  absl::Status RegisterAndPublish(const std::shared_ptr<Session>& session,
                                  const v1::RegisterMrRequest& req,
                                  v1::RegisterMrResponse* out,
                                  const CancelCheck& cancelled);
  // A batch's session, after checking its size against max_batch_items.
  absl::StatusOr<std::shared_ptr<Session>> FindBatchSession(
      const std::string& token, size_t items);
  absl::StatusOr<v1::BufferInfo> AddBuffer(
      const std::shared_ptr<Session>& session,
      std::shared_ptr<fd_socket::MappedFile> file);

  // A batch on every device (Device::BeginBatch), for work that unpins.
  std::vector<std::unique_ptr<device::DeviceBatch>> BeginBatches();
  // GetDeviceInfo's description of one device.
  static void DescribeDevice(const device::Device& device, v1::DeviceInfo* out);

  // Freed objects between two ReturnFreedMemory calls.
  static constexpr uint64_t kReturnMemoryEvery = 4096;

  const std::vector<device::Device*> devices_;  // devices_[0] == device_
  device::Device* const device_;
  const Clock* const clock_;
  const CoreOptions options_;
  SessionTable sessions_;  // open sessions, max_sessions
  Budgets budgets_;        // limits and tenant quotas of what sessions hold
  std::atomic<uint64_t> next_handle_{1};  // buffers, MR objects, LAMs
  ProgressReporter progress_;    // started by Start, stopped by Shutdown
  Registrations registrations_;  // with the cache and warm pins
  FastRegistration fast_;        // LAMs and MR objects
  Publications publications_{&registrations_, devices_};  // the directory
  // Objects freed, for giving the allocator's free pages back now and then.
  FreedObjects freed_{kReturnMemoryEvery};
  std::shared_ptr<TenantTable> tenants_;
  int shm_dir_fd_ = -1;
  std::function<void(const std::string&)> fd_hangup_;  // fixed after Start

  // What TakeDeviceHealthChanges last saw of each device (empty before its
  // first call).
  absl::Mutex health_mu_;
  std::vector<bool> last_healthy_ ABSL_GUARDED_BY(health_mu_);

  // The teardown runner and the teardowns given to it that have not run.
  absl::Mutex teardown_mu_;
  TeardownRunner teardown_runner_ ABSL_GUARDED_BY(teardown_mu_);
  uint64_t teardowns_pending_ ABSL_GUARDED_BY(teardown_mu_) = 0;

  absl::Mutex reaper_mu_;
  bool reaper_stop_ ABSL_GUARDED_BY(reaper_mu_) = false;
  Thread reaper_;  // started by Start, joined by Shutdown
};

}  // namespace mrd::core

#endif  // MRD_SERVER_CORE_CORE_H_
