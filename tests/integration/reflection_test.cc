// Talks to the real mrd the way grpcurl does: no generated mrd code is linked
// into this test. It lists services and fetches descriptors through server
// reflection, builds messages from JSON against those descriptors, and calls
// methods with a generic stub.

#include <google/protobuf/descriptor.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <string>

#include "tests/integration/mrd_process.h"
#include "tests/support/reflection_client.h"

namespace mrd::testing {
namespace {

class ReflectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto mrd = MrdProcess::Start();
    ASSERT_TRUE(mrd.ok()) << mrd.status();
    mrd_ = std::move(*mrd);
    channel_ = grpc::CreateChannel(mrd_->grpc_target(),
                                   grpc::InsecureChannelCredentials());
    reflection_ = std::make_unique<ReflectionClient>(channel_);
  }
  void TearDown() override {
    // An idle open channel holds mrd's shutdown until its grace deadline.
    reflection_.reset();
    channel_.reset();
    if (mrd_) {
      absl::Status stopped = mrd_->Stop();
      EXPECT_TRUE(stopped.ok()) << stopped;
    }
  }

  // Loads `symbol`'s file through reflection.
  ::testing::AssertionResult Load(const std::string& symbol) {
    absl::Status loaded = reflection_->LoadSymbol(symbol);
    if (loaded.ok()) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << loaded;
  }

  // Calls `method` (e.g. "GetDeviceInfo") with a JSON request; returns the
  // JSON response, or the status message prefixed by "ERROR:".
  std::string Call(
      const std::string& method, const std::string& json,
      const std::string& service_name = "mrd.v1.MemoryRegistration") {
    absl::StatusOr<ReflectionCallResult> result =
        reflection_->Call(service_name, method, json);
    EXPECT_TRUE(result.ok()) << result.status();
    if (!result.ok()) return "ERROR:" + std::string(result.status().message());
    if (!result->status.ok()) return "ERROR:" + result->status.error_message();
    return result->json;
  }

  std::unique_ptr<MrdProcess> mrd_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<ReflectionClient> reflection_;
};

TEST_F(ReflectionTest, ListsServicesAsGrpcurlWould) {
  absl::StatusOr<std::vector<std::string>> services =
      reflection_->ListServices();
  ASSERT_TRUE(services.ok()) << services.status();
  auto has = [&](const std::string& s) {
    return std::find(services->begin(), services->end(), s) != services->end();
  };
  EXPECT_TRUE(has("mrd.v1.MemoryRegistration"));
  EXPECT_TRUE(has("grpc.health.v1.Health"));
  EXPECT_TRUE(has("grpc.reflection.v1alpha.ServerReflection"));
}

// grpcurl ... grpc.health.v1.Health/Check (README): health is described by
// reflection like any service, and answers for "" and for mrd's service name
// (Kubernetes gRPC probes and grpc_health_probe send one).
TEST_F(ReflectionTest, HealthIsDescribedAndAnswersForTheServerAndMrd) {
  ASSERT_TRUE(Load("grpc.health.v1.Health"));
  const auto* health =
      reflection_->pool().FindServiceByName("grpc.health.v1.Health");
  ASSERT_NE(health, nullptr);
  ASSERT_NE(health->FindMethodByName("Check"), nullptr);
  EXPECT_EQ(Call("Check", "{}", "grpc.health.v1.Health"),
            R"({"status":"SERVING"})");
  EXPECT_EQ(Call("Check", R"({"service":"mrd.v1.MemoryRegistration"})",
                 "grpc.health.v1.Health"),
            R"({"status":"SERVING"})");
  EXPECT_EQ(Call("Check", R"({"service":"no.such.Service"})",
                 "grpc.health.v1.Health"),
            "ERROR:service name unknown");
}

