#include "server/service/service.h"

#include <grpc/grpc.h>

#include <deque>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "mrd/status.h"
#include "server/common/progress.h"
#include "server/common/tsan.h"
#include "server/service/grpc_status.h"

namespace mrd::service {
namespace {

// A unary call's reactor, in the call's arena (as gRPC's default reactor
// is): no allocation of its own, and gRPC discards the memory with the call.
// Finish may be called by a worker thread; gRPC then completes the call on
// one of its own threads, which calls OnDone and frees the request and
// response the worker used (TsanTakeOverFromGrpc tells ThreadSanitizer about
// that hand-over; it is nothing otherwise).
class UnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  static UnaryReactor* Create(grpc::CallbackServerContext* ctx) {
    void* memory = grpc_call_arena_alloc(ctx->c_call(), sizeof(UnaryReactor));
    return new (memory) UnaryReactor();
  }

  void OnDone() override {
    TsanTakeOverFromGrpc();
    this->~UnaryReactor();  // the arena's memory goes with the call
  }

  // Its reactions (this OnDone, the default OnCancel) are trivial, as those
  // of gRPC's default reactor, which says so the same way: gRPC then runs
  // OnDone, and the call's teardown after it, on the thread that finished
  // the call. Otherwise each call's end is handed to gRPC's executor thread:
  // measured, one more context switch for about one call in three, and
  // 6,469 of mrd's 55,715 switches under rpc_bench's inline calls
  // (docs/PERFORMANCE.md, "A unary call's end without gRPC's executor").
  bool InternalInlineable() override { return true; }

 private:
  UnaryReactor() = default;
};

// Streams one session's completions. Lifetime: the reactor owns itself
// through `self_` until gRPC calls OnDone; the notifier handed to the core
// holds a weak reference, so a completion arriving after OnDone finds nothing
// to call. No lock is held while calling StartWrite or Finish.
class CompletionWriter final
    : public grpc::ServerWriteReactor<v1::Completion>,
      public std::enable_shared_from_this<CompletionWriter> {
 public:
  CompletionWriter(core::Core* core, RpcObserver* observer)
      : core_(core), observer_(observer), start_(absl::Now()) {}

  void Start(grpc::CallbackServerContext* ctx,
             const v1::StreamCompletionsRequest& req) {
    ctx_ = ctx;
    self_ = shared_from_this();
    std::weak_ptr<CompletionWriter> weak = self_;
    absl::StatusOr<core::CompletionSubscription> session =
        core_->SubscribeCompletions(req.session(), [weak] {
          if (auto w = weak.lock()) w->MaybeWrite();
        });
    if (!session.ok()) {
      {
        absl::MutexLock lock(&mu_);
        finished_ = true;
      }
      Answer(ToGrpcStatus(session.status(), ctx));
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      session_ = *session;
    }
    MaybeWrite();
  }

  // Each callback runs on a gRPC thread, after a batch this reactor started
  // (StartWrite, Finish) on another (see UnaryReactor).
  void OnWriteDone(bool ok) override {
    TsanTakeOverFromGrpc();
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) cancelled_ = true;
    }
    MaybeWrite();
  }

  void OnCancel() override {
    TsanTakeOverFromGrpc();
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
    }
    MaybeWrite();
  }

  void OnDone() override {
    TsanTakeOverFromGrpc();
    core::CompletionSubscription session;
    {
      absl::MutexLock lock(&mu_);
      session = session_;
    }
    core_->UnsubscribeCompletions(session);
    TsanHandBackToGrpc();  // before the teardown after the server stopped
    self_.reset();         // may destroy this
  }

 private:
  void MaybeWrite() {
    std::optional<grpc::Status> finish;
    bool write = false;
    {
      absl::MutexLock lock(&mu_);
      if (writing_ || finished_ || session_.session == nullptr) return;
      if (cancelled_) {
        finished_ = true;
        finish = grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled");
      } else if (session_->handed_over()) {
        // The session goes on in the new process, with what was queued.
        finished_ = true;
        finish = ToGrpcStatus(
            MrdError(absl::StatusCode::kUnavailable, "HANDED_OVER",
                     "this mrd handed over to a new process, which goes on "
                     "with the session and its queued completions: open the "
                     "stream again"),
            ctx_);
      } else if (session_->stream_replaced(session_.stream)) {
        finished_ = true;
        finish = ToGrpcStatus(
            MrdError(absl::StatusCode::kAborted, "STREAM_REPLACED",
                     "a newer completion stream of this session took over; "
                     "the completions not yet sent go to it"),
            ctx_);
      } else if (session_->stream_held()) {
        return;  // a handover is exporting the queue
      } else if (std::optional<v1::Completion> c =
                     session_->PopCompletionFor(session_.stream)) {
        current_ = std::move(*c);
        writing_ = true;
        write = true;
      } else if (session_->ended()) {
        finished_ = true;
        finish = grpc::Status::OK;  // the session ended: nothing more comes
      }
    }
    if (write) StartWrite(&current_);
    if (finish.has_value()) Answer(*finish);
  }

  // Tells the observer here, not in OnDone (as WatchName does): a server
  // shutting down may run OnDone after it returned, when the observer is
  // gone.
  void Answer(const grpc::Status& status) {
    if (observer_ != nullptr) {
      observer_->OnRpcDone("StreamCompletions", status.error_code(),
                           absl::Now() - start_);
    }
    TsanHandBackToGrpc();
    Finish(status);
  }

  core::Core* const core_;
  RpcObserver* const observer_;
  const absl::Time start_;
  grpc::CallbackServerContext* ctx_ = nullptr;  // set by Start
  std::shared_ptr<CompletionWriter> self_;

  absl::Mutex mu_;
  core::CompletionSubscription session_ ABSL_GUARDED_BY(mu_);
  v1::Completion current_;  // owned by the in-flight write
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

