#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/mrctl/args.h"
#include "client/mrctl/commands.h"
#include "client/mrctl/output.h"
#include "gtest/gtest.h"
#include "mrd/status.h"

namespace mrd::mrctl {
namespace {

absl::StatusOr<Invocation> Parse(std::vector<std::string> args,
                                 std::string env_session = "") {
  Environment env;
  env.session = std::move(env_session);
  return ParseArgs(args, env);
}

TEST(ParseArgsTest, CommandWithFlagsInBothSpellings) {
  auto inv = Parse({"--session=tok", "register", "--buffer=3", "--length",
                    "4096", "--flags=remote_read"});
  ASSERT_TRUE(inv.ok()) << inv.status();
  EXPECT_EQ(inv->command->name, "register");
  EXPECT_EQ(inv->global.session, "tok");
  EXPECT_EQ(inv->flags.at("buffer"), "3");
  EXPECT_EQ(inv->flags.at("length"), "4096");
  EXPECT_EQ(inv->flags.at("flags"), "remote_read");
}

TEST(ParseArgsTest, GlobalFlagsMayFollowTheCommand) {
  auto inv = Parse({"info", "--json", "--socket", "/s", "--timeout=2s", "-q"});
  ASSERT_TRUE(inv.ok()) << inv.status();
  EXPECT_TRUE(inv->global.json);
  EXPECT_TRUE(inv->global.quiet);
  EXPECT_EQ(inv->global.socket, "/s");
  EXPECT_EQ(inv->global.timeout, absl::Seconds(2));
}

TEST(ParseArgsTest, TwoWordCommands) {
  auto open = Parse({"lease", "open", "--ttl=10m"});
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_EQ(open->command->name, "lease open");
  EXPECT_EQ(open->flags.at("ttl"), "10m");
  auto read = Parse(
      {"peer", "read", "--ticket=t", "--rkey=0x10", "--va=4096", "--length=8"});
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->command->name, "peer read");
  EXPECT_FALSE(Parse({"lease"}).ok());
  EXPECT_FALSE(Parse({"lease", "renew"}).ok());
}

TEST(ParseArgsTest, SessionComesFromEnvironmentUnlessGiven) {
  auto from_env = Parse({"list"}, "env-token");
  ASSERT_TRUE(from_env.ok());
  EXPECT_EQ(from_env->global.session, "env-token");
  auto explicit_flag = Parse({"list", "--session=flag-token"}, "env-token");
  ASSERT_TRUE(explicit_flag.ok());
  EXPECT_EQ(explicit_flag->global.session, "flag-token");
}

TEST(ParseArgsTest, SessionCommandsWithoutSessionAreUsageErrors) {
  auto inv = Parse({"list"});
  ASSERT_FALSE(inv.ok());
  EXPECT_TRUE(IsUsageError(inv.status()));
  EXPECT_EQ(ExitCodeFor(inv.status()), kExitUsage);
  EXPECT_TRUE(Parse({"info"}).ok());
  EXPECT_TRUE(Parse({"hold", "--size=4096"}).ok());
}

TEST(ParseArgsTest, DirectoryCommandsTakeANameAndTheSession) {
  auto publish = Parse({"publish", "weights.0", "--registration=3"}, "tok");
  ASSERT_TRUE(publish.ok()) << publish.status();
  EXPECT_EQ(publish->command->name, "publish");
  EXPECT_EQ(publish->positional, std::vector<std::string>{"weights.0"});
  EXPECT_EQ(publish->flags.at("registration"), "3");
  EXPECT_EQ(publish->global.session, "tok");
  auto resolve = Parse({"resolve", "weights.0", "--tenant=uid:0"}, "tok");
  ASSERT_TRUE(resolve.ok()) << resolve.status();
  EXPECT_EQ(resolve->flags.at("tenant"), "uid:0");
  EXPECT_TRUE(Parse({"unpublish", "weights.0"}, "tok").ok());
  EXPECT_TRUE(Parse({"published"}, "tok").ok());
  // A name is required (and published takes none); every one needs a
  // session; resolve has no --registration.
  EXPECT_TRUE(IsUsageError(Parse({"resolve"}, "tok").status()));
  EXPECT_TRUE(IsUsageError(Parse({"published", "x"}, "tok").status()));
  EXPECT_TRUE(IsUsageError(Parse({"unpublish", "weights.0"}).status()));
  EXPECT_TRUE(IsUsageError(
      Parse({"resolve", "w", "--registration=1"}, "tok").status()));
}

TEST(ParseArgsTest, PositionalArguments) {
  auto inv = Parse({"release-buffer", "7", "--session=s"});
  ASSERT_TRUE(inv.ok()) << inv.status();
  ASSERT_EQ(inv->positional.size(), 1u);
  EXPECT_EQ(inv->positional[0], "7");
  EXPECT_FALSE(Parse({"release-buffer", "--session=s"}).ok());
  EXPECT_FALSE(Parse({"release-buffer", "1", "2", "--session=s"}).ok());
  EXPECT_FALSE(Parse({"info", "extra"}).ok());
  auto dashed = Parse({"import-file", "--session=s", "--", "-odd-name"});
  ASSERT_TRUE(dashed.ok()) << dashed.status();
  EXPECT_EQ(dashed->positional[0], "-odd-name");
}

TEST(ParseArgsTest, BooleanFlags) {
  auto inv = Parse(
      {"create-mr", "--session=s", "--fast-register", "--allow-remote=false"});
  ASSERT_TRUE(inv.ok()) << inv.status();
  EXPECT_EQ(inv->flags.at("fast-register"), "true");
  EXPECT_EQ(inv->flags.at("allow-remote"), "false");
  EXPECT_FALSE(
      Parse({"create-mr", "--session=s", "--fast-register=maybe"}).ok());
  // A boolean does not swallow the next word.
  auto json = Parse({"--json", "info"});
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_EQ(json->command->name, "info");
}

TEST(ParseArgsTest, UnknownThingsAreUsageErrors) {
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"frobnicate"},
           {"info", "--bogus"},
           {"--buffer=1", "register"},  // command flag before the command
           {"register", "--session=s", "--ttl=5"},
           {"info", "-x"},
           {"register", "--session=s", "--buffer"},  // value missing
           {"info", "--timeout=soon"},
       }) {
    auto inv = Parse(args);
    EXPECT_FALSE(inv.ok()) << args[0];
    EXPECT_TRUE(IsUsageError(inv.status())) << inv.status();
  }
}

