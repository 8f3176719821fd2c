// MrdService: the gRPC edge. A thin adapter over core::Core: decode, hand to
// the core, convert the status once (ToGrpcStatus), finish. Work that can take
// long (pinning, registration, teardown) runs on the workers, never on a
// gRPC thread; quick reads run inline, and so do a RegisterMr that is a cache
// hit and a DeregisterMr that leaves references (the core's Try* forms say
// when a call can be answered without blocking).
//
// The workers are shared fairly between tenants (server/common/
// fair_scheduler.h): a call waits in the queue of its session's tenant, with
// a cost that reflects its work (pages to pin, items of a batch), so that
// one tenant's small request is not held up behind another's big ones.
//
// AdminService: the administrative calls (mrd.v1.TenantAdmin), served by a
// grpc::Server of their own on the admin socket, which only root and mrd's
// own uid may connect to (GrpcAcceptorOptions::allowed_uids). Answered
// inline, through MrdService's call gate: a handover's snapshot holds every
// setting made before it.
//
// Thread safety: gRPC calls the handlers concurrently; the services hold no
// state of their own besides pointers fixed at construction and the call
// gate (call_gate.h) a live handover closes.
#ifndef MRD_SERVER_SERVICE_SERVICE_H_
#define MRD_SERVER_SERVICE_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "mrd/v1/mrd.grpc.pb.h"
#include "server/common/fair_scheduler.h"
#include "server/core/core.h"
#include "server/metrics/rpc_observer.h"
#include "server/service/call_gate.h"

namespace mrd::service {

using metrics::RpcObserver;

struct CallEnd;  // service.cc

class MrdService final : public v1::MemoryRegistration::CallbackService {
 public:
  // All pointers must outlive the service; `observer` may be null.
  // `fair` false: every call waits in one queue, first come first served
  // (for comparison: bench/tenant_bench).
  MrdService(core::Core* core, FairScheduler* workers, RpcObserver* observer,
             bool fair = true)
      : core_(core), workers_(workers), observer_(observer), fair_(fair) {}

  // What a live handover pauses (unary calls; completion streams go on).
  CallGate& gate() { return gate_; }

  grpc::ServerUnaryReactor* GetDeviceInfo(grpc::CallbackServerContext* ctx,
                                          const v1::GetDeviceInfoRequest* req,
                                          v1::DeviceInfo* resp) override;
  grpc::ServerUnaryReactor* OpenLeaseSession(
      grpc::CallbackServerContext* ctx, const v1::OpenLeaseSessionRequest* req,
      v1::SessionInfo* resp) override;
  grpc::ServerUnaryReactor* GetSession(grpc::CallbackServerContext* ctx,
                                       const v1::GetSessionRequest* req,
                                       v1::SessionInfo* resp) override;
  grpc::ServerUnaryReactor* SetDefaultDevices(
      grpc::CallbackServerContext* ctx, const v1::SetDefaultDevicesRequest* req,
      v1::SessionInfo* resp) override;
  grpc::ServerUnaryReactor* CloseSession(
      grpc::CallbackServerContext* ctx, const v1::CloseSessionRequest* req,
      v1::CloseSessionResponse* resp) override;
  grpc::ServerUnaryReactor* ImportFile(grpc::CallbackServerContext* ctx,
                                       const v1::ImportFileRequest* req,
                                       v1::BufferInfo* resp) override;
  grpc::ServerUnaryReactor* ReleaseBuffer(
      grpc::CallbackServerContext* ctx, const v1::ReleaseBufferRequest* req,
      v1::ReleaseBufferResponse* resp) override;
  grpc::ServerUnaryReactor* CreateMr(grpc::CallbackServerContext* ctx,
                                     const v1::CreateMrRequest* req,
                                     v1::MrInfo* resp) override;
  grpc::ServerUnaryReactor* CloseMr(grpc::CallbackServerContext* ctx,
                                    const v1::CloseMrRequest* req,
                                    v1::CloseMrResponse* resp) override;
  grpc::ServerUnaryReactor* RegisterMr(grpc::CallbackServerContext* ctx,
                                       const v1::RegisterMrRequest* req,
                                       v1::RegisterMrResponse* resp) override;
  grpc::ServerUnaryReactor* DeregisterMr(
      grpc::CallbackServerContext* ctx, const v1::DeregisterMrRequest* req,
      v1::DeregisterMrResponse* resp) override;
  grpc::ServerUnaryReactor* RegisterMrBatch(
      grpc::CallbackServerContext* ctx, const v1::RegisterMrBatchRequest* req,
      v1::RegisterMrBatchResponse* resp) override;
  grpc::ServerUnaryReactor* DeregisterMrBatch(
      grpc::CallbackServerContext* ctx, const v1::DeregisterMrBatchRequest* req,
      v1::DeregisterMrBatchResponse* resp) override;
  grpc::ServerUnaryReactor* BuildLam(grpc::CallbackServerContext* ctx,
                                     const v1::BuildLamRequest* req,
                                     v1::BuildLamResponse* resp) override;
  grpc::ServerUnaryReactor* ReleaseLam(grpc::CallbackServerContext* ctx,
                                       const v1::ReleaseLamRequest* req,
                                       v1::ReleaseLamResponse* resp) override;
  grpc::ServerUnaryReactor* FastRegister(
      grpc::CallbackServerContext* ctx, const v1::FastRegisterRequest* req,
      v1::FastRegisterResponse* resp) override;
  grpc::ServerUnaryReactor* InvalidateMr(
      grpc::CallbackServerContext* ctx, const v1::InvalidateMrRequest* req,
      v1::InvalidateMrResponse* resp) override;
  grpc::ServerWriteReactor<v1::Completion>* StreamCompletions(
      grpc::CallbackServerContext* ctx,
      const v1::StreamCompletionsRequest* req) override;
  grpc::ServerUnaryReactor* CreatePeerTicket(
      grpc::CallbackServerContext* ctx, const v1::CreatePeerTicketRequest* req,
      v1::PeerTicket* resp) override;
  grpc::ServerUnaryReactor* ListRegistrations(
      grpc::CallbackServerContext* ctx, const v1::ListRegistrationsRequest* req,
      v1::ListRegistrationsResponse* resp) override;
  grpc::ServerUnaryReactor* Publish(grpc::CallbackServerContext* ctx,
                                    const v1::PublishRequest* req,
                                    v1::PublishedEntry* resp) override;
  grpc::ServerUnaryReactor* Unpublish(grpc::CallbackServerContext* ctx,
                                      const v1::UnpublishRequest* req,
                                      v1::UnpublishResponse* resp) override;
  grpc::ServerUnaryReactor* ListPublished(
      grpc::CallbackServerContext* ctx, const v1::ListPublishedRequest* req,
      v1::ListPublishedResponse* resp) override;
  grpc::ServerUnaryReactor* Resolve(grpc::CallbackServerContext* ctx,
                                    const v1::ResolveRequest* req,
                                    v1::PublishedEntry* resp) override;
  grpc::ServerWriteReactor<v1::NameEvent>* WatchName(
      grpc::CallbackServerContext* ctx, const v1::ResolveRequest* req) override;