// Streams one name's events (WatchName). Its watch is made on a worker
// (it reads etcd first); events then come on the watch's thread, queued
// here and written one at a time. Lifetime as CompletionWriter's: `self_`
// until OnDone; the watch's callback holds a weak reference. No lock is
// held while calling StartWrite or Finish. The watch is destroyed on a
// worker, never on a gRPC thread: its destructor waits for the watch's
// thread, whose stream's cancel may be queued to the very gRPC executor
// thread that would be waiting.
class NameWatcher final : public grpc::ServerWriteReactor<v1::NameEvent>,
                          public std::enable_shared_from_this<NameWatcher> {
 public:
  NameWatcher(core::Core* core, RpcObserver* observer)
      : core_(core), observer_(observer), start_(absl::Now()) {}

  // `dispatch` runs the watch's making on a worker.
  void Start(grpc::CallbackServerContext* ctx, const v1::ResolveRequest& req,
             absl::AnyInvocable<void(absl::AnyInvocable<void() &&>)> dispatch) {
    ctx_ = ctx;
    self_ = shared_from_this();
    dispatch_ = std::move(dispatch);
    dispatch_([self = self_, req]() mutable { self->Open(req); });
  }

  void OnWriteDone(bool ok) override {
    TsanTakeOverFromGrpc();
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) cancelled_ = true;
    }
    MaybeWrite();
  }

  void OnCancel() override {
    TsanTakeOverFromGrpc();
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
    }
    // A write in flight: OnWriteDone finishes. Either way the watch is
    // dropped now, not at the write's end.
    DropWatch();
    MaybeWrite();
    TsanHandBackToGrpc();
  }

  void OnDone() override {
    TsanTakeOverFromGrpc();
    DropWatch();  // dropped when finished already: nothing left here
    TsanHandBackToGrpc();
    self_.reset();  // may destroy this
  }

 private:
  void Open(const v1::ResolveRequest& req) {
    std::weak_ptr<NameWatcher> weak = self_;
    absl::StatusOr<std::unique_ptr<core::Publications::NameWatch>> watch =
        core_->WatchName(req, [weak](absl::StatusOr<v1::NameEvent> event) {
          if (auto self = weak.lock()) self->Push(std::move(event));
        });
    {
      absl::MutexLock lock(&mu_);
      if (!watch.ok()) {
        if (!end_.has_value()) end_ = watch.status();
      } else if (!done_) {
        watch_ = std::move(*watch);
      }
    }
    // A watch made after the stream was done goes here (the lock is free).
    watch = absl::StatusOr<std::unique_ptr<core::Publications::NameWatch>>();
    MaybeWrite();
  }

  // Stops the watch and has a worker destroy it (the workers are drained
  // before anything a watch uses goes). Done at Finish: OnDone, which a
  // server shutting down may run after it returned, then has nothing left.
  void DropWatch() {
    std::unique_ptr<core::Publications::NameWatch> watch;
    {
      absl::MutexLock lock(&mu_);
      watch = std::move(watch_);
      done_ = true;
    }
    if (watch == nullptr) return;
    watch->Stop();
    dispatch_([watch = std::move(watch)]() mutable { watch.reset(); });
  }

  void Push(absl::StatusOr<v1::NameEvent> event) {
    {
      absl::MutexLock lock(&mu_);
      if (event.ok()) {
        queue_.push_back(std::move(*event));
      } else if (!end_.has_value()) {
        end_ = event.status();
      }
    }
    MaybeWrite();
  }

  void MaybeWrite() {
    std::optional<grpc::Status> finish;
    bool write = false;
    {
      absl::MutexLock lock(&mu_);
      if (writing_ || finished_) return;
      if (cancelled_) {
        finished_ = true;
        code_ = grpc::StatusCode::CANCELLED;
        finish = grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled");
      } else if (!queue_.empty()) {
        current_ = std::move(queue_.front());
        queue_.pop_front();
        writing_ = true;
        write = true;
      } else if (end_.has_value()) {
        finished_ = true;
        finish = ToGrpcStatus(*end_, ctx_);
        code_ = finish->error_code();
      }
    }
    if (write) StartWrite(&current_);
    if (finish.has_value()) {
      DropWatch();
      // Told here, not in OnDone: a server shutting down may run OnDone
      // after it returned, when the observer is gone.
      if (observer_ != nullptr) {
        observer_->OnRpcDone("WatchName", code_, absl::Now() - start_);
      }
      TsanHandBackToGrpc();
      Finish(*finish);
    }
  }

  core::Core* const core_;
  RpcObserver* const observer_;
  const absl::Time start_;
  grpc::CallbackServerContext* ctx_ = nullptr;  // set by Start
  std::shared_ptr<NameWatcher> self_;
  // Runs a task on a worker; set by Start, before any other thread runs.
  absl::AnyInvocable<void(absl::AnyInvocable<void() &&>)> dispatch_;
  grpc::StatusCode code_ = grpc::StatusCode::OK;

  absl::Mutex mu_;
  std::unique_ptr<core::Publications::NameWatch> watch_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::NameEvent> queue_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Status> end_ ABSL_GUARDED_BY(mu_);
  v1::NameEvent current_;  // owned by the in-flight write
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