TEST(ParseArgsTest, HelpForms) {
  auto overview = Parse({"help"});
  ASSERT_TRUE(overview.ok());
  EXPECT_TRUE(overview->help);
  EXPECT_EQ(overview->command, nullptr);
  auto command = Parse({"help", "register"});
  ASSERT_TRUE(command.ok());
  EXPECT_TRUE(command->help);
  EXPECT_EQ(command->command->name, "register");
  // --help skips the checks for a session and required arguments.
  auto flag = Parse({"release-buffer", "--help"});
  ASSERT_TRUE(flag.ok()) << flag.status();
  EXPECT_TRUE(flag->help);
  auto group = Parse({"lease", "-h"});
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_EQ(group->help_group, "lease");
  EXPECT_NE(GroupHelp("lease").find("lease close"), std::string::npos);
}

TEST(HelpTest, EveryCommandHasHelpAndAHandler) {
  EXPECT_NE(OverviewHelp().find("Exit codes"), std::string::npos);
  for (const CommandSpec& c : Commands()) {
    std::string help = CommandHelp(c);
    EXPECT_NE(help.find("Usage: mrctl " + c.name), std::string::npos);
    for (const FlagSpec& f : c.flags) {
      EXPECT_NE(help.find("--" + f.name), std::string::npos) << c.name;
    }
  }
}

