// mrctl's commands end to end against FakeMrd: what they print, and their
// exit codes.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/mrctl/commands.h"
#include "client/mrctl/output.h"
#include "gtest/gtest.h"
#include "tests/unit/client/fake_mrd.h"

namespace mrd::mrctl {
namespace {

struct Result {
  int code;
  std::string out;
  std::string err;
};

std::string ReadAll(std::FILE* f) {
  std::rewind(f);
  std::string s;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) s.append(buf, n);
  std::fclose(f);
  return s;
}

class MrctlCommandsTest : public ::testing::Test {
 protected:
  Result Mrctl(std::vector<std::string> args) {
    args.insert(args.begin(),
                {"--runtime-dir=" + fake_.dir(), "--timeout=10s"});
    std::FILE* out = std::tmpfile();
    std::FILE* err = std::tmpfile();
    int code = ::mrd::mrctl::Run(args, env_, out, err);
    return {code, ReadAll(out), ReadAll(err)};
  }

  // key=value lines into a map.
  static std::map<std::string, std::string> Fields(const std::string& out) {
    std::map<std::string, std::string> m;
    for (absl::string_view line :
         absl::StrSplit(out, '\n', absl::SkipEmpty())) {
      std::pair<std::string, std::string> kv = absl::StrSplit(line, '=');
      m[kv.first] = kv.second;
    }
    return m;
  }

  void OpenLease() {
    Result r = Mrctl({"lease", "open", "-q"});
    ASSERT_EQ(r.code, 0) << r.err;
    env_.session = std::string(absl::StripSuffix(r.out, "\n"));
    ASSERT_FALSE(env_.session.empty());
    ASSERT_EQ(env_.session.find('\n'), std::string::npos);
  }

  void TearDown() override {
    if (!env_.session.empty()) {
      Result r = Mrctl({"lease", "close"});
      EXPECT_EQ(r.code, 0) << r.err;
    }
    EXPECT_EQ(fake_.sessions(), 0);
  }

