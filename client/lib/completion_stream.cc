#include "client/lib/completion_stream.h"

#include <grpcpp/client_context.h>
#include <grpcpp/support/client_callback.h>

#include <deque>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/lib/client_core.h"
#include "client/lib/deferred_release.h"
#include "client/lib/session_core.h"
#include "client/lib/status.h"

namespace mrd::client {

class CompletionStream::Reactor final
    : public grpc::ClientReadReactor<v1::Completion> {
 public:
  static constexpr size_t kMaxBuffered = 4096;

  static std::shared_ptr<Reactor> Start(
      std::shared_ptr<internal::SessionCore> core) {
    std::shared_ptr<Reactor> reactor(new Reactor(std::move(core)));
    // gRPC holds a raw pointer until OnDone; this reference keeps the
    // object alive until then, whatever the owner does.
    reactor->self_ = reactor;
    reactor->Begin();
    return reactor;
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream is over; OnDone follows
    bool read_more = false;
    {
      absl::MutexLock lock(&mu_);
      queue_.push_back(std::move(incoming_));
      incoming_.Clear();
      read_more = queue_.size() < kMaxBuffered;
      reading_ = read_more;
    }
    if (read_more) StartRead(&incoming_);
  }

  void OnDone(const grpc::Status& status) override {
    std::shared_ptr<Reactor> keep = std::move(self_);
    {
      absl::MutexLock lock(&mu_);
      final_status_ = StatusFromGrpc(status, context_);
      done_ = true;
    }
    // `keep` may be the last reference to this reactor and, through it, to
    // the client's channel: release it off this gRPC callback thread. Nothing
    // may touch `this` after this line.
    internal::DeferRelease(std::move(keep));
  }

  absl::StatusOr<v1::Completion> Next(absl::Duration timeout) {
    bool resume_reading = false;
    absl::StatusOr<v1::Completion> result;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !queue_.empty() || done_;
      };
      if (timeout == absl::InfiniteDuration()) {
        mu_.Await(absl::Condition(&ready));
      } else {
        mu_.AwaitWithTimeout(absl::Condition(&ready),
                             std::max(timeout, absl::ZeroDuration()));
      }
      if (!queue_.empty()) {
        result = std::move(queue_.front());
        queue_.pop_front();
        if (!reading_ && !done_) {
          reading_ = true;
          resume_reading = true;
        }
      } else if (done_) {
        if (cancelled_) {
          result = absl::CancelledError("completion stream cancelled");
        } else if (final_status_.ok()) {
          result = absl::OutOfRangeError(
              "completion stream ended (the session ended)");
        } else {
          result = final_status_;
        }
      } else {
        result = absl::DeadlineExceededError(absl::StrCat(
            "no completion within ", absl::FormatDuration(timeout)));
      }
    }
    if (resume_reading) StartRead(&incoming_);
    return result;
  }

  void Cancel() {
    {
      absl::MutexLock lock(&mu_);
      if (done_) return;
      cancelled_ = true;
    }
    context_.TryCancel();
  }

  void WaitDone() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
  }

  const std::shared_ptr<internal::SessionCore>& core() const { return core_; }

 private:
  explicit Reactor(std::shared_ptr<internal::SessionCore> core)
      : core_(std::move(core)) {
    request_.set_session(core_->token);
  }

  void Begin() {
    core_->client.core().stub->async()->StreamCompletions(&context_, &request_,
                                                          this);
    {
      absl::MutexLock lock(&mu_);
      reading_ = true;
    }
    StartRead(&incoming_);
    StartCall();
  }

  const std::shared_ptr<internal::SessionCore> core_;
  grpc::ClientContext context_;
  v1::StreamCompletionsRequest request_;
  v1::Completion incoming_;  // written by gRPC between StartRead and OnReadDone
  std::shared_ptr<Reactor> self_;

  absl::Mutex mu_;
  std::deque<v1::Completion> queue_ ABSL_GUARDED_BY(mu_);
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status final_status_ ABSL_GUARDED_BY(mu_);
};

CompletionStream CompletionStream::Open(const Session& session) {
  return CompletionStream(Reactor::Start(session.core()));
}

CompletionStream::CompletionStream(CompletionStream&& other) noexcept {
  absl::MutexLock theirs(&other.mu_);
  absl::MutexLock ours(&mu_);
  reactor_ = std::move(other.reactor_);
  cancelled_ = other.cancelled_;
}

CompletionStream& CompletionStream::operator=(
    CompletionStream&& other) noexcept {
  if (this != &other) {
    Shutdown();
    absl::MutexLock theirs(&other.mu_);
    absl::MutexLock ours(&mu_);
    reactor_ = std::move(other.reactor_);
    cancelled_ = other.cancelled_;
  }
  return *this;
}

CompletionStream::~CompletionStream() { Shutdown(); }

std::shared_ptr<CompletionStream::Reactor> CompletionStream::reactor() const {
  absl::MutexLock lock(&mu_);
  return reactor_;
}

void CompletionStream::Shutdown() {
  std::shared_ptr<Reactor> reactor;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    reactor = std::move(reactor_);
  }
  if (reactor == nullptr) return;
  reactor->Cancel();
  reactor->WaitDone();
}

absl::StatusOr<v1::Completion> CompletionStream::Next(absl::Duration timeout) {
  const absl::Time deadline = timeout == absl::InfiniteDuration()
                                  ? absl::InfiniteFuture()
                                  : absl::Now() + timeout;
  for (;;) {
    std::shared_ptr<Reactor> current = reactor();
    if (current == nullptr) {
      return absl::FailedPreconditionError(
          "use of a moved-from CompletionStream");
    }
    absl::StatusOr<v1::Completion> next = current->Next(
        deadline == absl::InfiniteFuture() ? absl::InfiniteDuration()
                                           : deadline - absl::Now());
    if (next.ok() || next.status().code() != absl::StatusCode::kUnavailable ||
        ReasonOf(next.status()) != "HANDED_OVER") {
      return next;
    }
    // mrd handed over: the session goes on in the new process, which the
    // channel reaches on its next connection. Open the stream there.
    absl::SleepFor(absl::Milliseconds(20));
    absl::MutexLock lock(&mu_);
    if (cancelled_) return absl::CancelledError("completion stream cancelled");
    if (reactor_ == current) reactor_ = Reactor::Start(current->core());
  }
}

void CompletionStream::Cancel() {
  std::shared_ptr<Reactor> current;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    current = reactor_;
  }
  if (current != nullptr) current->Cancel();
}

}  // namespace mrd::client