TEST(ValueParsersTest, Sizes) {
  EXPECT_EQ(*ParseSize("4096"), 4096u);
  EXPECT_EQ(*ParseSize("0x1000"), 4096u);
  EXPECT_EQ(*ParseSize("4K"), 4096u);
  EXPECT_EQ(*ParseSize("4KiB"), 4096u);
  EXPECT_EQ(*ParseSize("4k"), 4096u);
  EXPECT_EQ(*ParseSize("8G"), uint64_t{8} << 30);
  EXPECT_EQ(*ParseSize("8GiB"), uint64_t{8} << 30);
  EXPECT_EQ(*ParseSize("2M"), uint64_t{2} << 20);
  EXPECT_EQ(*ParseSize("1T"), uint64_t{1} << 40);
  EXPECT_EQ(*ParseSize("4KB"), 4000u);
  EXPECT_EQ(*ParseSize("1GB"), 1000000000u);
}

TEST(ValueParsersTest, BadSizes) {
  for (const char* bad : {"", "K", "4X", "4 KiB", "-1", "1.5G", "4Ki", "0xK",
                          "16384P", "20000000000G"}) {
    EXPECT_FALSE(ParseSize(bad).ok()) << bad;
  }
}

TEST(ValueParsersTest, Numbers) {
  EXPECT_EQ(*ParseUint64("42"), 42u);
  EXPECT_EQ(*ParseUint64("0x2A"), 42u);
  EXPECT_EQ(*ParseUint64("18446744073709551615"), UINT64_MAX);
  EXPECT_FALSE(ParseUint64("18446744073709551616").ok());
  EXPECT_FALSE(ParseUint64("-1").ok());
  EXPECT_FALSE(ParseUint64("0x").ok());
  EXPECT_FALSE(ParseUint64("12abc").ok());
  EXPECT_FALSE(ParseUint64("").ok());
  EXPECT_EQ(*ParseUint64List("0x1000, 8192,0x3000"),
            (std::vector<uint64_t>{0x1000, 8192, 0x3000}));
}

TEST(ValueParsersTest, MrFlags) {
  EXPECT_EQ(*ParseMrFlags("local_write,remote_read,remote_write,read_sink"),
            0x1u | 0x2u | 0x5u | 0x8u);
  EXPECT_EQ(*ParseMrFlags("remote_read|read_sink"), 0xau);
  EXPECT_EQ(*ParseMrFlags("REMOTE_WRITE"), 0x5u);
  EXPECT_EQ(*ParseMrFlags("local_read"), 0u);
  EXPECT_EQ(*ParseMrFlags("0x5"), 5u);
  // Unknown bits go to the server, which answers WSAEINVAL.
  EXPECT_EQ(*ParseMrFlags("0x100"), 0x100u);
  absl::StatusOr<uint32_t> bad = ParseMrFlags("remote_exec");
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(IsUsageError(bad.status()));
  EXPECT_NE(bad.status().message().find("remote_read"),
            absl::string_view::npos);
}

TEST(ValueParsersTest, OpAndMemFlags) {
  EXPECT_EQ(*ParseOpFlags("silent_success,remote_write,defer"),
            0x1u | 0x30u | 0x200u);
  EXPECT_EQ(*ParseOpFlags("read_fence,remote_read,read_sink"), 0x4au);
  EXPECT_EQ(*ParseMemFlags("read"), 1u);
  EXPECT_EQ(*ParseMemFlags("write"), 2u);
  EXPECT_EQ(*ParseMemFlags("readwrite"), 3u);
  EXPECT_EQ(*ParseMemFlags("3"), 3u);
  EXPECT_FALSE(ParseMemFlags("execute").ok());
}

TEST(ValueParsersTest, Devices) {
  absl::StatusOr<DeviceChoice> two = ParseDevices("software, software1");
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->names, (std::vector<std::string>{"software", "software1"}));
  EXPECT_FALSE(two->all);
  absl::StatusOr<DeviceChoice> all = ParseDevices("all");
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_TRUE(all->all);
  EXPECT_TRUE(all->names.empty());
  absl::StatusOr<DeviceChoice> nearest = ParseDevices("nearest");
  ASSERT_TRUE(nearest.ok()) << nearest.status();
  EXPECT_TRUE(nearest->nearest);
  EXPECT_FALSE(nearest->all);
  for (const char* bad :
       {"", ",", "all,software", "nearest,software", "all,nearest"}) {
    absl::StatusOr<DeviceChoice> choice = ParseDevices(bad);
    EXPECT_FALSE(choice.ok()) << bad;
    EXPECT_TRUE(IsUsageError(choice.status())) << bad;
  }
}

