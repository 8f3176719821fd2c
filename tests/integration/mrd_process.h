// MrdProcess: starts the real mrd binary for a test, with its own runtime
// directory (sockets), its own shared-memory directory, the software device's
// peer listener on a free port (software device on loopback; the verbs
// device on MRD_VERBS_ADDRESS, see DeviceFlags) and metrics off (or on, when
// asked), and waits until its health service says SERVING. Stop() sends SIGTERM
// and checks that mrd exited 0, reported nothing pinned and no sanitizer
// report.
//
// The binary is the mrd of this build (compiled in), or the one named by the
// environment variable MRD_TEST_MRD_BINARY when it is set and not empty:
// scripts/test-all.sh runs the plain build's integration tests against the
// TSan build's mrd that way. The server's sanitizer runtimes write their
// reports to <runtime_dir>/sanitizer.<pid> (MrdProcess appends log_path to
// TSAN_OPTIONS, ASAN_OPTIONS and UBSAN_OPTIONS for the child, keeping the
// rest of those variables). Stop() fails on any AddressSanitizer,
// LeakSanitizer or UBSan report, and on any ThreadSanitizer report except
// one whose every access was made by Debian's gRPC (CheckSanitizerLog below;
// why: tests/support/tsan_server.supp).
//
// Not thread-safe; one per test fixture.
#ifndef MRD_TESTS_INTEGRATION_MRD_PROCESS_H_
#define MRD_TESTS_INTEGRATION_MRD_PROCESS_H_

#include <grpcpp/grpcpp.h>
#include <sys/types.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace mrd::testing {

struct MrdProcessOptions {
  std::vector<std::string> extra_flags;
  bool metrics = false;  // serve metrics on a free loopback port
  // With metrics: this address instead of a free port (a successor that
  // takes over another mrd's metrics socket says the same address).
  std::string metrics_address;
  // --runtime_dir and --shm_dir: empty = a fresh private directory that the
  // process removes when it goes. A given one belongs to the test (not
  // removed); with a given runtime_dir the log goes to a file of its own.
  std::string runtime_dir;
  std::string shm_dir;
  // Non-empty: run mrd under `prlimit --nofile=<nofile>` (util-linux), e.g.
  // "1024" (soft and hard) or "512:4096" (soft:hard). prlimit execs mrd, so
  // pid() is still mrd's.
  std::string nofile;
  // Run mrd under this command (which execs the rest), e.g. setpriv to drop
  // a capability. pid() is mrd's as long as the command execs.
  std::vector<std::string> wrapper;
  // Environment variables set for mrd (on top of the test's own), e.g.
  // NOTIFY_SOCKET.
  std::vector<std::pair<std::string, std::string>> env;
};

// How an mrd that was expected to refuse to start ended.
struct MrdExit {
  int status = 0;  // as from waitpid
  std::string log;
};

class MrdProcess {
 public:
  static absl::StatusOr<std::unique_ptr<MrdProcess>> Start(
      const MrdProcessOptions& options = {});
  // Runs mrd expecting it to exit on its own within `timeout_ms` (a refusal
  // to start): returns how it exited and its log. An error when it is still
  // running then (it is killed) or cannot be started.
  static absl::StatusOr<MrdExit> RunToExit(const MrdProcessOptions& options,
                                           int timeout_ms = 10000);
  ~MrdProcess();

  const std::string& runtime_dir() const { return runtime_dir_; }
  std::string grpc_socket() const { return runtime_dir_ + "/mrd.sock"; }
  std::string grpc_target() const { return "unix:" + grpc_socket(); }
  std::string fd_socket() const { return runtime_dir_ + "/fd.sock"; }
  const std::string& shm_dir() const { return shm_dir_; }
  const std::string& metrics_address() const { return metrics_address_; }
  pid_t pid() const { return pid_; }

