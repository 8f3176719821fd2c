// mrd's command line as an operator meets it: --help lists every flag with
// its default and exits 0, and lists exactly the flags docs/CONFIG.md
// documents; --version names the version.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "tests/integration/mrd_process.h"

namespace mrd::testing {
namespace {

struct MrdRun {
  int exit_code = -1;
  std::string out;
};

// `mrd <args>`, its standard output (and error, if `with_stderr`) and exit
// code.
MrdRun RunMrd(const std::string& args, bool with_stderr = false) {
  MrdRun r;
  FILE* p = ::popen(
      (MrdBinary() + " " + args + (with_stderr ? " 2>&1" : " 2>/dev/null"))
          .c_str(),
      "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// The flags named by --help: lines "  --name (default: ...)".
std::set<std::string> HelpFlags(const std::string& help) {
  std::set<std::string> flags;
  for (absl::string_view line : absl::StrSplit(help, '\n')) {
    if (!absl::ConsumePrefix(&line, "  --")) continue;
    const size_t end = line.find_first_of(" =,");
    flags.insert(std::string(line.substr(0, end)));
  }
  return flags;
}

// The flags of docs/CONFIG.md's tables: rows "| `--name` | ...".
std::set<std::string> DocumentedFlags() {
  std::ifstream in(std::string(MRD_SOURCE_DIR) + "/docs/CONFIG.md");
  std::stringstream text;
  text << in.rdbuf();
  std::set<std::string> flags;
  for (absl::string_view line : absl::StrSplit(text.str(), '\n')) {
    if (!absl::ConsumePrefix(&line, "| `--")) continue;
    flags.insert(std::string(line.substr(0, line.find('`'))));
  }
  return flags;
}

TEST(MrdCliTest, HelpListsEveryDocumentedFlagAndExitsZero) {
  for (const char* arg : {"--help", "--helpfull"}) {
    MrdRun help = RunMrd(arg);
    EXPECT_EQ(help.exit_code, 0) << arg;
    std::set<std::string> listed = HelpFlags(help.out);
    listed.erase("flagfile");
    listed.erase("help");
    const std::set<std::string> documented = DocumentedFlags();
    ASSERT_GT(documented.size(), 30u);
    EXPECT_EQ(listed, documented) << arg << "\n" << help.out;
    EXPECT_TRUE(
        absl::StrContains(help.out, "--grpc_max_connections (default: \"0\")"))
        << help.out;
  }
}

// Byte-size flags read units as mrctl and the tenants file do
// (mrd/byte_size.h), show their defaults with them, and refuse what is not
// a size by name.
TEST(MrdCliTest, ByteSizeFlagsTakeUnits) {
  MrdRun help = RunMrd("--help");
  EXPECT_TRUE(absl::StrContains(help.out,
                                "--max_total_pinned_bytes (default: \"16G\")"))
      << help.out;
  EXPECT_TRUE(
      absl::StrContains(help.out, "--peer_buffer_bytes (default: \"256M\")"))
      << help.out;
  // Refused before anything starts (--await_handover: mrd would only wait).
  MrdRun bad = RunMrd("--max_total_pinned_bytes=16Q --await_handover=1ms",
                      /*with_stderr=*/true);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(bad.out, "'16Q' is not a size")) << bad.out;
}

// The directory's flags are checked at start, each refusal naming the flag
// (etcd is never reached: port 1 on loopback).
TEST(MrdCliTest, BadDirectoryFlagsAreRefusedByName) {
  char dir[] = "/tmp/mrd-cli-directory-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string common = absl::StrCat(
      "--device=software --runtime_dir=", dir,
      "/run --shm_dir= --metrics_address= --peer_address=127.0.0.1:0 "
      "--etcd_endpoints=127.0.0.1:1 ");
  struct Case {
    const char* flags;
    const char* says;
  };
  for (const Case& c : {
           Case{"--directory_mooncake_prefix=mooncake",
                "--directory_mooncake_prefix='mooncake' must end with '/'"},
           Case{"--etcd_cert_file=/nonexistent",
                "--etcd_cert_file needs --etcd_key_file"},
       }) {
    MrdRun bad = RunMrd(common + c.flags, /*with_stderr=*/true);
    EXPECT_EQ(bad.exit_code, 1) << c.flags << "\n" << bad.out;
    EXPECT_TRUE(absl::StrContains(bad.out, c.says)) << bad.out;
  }
  std::filesystem::remove_all(dir);
}

TEST(MrdCliTest, VersionNamesTheVersion) {
  MrdRun version = RunMrd("--version");
  EXPECT_EQ(version.exit_code, 0);
  EXPECT_TRUE(absl::StartsWith(version.out, "mrd ")) << version.out;
}

// mrd without CAP_IPC_LOCK (dropped with setpriv when the test runs as
// root), with the given RLIMIT_MEMLOCK (lowered: raising needs privileges
// a container may lack) and flags; returns its log once it serves.
std::string StartLog(const std::string& memlock,
                     std::vector<std::string> flags = {}) {
  MrdProcessOptions o;
  o.extra_flags = std::move(flags);
  if (geteuid() == 0) {
    o.wrapper = {"/usr/bin/setpriv", "--bounding-set=-ipc_lock",
                 "--inh-caps=-ipc_lock", "--"};
  }
  for (const char* a : {"/usr/bin/prlimit", "--memlock=", "--"}) {
    o.wrapper.push_back(a);
  }
  o.wrapper[o.wrapper.size() - 2] += memlock;
  absl::StatusOr<std::unique_ptr<MrdProcess>> mrd = MrdProcess::Start(o);
  EXPECT_TRUE(mrd.ok()) << mrd.status();
  if (!mrd.ok()) return "";
  std::string log = (*mrd)->Log();
  absl::Status stopped = (*mrd)->Stop();
  EXPECT_TRUE(stopped.ok()) << stopped;
  return log;
}

// `make run` as a user without the right to lock memory: mrd says so at
// start, with the fixes, instead of leaving it to PIN_FAILED later.
TEST(MrdStartTest, WarnsWhenItCannotPinWhatItsLimitsAllow) {
  const std::string low = StartLog("65536");
  EXPECT_TRUE(absl::StrContains(low,
                                "RLIMIT_MEMLOCK is 65536 bytes and mrd "
                                "lacks CAP_IPC_LOCK"))
      << low;
  EXPECT_TRUE(absl::StrContains(low, "AmbientCapabilities=CAP_IPC_LOCK"))
      << low;
  // Limits within what it can pin: no warning.
  const std::string enough =
      StartLog("65536", {"--max_total_pinned_bytes=65536"});
  EXPECT_FALSE(absl::StrContains(enough, "RLIMIT_MEMLOCK")) << enough;
  // The same limit with a unit.
  const std::string with_unit =
      StartLog("65536", {"--max_total_pinned_bytes=64K"});
  EXPECT_FALSE(absl::StrContains(with_unit, "RLIMIT_MEMLOCK")) << with_unit;
}

// The nice value of each thread of process `pid` (/proc/<pid>/task/*/stat,
// field 19), by thread id; the main thread's id is `pid`.
std::map<pid_t, int> ThreadNices(pid_t pid) {
  std::map<pid_t, int> nices;
  const std::string tasks = absl::StrCat("/proc/", pid, "/task");
  for (const auto& entry : std::filesystem::directory_iterator(tasks)) {
    std::ifstream in(entry.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(in)),
                     std::istreambuf_iterator<char>());
    // The fields after the name's closing parenthesis, from field 3 on.
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(absl::string_view(stat).substr(close + 2), ' ');
    int nice = 0;
    pid_t tid = 0;
    if (fields.size() > 16 && absl::SimpleAtoi(fields[16], &nice) &&
        absl::SimpleAtoi(entry.path().filename().string(), &tid)) {
      nices[tid] = nice;
    }
  }
  return nices;
}

// --nice (issue 24, flood b.): every thread of mrd, gRPC's among them, runs
// at it, so that on a busy node mrd's answers do not wait behind a client's
// threads; bulk work runs --bulk_nice below it. A value mrd may not take is
// said at start and skipped; one out of range is refused.
TEST(MrdStartTest, EveryThreadRunsAtItsNiceValue) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (CAP_SYS_NICE)";
  struct Case {
    std::vector<std::string> flags;
    int nice;
  };
  for (const Case& c : {Case{{}, -5}, Case{{"--nice=3"}, 3}}) {
    MrdProcessOptions o;
    o.extra_flags = c.flags;
    absl::StatusOr<std::unique_ptr<MrdProcess>> mrd = MrdProcess::Start(o);
    ASSERT_TRUE(mrd.ok()) << mrd.status();
    const std::map<pid_t, int> nices = ThreadNices((*mrd)->pid());
    EXPECT_GT(nices.size(), 10u);  // gRPC's threads, the workers, ...
    for (const auto& [tid, nice] : nices) {
      EXPECT_EQ(nice, c.nice) << "thread " << tid;
    }
    EXPECT_TRUE(absl::StrContains(
        (*mrd)->Log(), absl::StrCat("threads run at nice ", c.nice)));
    absl::Status stopped = (*mrd)->Stop();
    EXPECT_TRUE(stopped.ok()) << stopped;
  }
  // Without CAP_SYS_NICE, with RLIMIT_NICE 0: mrd keeps its priority.
  errno = 0;
  const int own = ::getpriority(PRIO_PROCESS, 0);
  MrdProcessOptions o;
  o.wrapper = {"/usr/bin/setpriv",
               "--bounding-set=-sys_nice",
               "--inh-caps=-sys_nice",
               "--",
               "/usr/bin/prlimit",
               "--nice=0",
               "--"};
  absl::StatusOr<std::unique_ptr<MrdProcess>> kept = MrdProcess::Start(o);
  ASSERT_TRUE(kept.ok()) << kept.status();
  const std::map<pid_t, int> nices = ThreadNices((*kept)->pid());
  ASSERT_TRUE(nices.contains((*kept)->pid()));
  EXPECT_EQ(nices.at((*kept)->pid()), own);
  for (const auto& [tid, nice] : nices) EXPECT_GE(nice, own) << tid;
  EXPECT_TRUE(absl::StrContains(
      (*kept)->Log(),
      absl::StrCat("threads stay at nice ", own, ", not --nice=-5")))
      << (*kept)->Log();
  absl::Status stopped = (*kept)->Stop();
  EXPECT_TRUE(stopped.ok()) << stopped;
  MrdRun bad =
      RunMrd("--device=software --runtime_dir=/nonexistent --nice=20", true);
  EXPECT_EQ(bad.exit_code, 1) << bad.out;
  EXPECT_TRUE(
      absl::StrContains(bad.out, "--nice: a nice value is -20 to 19, not 20"))
      << bad.out;
}

}  // namespace
}  // namespace mrd::testing
