// mrd::client::CompletionStream: the session's StreamCompletions stream
// (completions of FastRegister/InvalidateMr with their request_context, peer
// connection events, and REGISTRATION_PROGRESS reports of registrations of
// 32 MiB or more still pinning: request_id, buffer, offset and length name
// the call), read with a timeout. A registration is cancelled, leaving
// nothing pinned, when its deadline (ClientOptions::rpc_timeout) passes
// while mrd pins. Runs on gRPC's callback API; completions are buffered here
// (up to 4096, then reading pauses until Next() makes room). The destructor
// cancels the stream and waits for it to end.
//
// Movable, not copyable. Next() and Cancel() may be called from different
// threads; one reader at a time.
#ifndef MRD_CLIENT_LIB_COMPLETION_STREAM_H_
#define MRD_CLIENT_LIB_COMPLETION_STREAM_H_

#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/lib/session.h"
#include "mrd/v1/mrd.pb.h"

namespace mrd::client {

class CompletionStream {
 public:
  // Starts the stream (no deadline). Errors surface on Next().
  static CompletionStream Open(const Session& session);

  CompletionStream(CompletionStream&& other) noexcept;
  CompletionStream& operator=(CompletionStream&& other) noexcept;
  CompletionStream(const CompletionStream&) = delete;
  CompletionStream& operator=(const CompletionStream&) = delete;
  ~CompletionStream();

  // The next completion, in order. DEADLINE_EXCEEDED if none arrived within
  // `timeout` (the stream stays usable); OUT_OF_RANGE once the stream ended
  // normally (the session ended); CANCELLED after Cancel(); otherwise the
  // stream's error (e.g. FAILED_PRECONDITION with WSAENOTCONN for an unknown
  // session).
  absl::StatusOr<v1::Completion> Next(
      absl::Duration timeout = absl::InfiniteDuration());
  // Cancels the stream; pending and later Next() calls return what is
  // buffered, then CANCELLED. Idempotent.
  void Cancel();

  class Reactor;  // implementation detail

 private:
  explicit CompletionStream(std::shared_ptr<Reactor> reactor)
      : reactor_(std::move(reactor)) {}
  void Shutdown();
  std::shared_ptr<Reactor> reactor() const ABSL_LOCKS_EXCLUDED(mu_);

  // Replaced when mrd hands over to a new process (the stream ends with
  // UNAVAILABLE HANDED_OVER): Next opens it again there, where the session
  // and its queued completions went. The mutex: Cancel may run on another
  // thread meanwhile.
  mutable absl::Mutex mu_;
  std::shared_ptr<Reactor> reactor_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace mrd::client

#endif  // MRD_CLIENT_LIB_COMPLETION_STREAM_H_
