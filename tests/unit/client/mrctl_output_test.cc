// mrctl's printer on messages built here: what each command prints for a
// given reply (key=value and --json), and its error lines. No server: the
// real mrctl against the real mrd is tests/integration/mrctl_test.cc.
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/mrctl/args.h"
#include "client/mrctl/output.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "mrd/v1/mrd.pb.h"

namespace mrd::mrctl {
namespace {

// key=value lines into a map; fails on a line without '='.
std::map<std::string, std::string> Fields(const std::string& text) {
  std::map<std::string, std::string> m;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    size_t eq = line.find('=');
    EXPECT_NE(eq, absl::string_view::npos) << line;
    if (eq == absl::string_view::npos) continue;
    m[std::string(line.substr(0, eq))] = std::string(line.substr(eq + 1));
  }
  return m;
}

std::string Json(const google::protobuf::Message& m) {
  absl::StatusOr<std::string> json = JsonForm(m);
  EXPECT_TRUE(json.ok()) << json.status();
  return json.ok() ? *json : "";
}

TEST(OutputFormTest, DeviceInfo) {
  v1::DeviceInfo info;
  info.set_name("software");
  info.set_kind("software");
  info.set_page_size(4096);
  info.set_peer_address("127.0.0.1:7471");
  info.set_healthy(true);
  std::string text = HumanForm(info);
  auto f = Fields(text);
  EXPECT_EQ(f["name"], "software");
  EXPECT_EQ(f["page_size"], "4096");
  EXPECT_EQ(f["peer_address"], "127.0.0.1:7471");
  EXPECT_EQ(f["healthy"], "true");
  EXPECT_EQ(f["pinned_bytes"], "0");  // defaults are shown
  EXPECT_EQ(text.back(), '\n');
  std::string json = Json(info);
  EXPECT_NE(json.find("\"pageSize\":\"4096\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"pinnedBytes\":\"0\""), std::string::npos) << json;
  EXPECT_EQ(json.find('\n'), std::string::npos);
}

TEST(OutputFormTest, DeviceInfoListsEveryDevice) {
  v1::DeviceInfo info;
  info.set_name("software");
  for (const char* name : {"software", "software1"}) {
    v1::DeviceInfo* device = info.add_devices();
    device->set_name(name);
    device->set_peer_address(absl::StrCat("127.0.0.1:", device->name().size()));
  }
  auto f = Fields(HumanForm(info));
  EXPECT_EQ(f["name"], "software");
  EXPECT_EQ(f["devices[0].name"], "software");
  EXPECT_EQ(f["devices[0].peer_address"], "127.0.0.1:8");
  EXPECT_EQ(f["devices[1].name"], "software1");
  EXPECT_EQ(f["devices[1].peer_address"], "127.0.0.1:9");
  EXPECT_EQ(f.count("devices[2].name"), 0u);
  std::string json = Json(info);
  EXPECT_NE(json.find("\"devices\":[{\"name\":\"software\","),
            std::string::npos)
      << json;
  EXPECT_NE(json.find("{\"name\":\"software1\","), std::string::npos) << json;
}

TEST(OutputFormTest, SessionInfoOfALease) {
  v1::SessionInfo s;
  s.set_session("tok");
  s.set_kind("lease");
  s.set_ttl_seconds(90);
  auto f = Fields(HumanForm(s));
  EXPECT_EQ(f["session"], "tok");
  EXPECT_EQ(f["kind"], "lease");
  EXPECT_EQ(f["ttl_seconds"], "90");
  std::string json = Json(s);
  EXPECT_NE(json.find("\"session\":\"tok\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"ttlSeconds\":90"), std::string::npos) << json;
  EXPECT_NE(json.find("\"expiresUnixMs\":\"0\""), std::string::npos) << json;
}

TEST(OutputFormTest, RegisterListDeregisterRelease) {
  v1::RegisterMrResponse r;
  r.set_registration(1);
  r.set_rkey(0x2dd3c0);
  r.set_base_address(4294967296);
  r.set_references(2);
  r.set_cache_hit(true);
  r.set_rdma_descriptor(std::string("\xc0\xd3\x2d\x00", 4));
  auto f = Fields(HumanForm(r));
  EXPECT_EQ(f["registration"], "1");
  EXPECT_EQ(f["rkey"], "3003328");
  EXPECT_EQ(f["base_address"], "4294967296");
  EXPECT_EQ(f["cache_hit"], "true");
  EXPECT_EQ(f["rdma_descriptor"], "c0d32d00");
  std::string json = Json(r);
  EXPECT_NE(json.find("\"cacheHit\":true"), std::string::npos) << json;
  EXPECT_NE(json.find("\"references\":2"), std::string::npos) << json;
  EXPECT_NE(json.find("\"baseAddress\":\"4294967296\""), std::string::npos);
  EXPECT_NE(json.find("\"rdmaDescriptor\":\"wNMtAA==\""), std::string::npos)
      << json;  // bytes in base64

  // One token per device: device, rkey, lkey and peer address each.
  for (const char* device : {"software", "software1"}) {
    v1::DeviceToken* token = r.add_tokens();
    token->set_device(device);
    token->set_rkey(r.tokens_size() == 1 ? 0x2dd3c0 : 0x77);
    token->set_lkey(token->rkey());
    token->set_peer_address(absl::StrCat("127.0.0.1:", 7470 + r.tokens_size()));
  }
  auto tf = Fields(HumanForm(r));
  EXPECT_EQ(tf["tokens[0].device"], "software");
  EXPECT_EQ(tf["tokens[0].rkey"], "3003328");
  EXPECT_EQ(tf["tokens[0].peer_address"], "127.0.0.1:7471");
  EXPECT_EQ(tf["tokens[1].device"], "software1");
  EXPECT_EQ(tf["tokens[1].rkey"], "119");
  EXPECT_EQ(tf["tokens[1].lkey"], "119");
  EXPECT_EQ(tf["tokens[1].peer_address"], "127.0.0.1:7472");
  EXPECT_EQ(tf["rkey"], "3003328");  // the first device's, as before
  json = Json(r);
  EXPECT_NE(json.find("\"tokens\":[{\"device\":\"software\",\"rkey\":3003328,"
                      "\"lkey\":3003328,\"peerAddress\":\"127.0.0.1:7471\"},"
                      "{\"device\":\"software1\",\"rkey\":119,\"lkey\":119,"
                      "\"peerAddress\":\"127.0.0.1:7472\"}]"),
            std::string::npos)
      << json;

  v1::ListRegistrationsResponse list;
  list.add_buffers()->set_buffer(3);
  v1::RegistrationInfo* listed = list.add_registrations();
  listed->set_references(2);
  *listed->mutable_tokens() = r.tokens();
  auto lf = Fields(HumanForm(list));
  EXPECT_EQ(lf["registrations[0].tokens[1].device"], "software1");
  EXPECT_EQ(lf["registrations[0].tokens[1].peer_address"], "127.0.0.1:7472");
  EXPECT_EQ(lf["buffers[0].buffer"], "3");
  EXPECT_EQ(lf["registrations[0].references"], "2");
  EXPECT_EQ(lf.count("lams[0].lam"), 0u);  // empty repeated messages: nothing

  v1::DeregisterMrResponse d;
  d.set_references(1);
  EXPECT_EQ(HumanForm(d), "references=1\n");
  d.set_references(0);
  EXPECT_EQ(HumanForm(d), "references=0\n");
  EXPECT_EQ(Json(d), "{\"references\":0}");

  v1::ReleaseBufferResponse rb;
  rb.set_invalidated_registrations(1);
  EXPECT_EQ(Fields(HumanForm(rb))["invalidated_registrations"], "1");
  EXPECT_EQ(Fields(HumanForm(rb))["released_lams"], "0");
}

TEST(OutputFormTest, EmptyRepliesPrintNothingOrAnEmptyObject) {
  EXPECT_EQ(HumanForm(v1::CloseSessionResponse()), "");
  EXPECT_EQ(Json(v1::CloseSessionResponse()), "{}");
  EXPECT_EQ(HumanForm(v1::ReleaseLamResponse()), "");
  EXPECT_EQ(Json(v1::CloseMrResponse()), "{}");
}

TEST(OutputFormTest, LamCompletionAndTicket) {
  v1::BuildLamResponse lam;
  lam.set_lam(4);
  lam.add_pages(4096);
  lam.add_pages(8192);
  lam.set_fbo(100);
  auto f = Fields(HumanForm(lam));
  EXPECT_EQ(f["pages"], "4096,8192");
  EXPECT_EQ(f["fbo"], "100");
  EXPECT_NE(Json(lam).find("\"pages\":[\"4096\",\"8192\"]"), std::string::npos)
      << Json(lam);

  v1::Completion c;
  c.set_kind(v1::Completion::FAST_REGISTER);
  c.set_request_context(42);
  c.set_status(v1::STATUS_SUCCESS);
  std::string json = Json(c);
  EXPECT_NE(json.find("\"kind\":\"FAST_REGISTER\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"requestContext\":\"42\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"status\":\"STATUS_SUCCESS\""), std::string::npos)
      << json;
  EXPECT_EQ(Fields(HumanForm(c))["kind"], "FAST_REGISTER");

  v1::PeerTicket t;
  t.set_ticket("abc");
  t.set_peer_address("127.0.0.1:1");
  t.set_device("software1");
  EXPECT_EQ(HumanForm(t),
            "ticket=abc\npeer_address=127.0.0.1:1\ndevice=software1\n");
}

TEST(OutputFormTest, PrefixesNestTheWayHoldPrintsThem) {
  v1::SessionInfo s;
  s.set_kind("fd");
  v1::BufferInfo b;
  b.set_source("memfd");
  EXPECT_EQ(Fields(HumanForm(s, "session."))["session.kind"], "fd");
  EXPECT_EQ(Fields(HumanForm(b, "buffer."))["buffer.source"], "memfd");
}

TEST(ErrorLineTest, CodeSeedReasonMessageAndRequiredSize) {
  EXPECT_EQ(ErrorLine(SeedError(::mrd::STATUS_INVALID_PARAMETER, "ZERO_LENGTH",
                                "length is zero")),
            "mrctl: INVALID_ARGUMENT STATUS_INVALID_PARAMETER ZERO_LENGTH: "
            "length is zero");
  EXPECT_EQ(ErrorLine(SeedError(::mrd::WSAEFAULT, "DESCRIPTOR_SPACE_TOO_SMALL",
                                "too small", 24)),
            "mrctl: OUT_OF_RANGE WSAEFAULT DESCRIPTOR_SPACE_TOO_SMALL: too "
            "small (required_size=24)");
  EXPECT_EQ(ErrorLine(SeedError(::mrd::WSAENOTCONN, "SESSION_NOT_CONNECTED",
                                "unknown, closed or expired session")),
            "mrctl: FAILED_PRECONDITION WSAENOTCONN SESSION_NOT_CONNECTED: "
            "unknown, closed or expired session");
  // A reason without a seed outcome, and neither.
  EXPECT_EQ(ErrorLine(MrdError(absl::StatusCode::kPermissionDenied,
                               "REMOTE_ACCESS_ERROR", "bad key")),
            "mrctl: PERMISSION_DENIED SEED_STATUS_UNSPECIFIED "
            "REMOTE_ACCESS_ERROR: bad key");
  EXPECT_EQ(ErrorLine(absl::UnavailableError("down")),
            "mrctl: UNAVAILABLE SEED_STATUS_UNSPECIFIED -: down");
  EXPECT_EQ(
      ErrorLine(UsageError("give exactly one of --registration and --mr")),
      "mrctl: give exactly one of --registration and --mr");
}

TEST(ExitCodeForTest, SeedOutcomesMapThroughTheirCodes) {
  EXPECT_EQ(ExitCodeFor(SeedError(::mrd::STATUS_INVALID_PARAMETER, "X", "m")),
            kExitFailed);
  EXPECT_EQ(ExitCodeFor(SeedError(::mrd::WSAEFAULT, "X", "m", 24)),
            kExitFailed);
  EXPECT_EQ(ExitCodeFor(SeedError(::mrd::STATUS_BUFFER_TOO_SMALL, "X", "m", 8)),
            kExitFailed);
  EXPECT_EQ(
      ExitCodeFor(SeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "X", "m")),
      kExitExhausted);
  EXPECT_EQ(ExitCodeFor(SeedError(::mrd::WSAENOTCONN, "X", "m")),
            kExitPrecondition);
  EXPECT_EQ(ExitCodeFor(SeedError(::mrd::STATUS_CONNECTION_INVALID, "X", "m")),
            kExitPrecondition);
  EXPECT_EQ(ExitCodeFor(SeedError(::mrd::STATUS_ACCESS_VIOLATION, "X", "m")),
            kExitDenied);
}

}  // namespace
}  // namespace mrd::mrctl
