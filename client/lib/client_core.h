// Internal to mrd_client: the state a Client shares with its copies and with
// everything made from it. Immutable after Client::Connect, hence
// thread-safe.
#ifndef MRD_CLIENT_LIB_CLIENT_CORE_H_
#define MRD_CLIENT_LIB_CLIENT_CORE_H_

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>

#include <memory>
#include <string>

#include "client/lib/options.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "mrd/v1/mrd.grpc.pb.h"

namespace mrd::client::internal {

struct ClientCore {
  ClientOptions options;
  std::string target;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::MemoryRegistration::Stub> stub;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_stub;

  // Applies rpc_timeout to a unary call's context.
  void PrepareUnary(grpc::ClientContext* context) const;
};

}  // namespace mrd::client::internal

#endif  // MRD_CLIENT_LIB_CLIENT_CORE_H_
