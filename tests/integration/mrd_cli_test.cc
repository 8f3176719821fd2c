// mrd's command line as an operator meets it: --help lists every flag with
// its default and exits 0, and lists exactly the flags docs/CONFIG.md
// documents; --version names the version.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
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

}  // namespace
}  // namespace mrd::testing
