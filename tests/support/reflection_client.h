// A gRPC client that knows nothing of mrd at build time, as grpcurl does:
// it lists services and fetches descriptors through server reflection
// (grpc.reflection.v1alpha), builds requests from JSON against those
// descriptors and calls methods with a generic stub. Used by
// tests/integration/reflection_test.cc and by tests/support/grpcurl.cc (the
// `grpcurl` that runs the README's recipes in tests).
//
// Not thread-safe.
#ifndef MRD_TESTS_SUPPORT_REFLECTION_CLIENT_H_
#define MRD_TESTS_SUPPORT_REFLECTION_CLIENT_H_

#include <google/protobuf/descriptor.h>
#include <google/protobuf/dynamic_message.h>
#include <grpcpp/grpcpp.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"

namespace mrd::testing {

// A finished unary call: its status, its response as JSON (when OK) and the
// server's trailing metadata.
struct ReflectionCallResult {
  grpc::Status status;
  std::string json;
  std::multimap<std::string, std::string> trailers;
};

class ReflectionClient {
 public:
  explicit ReflectionClient(std::shared_ptr<grpc::Channel> channel);
  ~ReflectionClient();

  absl::StatusOr<std::vector<std::string>> ListServices();

  // Loads the file defining `symbol` (a service, method, message or enum's
  // full name) and its dependencies into pool().
  absl::Status LoadSymbol(const std::string& symbol);

  // Calls `service`/`method` with a JSON request (`{}` when empty). Errors
  // only for what keeps the call from being made (unknown method, bad
  // JSON); the call's own status is in the result. `indent`: the response
  // JSON indented (grpcurl's output) or on one line.
  absl::StatusOr<ReflectionCallResult> Call(const std::string& service,
                                            const std::string& method,
                                            const std::string& json,
                                            bool indent = false);

  const google::protobuf::DescriptorPool& pool() const { return pool_; }

 private:
  absl::StatusOr<grpc::reflection::v1alpha::ServerReflectionResponse> Ask(
      const grpc::reflection::v1alpha::ServerReflectionRequest& req);
  absl::Status LoadFiles(
      const grpc::reflection::v1alpha::ServerReflectionResponse& resp);

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::reflection::v1alpha::ServerReflection::Stub> stub_;
  google::protobuf::DescriptorPool pool_;
  // Its prototypes point into pool_: declared after it, destroyed first.
  std::unique_ptr<google::protobuf::DynamicMessageFactory> factory_;
};

}  // namespace mrd::testing

#endif  // MRD_TESTS_SUPPORT_REFLECTION_CLIENT_H_