// The end of every unary call: the status converted once, the observer
// told, the reactor finished.
struct CallEnd {
  grpc::CallbackServerContext* ctx;
  grpc::ServerUnaryReactor* reactor;
  RpcObserver* observer;
  absl::string_view method;
  absl::Time start;
  CallGate* gate;  // left when answered; null: refused at the gate

  void operator()(const absl::Status& result) const {
    grpc::Status status = ToGrpcStatus(result, ctx);
    if (observer != nullptr) {
      observer->OnRpcDone(method, status.error_code(), absl::Now() - start);
    }
    if (gate != nullptr) gate->Leave();
    reactor->Finish(status);
  }
};

namespace {

// How long a client refused after a handover waits before it retries
// (grpc-retry-pushback-ms, which gRPC's retry policy honours): long enough
// for its channel to hear GOAWAY and reconnect, to the new process.
constexpr int kHandoverRetryMs = 50;

absl::Status HandedOver() {
  return MrdError(
      absl::StatusCode::kUnavailable, "HANDED_OVER",
      absl::StrCat("this mrd handed over to a new process; "
                   "nothing was done: retry in ",
                   kHandoverRetryMs, " ms (a new connection reaches it)"));
}

}  // namespace

CallEnd MrdService::Begin(grpc::CallbackServerContext* ctx,
                          absl::string_view method) {
  if (observer_ != nullptr) observer_->OnRpcStart(method);
  return CallEnd{
      ctx, UnaryReactor::Create(ctx), observer_, method, absl::Now(), nullptr};
}

// A call the gate refused: answered before anything is done.
void MrdService::Refuse(const CallEnd& end) {
  end.ctx->AddTrailingMetadata("grpc-retry-pushback-ms",
                               std::to_string(kHandoverRetryMs));
  end(HandedOver());
}