  testing::FakeMrd fake_;
  Environment env_;
};

TEST_F(MrctlCommandsTest, InfoHumanAndJson) {
  Result human = Mrctl({"info"});
  ASSERT_EQ(human.code, 0) << human.err;
  EXPECT_EQ(Fields(human.out)["name"], "fake");
  EXPECT_EQ(Fields(human.out)["page_size"], "4096");
  Result json = Mrctl({"info", "--json"});
  ASSERT_EQ(json.code, 0) << json.err;
  EXPECT_NE(json.out.find("\"pageSize\":\"4096\""), std::string::npos);
  EXPECT_EQ(json.out.back(), '\n');
  Result health = Mrctl({"health"});
  EXPECT_EQ(health.code, 0) << health.err;
  EXPECT_EQ(health.out, "status=SERVING\n");
}

TEST_F(MrctlCommandsTest, LeaseImportRegisterListDeregisterRelease) {
  OpenLease();
  Result imported = Mrctl({"import-file", "data", "--writable"});
  ASSERT_EQ(imported.code, 0) << imported.err;
  std::string buffer = Fields(imported.out)["buffer"];
  ASSERT_FALSE(buffer.empty());

  Result reg = Mrctl({"register", "--buffer=" + buffer, "--length=4096",
                      "--flags=remote_read,remote_write"});
  ASSERT_EQ(reg.code, 0) << reg.err;
  auto f = Fields(reg.out);
  EXPECT_EQ(f["references"], "1");
  EXPECT_EQ(f["cache_hit"], "false");
  EXPECT_FALSE(f["rkey"].empty());

  Result again = Mrctl({"register", "--json", "--buffer=" + buffer,
                        "--length=4096", "--flags=0x7"});
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_NE(again.out.find("\"cacheHit\":true"), std::string::npos);
  EXPECT_NE(again.out.find("\"references\":2"), std::string::npos);

  Result list = Mrctl({"list"});
  ASSERT_EQ(list.code, 0) << list.err;
  EXPECT_EQ(Fields(list.out)["registrations[0].references"], "2");

  Result dereg = Mrctl({"deregister", "--registration=" + f["registration"]});
  ASSERT_EQ(dereg.code, 0) << dereg.err;
  EXPECT_EQ(Fields(dereg.out)["references"], "1");

  Result released = Mrctl({"release-buffer", buffer});
  ASSERT_EQ(released.code, 0) << released.err;
  EXPECT_EQ(Fields(released.out)["invalidated_registrations"], "1");
  EXPECT_EQ(fake_.registration_references(), 0);
}

TEST_F(MrctlCommandsTest, ErrorsPrintCodeSeedReasonAndExitByTable) {
  OpenLease();
  Result imported = Mrctl({"import-file", "data"});
  std::string buffer = Fields(imported.out)["buffer"];

  Result zero = Mrctl({"register", "--buffer=" + buffer, "--length=0"});
  EXPECT_EQ(zero.code, kExitFailed);
  EXPECT_EQ(zero.err,
            "mrctl: INVALID_ARGUMENT STATUS_INVALID_PARAMETER ZERO_LENGTH: "
            "length is zero\n");
  EXPECT_EQ(zero.out, "");

  Result small =
      Mrctl({"register", "--buffer=" + buffer, "--length=8", "--capacity=8"});
  EXPECT_EQ(small.code, kExitFailed);
  EXPECT_NE(small.err.find("WSAEFAULT DESCRIPTOR_CAPACITY"), std::string::npos);
  EXPECT_NE(small.err.find("(required_size=24)"), std::string::npos);

  Result missing = Mrctl({"release-buffer", "999"});
  EXPECT_EQ(missing.code, kExitNotFound);
  EXPECT_NE(missing.err.find("NOT_FOUND"), std::string::npos);

  Result stale = Mrctl({"session", "--session=gone"});
  EXPECT_EQ(stale.code, kExitPrecondition);
  EXPECT_NE(stale.err.find("WSAENOTCONN"), std::string::npos);

  Result usage = Mrctl({"deregister", "--registration=1", "--mr=2"});
  EXPECT_EQ(usage.code, kExitUsage);

  Result release_buffer_bad = Mrctl({"release-buffer", "x"});
  EXPECT_EQ(release_buffer_bad.code, kExitUsage);
}

TEST_F(MrctlCommandsTest, FastRegisterThenCompletions) {
  OpenLease();
  std::string buffer = Fields(Mrctl({"import-file", "d"}).out)["buffer"];
  Result mr = Mrctl({"create-mr", "--fast-register", "--allow-remote"});
  ASSERT_EQ(mr.code, 0) << mr.err;
  std::string mr_id = Fields(mr.out)["mr"];
  Result lam = Mrctl({"build-lam", "--buffer=" + buffer, "--length=8192"});
  ASSERT_EQ(lam.code, 0) << lam.err;
  auto lf = Fields(lam.out);
  Result fr = Mrctl({"fast-register", "--connection=1", "--mr=" + mr_id,
                     "--pages=" + lf["pages"], "--length=8192", "--base=0",
                     "--flags=remote_read", "--context=42"});
  ASSERT_EQ(fr.code, 0) << fr.err;
  Result done = Mrctl({"completions", "--count=1", "--json"});
  ASSERT_EQ(done.code, 0) << done.err;
  EXPECT_NE(done.out.find("\"kind\":\"FAST_REGISTER\""), std::string::npos);
  EXPECT_NE(done.out.find("\"requestContext\":\"42\""), std::string::npos);

  Result none = Mrctl({"completions", "--count=1", "--timeout=200ms"});
  EXPECT_EQ(none.code, kExitUnavailable);
  Result idle = Mrctl({"completions", "--timeout=100ms"});
  EXPECT_EQ(idle.code, 0) << idle.err;

  EXPECT_EQ(Mrctl({"release-lam", lf["lam"]}).code, 0);
  EXPECT_EQ(Mrctl({"close-mr", mr_id}).code, 0);
  EXPECT_EQ(fake_.mrs(), 0);
  EXPECT_EQ(fake_.lams(), 0);
}

TEST_F(MrctlCommandsTest, HoldRegistersAnFdSessionBufferAndReleasesIt) {
  // stdin of a test may be anything; --duration bounds the wait anyway.
  Result held = Mrctl({"hold", "--size=8192", "--fill=hello", "--repeat",
                       "--flags=remote_read", "--duration=100ms", "--json"});
  ASSERT_EQ(held.code, 0) << held.err;
  EXPECT_EQ(held.out.rfind("{\"session\":{", 0), 0u) << held.out;
  EXPECT_NE(held.out.find("\"kind\":\"fd\""), std::string::npos);
  EXPECT_NE(held.out.find("\"source\":\"memfd\""), std::string::npos);
  EXPECT_NE(held.out.find("\"registration\":{"), std::string::npos);
  EXPECT_EQ(fake_.last_import_size(), 8192u);
  EXPECT_EQ(fake_.buffers(), 0);
  EXPECT_EQ(fake_.registration_references(), 0);
}

TEST_F(MrctlCommandsTest, PeerTicketAndLeaseOpenJson) {
  Result open = Mrctl({"lease", "open", "--ttl=90s", "--json"});
  ASSERT_EQ(open.code, 0) << open.err;
  EXPECT_NE(open.out.find("\"ttlSeconds\":90"), std::string::npos);
  size_t start = open.out.find("\"session\":\"") + 11;
  env_.session = open.out.substr(start, open.out.find('"', start) - start);
  Result ticket = Mrctl({"peer-ticket"});
  ASSERT_EQ(ticket.code, 0) << ticket.err;
  EXPECT_EQ(Fields(ticket.out)["ticket"], "ticket-" + env_.session);
}

}  // namespace
}  // namespace mrd::mrctl
