// mrd's /metrics as an operator meets it: the standard gRPC server metrics
// (the names of go-grpc-prometheus, which existing dashboards use), build
// and device information, every configured limit, the registration sizes and
// the process's own CPU, memory, fds and threads; every series there from the
// first scrape; docs/METRICS.md naming exactly what a live scrape has; and
// Prometheus' own linter (promtool, from Debian's prometheus package) clean
// on a live scrape.

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "tests/integration/test_env.h"

namespace mrd::testing {
namespace {

using client::Buffer;
using client::Registration;
using client::Session;

constexpr char kService[] = "mrd.v1.MemoryRegistration";

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// The text exposition format, as far as mrd uses it: `name{k="v",...} value`.
std::vector<Sample> Parse(const std::string& text) {
  std::vector<Sample> out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    Sample s;
    const size_t brace = line.find('{');
    const size_t space = line.rfind(' ');
    if (space == absl::string_view::npos) continue;
    if (brace != absl::string_view::npos && brace < space) {
      s.name = std::string(line.substr(0, brace));
      const size_t close = line.rfind('}');
      absl::string_view labels = line.substr(brace + 1, close - brace - 1);
      for (absl::string_view pair : absl::StrSplit(labels, "\",")) {
        const size_t eq = pair.find("=\"");
        if (eq == absl::string_view::npos) continue;
        absl::string_view value = pair.substr(eq + 2);
        absl::ConsumeSuffix(&value, "\"");
        s.labels[std::string(pair.substr(0, eq))] = std::string(value);
      }
    } else {
      s.name = std::string(line.substr(0, space));
    }
    if (!absl::SimpleAtod(line.substr(space + 1), &s.value)) continue;
    out.push_back(std::move(s));
  }
  return out;
}

// The families a scrape declares (`# TYPE name type`): name -> type.
std::map<std::string, std::string> Families(const std::string& text) {
  std::map<std::string, std::string> out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::ConsumePrefix(&line, "# TYPE ")) continue;
    std::vector<std::string> parts = absl::StrSplit(line, ' ');
    if (parts.size() == 2) out[parts[0]] = parts[1];
  }
  return out;
}

class MetricsTest : public MrdTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    o.metrics = true;
    o.extra_flags = {"--max_total_pinned_bytes=1073741824",
                     "--max_sessions=77"};
    return o;
  }

  std::vector<Sample> Scrape() {
    absl::StatusOr<std::string> text = ScrapeMetrics(mrd_->metrics_address());
    EXPECT_TRUE(text.ok()) << text.status();
    last_text_ = text.ok() ? *text : "";
    return Parse(last_text_);
  }

  // The value of the one sample named `name` whose labels include `labels`;
  // -1 (and a failure) when there is not exactly one.
  double Value(const std::vector<Sample>& samples, const std::string& name,
               const std::map<std::string, std::string>& labels = {}) {
    const Sample* found = nullptr;
    int count = 0;
    for (const Sample& s : samples) {
      if (s.name != name) continue;
      bool match = true;
      for (const auto& [k, v] : labels) {
        auto it = s.labels.find(k);
        match = match && it != s.labels.end() && it->second == v;
      }
      if (match) {
        found = &s;
        ++count;
      }
    }
    if (count != 1) {
      ADD_FAILURE() << count << " samples of " << name << " match the labels\n"
                    << last_text_;
      return -1;
    }
    return found->value;
  }

  std::map<std::string, std::string> Rpc(const std::string& method,
                                         const std::string& type = "unary") {
    return {{"grpc_service", kService},
            {"grpc_method", method},
            {"grpc_type", type}};
  }

  std::string last_text_;
};

TEST_F(MetricsTest, GrpcServerMetricsUseTheStandardNamesFromTheStart) {
  std::vector<Sample> before = Scrape();
  // Every method and every code is there before its first call (at 0), so
  // rate() and absent() work from mrd's first scrape. Codes are spelled as
  // go-grpc-prometheus spells them (Go's names).
  for (const char* method : {"RegisterMr", "DeregisterMr", "BuildLam",
                             "FastRegister", "CreateMr", "InvalidateMr"}) {
    EXPECT_EQ(Value(before, "grpc_server_started_total", Rpc(method)), 0);
    auto labels = Rpc(method);
    labels["grpc_code"] = "ResourceExhausted";
    EXPECT_EQ(Value(before, "grpc_server_handled_total", labels), 0);
    EXPECT_EQ(Value(before, "grpc_server_handling_seconds_count", Rpc(method)),
              0);
  }
  EXPECT_EQ(Value(before, "grpc_server_started_total",
                  Rpc("StreamCompletions", "server_stream")),
            0);
  // The top bucket reaches registrations of many GiB (3 GiB took 17 s on
  // the verbs device).
  auto le = Rpc("RegisterMr");
  le["le"] = "300";
  EXPECT_EQ(Value(before, "grpc_server_handling_seconds_bucket", le), 0);

  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 3 * 4096);
  Registration reg = Register(session, buffer, 0, 2 * 4096, kRemoteRead);
  client::RegisterOptions bad;
  bad.buffer = buffer.id();
  bad.offset = 0;
  bad.length = 1ull << 40;  // past the buffer
  ASSERT_FALSE(Registration::Register(session, bad).ok());

  std::vector<Sample> after = Scrape();
  EXPECT_EQ(Value(after, "grpc_server_started_total", Rpc("RegisterMr")), 2);
  auto ok = Rpc("RegisterMr");
  ok["grpc_code"] = "OK";
  EXPECT_EQ(Value(after, "grpc_server_handled_total", ok), 1);
  double failed = 0;
  for (const Sample& s : after) {
    if (s.name == "grpc_server_handled_total" &&
        s.labels.at("grpc_method") == "RegisterMr" &&
        s.labels.at("grpc_code") != "OK") {
      failed += s.value;
    }
  }
  EXPECT_EQ(failed, 1);
  EXPECT_EQ(
      Value(after, "grpc_server_handling_seconds_count", Rpc("RegisterMr")), 2);
  le["le"] = "+Inf";
  EXPECT_EQ(Value(after, "grpc_server_handling_seconds_bucket", le), 2);
  // Sizes of successful registrations only, by method.
  EXPECT_EQ(Value(after, "mrd_registration_size_bytes_count",
                  {{"method", "RegisterMr"}}),
            1);
  EXPECT_EQ(Value(after, "mrd_registration_size_bytes_sum",
                  {{"method", "RegisterMr"}}),
            2 * 4096);
  EXPECT_EQ(Value(after, "mrd_registration_size_bytes_count",
                  {{"method", "BuildLam"}}),
            0);
}

