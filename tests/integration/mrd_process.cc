#include "tests/integration/mrd_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "grpc/health/v1/health.grpc.pb.h"

#ifndef MRD_BINARY
#error "MRD_BINARY must name the mrd executable"
#endif

namespace mrd::testing {

absl::StatusOr<int> PickFreePort() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::ErrnoToStatus(errno, "socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  // Unchecked, a failed bind reads back port 0, which mrd would take as "any
  // port" and the test could not find.
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    absl::Status error = absl::ErrnoToStatus(errno, "bind 127.0.0.1:0");
    close(fd);
    return error;
  }
  close(fd);
  return ntohs(addr.sin_port);
}

absl::Status WriteShmFile(const std::string& dir, const std::string& name,
                          const std::string& content, size_t size) {
  std::string path = dir + "/" + name;
  int fd = open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
  if (fd < 0) return absl::ErrnoToStatus(errno, "open " + path);
  // `content` repeated to about 1 MiB (a whole number of times, so that
  // the chunks continue the pattern), written as often as it takes: a
  // GiB file costs no GiB of memory, nor a byte-by-byte loop (which the
  // ASan build's coverage instrumentation made take a minute).
  const std::string unit = content.empty() ? std::string(1, '\0') : content;
  std::string chunk = unit;
  while (chunk.size() < (size_t{1} << 20)) chunk += chunk;
  for (size_t written = 0; written < size;) {
    const size_t at = written % chunk.size();  // after a short write
    const size_t want = std::min(chunk.size() - at, size - written);
    const ssize_t n = write(fd, chunk.data() + at, want);
    if (n <= 0) {
      const int error = errno;
      close(fd);
      return n < 0 ? absl::ErrnoToStatus(error, "write " + path)
                   : absl::InternalError("short write");
    }
    written += static_cast<size_t>(n);
  }
  close(fd);
  return absl::OkStatus();
}

std::string MrdBinary() {
  const char* binary = std::getenv("MRD_TEST_MRD_BINARY");
  return binary == nullptr || *binary == '\0' ? MRD_BINARY : binary;
}

bool MrdBinaryIsForeign() { return MrdBinary() != MRD_BINARY; }

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define MRD_SANITIZED_BUILD 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define MRD_SANITIZED_BUILD 1
#endif
#endif

bool MrdHasSanitizerAllocator() {
#ifdef MRD_SANITIZED_BUILD
  return true;
#else
  return MrdBinaryIsForeign();
#endif
}

std::shared_ptr<grpc::Channel> NewConnection(const MrdProcess& mrd) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(mrd.grpc_target(),
                                   grpc::InsecureChannelCredentials(), args);
}

grpc::Status CheckHealth(const std::shared_ptr<grpc::Channel>& channel,
                         absl::Duration timeout, bool* serving) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, req, &resp);
  *serving =
      s.ok() && resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  return s;
}

absl::Status HealthCheckOnNewConnection(const MrdProcess& mrd) {
  bool serving = false;
  grpc::Status s = CheckHealth(NewConnection(mrd), absl::Seconds(3), &serving);
  if (!s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("health check: ", s.error_code(), " ", s.error_message()));
  }
  if (!serving) return absl::UnavailableError("health check: not SERVING");
  return absl::OkStatus();
}

absl::StatusOr<std::string> ScrapeMetrics(const std::string& host_port) {
  int port = 0;
  if (!absl::SimpleAtoi(host_port.substr(host_port.rfind(':') + 1), &port)) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad metrics address ", host_port));
  }
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot connect to metrics at ", host_port));
  }
  const std::string req = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
  if (::write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    ::close(fd);
    return absl::UnavailableError("cannot send the metrics request");
  }
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof(buf))) > 0) {
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  // The body of a 200 response.
  const size_t body = out.find("\r\n\r\n");
  if (!absl::StartsWith(out, "HTTP/1.1 200") || body == std::string::npos) {
    return absl::UnavailableError(absl::StrCat(
        "metrics at ", host_port, " answered: ", out.substr(0, 80)));
  }
  return out.substr(body + 4);
}