TEST(ParseArgsTest, DeviceFlags) {
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"register", "--buffer=1", "--length=1", "--devices=all"},
           {"register-batch", "--buffer=1", "--length=1", "--count=2",
            "--devices=software,software1"},
           {"hold", "--size=4096", "--devices=software1"},
           {"peer-ticket", "--device=software1"},
           {"peer", "read", "--device=software1"},
           {"peer", "write", "--device=software1"},
       }) {
    auto inv = Parse(args, "tok");
    EXPECT_TRUE(inv.ok()) << args[0] << ": " << inv.status();
  }
  // A ticket and a peer are for one device; a registration for several.
  EXPECT_FALSE(Parse({"peer-ticket", "--devices=all"}, "tok").ok());
  EXPECT_FALSE(Parse({"register", "--device=software"}, "tok").ok());
}

TEST(ValueParsersTest, DurationsAndHex) {
  EXPECT_EQ(*ParseDurationFlag("250ms"), absl::Milliseconds(250));
  EXPECT_EQ(*ParseDurationFlag("10m"), absl::Minutes(10));
  EXPECT_EQ(*ParseDurationFlag("1.5"), absl::Milliseconds(1500));
  EXPECT_FALSE(ParseDurationFlag("-1s").ok());
  EXPECT_EQ(*DecodeHex("0x48 65:6c6C6f"), "Hello");
  EXPECT_FALSE(DecodeHex("abc").ok());
  EXPECT_FALSE(DecodeHex("zz").ok());
  EXPECT_EQ(EncodeHex(std::string("\x00\xff\x10", 3)), "00ff10");
}

TEST(FlagValuesTest, TypedAccess) {
  auto inv = Parse({"register", "--session=s", "--buffer=0x10", "--length=9",
                    "--capacity=99999999999"});
  ASSERT_TRUE(inv.ok());
  FlagValues f(*inv);
  EXPECT_EQ(*f.Uint64("buffer"), 16u);
  EXPECT_EQ(*f.Uint64Or("offset", 5), 5u);
  EXPECT_FALSE(f.Uint32Or("capacity", 0).ok());
  EXPECT_FALSE(f.Uint64("mr").ok());
  EXPECT_EQ(*f.OptionalUint64("base"), std::nullopt);
  EXPECT_FALSE(*f.Bool("writable"));
}

TEST(ExitCodeTest, EveryCodeIsMapped) {
  using C = absl::StatusCode;
  const std::vector<std::pair<C, int>> table = {
      {C::kOk, 0},
      {C::kCancelled, 2},
      {C::kUnknown, 2},
      {C::kInvalidArgument, 2},
      {C::kDeadlineExceeded, 6},
      {C::kNotFound, 3},
      {C::kAlreadyExists, 2},
      {C::kPermissionDenied, 4},
      {C::kResourceExhausted, 5},
      {C::kFailedPrecondition, 7},
      {C::kAborted, 2},
      {C::kOutOfRange, 2},
      {C::kUnimplemented, 2},
      {C::kInternal, 2},
      {C::kUnavailable, 6},
      {C::kDataLoss, 2},
      {C::kUnauthenticated, 4},
  };
  for (const auto& [code, exit_code] : table) {
    EXPECT_EQ(ExitCodeFor(absl::Status(code, code == C::kOk ? "" : "m")),
              exit_code)
        << absl::StatusCodeToString(code);
  }
  EXPECT_EQ(ExitCodeFor(UsageError("bad")), 1);
}

