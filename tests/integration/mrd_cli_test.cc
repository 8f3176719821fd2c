// mrd's command line as an operator meets it: --help lists every flag with
// its default and exits 0, and lists exactly the flags docs/CONFIG.md
// documents; --version names the version.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

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

// `mrd <args>`, its standard output and exit code.
MrdRun RunMrd(const std::string& args) {
  MrdRun r;
  FILE* p = ::popen((MrdBinary() + " " + args + " 2>/dev/null").c_str(), "r");
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

TEST(MrdCliTest, VersionNamesTheVersion) {
  MrdRun version = RunMrd("--version");
  EXPECT_EQ(version.exit_code, 0);
  EXPECT_TRUE(absl::StartsWith(version.out, "mrd ")) << version.out;
}

}  // namespace
}  // namespace mrd::testing