TEST_F(ReflectionTest, DescribesRegisterMr) {
  ASSERT_TRUE(Load("mrd.v1.MemoryRegistration"));
  const auto* service =
      reflection_->pool().FindServiceByName("mrd.v1.MemoryRegistration");
  ASSERT_NE(service, nullptr);
  const auto* register_mr = service->FindMethodByName("RegisterMr");
  ASSERT_NE(register_mr, nullptr);
  EXPECT_EQ(register_mr->input_type()->full_name(), "mrd.v1.RegisterMrRequest");
  EXPECT_EQ(register_mr->output_type()->full_name(),
            "mrd.v1.RegisterMrResponse");
  for (const char* field :
       {"session", "buffer", "offset", "length", "flags", "base_address"}) {
    EXPECT_NE(register_mr->input_type()->FindFieldByName(field), nullptr)
        << field;
  }
  EXPECT_NE(register_mr->output_type()->FindFieldByName("rkey"), nullptr);
  // The seed flag values are in the schema too.
  const auto* flags = reflection_->pool().FindEnumTypeByName("mrd.v1.MrFlag");
  ASSERT_NE(flags, nullptr);
  EXPECT_EQ(flags->FindValueByName("NDK_MR_FLAG_ALLOW_REMOTE_WRITE")->number(),
            5);
}

TEST_F(ReflectionTest, CallsGetDeviceInfoAndRegistersThroughALeaseSession) {
  ASSERT_TRUE(Load("mrd.v1.MemoryRegistration"));
  std::string info = Call("GetDeviceInfo", "{}");
  EXPECT_NE(info.find("\"kind\":\"software\""), std::string::npos) << info;
  EXPECT_NE(info.find("\"pageSize\""), std::string::npos) << info;

  std::string lease = Call("OpenLeaseSession", R"({"ttlSeconds": 60})");
  ASSERT_EQ(lease.find("ERROR:"), std::string::npos) << lease;
  auto field = [](const std::string& json, const std::string& name) {
    size_t at = json.find("\"" + name + "\":");
    if (at == std::string::npos) return std::string();
    at += name.size() + 3;
    if (json[at] == '"') ++at;
    size_t end = json.find_first_of("\",}", at);
    return json.substr(at, end - at);
  };
  std::string session = field(lease, "session");
  ASSERT_FALSE(session.empty()) << lease;

  ASSERT_TRUE(WriteShmFile(mrd_->shm_dir(), "demo", "hello", 8192).ok());
  // The lease is anonymous (grpcurl cannot vouch through the fd socket), and
  // anyone in mrd's group can reach its socket (mode 0660): the file must be
  // one a member of that group may read and write (README recipe).
  const std::string demo = mrd_->shm_dir() + "/demo";
  ASSERT_EQ(::chown(demo.c_str(), static_cast<uid_t>(-1), getegid()), 0);
  ASSERT_EQ(::chmod(demo.c_str(), 0660), 0);
  std::string buffer =
      Call("ImportFile",
           R"({"session":")" + session + R"(","path":"demo","writable":true})");
  ASSERT_EQ(buffer.find("ERROR:"), std::string::npos) << buffer;
  std::string buffer_id = field(buffer, "buffer");
  ASSERT_FALSE(buffer_id.empty()) << buffer;

  std::string reg =
      Call("RegisterMr", R"({"session":")" + session + R"(","buffer":")" +
                             buffer_id + R"(","length":"4096","flags":2})");
  ASSERT_EQ(reg.find("ERROR:"), std::string::npos) << reg;
  EXPECT_FALSE(field(reg, "rkey").empty()) << reg;
  EXPECT_EQ(field(reg, "references"), "1") << reg;

  // Errors come back with the seed's name, as grpcurl would print them.
  std::string bad =
      Call("RegisterMr", R"({"session":")" + session + R"(","buffer":")" +
                             buffer_id + R"(","length":"4096","flags":64})");
  EXPECT_NE(bad.find("ERROR:"), std::string::npos) << bad;
  EXPECT_NE(bad.find("NDK_MR_FLAG"), std::string::npos) << bad;

  EXPECT_EQ(Call("CloseSession", R"({"session":")" + session + R"("})"), "{}");
}

}  // namespace
}  // namespace mrd::testing