template <typename Go>
void MrdService::ThroughGate(CallEnd end, Go go) {
  if (gate_.Enter()) {
    end.gate = &gate_;
    go(end);
    return;
  }
  // Paused for a handover: held until it ends either way.
  gate_.Defer([this, end, go = std::move(go)](bool admitted) mutable {
    if (!admitted) {
      Refuse(end);
      return;
    }
    end.gate = &gate_;
    go(end);
  });
}

namespace {

// Queues `task` on `workers` for `tenant` (null: "anonymous"), or in the
// one queue when scheduling is not fair.
void ScheduleFor(FairScheduler& workers, bool fair, const core::Tenant* tenant,
                 uint64_t cost, absl::AnyInvocable<void() &&> task) {
  if (!fair) {
    workers.Schedule("", 1, cost, std::move(task));
  } else if (tenant == nullptr) {
    workers.Schedule("anonymous", core::kDefaultTenantWeight, cost,
                     std::move(task));
  } else {
    workers.Schedule(tenant->name(), tenant->weight(), cost, std::move(task));
  }
}

}  // namespace

void MrdService::Dispatch(const Work& work,
                          absl::AnyInvocable<void() &&> task) {
  std::shared_ptr<core::Tenant> tenant =
      !fair_ || work.session == nullptr ? nullptr
                                        : core_->TenantOfSession(*work.session);
  ScheduleFor(*workers_, fair_, tenant.get(), work.cost, std::move(task));
}

core::Core::TeardownRunner TeardownsOnWorkers(FairScheduler* workers,
                                              bool fair) {
  return [workers, fair](const std::shared_ptr<core::Tenant>& tenant,
                         uint64_t pinned_bytes,
                         absl::AnyInvocable<void() &&> teardown) {
    ScheduleFor(*workers, fair, tenant.get(), WorkCost(pinned_bytes),
                std::move(teardown));
  };
}

template <typename Fn>
grpc::ServerUnaryReactor* MrdService::RunInline(
    grpc::CallbackServerContext* ctx, absl::string_view method, Fn fn) {
  const CallEnd begun = Begin(ctx, method);
  ThroughGate(begun,
              [fn = std::move(fn)](const CallEnd& end) mutable { end(fn()); });
  return begun.reactor;
}

template <typename Fn>
grpc::ServerUnaryReactor* MrdService::RunOnWorker(
    grpc::CallbackServerContext* ctx, absl::string_view method, Work work,
    Fn fn) {
  const CallEnd begun = Begin(ctx, method);
  ThroughGate(begun, [this, work, fn = std::move(fn)](const CallEnd& end) {
    Dispatch(work, [end, fn = std::move(fn)]() { end(fn()); });
  });
  return begun.reactor;
}

template <typename Quick, typename Fn>
grpc::ServerUnaryReactor* MrdService::RunQuickOrWorker(
    grpc::CallbackServerContext* ctx, absl::string_view method, Work work,
    Quick quick, Fn fn) {
  const CallEnd begun = Begin(ctx, method);
  ThroughGate(begun, [this, work, quick = std::move(quick),
                      fn = std::move(fn)](const CallEnd& end) mutable {
    if (std::optional<absl::Status> answered = quick(&work.cost);
        answered.has_value()) {
      end(*answered);
    } else {
      Dispatch(work, [end, fn = std::move(fn)]() { end(fn()); });
    }
  });
  return begun.reactor;
}

absl::Status MrdService::Registered(absl::string_view method, uint64_t bytes,
                                    absl::Status status) {
  if (status.ok() && observer_ != nullptr) {
    observer_->OnRegistered(method, bytes);
  }
  return status;
}

grpc::ServerUnaryReactor* MrdService::GetDeviceInfo(
    grpc::CallbackServerContext* ctx, const v1::GetDeviceInfoRequest*,
    v1::DeviceInfo* resp) {
  return RunInline(ctx, "GetDeviceInfo",
                   [this, resp] { return core_->GetDeviceInfo(resp); });
}