namespace {

// How ThreadSanitizer shows a stack: its own shadow stack of the
// instrumented functions (mrd's code, and Debian's header code compiled into
// mrd, such as gRPC's callback API in /usr/include/grpcpp), topped, for an
// access made by a libc call, by the interceptor (libtsan) and the
// interceptor's caller. Code of an uninstrumented library appears only as
// that caller.
//
// The rule (tests/support/tsan_server.supp says why): a report is
// library-only when each stack it is about is either
//  - made by gRPC: the frames above the first frame of mrd's own code are
//    all library code and include gRPC's (libgrpc, libgpr, or gRPC's headers
//    compiled into mrd). mrd's frames below are only the callers (mrd
//    starting the server, replying through its reactor); or
//  - library code only: no frame of mrd's own code at all, and at least one
//    frame of gRPC or of another of Debian's uninstrumented libraries
//    (Abseil's time zone loading on a gRPC thread, say).
// Frames that act for whoever calls them count as library code but make
// neither case alone: the sanitizer runtime's interceptors, libstdc++'s,
// Abseil's and protobuf's header code, and the protobuf code generated for
// mrd's messages (gRPC constructs and destroys requests and responses with
// it). A stack whose access is made by mrd's code, or by such code or a
// library on mrd's behalf without gRPC (std::vector, absl::flat_hash_map, a
// protobuf setter called by mrd's service), an unreadable frame, or a stack
// TSan could not restore fails the report.
enum class FrameKind {
  kGrpc,           // gRPC: libgrpc, libgrpc++, libgpr, gRPC's headers
  kLibrary,        // another of Debian's uninstrumented libraries
  kActsForCaller,  // sanitizer runtime, header-only and generated code
  kMrd,            // mrd's own code, or a frame that cannot be read
};

// The module and file of one frame line, e.g. "libgrpc.so.29" and "<null>"
// of
//   #1 grpc_event_engine::...::DoEpollWait(...) <null> (libgrpc.so.29+0x3dc79d)
// or "mrd" and "/usr/include/grpcpp/support/status.h:44" of
//   #2 grpc::Status::Status(...) /usr/include/grpcpp/support/status.h:44
//   (mrd+0x12)
FrameKind ClassifyFrame(absl::string_view line) {
  // clang's runtime appends the module's build id: "(mrd+0x12) (BuildId: ..)".
  if (const size_t id = line.rfind(" (BuildId: ");
      id != absl::string_view::npos) {
    line = line.substr(0, id);
  }
  const size_t open = line.rfind('(');
  if (open == absl::string_view::npos || line.back() != ')') {
    return FrameKind::kMrd;
  }
  // "libstdc++.so.6+0x1409" or "mrd+0x12)": the name ends at the offset
  // (names hold '+' of their own: libstdc++, libgrpc++).
  absl::string_view module = line.substr(open + 1);
  module = module.substr(0, module.size() - 1);  // the ')'
  if (const size_t offset = module.rfind("+0x");
      offset != absl::string_view::npos) {
    module = module.substr(0, offset);
  }
  const size_t slash = module.rfind('/');
  if (slash != absl::string_view::npos) module = module.substr(slash + 1);
  for (const char* grpc : {"libgrpc.so.", "libgrpc++.so.",
                           "libgrpc++_reflection.so.", "libgpr.so."}) {
    if (absl::StartsWith(module, grpc)) return FrameKind::kGrpc;
  }
  for (const char* runtime : {"libtsan.so.", "libclang_rt.tsan"}) {
    if (absl::StartsWith(module, runtime)) return FrameKind::kActsForCaller;
  }
  // Another shared object: libc, libstdc++, Abseil, protobuf, liburing...
  if (absl::StrContains(module, ".so")) return FrameKind::kLibrary;
  // mrd's executable: the file is the word before the module.
  std::vector<absl::string_view> words =
      absl::StrSplit(line.substr(0, open), ' ', absl::SkipEmpty());
  if (words.size() < 3) return FrameKind::kMrd;
  absl::string_view file = words.back();
  // clang links its TSan runtime into mrd; its interceptors are the only code
  // of mrd's executable without line information (mrd is built with -g).
  if (file == "<null>") return FrameKind::kActsForCaller;
  for (const char* grpc :
       {"/usr/include/grpcpp/", "/usr/include/grpc++/", "/usr/include/grpc/"}) {
    if (absl::StartsWith(file, grpc)) return FrameKind::kGrpc;
  }
  // libstdc++'s headers, as GCC ("/usr/include/c++/12/...") or clang
  // ("/usr/bin/../lib/gcc/x86_64-linux-gnu/12/../../../../include/c++/12/...")
  // names them; Abseil's and protobuf's headers; mrd's generated messages
  // (proto/gen/ in the build directory, gen/ in older builds).
  if (absl::StartsWith(file, "/usr/include/c++/") ||
      (absl::StartsWith(file, "/usr/") &&
       absl::StrContains(file, "/include/c++/")) ||
      absl::StartsWith(file, "/usr/include/absl/") ||
      absl::StartsWith(file, "/usr/include/google/protobuf/") ||
      absl::StrContains(file, ".pb.cc:") || absl::StrContains(file, ".pb.h:")) {
    return FrameKind::kActsForCaller;
  }
  return FrameKind::kMrd;
}

// Stacks that only give context: where a thread was created, where a block,
// fd or mutex was created. Every other stack of a report (the accesses, the
// mutex acquisitions, the calls) is what the report is about.
bool IsContextStack(absl::string_view header) {
  return absl::StartsWith(header, "Location is ") ||
         (absl::StartsWith(header, "Thread ") &&
          absl::StrContains(header, " created by ")) ||
         (absl::StartsWith(header, "Mutex ") &&
          absl::StrContains(header, " created at")) ||
         absl::StartsWith(header, "As if synchronized via sleep");
}

// One ThreadSanitizer report (its lines from "WARNING:" to before the closing
// "=====" line): library-only by the rule above.
bool IsLibraryOnlyTsanReport(const std::vector<absl::string_view>& lines) {
  std::vector<std::vector<absl::string_view>> stacks;
  bool in_stack = false;
  for (absl::string_view raw : lines) {
    absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty()) continue;
    if (absl::StartsWith(line, "#")) {
      if (in_stack) stacks.back().push_back(line);
      continue;
    }
    in_stack = absl::EndsWith(line, ":") &&
               !absl::StartsWith(line, "WARNING:") && !IsContextStack(line);
    if (in_stack) stacks.emplace_back();
    // Any other line inside a stack ("[failed to restore the stack]") leaves
    // that stack short of its frames: it fails below.
  }
  if (stacks.empty()) return false;
  for (const std::vector<absl::string_view>& frames : stacks) {
    bool grpc = false;     // a gRPC frame above the first frame of mrd's
    bool library = false;  // a frame of an uninstrumented library there
    bool mrd = false;      // a frame of mrd's own code
    // Header code instantiated for gRPC's types (std::function<grpc::Status
    // (const void*)> in gRPC's call ops).
    bool for_grpc = false;
    for (absl::string_view frame : frames) {
      const FrameKind kind = ClassifyFrame(frame);
      if (kind == FrameKind::kMrd) {
        mrd = true;
        break;
      }
      grpc = grpc || kind == FrameKind::kGrpc;
      library = library || kind == FrameKind::kLibrary;
      for_grpc = for_grpc || (kind == FrameKind::kActsForCaller &&
                              absl::StrContains(frame, "grpc::"));
    }
    // No frame of mrd's at all: the caller of that header code is not
    // instrumented, and gRPC's header code is not (the TSan build's
    // ignorelist) — the code gRPC instantiated ran for gRPC.
    if (!mrd && for_grpc) grpc = true;
    // Made by gRPC, or library code only. Also fails an empty (unrestored)
    // stack.
    if (!grpc && (mrd || !library)) return false;
  }
  return true;
}

}  // namespace