TEST(OutputTest, ErrorLineNamesSeedReasonAndSize) {
  absl::Status s = SeedError(::mrd::STATUS_BUFFER_TOO_SMALL, "LAM_CAPACITY",
                             "mapping needs 24 bytes", 24);
  EXPECT_EQ(ErrorLine(s),
            "mrctl: OUT_OF_RANGE STATUS_BUFFER_TOO_SMALL LAM_CAPACITY: mapping "
            "needs 24 bytes (required_size=24)");
  EXPECT_EQ(ErrorLine(UsageError("--length is required")),
            "mrctl: --length is required");
}

TEST(OutputTest, HumanFormIsKeyValueLines) {
  v1::RegisterMrResponse r;
  r.set_registration(3);
  r.set_rkey(0x1234);
  r.set_references(2);
  r.set_rdma_descriptor(std::string("\x01\x02", 2));
  std::string text = HumanForm(r);
  EXPECT_NE(text.find("registration=3\n"), std::string::npos);
  EXPECT_NE(text.find("rkey=4660\n"), std::string::npos);
  EXPECT_NE(text.find("cache_hit=false\n"), std::string::npos);  // defaults too
  EXPECT_NE(text.find("rdma_descriptor=0102\n"), std::string::npos);

  v1::ListRegistrationsResponse list;
  list.mutable_session()->set_kind("lease");
  list.add_registrations()->set_rkey(7);
  list.add_registrations()->set_rkey(8);
  std::string l = HumanForm(list, "x.");
  EXPECT_NE(l.find("x.session.kind=lease\n"), std::string::npos);
  EXPECT_NE(l.find("x.registrations[1].rkey=8\n"), std::string::npos);

  v1::BuildLamResponse lam;
  lam.add_pages(4096);
  lam.add_pages(8192);
  EXPECT_NE(HumanForm(lam).find("pages=4096,8192\n"), std::string::npos);

  v1::Completion c;
  c.set_kind(v1::Completion::FAST_REGISTER);
  c.set_status(v1::STATUS_SUCCESS);
  std::string ct = HumanForm(c);
  EXPECT_NE(ct.find("kind=FAST_REGISTER\n"), std::string::npos);
  EXPECT_NE(ct.find("status=STATUS_SUCCESS\n"), std::string::npos);
}

TEST(OutputTest, HumanFormSkipsUnsetOptionalFields) {
  v1::RegisterMrRequest req;
  EXPECT_EQ(HumanForm(req).find("base_address="), std::string::npos);
  req.set_base_address(0);
  EXPECT_NE(HumanForm(req).find("base_address=0\n"), std::string::npos);
}

TEST(OutputTest, JsonFormIsGrpcurlStyle) {
  v1::RegisterMrResponse r;
  r.set_registration(3);
  r.set_rkey(9);
  r.set_base_address(0x1000);
  absl::StatusOr<std::string> json = JsonForm(r);
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_EQ(json->find('\n'), std::string::npos);
  EXPECT_NE(json->find("\"registration\":\"3\""), std::string::npos);
  EXPECT_NE(json->find("\"rkey\":9"), std::string::npos);
  EXPECT_NE(json->find("\"baseAddress\":\"4096\""), std::string::npos);
  EXPECT_NE(json->find("\"cacheHit\":false"), std::string::npos);
}

TEST(ClientOptionsForTest, RuntimeDirSocketAndTimeout) {
  GlobalOptions g;
  g.runtime_dir = "/rd";
  g.timeout = absl::Seconds(3);
  client::ClientOptions o = ClientOptionsFor(g);
  EXPECT_EQ(o.socket_path, "/rd/mrd.sock");
  EXPECT_EQ(o.fd_socket_path, "/rd/fd.sock");
  EXPECT_EQ(o.rpc_timeout, absl::Seconds(3));
  EXPECT_EQ(o.connect_timeout, absl::Seconds(3));
  g.socket = "/other.sock";
  g.fd_socket = "/other-fd.sock";
  o = ClientOptionsFor(g);
  EXPECT_EQ(o.socket_path, "/other.sock");
  EXPECT_EQ(o.fd_socket_path, "/other-fd.sock");
}