grpc::ServerUnaryReactor* MrdService::OpenLeaseSession(
    grpc::CallbackServerContext* ctx, const v1::OpenLeaseSessionRequest* req,
    v1::SessionInfo* resp) {
  return RunOnWorker(
      ctx, "OpenLeaseSession", Work{&req->vouching_session(), 1},
      [this, req, resp] { return core_->OpenLeaseSession(*req, resp); });
}

grpc::ServerUnaryReactor* MrdService::GetSession(
    grpc::CallbackServerContext* ctx, const v1::GetSessionRequest* req,
    v1::SessionInfo* resp) {
  return RunInline(ctx, "GetSession",
                   [this, req, resp] { return core_->GetSession(*req, resp); });
}

grpc::ServerUnaryReactor* MrdService::SetDefaultDevices(
    grpc::CallbackServerContext* ctx, const v1::SetDefaultDevicesRequest* req,
    v1::SessionInfo* resp) {
  return RunInline(ctx, "SetDefaultDevices", [this, req, resp] {
    return core_->SetDefaultDevices(*req, resp);
  });
}

grpc::ServerUnaryReactor* MrdService::CloseSession(
    grpc::CallbackServerContext* ctx, const v1::CloseSessionRequest* req,
    v1::CloseSessionResponse*) {
  return RunOnWorker(
      ctx, "CloseSession",
      Work{&req->session(), WorkCost(core_->CloseSessionBytes(*req))},
      [this, req] { return core_->CloseSession(*req); });
}

grpc::ServerUnaryReactor* MrdService::ImportFile(
    grpc::CallbackServerContext* ctx, const v1::ImportFileRequest* req,
    v1::BufferInfo* resp) {
  return RunOnWorker(
      ctx, "ImportFile", Work{&req->session(), 1},
      [this, req, resp] { return core_->ImportFile(*req, resp); });
}

grpc::ServerUnaryReactor* MrdService::ReleaseBuffer(
    grpc::CallbackServerContext* ctx, const v1::ReleaseBufferRequest* req,
    v1::ReleaseBufferResponse* resp) {
  // Unmapping a big buffer is bulk work.
  return RunOnWorker(
      ctx, "ReleaseBuffer",
      Work{&req->session(), WorkCost(core_->ReleaseBufferBytes(*req))},
      [this, req, resp] { return core_->ReleaseBuffer(*req, resp); });
}

grpc::ServerUnaryReactor* MrdService::CreateMr(grpc::CallbackServerContext* ctx,
                                               const v1::CreateMrRequest* req,
                                               v1::MrInfo* resp) {
  return RunOnWorker(ctx, "CreateMr", Work{&req->session(), 1},
                     [this, req, resp] { return core_->CreateMr(*req, resp); });
}

grpc::ServerUnaryReactor* MrdService::CloseMr(grpc::CallbackServerContext* ctx,
                                              const v1::CloseMrRequest* req,
                                              v1::CloseMrResponse*) {
  return RunOnWorker(ctx, "CloseMr", Work{&req->session(), 1},
                     [this, req] { return core_->CloseMr(*req); });
}

grpc::ServerUnaryReactor* MrdService::RegisterMr(
    grpc::CallbackServerContext* ctx, const v1::RegisterMrRequest* req,
    v1::RegisterMrResponse* resp) {
  return RunQuickOrWorker(
      ctx, "RegisterMr", Work{&req->session(), WorkCost(req->length())},
      [this, req, resp](uint64_t*) -> std::optional<absl::Status> {
        std::optional<absl::Status> done = core_->TryRegisterMrHit(*req, resp);
        if (!done.has_value()) done = core_->TryRegisterMrSmall(*req, resp);
        if (!done.has_value()) return std::nullopt;
        return Registered("RegisterMr", req->length(), *std::move(done));
      },
      [this, ctx, req, resp] {
        return Registered("RegisterMr", req->length(),
                          core_->RegisterMr(*req, resp, [ctx] {
                            return ctx->IsCancelled();
                          }));
      });
}

grpc::ServerUnaryReactor* MrdService::DeregisterMr(
    grpc::CallbackServerContext* ctx, const v1::DeregisterMrRequest* req,
    v1::DeregisterMrResponse* resp) {
  // The last reference unpins its range: the worker's cost is its pages.
  return RunQuickOrWorker(
      ctx, "DeregisterMr", Work{&req->session(), 1},
      [this, req, resp](uint64_t* cost) {
        uint64_t last_bytes = 0;
        std::optional<absl::Status> done =
            core_->TryDeregisterMrNotLast(*req, resp, &last_bytes);
        if (!done.has_value()) {
          done = core_->TryDeregisterMrSmall(*req, resp, last_bytes);
        }
        *cost = WorkCost(last_bytes);
        return done;
      },
      [this, req, resp] { return core_->DeregisterMr(*req, resp); });
}

