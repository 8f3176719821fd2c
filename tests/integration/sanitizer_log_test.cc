// CheckSanitizerLog, the rule MrdProcess::Stop applies to the reports of a
// sanitized mrd: only a ThreadSanitizer report whose every access was made by
// Debian's gRPC passes (see mrd_process.h).
#include <gtest/gtest.h>

#include <string>

#include "absl/strings/match.h"
#include "tests/integration/mrd_process.h"

namespace mrd::testing {
namespace {

// The one report every TSan-built mrd gives (GCC 12's libtsan, Debian's
// gRPC 1.51): gRPC's event engine thread waits on the epoll fd that gRPC
// created while mrd's main started the server; the hand-over of the poller to
// that thread happens inside libgrpc, where TSan sees no synchronization.
constexpr char kEpollReport[] = R"(==================
WARNING: ThreadSanitizer: data race (pid=30048)
  Read of size 8 at 0x7ba0000000e0 by thread T12:
    #0 epoll_wait ../../../../src/libsanitizer/tsan/tsan_interceptors_posix.cpp:1895 (libtsan.so.2+0x610ed)
    #1 grpc_event_engine::posix_engine::Epoll1Poller::DoEpollWait(std::chrono::duration<long, std::ratio<1l, 1000000000l> >) <null> (libgrpc.so.29+0x3dc79d)

  Previous write of size 8 at 0x7ba0000000e0 by main thread:
    #0 epoll_create1 ../../../../src/libsanitizer/tsan/tsan_interceptors_posix.cpp:1875 (libtsan.so.2+0x3f6fe)
    #1 grpc_event_engine::posix_engine::Epoll1Poller::Epoll1Poller(grpc_event_engine::posix_engine::Scheduler*) <null> (libgrpc.so.29+0x3dc262)
    #2 main ../server/main.cc:505 (mrd+0x311c1)

  Location is file descriptor 14 created by main thread at:
    #0 epoll_create1 ../../../../src/libsanitizer/tsan/tsan_interceptors_posix.cpp:1875 (libtsan.so.2+0x3f6fe)
    #1 grpc_event_engine::posix_engine::Epoll1Poller::Epoll1Poller(grpc_event_engine::posix_engine::Scheduler*) <null> (libgrpc.so.29+0x3dc262)
    #2 main ../server/main.cc:505 (mrd+0x311c1)

