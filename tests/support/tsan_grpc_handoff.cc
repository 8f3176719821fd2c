// TSan builds only (linked into every executable when MRD_SANITIZE=thread,
// see cmake/MrdOptions.cmake). Debian's libgrpc and libgrpc++ are not built
// with -fsanitize=thread, so ThreadSanitizer cannot see them hand a call from
// one thread to another:
//  - from the thread that starts a batch of operations (a worker calling
//    Finish or StartWrite, which serializes the response first) to the
//    gRPC thread that completes it, runs the reactor's callbacks and then
//    frees the request and response;
//  - from the thread that drops a callback call's last reference (which may
//    have bound the reactor just before) to the thread libgrpc++ then runs
//    OnDone or OnCancel on.
// Every call would be reported as a race between those threads.
//
// The definitions below interpose libgrpc's grpc_call_start_batch and
// libgrpc++'s ServerCallbackCall::ScheduleOnDone and ::CallOnCancel: an
// executable's symbol wins over a shared library's for every caller that
// goes through the dynamic linker (gRPC's header code compiled into mrd, and
// libgrpc++'s calls into libgrpc). Each releases on one process-wide key,
// then runs the real function; the receiving side acquires on the same key
// (mrd::TsanTakeOverFromGrpc in server/common/tsan.h, called first thing by
// mrd's reactor callbacks).
//
// The key is process-wide, not per call, because a callback must acquire
// before it reads anything, its own members included. The price: a callback
// is ordered after every hand-over made before it, on any call, so TSan may
// miss a race between a thread that handed a call to gRPC and a later
// callback.
#include <dlfcn.h>
#include <grpc/grpc.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>

namespace {
// The real definition of `name`, in the next object after this executable.
template <typename Fn>
Fn Real(const char* name) {
  void* sym = ::dlsym(RTLD_NEXT, name);
  if (sym == nullptr) {
    std::fprintf(stderr, "tsan_grpc_handoff: %s not found\n", name);
    std::abort();
  }
  return reinterpret_cast<Fn>(sym);
}
}  // namespace

extern "C" {

char mrd_tsan_grpc_handoff = 0;

grpc_call_error grpc_call_start_batch(grpc_call* call, const grpc_op* ops,
                                      size_t nops, void* tag, void* reserved) {
  using Fn =
      grpc_call_error (*)(grpc_call*, const grpc_op*, size_t, void*, void*);
  static const Fn real = Real<Fn>("grpc_call_start_batch");
  __tsan_release(&mrd_tsan_grpc_handoff);
  return real(call, ops, nops, tag, reserved);
}

// grpc::internal::ServerCallbackCall::ScheduleOnDone(bool) and
// ::CallOnCancel(grpc::internal::ServerReactor*): member functions, whose
// first argument is `this`.
void MrdTsanScheduleOnDone(void* self, bool inline_ondone) __asm__(
    "_ZN4grpc8internal18ServerCallbackCall14ScheduleOnDoneEb");
void MrdTsanScheduleOnDone(void* self, bool inline_ondone) {
  using Fn = void (*)(void*, bool);
  static const Fn real =
      Real<Fn>("_ZN4grpc8internal18ServerCallbackCall14ScheduleOnDoneEb");
  __tsan_release(&mrd_tsan_grpc_handoff);
  real(self, inline_ondone);
}

void MrdTsanCallOnCancel(void* self, void* reactor) __asm__(
    "_ZN4grpc8internal18ServerCallbackCall12CallOnCancelEPNS0_"
    "13ServerReactorE");
void MrdTsanCallOnCancel(void* self, void* reactor) {
  using Fn = void (*)(void*, void*);
  static const Fn real = Real<Fn>(
      "_ZN4grpc8internal18ServerCallbackCall12CallOnCancelEPNS0_"
      "13ServerReactorE");
  __tsan_release(&mrd_tsan_grpc_handoff);
  real(self, reactor);
}

}  // extern "C"
