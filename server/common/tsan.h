// ThreadSanitizer annotations for hand-overs that happen inside libraries
// TSan cannot see (Debian's libgrpc is not built with -fsanitize=thread).
// They compile to nothing unless the build is a TSan build.
//
// The gRPC hand-over: a thread that starts a batch of operations on a call
// (grpc_call_start_batch: Finish, StartWrite) publishes what it wrote before,
// and the gRPC thread that later runs the call's callbacks (OnWriteDone,
// OnDone, then the destruction of the request and response) reads and frees
// that memory. In TSan builds every executable gets an interposed
// grpc_call_start_batch that releases on one process-wide key
// (tests/support/tsan_grpc_handoff.cc); each callback of ours acquires on
// that key with TsanTakeOverFromGrpc before it touches anything (before
// reading even its own members, which is why the key is not per call).
#ifndef MRD_SERVER_COMMON_TSAN_H_
#define MRD_SERVER_COMMON_TSAN_H_

#if defined(__SANITIZE_THREAD__)
#define MRD_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MRD_TSAN 1
#endif
#endif

#include <chrono>

#ifdef MRD_TSAN
#include <sanitizer/tsan_interface.h>

// Defined by tests/support/tsan_grpc_handoff.cc (TSan builds only).
extern "C" char mrd_tsan_grpc_handoff;
// TSan's runtime has these; its public header does not declare them.
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
#endif

namespace mrd {

// Orders everything threads did before they started a gRPC batch before
// what the calling thread (a gRPC callback) does next.
inline void TsanTakeOverFromGrpc() {
#ifdef MRD_TSAN
  __tsan_acquire(&mrd_tsan_grpc_handoff);
#endif
}

// The other way: what a gRPC callback did so far is ordered before what a
// thread that later calls TsanTakeOverFromGrpc does (the main thread
// tearing down, after the server stopped, what callbacks used).
inline void TsanHandBackToGrpc() {
#ifdef MRD_TSAN
  __tsan_release(&mrd_tsan_grpc_handoff);
#endif
}

// Runs `call`, a call into gRPC that does gRPC's own work on this thread
// (grpc::Server::Shutdown tearing down connections that gRPC's threads
// made), with this thread's reads and writes unrecorded; its locks and
// releases still count. TSan sees such work only through the libc calls it
// makes, some of them from Debian's uninstrumented Abseil on gRPC's own data
// (absl::StrCat copying a peer address gRPC's TCP client wrote), which
// neither the suppressions nor the log check can tell from mrd's own use of
// Abseil: the report's stacks end in the mrd frame that called gRPC. What
// mrd's callbacks do on this thread during the call goes unchecked too:
// keep `call` to the one gRPC call.
template <typename Call>
void TsanUnrecorded(Call&& call) {
#ifdef MRD_TSAN
  __tsan_ignore_thread_begin();
#endif
  call();
#ifdef MRD_TSAN
  __tsan_ignore_thread_end();
#endif
}

// A gRPC server's Shutdown with `grace` for its calls, unrecorded as above.
template <typename Server>
void ShutdownUnrecorded(Server& server, std::chrono::milliseconds grace) {
  TsanUnrecorded(
      [&] { server.Shutdown(std::chrono::system_clock::now() + grace); });
}

}  // namespace mrd

#endif  // MRD_SERVER_COMMON_TSAN_H_
