// mrd::client::NameWatch: one WatchName stream (mrd.proto), made by
// Client::WatchName. Next() blocks until mrd reports the watched name's next
// state: first its state when the watch began (PUBLISHED with the entry, or
// UNPUBLISHED), then each change, so a peer learns that a token it uses died
// (UNPUBLISHED) or was published again (PUBLISHED with a new rkey or epoch)
// without polling Resolve. The stream has no deadline: it lasts until the
// caller cancels it or mrd ends it (UNAVAILABLE when mrd stops or hands
// over: watch again). Runs on gRPC's synchronous API; nothing is buffered
// here beyond what gRPC holds. The destructor cancels the stream and waits
// for it to end.
//
// Movable, not copyable. One thread reads (Next); Cancel() may be called
// from any thread meanwhile. Moving, assigning and destroying must not race
// with Next() or Cancel().
#ifndef MRD_CLIENT_LIB_NAME_WATCH_H_
#define MRD_CLIENT_LIB_NAME_WATCH_H_

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "mrd/v1/mrd.pb.h"

namespace mrd::client {

namespace internal {
struct ClientCore;
}  // namespace internal

class NameWatch {
 public:
  NameWatch(NameWatch&& other) noexcept;
  NameWatch& operator=(NameWatch&& other) noexcept;
  NameWatch(const NameWatch&) = delete;
  NameWatch& operator=(const NameWatch&) = delete;
  ~NameWatch();

  // Blocks until the next event. Once the stream is over, every call
  // returns how it ended: CANCELLED after Cancel() (events that arrived
  // before the cancel may still come first), OUT_OF_RANGE if mrd ended it
  // without an error, otherwise mrd's error as StatusFromGrpc converts it
  // (Resolve's errors, RESOURCE_EXHAUSTED WATCH_LIMIT, UNAVAILABLE when mrd
  // stopped, UNAVAILABLE ETCD_COMPACTED). FAILED_PRECONDITION on a
  // moved-from NameWatch.
  absl::StatusOr<v1::NameEvent> Next();

  // Ends the stream: a Next() blocked now, or called later, returns
  // CANCELLED. Idempotent; a no-op on a moved-from NameWatch.
  void Cancel();

  class Stream;  // implementation detail

 private:
  friend class Client;
  // Opens the stream on `core`'s channel; errors surface on Next().
  NameWatch(std::shared_ptr<const internal::ClientCore> core,
            const v1::ResolveRequest& request);

  std::unique_ptr<Stream> stream_;
};

}  // namespace mrd::client

#endif  // MRD_CLIENT_LIB_NAME_WATCH_H_