  // Runs `fn` inline for another service's call, through this service's
  // gate and observer (AdminService).
  template <typename Fn>
  grpc::ServerUnaryReactor* RunInline(grpc::CallbackServerContext* ctx,
                                      absl::string_view method, Fn fn);

 private:
  // Whose queue a call waits in and what it costs (FairScheduler).
  struct Work {
    const std::string* session;  // the session the request names
    uint64_t cost;
  };
  // Starts a unary call: the observer told, the reactor made; the returned
  // CallEnd finishes it.
  CallEnd Begin(grpc::CallbackServerContext* ctx, absl::string_view method);
  // `fn` on a worker, in the queue of the tenant of `work.session`.
  template <typename Fn>
  grpc::ServerUnaryReactor* RunOnWorker(grpc::CallbackServerContext* ctx,
                                        absl::string_view method, Work work,
                                        Fn fn);
  // `quick` first, on the gRPC thread: it answers what never blocks and
  // returns nullopt for the rest, which `fn` then answers on a worker.
  // `quick` is given `&work.cost` to set the worker's cost it found.
  template <typename Quick, typename Fn>
  grpc::ServerUnaryReactor* RunQuickOrWorker(grpc::CallbackServerContext* ctx,
                                             absl::string_view method,
                                             Work work, Quick quick, Fn fn);
  // Queues `task` for the tenant of `work.session` ("anonymous" when no
  // live session is named).
  void Dispatch(const Work& work, absl::AnyInvocable<void() &&> task);
  // Runs `go(end)` once the call gate lets the call in (at once, unless a
  // handover holds it), or answers it with the gate's refusal.
  template <typename Go>
  void ThroughGate(CallEnd end, Go go);
  void Refuse(const CallEnd& end);
  // Tells the observer about a successful registration; returns `status`.
  absl::Status Registered(absl::string_view method, uint64_t bytes,
                          absl::Status status);

  core::Core* const core_;
  FairScheduler* const workers_;
  RpcObserver* const observer_;
  const bool fair_;
  CallGate gate_;
};

// The core's teardown runner in mrd (Core::SetTeardownRunner): a session
// that ends by its fd socket's hang-up or its lease's expiry is released on
// `workers`, in its tenant's queue (one queue for all with `fair` false) at
// the cost of its pinned pages, as CloseSession is. `workers` must outlive
// the runner's use: clear it (Core::Shutdown does) before `workers` goes.
core::Core::TeardownRunner TeardownsOnWorkers(FairScheduler* workers,
                                              bool fair);

class AdminService final : public v1::TenantAdmin::CallbackService {
 public:
  // All pointers must outlive the service; `workers` may be null (no
  // queue figures then).
  AdminService(core::Core* core, MrdService* calls,
               const FairScheduler* workers)
      : core_(core), calls_(calls), workers_(workers) {}

  grpc::ServerUnaryReactor* ListTenants(grpc::CallbackServerContext* ctx,
                                        const v1::ListTenantsRequest* req,
                                        v1::ListTenantsResponse* resp) override;
  grpc::ServerUnaryReactor* SetTenant(grpc::CallbackServerContext* ctx,
                                      const v1::SetTenantRequest* req,
                                      v1::TenantInfo* resp) override;
  grpc::ServerUnaryReactor* ClearTenant(grpc::CallbackServerContext* ctx,
                                        const v1::ClearTenantRequest* req,
                                        v1::TenantInfo* resp) override;

 private:
  // The scheduler's queued and running requests of each tenant listed.
  void AddQueueFigures(v1::TenantInfo* tenant) const;

  core::Core* const core_;
  MrdService* const calls_;
  const FairScheduler* const workers_;
};

}  // namespace mrd::service

#endif  // MRD_SERVER_SERVICE_SERVICE_H_