  // SIGTERM, wait, expect exit code 0 and "pinned bytes: 0" in the log, and
  // no sanitizer report (see above). ThreadSanitizer exits 66 after any
  // report: that exit is accepted when every report is library-only.
  absl::Status Stop();
  // Waits up to `timeout` for mrd to exit on its own (a handover's old
  // process does); true when it did. Stop then checks how it exited
  // instead of stopping it.
  bool WaitExited(absl::Duration timeout);
  // The server's stderr so far.
  std::string Log() const;
  // The sanitizer reports this mrd wrote so far (<runtime_dir>/sanitizer.<pid>;
  // another process sharing the runtime directory, a handover's other side,
  // may be writing its own meanwhile), or those of process `pid`.
  std::string SanitizerLog() const { return SanitizerLogOf(pid_); }
  std::string SanitizerLogOf(pid_t pid) const;

 private:
  MrdProcess() = default;
  // Forks and execs mrd with `options`; does not wait.
  static absl::StatusOr<std::unique_ptr<MrdProcess>> Launch(
      const MrdProcessOptions& options);
  absl::Status WaitServing();

  pid_t pid_ = -1;
  bool exited_ = false;  // reaped by WaitExited, with exit_status_
  int exit_status_ = 0;
  std::string runtime_dir_;
  std::string shm_dir_;
  std::string log_path_;
  bool owns_runtime_dir_ = false;  // removed by the destructor
  bool owns_shm_dir_ = false;
  bool owns_log_ = false;  // log_path_ lies outside runtime_dir_
  std::string metrics_address_;
};

// The device the tests run against: env MRD_TEST_DEVICE ("software", the
// default, or "verbs" inside the Soft-RoCE VM, where MRD_VERBS_DEVICE and
// MRD_VERBS_ADDRESS name the device and the address peers connect to).
std::string TestDeviceKind();
// mrd's --device, --verbs_device and --peer_address flags for that device.
std::vector<std::string> DeviceFlags();

// The mrd executable the tests start (see MRD_TEST_MRD_BINARY above).
std::string MrdBinary();
// A channel to mrd's gRPC socket on a connection of its own: a subchannel
// pool of its own (gRPC shares one connection between channels to the same
// target otherwise).
std::shared_ptr<grpc::Channel> NewConnection(const MrdProcess& mrd);
// A grpc.health.v1 Check on `channel` within `timeout`: gRPC's status, and
// the answer in `*serving`.
grpc::Status CheckHealth(const std::shared_ptr<grpc::Channel>& channel,
                         absl::Duration timeout, bool* serving);
// CheckHealth on a NewConnection, 3 s deadline. OK when SERVING.
absl::Status HealthCheckOnNewConnection(const MrdProcess& mrd);
// GET /metrics from an mrd serving metrics on `host_port` (loopback): the
// body of its 200 response; an error for any other answer.
absl::StatusOr<std::string> ScrapeMetrics(const std::string& host_port);
// True when that is another build's mrd (the TSan build's).
bool MrdBinaryIsForeign();
// True when the mrd the tests start runs a sanitizer's allocator (this is an
// ASan or TSan build, or the binary is foreign): it keeps freed memory in
// quarantine and maps memory of its own as it goes, so mrd's memory and map
// counts carry more than mrd holds.
bool MrdHasSanitizerAllocator();

// Checks the sanitizer output `log` of one mrd: OK when it has no report, or
// only library-only ThreadSanitizer reports: in every stack the report is
// about (not those that only say where a thread, block or fd was created),
// the frames above the first frame of mrd's own code (its sources, its
// generated protobuf code) are all Debian library code and include gRPC's
// (libgrpc, libgrpc++, libgpr, or gRPC's headers compiled into mrd): the
// access was made by gRPC, and mrd's frames are only its callers.
// `*library_only` counts those reports. Otherwise an error carrying the
// offending reports. Any AddressSanitizer, LeakSanitizer or UBSan report is
// an error.
absl::Status CheckSanitizerLog(const std::string& log, int* library_only);

// A free TCP port on 127.0.0.1 (bound and released; good enough for tests),
// or the error of the socket call that failed.
absl::StatusOr<int> PickFreePort();

// Writes `size` bytes (content repeated) to a new file under `dir`, mode
// 0600, owned by the caller.
absl::Status WriteShmFile(const std::string& dir, const std::string& name,
                          const std::string& content, size_t size);

}  // namespace mrd::testing

#endif  // MRD_TESTS_INTEGRATION_MRD_PROCESS_H_