absl::Status CheckSanitizerLog(const std::string& log, int* library_only) {
  *library_only = 0;
  std::vector<absl::string_view> lines = absl::StrSplit(log, '\n');
  std::string failures;
  int failed = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    absl::string_view line = lines[i];
    if (absl::StrContains(line, "ERROR: AddressSanitizer") ||
        absl::StrContains(line, "ERROR: LeakSanitizer") ||
        absl::StrContains(line, "runtime error:") ||
        absl::StrContains(line, "ERROR: ThreadSanitizer")) {
      return absl::InternalError(
          absl::StrCat("sanitizer report in mrd:\n",
                       absl::StrJoin(lines.begin() + i, lines.end(), "\n")));
    }
    if (!absl::StartsWith(line, "WARNING: ThreadSanitizer:")) continue;
    size_t end = i + 1;
    while (end < lines.size() && !absl::StartsWith(lines[end], "=====")) ++end;
    std::vector<absl::string_view> report(lines.begin() + i,
                                          lines.begin() + end);
    if (IsLibraryOnlyTsanReport(report)) {
      ++*library_only;
    } else if (++failed <= 10) {  // the first ten in full
      absl::StrAppend(&failures, absl::StrJoin(report, "\n"), "\n");
    }
    i = end;
  }
  if (failed == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(
      failed,
      " ThreadSanitizer report(s) in mrd not entirely inside Debian's "
      "uninstrumented gRPC (",
      *library_only, " others were):\n", failures));
}