TEST(RunTest, UsageErrorsExitOneAndHelpExitsZero) {
  std::FILE* out = std::tmpfile();
  std::FILE* err = std::tmpfile();
  EXPECT_EQ(::mrd::mrctl::Run({}, {}, out, err), kExitUsage);
  EXPECT_EQ(::mrd::mrctl::Run({"nope"}, {}, out, err), kExitUsage);
  EXPECT_EQ(::mrd::mrctl::Run({"register", "--session=s", "--buffer=1"}, {},
                              out, err),
            kExitUsage);  // --length missing: found while running
  EXPECT_EQ(::mrd::mrctl::Run({"help"}, {}, out, err), kExitOk);
  EXPECT_EQ(::mrd::mrctl::Run({"hold", "--help"}, {}, out, err), kExitOk);
  std::fclose(out);
  std::fclose(err);
}

TEST(RunTest, NoServerIsUnavailable) {
  std::FILE* out = std::tmpfile();
  std::FILE* err = std::tmpfile();
  EXPECT_EQ(::mrd::mrctl::Run({"info", "--socket=/nonexistent/mrd.sock"}, {},
                              out, err),
            kExitUnavailable);
  std::rewind(err);
  char line[512] = {};
  ASSERT_NE(std::fgets(line, sizeof(line), err), nullptr);
  EXPECT_EQ(std::string(line).rfind("mrctl: UNAVAILABLE", 0), 0u) << line;
  std::fclose(out);
  std::fclose(err);
}

}  // namespace
// docs/CLI.md's command table against mrctl's own: every command is
// documented with each of its flags, and every documented command and flag
// exists (the table is what users read; the parser is what runs).
TEST(CliDocTest, TheCommandTableMatchesMrctl) {
  std::ifstream doc(std::string(MRD_SOURCE_DIR) + "/docs/CLI.md");
  ASSERT_TRUE(doc.good());
  std::map<std::string, std::string> documented;  // command -> flags cell
  std::string line;
  bool in_table = false;
  while (std::getline(doc, line)) {
    if (absl::StartsWith(line, "## Commands")) in_table = true;
    if (!in_table) continue;
    if (absl::StartsWith(line, "### ")) break;
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, "| `")) continue;
    const size_t tick = rest.find('`');
    ASSERT_NE(tick, absl::string_view::npos) << line;
    std::string name(rest.substr(0, tick));
    // "import-file PATH": the command is the lowercase words.
    std::vector<std::string> words;
    for (absl::string_view w : absl::StrSplit(name, ' ')) {
      if (!w.empty() && absl::ascii_islower(w[0])) words.emplace_back(w);
    }
    documented[absl::StrJoin(words, " ")] = line;
  }
  ASSERT_GE(documented.size(), 20u);
  for (const CommandSpec& c : Commands()) {
    auto it = documented.find(c.name);
    if (it == documented.end()) {
      ADD_FAILURE() << "mrctl " << c.name << " is not in docs/CLI.md";
      continue;
    }
    for (const FlagSpec& f : c.flags) {
      EXPECT_TRUE(absl::StrContains(it->second, "--" + f.name))
          << "docs/CLI.md does not give mrctl " << c.name << " --" << f.name;
    }
  }
  for (const auto& [name, row] : documented) {
    const CommandSpec* c = FindCommand(name);
    if (c == nullptr) {
      ADD_FAILURE() << "docs/CLI.md documents an unknown command: " << name;
      continue;
    }
    // Each --flag the row names (in the flags cell) is one of the command's.
    std::vector<std::string> cells = absl::StrSplit(row, " | ");
    ASSERT_GE(cells.size(), 3u) << row;
    for (absl::string_view token :
         absl::StrSplit(cells[2], absl::ByAnyChar(" [=`|]"))) {
      if (!absl::ConsumePrefix(&token, "--")) continue;
      bool known = false;
      for (const FlagSpec& f : c->flags) known |= f.name == token;
      for (const FlagSpec& f : GlobalFlags()) known |= f.name == token;
      EXPECT_TRUE(known) << "docs/CLI.md gives mrctl " << name << " --" << token
                         << ", which it does not take";
    }
  }
}

}  // namespace mrd::mrctl
