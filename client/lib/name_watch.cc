#include "client/lib/name_watch.h"

#include <grpcpp/client_context.h>
#include <grpcpp/support/sync_stream.h>

#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "client/lib/client_core.h"
#include "client/lib/status.h"

namespace mrd::client {

// The call and what it needs. The reading thread alone touches `reader_`,
// `finished_` and `end_`; Cancel() only the context (TryCancel is
// thread-safe) and `cancelled_`.
class NameWatch::Stream {
 public:
  Stream(std::shared_ptr<const internal::ClientCore> core,
         const v1::ResolveRequest& request)
      : core_(std::move(core)) {
    // No deadline: a watch lasts until it is cancelled or mrd ends it.
    // (ClientCore::PrepareUnary sets only the unary calls' deadline.)
    reader_ = core_->stub->WatchName(&context_, request);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  ~Stream() {
    if (finished_) return;
    Cancel();
    v1::NameEvent discarded;
    while (reader_->Read(&discarded)) {
    }
    (void)reader_->Finish();
  }

  absl::StatusOr<v1::NameEvent> Next() {
    if (!finished_) {
      v1::NameEvent event;
      if (reader_->Read(&event)) return event;
      end_ = Finish();
    }
    return end_;
  }

  void Cancel() {
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
    }
    context_.TryCancel();
  }

 private:
  // After Read() returned false: how the stream ended.
  absl::Status Finish() {
    const grpc::Status status = reader_->Finish();
    finished_ = true;
    if (cancelled()) return absl::CancelledError("name watch cancelled");
    if (status.ok()) return absl::OutOfRangeError("mrd ended the name watch");
    return StatusFromGrpc(status, context_);
  }

  bool cancelled() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return cancelled_;
  }

  // Keeps the channel alive as long as the call; destroyed last.
  const std::shared_ptr<const internal::ClientCore> core_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderInterface<v1::NameEvent>> reader_;
  bool finished_ = false;
  absl::Status end_;

  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

NameWatch::NameWatch(std::shared_ptr<const internal::ClientCore> core,
                     const v1::ResolveRequest& request)
    : stream_(std::make_unique<Stream>(std::move(core), request)) {}

// Destroying a Stream (here, or in a move assignment) cancels and drains it.
NameWatch::NameWatch(NameWatch&& other) noexcept = default;
NameWatch& NameWatch::operator=(NameWatch&& other) noexcept = default;
NameWatch::~NameWatch() = default;

absl::StatusOr<v1::NameEvent> NameWatch::Next() {
  if (stream_ == nullptr) {
    return absl::FailedPreconditionError("use of a moved-from NameWatch");
  }
  return stream_->Next();
}

void NameWatch::Cancel() {
  if (stream_ != nullptr) stream_->Cancel();
}

}  // namespace mrd::client
