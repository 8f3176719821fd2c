// DeferRelease: drops a reference on the library's own release thread.
//
// gRPC 1.51 must not lose its last channel reference on one of its own
// callback threads: destroying the channel there frees the callback queue
// that thread is running and aborts the process. Async completions and
// stream reactors of this library may hold the last reference to a Client's
// state (a caller may drop its Client and Session while calls are in flight),
// so whatever they hold is handed to DeferRelease instead of being dropped on
// the callback thread. Thread-safe; never blocks.
#ifndef MRD_CLIENT_LIB_DEFERRED_RELEASE_H_
#define MRD_CLIENT_LIB_DEFERRED_RELEASE_H_

#include <memory>

namespace mrd::client::internal {

void DeferRelease(std::shared_ptr<const void> object);

}  // namespace mrd::client::internal

#endif  // MRD_CLIENT_LIB_DEFERRED_RELEASE_H_
