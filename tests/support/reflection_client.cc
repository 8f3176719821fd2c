#include "tests/support/reflection_client.h"

#include <google/protobuf/descriptor.pb.h>
#include <google/protobuf/util/json_util.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/support/byte_buffer.h>

#include <future>
#include <utility>

#include "absl/strings/str_cat.h"

namespace mrd::testing {

namespace refl = grpc::reflection::v1alpha;
using google::protobuf::FileDescriptorProto;
using google::protobuf::Message;

ReflectionClient::ReflectionClient(std::shared_ptr<grpc::Channel> channel)
    : channel_(std::move(channel)),
      stub_(refl::ServerReflection::NewStub(channel_)),
      factory_(std::make_unique<google::protobuf::DynamicMessageFactory>()) {}

ReflectionClient::~ReflectionClient() = default;

absl::StatusOr<refl::ServerReflectionResponse> ReflectionClient::Ask(
    const refl::ServerReflectionRequest& req) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto stream = stub_->ServerReflectionInfo(&ctx);
  refl::ServerReflectionResponse resp;
  const bool wrote = stream->Write(req);
  stream->WritesDone();
  const bool read = wrote && stream->Read(&resp);
  grpc::Status status = stream->Finish();
  if (!status.ok()) {
    return absl::UnavailableError(
        absl::StrCat("reflection: ", status.error_message()));
  }
  if (!read) return absl::UnavailableError("reflection: no answer");
  if (resp.has_error_response()) {
    return absl::NotFoundError(resp.error_response().error_message());
  }
  return resp;
}

absl::StatusOr<std::vector<std::string>> ReflectionClient::ListServices() {
  refl::ServerReflectionRequest req;
  req.set_list_services("");
  absl::StatusOr<refl::ServerReflectionResponse> resp = Ask(req);
  if (!resp.ok()) return resp.status();
  std::vector<std::string> names;
  for (const auto& s : resp->list_services_response().service()) {
    names.push_back(s.name());
  }
  return names;
}

absl::Status ReflectionClient::LoadSymbol(const std::string& symbol) {
  refl::ServerReflectionRequest req;
  req.set_file_containing_symbol(symbol);
  absl::StatusOr<refl::ServerReflectionResponse> resp = Ask(req);
  if (!resp.ok()) return resp.status();
  return LoadFiles(*resp);
}

absl::Status ReflectionClient::LoadFiles(
    const refl::ServerReflectionResponse& resp) {
  if (!resp.has_file_descriptor_response()) {
    return absl::NotFoundError("reflection: no file descriptors");
  }
  std::vector<FileDescriptorProto> files;
  for (const auto& bytes :
       resp.file_descriptor_response().file_descriptor_proto()) {
    FileDescriptorProto file;
    if (!file.ParseFromString(bytes)) {
      return absl::DataLossError("reflection: a bad file descriptor");
    }
    files.push_back(std::move(file));
  }
  // Dependencies first: fetch the missing ones, retry until every file
  // builds.
  for (size_t round = 0; round <= files.size(); ++round) {
    for (const auto& file : files) {
      if (pool_.FindFileByName(file.name()) != nullptr) continue;
      bool deps_ready = true;
      for (const auto& dep : file.dependency()) {
        if (pool_.FindFileByName(dep) != nullptr) continue;
        bool listed = false;
        for (const auto& f : files) listed |= f.name() == dep;
        if (listed) {
          deps_ready = false;
          continue;
        }
        refl::ServerReflectionRequest req;
        req.set_file_by_filename(dep);
        absl::StatusOr<refl::ServerReflectionResponse> more = Ask(req);
        if (!more.ok()) return more.status();
        if (absl::Status s = LoadFiles(*more); !s.ok()) return s;
      }
      if (deps_ready) pool_.BuildFile(file);
    }
  }
  for (const auto& file : files) {
    if (pool_.FindFileByName(file.name()) == nullptr) {
      return absl::DataLossError(
          absl::StrCat("reflection: cannot build ", file.name()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ReflectionCallResult> ReflectionClient::Call(
    const std::string& service_name, const std::string& method_name,
    const std::string& json, bool indent) {
  if (pool_.FindServiceByName(service_name) == nullptr) {
    if (absl::Status s = LoadSymbol(service_name); !s.ok()) return s;
  }
  const auto* service = pool_.FindServiceByName(service_name);
  if (service == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("service not found: ", service_name));
  }
  const auto* method = service->FindMethodByName(method_name);
  if (method == nullptr) {
    return absl::NotFoundError(absl::StrCat("service ", service_name,
                                            " does not include a method named ",
                                            method_name));
  }
  std::unique_ptr<Message> req(
      factory_->GetPrototype(method->input_type())->New());
  auto parsed = google::protobuf::util::JsonStringToMessage(
      json.empty() ? "{}" : json, req.get());
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("error getting request data: ", parsed.ToString()));
  }
  std::string bytes = req->SerializeAsString();
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::GenericStub stub(channel_);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, absl::StrCat("/", service_name, "/", method_name),
                 grpc::StubOptions(), &request, &response,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  ReflectionCallResult result;
  result.status = done.get_future().get();
  for (const auto& [key, value] : ctx.GetServerTrailingMetadata()) {
    result.trailers.emplace(std::string(key.data(), key.size()),
                            std::string(value.data(), value.size()));
  }
  if (!result.status.ok()) return result;
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) {
    return absl::DataLossError("cannot read the response");
  }
  std::string out;
  for (const auto& s : slices) {
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  std::unique_ptr<Message> resp(
      factory_->GetPrototype(method->output_type())->New());
  if (!resp->ParseFromString(out)) {
    return absl::DataLossError("cannot parse the response");
  }
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = indent;
  auto printed =
      google::protobuf::util::MessageToJsonString(*resp, &result.json, options);
  if (!printed.ok()) return absl::InternalError(printed.ToString());
  return result;
}

}  // namespace mrd::testing