std::string TestDeviceKind() {
  const char* kind = std::getenv("MRD_TEST_DEVICE");
  return kind == nullptr || *kind == '\0' ? "software" : kind;
}

std::vector<std::string> DeviceFlags() {
  if (TestDeviceKind() != "verbs") {
    return {"--device=software", "--peer_address=127.0.0.1:0"};
  }
  // Inside the Soft-RoCE VM (tests/vm/run.sh sets these).
  const char* name = std::getenv("MRD_VERBS_DEVICE");
  const char* address = std::getenv("MRD_VERBS_ADDRESS");
  return {"--device=verbs",
          absl::StrCat("--verbs_device=", name == nullptr ? "" : name),
          absl::StrCat("--peer_address=",
                       address == nullptr ? "127.0.0.1" : address, ":0")};
}

absl::StatusOr<std::unique_ptr<MrdProcess>> MrdProcess::Launch(
    const MrdProcessOptions& options) {
  std::unique_ptr<MrdProcess> p(new MrdProcess());
  if (options.runtime_dir.empty()) {
    char run_template[] = "/tmp/mrd-test-run-XXXXXX";
    if (mkdtemp(run_template) == nullptr) {
      return absl::ErrnoToStatus(errno, "mkdtemp");
    }
    p->runtime_dir_ = run_template;
    p->owns_runtime_dir_ = true;
    p->log_path_ = p->runtime_dir_ + "/mrd.log";
  } else {
    p->runtime_dir_ = options.runtime_dir;
    char log_template[] = "/tmp/mrd-test-log-XXXXXX";
    int log = mkstemp(log_template);
    if (log < 0) return absl::ErrnoToStatus(errno, "mkstemp");
    close(log);
    p->log_path_ = log_template;
    p->owns_log_ = true;
  }
  if (options.shm_dir.empty()) {
    char shm_template[] = "/dev/shm/mrd-test-shm-XXXXXX";
    if (mkdtemp(shm_template) == nullptr) {
      return absl::ErrnoToStatus(errno, "mkdtemp");
    }
    p->shm_dir_ = shm_template;
    p->owns_shm_dir_ = true;
  } else {
    p->shm_dir_ = options.shm_dir;
  }

  std::vector<std::string> args = options.wrapper;
  if (!options.nofile.empty()) {
    for (std::string a : {std::string("/usr/bin/prlimit"),
                          "--nofile=" + options.nofile, std::string("--")}) {
      args.push_back(std::move(a));
    }
  }
  std::vector<std::string> mrd_args = {
      MrdBinary(),
      "--runtime_dir=" + p->runtime_dir_,
      "--shm_dir=" + p->shm_dir_,
  };
  for (std::string& a : mrd_args) args.push_back(std::move(a));
  for (std::string& flag : DeviceFlags()) args.push_back(std::move(flag));
  if (options.metrics && !options.metrics_address.empty()) {
    p->metrics_address_ = options.metrics_address;
    args.push_back("--metrics_address=" + p->metrics_address_);
  } else if (options.metrics) {
    absl::StatusOr<int> metrics_port = PickFreePort();
    if (!metrics_port.ok()) return metrics_port.status();
    p->metrics_address_ = absl::StrCat("127.0.0.1:", *metrics_port);
    args.push_back("--metrics_address=" + p->metrics_address_);
  } else {
    args.push_back("--metrics_address=");
  }
  // Warm pins off unless a test turns them on: the tests watch pinned bytes
  // go to zero when a registration is deregistered. (Later flags win.)
  args.push_back("--warm_pin_bytes_per_session=0");
  args.push_back("--warm_pin_bytes_total=0");
  for (const auto& f : options.extra_flags) args.push_back(f);

  // The sanitizer runtimes of a sanitized mrd write their reports next to its
  // log (log_path, appended last: it wins over any earlier one).
  std::vector<std::pair<std::string, std::string>> sanitizer_env;
  for (const char* name : {"TSAN_OPTIONS", "ASAN_OPTIONS", "UBSAN_OPTIONS"}) {
    const char* old = std::getenv(name);
    sanitizer_env.emplace_back(
        name, absl::StrCat(old == nullptr ? "" : old,
                           old == nullptr || *old == '\0' ? "" : ":",
                           "log_path=", p->runtime_dir_, "/sanitizer"));
  }

  pid_t pid = fork();
  if (pid < 0) return absl::ErrnoToStatus(errno, "fork");
  if (pid == 0) {
    for (const auto& [name, value] : sanitizer_env) {
      setenv(name.c_str(), value.c_str(), 1);
    }
    for (const auto& [name, value] : options.env) {
      setenv(name.c_str(), value.c_str(), 1);
    }
    int log = open(p->log_path_.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0644);
    dup2(log, STDERR_FILENO);
    dup2(log, STDOUT_FILENO);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  p->pid_ = pid;
  return p;
}

absl::StatusOr<std::unique_ptr<MrdProcess>> MrdProcess::Start(
    const MrdProcessOptions& options) {
  // The metrics port is picked free before mrd starts; mrd's own ephemeral
  // ports (the peer listener on port 0) may take it in between. Such a
  // start is retried on another port: the race is the harness's, not mrd's.
  for (int attempt = 1;; ++attempt) {
    absl::StatusOr<std::unique_ptr<MrdProcess>> launched = Launch(options);
    if (!launched.ok()) return launched.status();
    std::unique_ptr<MrdProcess> p = std::move(*launched);
    absl::Status ready = p->WaitServing();
    if (ready.ok()) return p;
    const std::string log = p->Log();
    if (options.metrics && options.metrics_address.empty() && attempt < 5 &&
        absl::StrContains(log, "METRICS_BIND_FAILED")) {
      continue;
    }
    return absl::Status(
        ready.code(),
        absl::StrCat(ready.message(), "\nmrd log:\n", log, p->SanitizerLog()));
  }
}

absl::StatusOr<MrdExit> MrdProcess::RunToExit(const MrdProcessOptions& options,
                                              int timeout_ms) {
  absl::StatusOr<std::unique_ptr<MrdProcess>> launched = Launch(options);
  if (!launched.ok()) return launched.status();
  MrdProcess& p = **launched;
  auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (waitpid(p.pid_, &status, WNOHANG) == p.pid_) {
      p.pid_ = -1;
      return MrdExit{status, p.Log()};
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("mrd was expected to exit but still runs after ", timeout_ms,
                   " ms\nlog:\n", p.Log()));  // the destructor kills it
}

absl::Status MrdProcess::WaitServing() {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    int status;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return absl::InternalError(
          absl::StrCat("mrd exited during start-up, status ", status));
    }
    struct stat st;
    if (stat(grpc_socket().c_str(), &st) == 0) {
      auto channel = grpc::CreateChannel(grpc_target(),
                                         grpc::InsecureChannelCredentials());
      auto stub = grpc::health::v1::Health::NewStub(channel);
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(1));
      grpc::health::v1::HealthCheckRequest req;
      grpc::health::v1::HealthCheckResponse resp;
      if (stub->Check(&ctx, req, &resp).ok() &&
          resp.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
        return absl::OkStatus();
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError("mrd did not become SERVING in 20 s");
}

// How long a SIGTERM may take: a drain of the workers (10 s at most) and
// the directory's deletes (2 s) under a sanitizer on a loaded machine.
constexpr absl::Duration kStopLimit = absl::Seconds(60);

absl::Status MrdProcess::Stop() {
  if (pid_ < 0) return absl::FailedPreconditionError("mrd is not running");
  if (!exited_) {
    kill(pid_, SIGTERM);
    // Bounded: an mrd stuck in its shutdown fails this test now, with its
    // log, not the whole run at ctest's timeout.
    if (!WaitExited(kStopLimit)) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      pid_ = -1;
      return absl::DeadlineExceededError(absl::StrCat(
          "mrd did not stop within ", absl::FormatDuration(kStopLimit),
          " of SIGTERM; log:\n", Log()));
    }
  }
  const int status = exit_status_;
  const std::string sanitizer_log = SanitizerLog();  // by its pid
  pid_ = -1;
  int library_only = 0;
  absl::Status reports = CheckSanitizerLog(sanitizer_log, &library_only);
  if (!reports.ok()) {
    return absl::InternalError(absl::StrCat(
        reports.message(), "\nmrd exit status ", status, ", log:\n", Log()));
  }
  // ThreadSanitizer's exit code after reports (TSAN_OPTIONS exitcode, 66 by
  // default): accepted when each report was library-only.
  const bool tsan_exit =
      WIFEXITED(status) && WEXITSTATUS(status) == 66 && library_only > 0;
  if (!tsan_exit && (!WIFEXITED(status) || WEXITSTATUS(status) != 0)) {
    return absl::InternalError(absl::StrCat("mrd did not exit cleanly (status ",
                                            status, ")\nlog:\n", Log()));
  }
  // Released everything itself, or handed everything over and left the
  // release of its own copies to the kernel's exit.
  if (!absl::StrContains(Log(), "device pinned bytes: 0") &&
      !absl::StrContains(Log(), "mrd handed over; exiting")) {
    return absl::InternalError("mrd left memory pinned at exit:\n" + Log());
  }
  return absl::OkStatus();
}