grpc::ServerUnaryReactor* MrdService::RegisterMrBatch(
    grpc::CallbackServerContext* ctx, const v1::RegisterMrBatchRequest* req,
    v1::RegisterMrBatchResponse* resp) {
  uint64_t cost = static_cast<uint64_t>(req->items_size());
  for (const v1::RegisterMrRequest& item : req->items()) {
    cost += WorkCost(item.length());
  }
  return RunOnWorker(ctx, "RegisterMrBatch", Work{&req->session(), cost},
                     [this, ctx, req, resp] {
                       absl::Status status = core_->RegisterMrBatch(
                           *req, resp, [ctx] { return ctx->IsCancelled(); });
                       // Each registration made counts as one of its size.
                       for (int i = 0; i < resp->items_size(); ++i) {
                         if (resp->items(i).status().code() == 0) {
                           (void)Registered("RegisterMrBatch",
                                            req->items(i).length(),
                                            absl::OkStatus());
                         }
                       }
                       return status;
                     });
}

grpc::ServerUnaryReactor* MrdService::DeregisterMrBatch(
    grpc::CallbackServerContext* ctx, const v1::DeregisterMrBatchRequest* req,
    v1::DeregisterMrBatchResponse* resp) {
  const uint64_t cost = static_cast<uint64_t>(req->items_size());
  return RunOnWorker(
      ctx, "DeregisterMrBatch", Work{&req->session(), cost},
      [this, req, resp] { return core_->DeregisterMrBatch(*req, resp); });
}

grpc::ServerUnaryReactor* MrdService::BuildLam(grpc::CallbackServerContext* ctx,
                                               const v1::BuildLamRequest* req,
                                               v1::BuildLamResponse* resp) {
  return RunOnWorker(
      ctx, "BuildLam", Work{&req->session(), WorkCost(req->length())},
      [this, ctx, req, resp] {
        return Registered(
            "BuildLam", req->length(),
            core_->BuildLam(*req, resp, [ctx] { return ctx->IsCancelled(); }));
      });
}

grpc::ServerUnaryReactor* MrdService::ReleaseLam(
    grpc::CallbackServerContext* ctx, const v1::ReleaseLamRequest* req,
    v1::ReleaseLamResponse*) {
  return RunOnWorker(ctx, "ReleaseLam", Work{&req->session(), 1},
                     [this, req] { return core_->ReleaseLam(*req); });
}

grpc::ServerUnaryReactor* MrdService::FastRegister(
    grpc::CallbackServerContext* ctx, const v1::FastRegisterRequest* req,
    v1::FastRegisterResponse* resp) {
  return RunOnWorker(ctx, "FastRegister", Work{&req->session(), 1},
                     [this, req, resp] {
                       return Registered("FastRegister", req->length(),
                                         core_->FastRegister(*req, resp));
                     });
}

grpc::ServerUnaryReactor* MrdService::InvalidateMr(
    grpc::CallbackServerContext* ctx, const v1::InvalidateMrRequest* req,
    v1::InvalidateMrResponse* resp) {
  return RunOnWorker(
      ctx, "InvalidateMr", Work{&req->session(), 1},
      [this, req, resp] { return core_->InvalidateMr(*req, resp); });
}

grpc::ServerWriteReactor<v1::Completion>* MrdService::StreamCompletions(
    grpc::CallbackServerContext* ctx, const v1::StreamCompletionsRequest* req) {
  if (observer_ != nullptr) observer_->OnRpcStart("StreamCompletions");
  auto writer = std::make_shared<CompletionWriter>(core_, observer_);
  writer->Start(ctx, *req);
  return writer.get();
}