  Thread T12 'event_engine' (tid=30061, running) created by main thread at:
    #0 pthread_create ../../../../src/libsanitizer/tsan/tsan_interceptors_posix.cpp:1001 (libtsan.so.2+0x5e686)
    #1 grpc_core::Thread::Thread(char const*, void (*)(void*), void*, bool*, grpc_core::Thread::Options const&) <null> (libgpr.so.29+0xb0cb)
    #2 main ../server/main.cc:505 (mrd+0x311c1)

SUMMARY: ThreadSanitizer: data race (/lib/x86_64-linux-gnu/libgrpc.so.29+0x3dc79d) in grpc_event_engine::posix_engine::Epoll1Poller::DoEpollWait(std::chrono::duration<long, std::ratio<1l, 1000000000l> >)
==================
)";

constexpr char kReadFrame1[] =
    "    #1 grpc_event_engine::posix_engine::Epoll1Poller::DoEpollWait(std::"
    "chrono::duration<long, std::ratio<1l, 1000000000l> >) <null> "
    "(libgrpc.so.29+0x3dc79d)\n";
constexpr char kWriteFrame0[] =
    "    #0 epoll_create1 ../../../../src/libsanitizer/tsan/"
    "tsan_interceptors_posix.cpp:1875 (libtsan.so.2+0x3f6fe)\n";

// The write stack's frames under epoll_create1 (gRPC's, called by main).
constexpr char kWriteFrames12[] =
    "    #1 grpc_event_engine::posix_engine::Epoll1Poller::"
    "Epoll1Poller(grpc_event_engine::posix_engine::Scheduler*) "
    "<null> (libgrpc.so.29+0x3dc262)\n"
    "    #2 main ../server/main.cc:505 (mrd+0x311c1)\n";

// `log` with `text` inserted after the first occurrence of `anchor`.
std::string InsertAfter(std::string log, const std::string& anchor,
                        const std::string& text) {
  const size_t at = log.find(anchor);
  EXPECT_NE(at, std::string::npos) << anchor;
  log.insert(at + anchor.size(), text);
  return log;
}

// Replaces the first occurrence of `from` in `log` with `to`.
std::string Replace(std::string log, const std::string& from,
                    const std::string& to) {
  const size_t at = log.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  log.replace(at, from.size(), to);
  return log;
}

absl::Status Check(const std::string& log) {
  int library_only = 0;
  return CheckSanitizerLog(log, &library_only);
}

TEST(SanitizerLogTest, NoReportPasses) {
  int library_only = -1;
  EXPECT_TRUE(CheckSanitizerLog("", &library_only).ok());
  EXPECT_EQ(library_only, 0);
}

TEST(SanitizerLogTest, ReportInsideGrpcPasses) {
  int library_only = 0;
  absl::Status s = CheckSanitizerLog(std::string(kEpollReport) + kEpollReport +
                                         "ThreadSanitizer: reported 2 "
                                         "warnings\n",
                                     &library_only);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(library_only, 2);
}

// gRPC's callback API is header code compiled into mrd: an access made there
// is gRPC's, and mrd's frames below it only called into gRPC.
TEST(SanitizerLogTest, GrpcHeaderCodeCalledFromMrdPasses) {
  const std::string log = InsertAfter(
      Replace(kEpollReport, kReadFrame1,
              "    #1 std::__cxx11::basic_string<char>::_M_data() const "
              "/usr/include/c++/12/bits/basic_string.h:234 (mrd+0x98)\n"
              "    #2 grpc::Status::operator=(grpc::Status&&) "
              "/usr/include/grpcpp/support/status.h:44 (mrd+0x99)\n"),
      "/usr/include/grpcpp/support/status.h:44 (mrd+0x99)\n",
      "    #3 mrd::service::MrdService::Reply() "
      "../server/service/service.cc:99 (mrd+0x4321)\n");
  absl::Status s = Check(log);
  EXPECT_TRUE(s.ok()) << s << log;
}

// An access made by mrd's code, or by a library for mrd without gRPC, fails
// the report, and the error carries it.
TEST(SanitizerLogTest, AnAccessMadeByMrdFails) {
  const std::string mrd_frame =
      "    #1 mrd::core::Core::Register() ../server/core/core.cc:10 "
      "(mrd+0x1234)\n";
  for (const std::string& log : {
           Replace(
               kEpollReport, kWriteFrame0,
               "    #0 mrd::core::Core::Register() ../server/core/core.cc:10 "
               "(mrd+0x1234)\n"),
           Replace(kEpollReport, kReadFrame1, mrd_frame),
           // Generated protobuf code acts for its caller: without gRPC or
           // a library calling it, it is mrd's.
           Replace(kEpollReport, kReadFrame1,
                   "    #1 mrd::v1::RegisterMrRequest::SharedCtor() "
                   "gen/mrd/v1/mrd.pb.cc:10 (mrd+0x99)\n"),
           Replace(kEpollReport, kReadFrame1,
                   "    #1 mrd::v1::RegisterMrResponse::set_key(unsigned int) "
                   "proto/gen/mrd/v1/mrd.pb.h:10 (mrd+0x99)\n" +
                       mrd_frame),
           // Abseil's or protobuf's header code, libstdc++, other libraries
           // act on mrd's data for mrd.
           Replace(kEpollReport, kReadFrame1,
                   "    #1 absl::container_internal::raw_hash_set<>::find() "
                   "/usr/include/absl/container/internal/raw_hash_set.h:9 "
                   "(mrd+0x99)\n" +
                       mrd_frame),
           Replace(kEpollReport, kReadFrame1,
                   "    #1 <null> <null> (libstdc++.so.6+0x10)\n" + mrd_frame),
           Replace(kEpollReport, kReadFrame1, "    #1 <null> <null> <null>\n"),
       }) {
    absl::Status s = Check(log);
    EXPECT_FALSE(s.ok()) << log;
    EXPECT_TRUE(absl::StrContains(s.message(), "Previous write of size 8"))
        << s;
  }
}

// gRPC destroys a response it allocated, with the code generated for it:
// the access is gRPC's (clang's report format, runtime linked into mrd).
TEST(SanitizerLogTest, GeneratedCodeCalledByGrpcPasses) {
  const std::string log = Replace(
      kEpollReport, kReadFrame1,
      "    #1 mrd::v1::RegisterMrResponse::~RegisterMrResponse() "
      "/work/build/proto/gen/mrd/v1/mrd.pb.cc:5893:41 (mrd+0x1f3e21) "
      "(BuildId: 27ed07d94e9b771c)\n"
      "    #2 grpc::internal::DefaultMessageHolder<mrd::v1::RegisterMrRequest, "
      "mrd::v1::RegisterMrResponse>::Release() "
      "/usr/include/grpcpp/support/server_callback.h:170:12 (mrd+0x1204f9) "
      "(BuildId: 27ed07d94e9b771c)\n"
      "    #3 <null> <null> (libgrpc++.so.1.51+0xa21ed) (BuildId: 967015e)\n");
  absl::Status s =
      Check(Replace(log, kWriteFrame0,
                    "    #0 operator delete(void*) <null> "
                    "(mrd+0xfe4fe) (BuildId: 27ed07d94e9b771c)\n"));
  EXPECT_TRUE(s.ok()) << s << log;
}

// libstdc++'s code instantiated for gRPC's types, called from gRPC's
// (uninstrumented) header code: the stack shows no caller, and it is gRPC's
// (clang's TSan build, a std::function gRPC's call ops construct).
TEST(SanitizerLogTest, HeaderCodeForGrpcTypesWithoutCallerPasses) {
  const std::string for_grpc =
      "    #1 std::_Function_base::_Function_base() /usr/bin/../lib/gcc/"
      "x86_64-linux-gnu/12/../../../../include/c++/12/bits/"
      "std_function.h:252:30 (mrd+0x1266a0) (BuildId: 1b02)\n"
      "    #2 std::function<grpc::Status (void const*)>::function() "
      "/usr/bin/../lib/gcc/x86_64-linux-gnu/12/../../../../include/c++/12/"
      "bits/std_function.h:369:9 (mrd+0x1266a0)\n";
  const std::string log = Replace(kEpollReport, kReadFrame1, for_grpc);
  absl::Status s = Check(log);
  EXPECT_TRUE(s.ok()) << s << log;
  // The same code called by mrd's is mrd's.
  s = Check(InsertAfter(log, "std_function.h:369:9 (mrd+0x1266a0)\n",
                        "    #3 mrd::service::Reply() "
                        "../server/service/service.cc:9 (mrd+0x1)\n"));
  EXPECT_FALSE(s.ok());
  // Without gRPC's types it is not gRPC's.
  s = Check(Replace(log, "grpc::Status (void const*)", "void ()"));
  EXPECT_FALSE(s.ok());
}

// A stack of Debian's uninstrumented libraries only (here Abseil's time
// zone code, which gRPC's threads run) is theirs, with or without gRPC.
TEST(SanitizerLogTest, LibraryOnlyStacksPass) {
  const std::string library_only =
      "    #1 absl::debian3::time_internal::cctz::time_zone::Impl::"
      "LoadTimeZone() <null> (libabsl_time_zone.so.20220623+0xc16d)\n";
  std::string log = Replace(kEpollReport, kReadFrame1, library_only);
  log = Replace(log, kWriteFrames12, library_only);
  absl::Status s = Check(log);
  EXPECT_TRUE(s.ok()) << s << log;
  // The same library called by mrd's code is mrd's access.
  s = Check(InsertAfter(log, library_only,
                        "    #2 mrd::Now() ../server/common/clock.h:9 "
                        "(mrd+0x1)\n"));
  EXPECT_FALSE(s.ok());
}

// Library names with a '+' of their own (libstdc++, libgrpc++) are read
// whole: an access libstdc++ made for an uninstrumented caller (here for
// gRPC, filling in a call's status message on its own thread) is library
// code only, and a libgrpc++ frame is gRPC's. Seen with mrd's etcd client:
// before, "libstdc" was taken for mrd's executable and the report failed.
TEST(SanitizerLogTest, LibraryNamesWithAPlusAreReadWhole) {
  const std::string libstdcxx =
      "    #0 memset <null> (mrd+0xba1dd) (BuildId: cdd9afa7)\n"
      "    #1 std::__cxx11::basic_string<char, std::char_traits<char>, "
      "std::allocator<char> >::_M_replace_aux(unsigned long, unsigned long, "
      "unsigned long, char) <null> (libstdc++.so.6+0x140959) (BuildId: "
      "289ee39f)\n";
  std::string log = Replace(kEpollReport, kWriteFrame0, libstdcxx);
  log = Replace(log, kWriteFrames12, "");
  absl::Status s = Check(log);
  EXPECT_TRUE(s.ok()) << s << log;
  const std::string grpcxx =
      "    #1 grpc::Server::Start(grpc::ServerCompletionQueue**, unsigned "
      "long) <null> (libgrpc++.so.1.51+0x9c1e0)\n";
  s = Check(Replace(kEpollReport, kReadFrame1, grpcxx));
  EXPECT_TRUE(s.ok()) << s;
}

TEST(SanitizerLogTest, UnrestoredStackFails) {
  const std::string stack = std::string(
                                "    #0 epoll_wait ../../../../src/"
                                "libsanitizer/tsan/tsan_interceptors_"
                                "posix.cpp:1895 (libtsan.so.2+0x610ed)"
                                "\n") +
                            kReadFrame1;
  EXPECT_FALSE(
      Check(Replace(kEpollReport, stack, "    [failed to restore the stack]\n"))
          .ok());
}

TEST(SanitizerLogTest, ThreadLeakFails) {
  constexpr char kLeak[] = R"(==================
WARNING: ThreadSanitizer: thread leak (pid=4242)
  Thread T5 (tid=4249, finished) created by main thread at:
    #0 pthread_create ../../../../src/libsanitizer/tsan/tsan_interceptors_posix.cpp:1001 (libtsan.so.2+0x5ad75)
    #1 <null> <null> (libgpr.so.29+0x1)

SUMMARY: ThreadSanitizer: thread leak
==================
)";
  EXPECT_FALSE(Check(kLeak).ok());
}

TEST(SanitizerLogTest, AsanAndUbsanReportsFail) {
  EXPECT_FALSE(Check("==1==ERROR: AddressSanitizer: heap-use-after-free on "
                     "address 0x1\n")
                   .ok());
  EXPECT_FALSE(
      Check("==1==ERROR: LeakSanitizer: detected memory leaks\n").ok());
  EXPECT_FALSE(Check("server/core/core.cc:10:5: runtime error: signed integer "
                     "overflow\n")
                   .ok());
}

}  // namespace
}  // namespace mrd::testing