TEST_F(MetricsTest, BuildDeviceLimitsAndProcessAreExported) {
  std::vector<Sample> s = Scrape();
  EXPECT_EQ(Value(s, "mrd_build_info", {{"version", MRD_VERSION}}), 1);
  for (const Sample& sample : s) {
    if (sample.name != "mrd_build_info") continue;
    EXPECT_EQ(sample.labels.at("device"), TestDeviceKind());
    EXPECT_FALSE(sample.labels.at("revision").empty());
  }
  EXPECT_EQ(Value(s, "mrd_device_healthy"), 1);
  EXPECT_EQ(Value(s, "mrd_device_fallback"), 0);
  // Every configured limit, under the name of its flag.
  EXPECT_EQ(Value(s, "mrd_limit", {{"limit", "max_total_pinned_bytes"}}),
            1073741824);
  EXPECT_EQ(Value(s, "mrd_limit", {{"limit", "max_sessions"}}), 77);
  EXPECT_EQ(Value(s, "mrd_limit", {{"limit", "max_session_pinned_bytes"}}),
            4294967296.0);
  // The process.
  EXPECT_GT(Value(s, "process_resident_memory_bytes"), 1 << 20);
  EXPECT_GT(Value(s, "process_virtual_memory_bytes"), 1 << 20);
  EXPECT_GT(Value(s, "process_open_fds"), 3);
  EXPECT_GT(Value(s, "process_max_fds"), 256);
  EXPECT_GT(Value(s, "process_threads"), 2);
  EXPECT_GE(Value(s, "process_cpu_seconds_total"), 0);
  const double start = Value(s, "process_start_time_seconds");
  const double now = absl::ToUnixSeconds(absl::Now());
  EXPECT_LE(start, now + 1);
  EXPECT_GT(start, now - 600);
}

// docs/METRICS.md's table (`| \`name\` | type | ...`) against a live scrape:
// every family mrd exports is documented with its type, and every
// documented one is exported.
TEST_F(MetricsTest, DocsListEveryMetricWithItsType) {
  Scrape();
  std::map<std::string, std::string> live = Families(last_text_);
  ASSERT_FALSE(live.empty());
  std::ifstream doc(std::string(MRD_SOURCE_DIR) + "/docs/METRICS.md");
  ASSERT_TRUE(doc.good()) << "docs/METRICS.md is missing";
  std::map<std::string, std::string> documented;
  std::string line;
  while (std::getline(doc, line)) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, "| `")) continue;
    std::vector<std::string> cells = absl::StrSplit(rest, '|');
    if (cells.size() < 2) continue;
    std::string name(
        absl::StripSuffix(absl::StripAsciiWhitespace(cells[0]), "`"));
    documented[name] = std::string(absl::StripAsciiWhitespace(cells[1]));
  }
  for (const auto& [name, type] : live) {
    auto it = documented.find(name);
    if (it == documented.end()) {
      ADD_FAILURE() << name << " (" << type << ") is not in docs/METRICS.md";
    } else {
      EXPECT_EQ(it->second, type) << name;
    }
  }
  for (const auto& [name, type] : documented) {
    // The directory's families exist only with --etcd_endpoints: the
    // directory's own test (directory_test) scrapes them against etcd.
    if (absl::StartsWith(name, "mrd_directory_")) continue;
    if (live.count(name) == 0) {
      ADD_FAILURE() << name << " is documented but not exported";
    }
  }
}

// Runs `promtool check metrics` on a scrape taken after some traffic.
TEST_F(MetricsTest, PromtoolFindsNothingToLintInALiveScrape) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 4096);
  Registration reg = Register(session, buffer, 0, 4096, kRemoteRead);
  Scrape();
  ASSERT_EQ(access("/usr/bin/promtool", X_OK), 0)
      << "promtool is missing (scripts/install-deps.sh installs Debian's "
         "prometheus package)";
  char path[] = "/tmp/mrd-metrics-XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, last_text_.data(), last_text_.size()),
            static_cast<ssize_t>(last_text_.size()));
  close(fd);
  FILE* p = popen(
      absl::StrCat("/usr/bin/promtool check metrics < ", path, " 2>&1").c_str(),
      "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  unlink(path);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_EQ(out, "") << "promtool's findings on mrd's metrics";
}

}  // namespace
}  // namespace mrd::testing