bool MrdProcess::WaitExited(absl::Duration timeout) {
  if (exited_) return true;
  if (pid_ < 0) return false;
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      exit_status_ = status;
      return true;
    }
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
}

std::string MrdProcess::SanitizerLogOf(pid_t pid) const {
  const std::string path = absl::StrCat(runtime_dir_, "/sanitizer.", pid);
  std::ifstream in(path);
  if (!in) return "";
  std::stringstream ss;
  ss << in.rdbuf();
  return absl::StrCat("---- ", path, " ----\n", ss.str());
}

std::string MrdProcess::Log() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

MrdProcess::~MrdProcess() {
  if (pid_ > 0 && !exited_) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    // Never stopped (a test that failed early): still show what the
    // sanitizer found, before the runtime directory goes.
    int library_only = 0;
    absl::Status reports = CheckSanitizerLog(SanitizerLog(), &library_only);
    if (!reports.ok()) {
      std::fprintf(stderr, "%s\n", std::string(reports.message()).c_str());
    }
  }
  std::error_code ec;
  if (owns_runtime_dir_) std::filesystem::remove_all(runtime_dir_, ec);
  if (owns_shm_dir_) std::filesystem::remove_all(shm_dir_, ec);
  if (owns_log_) std::filesystem::remove(log_path_, ec);
}

}  // namespace mrd::testing