grpc::ServerWriteReactor<v1::NameEvent>* MrdService::WatchName(
    grpc::CallbackServerContext* ctx, const v1::ResolveRequest* req) {
  if (observer_ != nullptr) observer_->OnRpcStart("WatchName");
  auto watcher = std::make_shared<NameWatcher>(core_, observer_);
  watcher->Start(
      ctx, *req,
      [this, session = req->session()](absl::AnyInvocable<void() &&> task) {
        Dispatch(Work{&session, 1}, std::move(task));
      });
  return watcher.get();
}

grpc::ServerUnaryReactor* MrdService::CreatePeerTicket(
    grpc::CallbackServerContext* ctx, const v1::CreatePeerTicketRequest* req,
    v1::PeerTicket* resp) {
  return RunOnWorker(
      ctx, "CreatePeerTicket", Work{&req->session(), 1},
      [this, req, resp] { return core_->CreatePeerTicket(*req, resp); });
}

grpc::ServerUnaryReactor* MrdService::ListRegistrations(
    grpc::CallbackServerContext* ctx, const v1::ListRegistrationsRequest* req,
    v1::ListRegistrationsResponse* resp) {
  return RunInline(ctx, "ListRegistrations", [this, req, resp] {
    return core_->ListRegistrations(*req, resp);
  });
}

// Publish queues its write and never waits for etcd: inline. Unpublish
// waits (bounded) for etcd's delete and Resolve reads etcd: on a worker, in
// the tenant's queue.
grpc::ServerUnaryReactor* MrdService::Publish(grpc::CallbackServerContext* ctx,
                                              const v1::PublishRequest* req,
                                              v1::PublishedEntry* resp) {
  return RunInline(ctx, "Publish",
                   [this, req, resp] { return core_->Publish(*req, resp); });
}

grpc::ServerUnaryReactor* MrdService::Unpublish(
    grpc::CallbackServerContext* ctx, const v1::UnpublishRequest* req,
    v1::UnpublishResponse* resp) {
  return RunOnWorker(
      ctx, "Unpublish", Work{&req->session(), 1},
      [this, req, resp] { return core_->Unpublish(*req, resp); });
}

grpc::ServerUnaryReactor* MrdService::ListPublished(
    grpc::CallbackServerContext* ctx, const v1::ListPublishedRequest* req,
    v1::ListPublishedResponse* resp) {
  return RunInline(ctx, "ListPublished", [this, req, resp] {
    return core_->ListPublished(*req, resp);
  });
}

grpc::ServerUnaryReactor* MrdService::Resolve(grpc::CallbackServerContext* ctx,
                                              const v1::ResolveRequest* req,
                                              v1::PublishedEntry* resp) {
  return RunOnWorker(ctx, "Resolve", Work{&req->session(), 1},
                     [this, req, resp] { return core_->Resolve(*req, resp); });
}

// --- the administrative service ---------------------------------------------

void AdminService::AddQueueFigures(v1::TenantInfo* tenant) const {
  if (workers_ == nullptr) return;
  for (const FairQueueStats& queue : workers_->Stats()) {
    if (queue.key != tenant->name()) continue;
    tenant->set_queued(queue.queued);
    tenant->set_running(queue.running);
  }
}

grpc::ServerUnaryReactor* AdminService::ListTenants(
    grpc::CallbackServerContext* ctx, const v1::ListTenantsRequest*,
    v1::ListTenantsResponse* resp) {
  return calls_->RunInline(ctx, "ListTenants", [this, resp] {
    absl::Status status = core_->ListTenants(resp);
    for (v1::TenantInfo& tenant : *resp->mutable_tenants()) {
      AddQueueFigures(&tenant);
    }
    return status;
  });
}

grpc::ServerUnaryReactor* AdminService::SetTenant(
    grpc::CallbackServerContext* ctx, const v1::SetTenantRequest* req,
    v1::TenantInfo* resp) {
  return calls_->RunInline(ctx, "SetTenant", [this, req, resp] {
    absl::Status status = core_->SetTenant(*req, resp);
    AddQueueFigures(resp);
    return status;
  });
}

grpc::ServerUnaryReactor* AdminService::ClearTenant(
    grpc::CallbackServerContext* ctx, const v1::ClearTenantRequest* req,
    v1::TenantInfo* resp) {
  return calls_->RunInline(ctx, "ClearTenant", [this, req, resp] {
    absl::Status status = core_->ClearTenant(*req, resp);
    AddQueueFigures(resp);
    return status;
  });
}

}  // namespace mrd::service
