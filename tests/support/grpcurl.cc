// `grpcurl`, as far as mrd's README uses it: the recipes there run in tests
// exactly as written (tests/integration/readme_test.py), on machines where
// grpcurl is not installed (it is not a Debian package). Like grpcurl it
// knows no service at build time: everything comes through server
// reflection (tests/support/reflection_client.h).
//
//   grpcurl [-plaintext] [-unix] [-v] [-d JSON] ADDRESS list [SERVICE]
//   grpcurl ... ADDRESS describe SYMBOL
//   grpcurl ... ADDRESS SERVICE/METHOD
//
// Output and exit codes follow grpcurl's: a response as indented JSON; an
// RPC error as "ERROR:\n  Code: <name>\n  Message: <message>" on stderr with
// exit code 64 + the gRPC code; -v adds the response trailers (mrd's seed
// status and reason); a usage or lookup error exits 1 or 2.

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/support/reflection_client.h"

namespace {

// grpcurl prints a code by its Go name.
const char* CodeName(grpc::StatusCode code) {
  static const char* const kNames[] = {"OK",
                                       "Canceled",
                                       "Unknown",
                                       "InvalidArgument",
                                       "DeadlineExceeded",
                                       "NotFound",
                                       "AlreadyExists",
                                       "PermissionDenied",
                                       "ResourceExhausted",
                                       "FailedPrecondition",
                                       "Aborted",
                                       "OutOfRange",
                                       "Unimplemented",
                                       "Internal",
                                       "Unavailable",
                                       "DataLoss",
                                       "Unauthenticated"};
  const int i = static_cast<int>(code);
  return i >= 0 && i < 17 ? kNames[i] : "Unknown";
}

int Usage(const char* why) {
  std::fprintf(stderr,
               "grpcurl: %s\nusage: grpcurl [-plaintext] [-unix] [-v] "
               "[-d JSON] ADDRESS (list [SERVICE] | describe SYMBOL | "
               "SERVICE/METHOD)\n",
               why);
  return 2;
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "Failed: %s\n", std::string(status.message()).c_str());
  return 1;
}

// "rpc Name ( .pkg.Request ) returns ( stream .pkg.Response );"
std::string MethodLine(const google::protobuf::MethodDescriptor& m) {
  return absl::StrCat("rpc ", m.name(), " ( ",
                      m.client_streaming() ? "stream " : "", ".",
                      m.input_type()->full_name(), " ) returns ( ",
                      m.server_streaming() ? "stream " : "", ".",
                      m.output_type()->full_name(), " );");
}

int Describe(mrd::testing::ReflectionClient& client,
             const std::string& symbol) {
  // A method's name is its service's plus one component.
  std::string file_symbol = symbol;
  if (absl::Status s = client.LoadSymbol(file_symbol); !s.ok()) {
    const size_t dot = symbol.rfind('.');
    if (dot == std::string::npos) return Fail(s);
    file_symbol = symbol.substr(0, dot);
    if (absl::Status again = client.LoadSymbol(file_symbol); !again.ok()) {
      std::fprintf(stderr, "Failed to resolve symbol \"%s\": %s\n",
                   symbol.c_str(), std::string(s.message()).c_str());
      return 1;
    }
  }
  const auto& pool = client.pool();
  if (const auto* service = pool.FindServiceByName(symbol)) {
    std::printf("%s is a service:\n%s", symbol.c_str(),
                service->DebugString().c_str());
  } else if (const auto* method = pool.FindMethodByName(symbol)) {
    std::printf("%s is a method:\n%s\n", symbol.c_str(),
                MethodLine(*method).c_str());
  } else if (const auto* message = pool.FindMessageTypeByName(symbol)) {
    std::printf("%s is a message:\n%s", symbol.c_str(),
                message->DebugString().c_str());
  } else if (const auto* e = pool.FindEnumTypeByName(symbol)) {
    std::printf("%s is an enum:\n%s", symbol.c_str(), e->DebugString().c_str());
  } else {
    std::fprintf(stderr, "Failed to resolve symbol \"%s\"\n", symbol.c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool plaintext = false, unix_socket = false, verbose = false;
  std::string data;
  std::vector<std::string> rest;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-plaintext") {
      plaintext = true;
    } else if (arg == "-unix") {
      unix_socket = true;
    } else if (arg == "-v") {
      verbose = true;
    } else if (arg == "-d") {
      if (++i == argc) return Usage("-d needs a value");
      data = argv[i];
    } else if (absl::StartsWith(arg, "-") && rest.empty()) {
      return Usage(absl::StrCat("unsupported option ", arg).c_str());
    } else {
      rest.push_back(arg);
    }
  }
  if (!plaintext) return Usage("only -plaintext is supported");
  if (rest.empty()) return Usage("no address");
  const std::string target =
      unix_socket ? absl::StrCat("unix:", rest[0]) : rest[0];
  mrd::testing::ReflectionClient client(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));

  if (rest.size() < 2) return Usage("no verb");
  if (rest[1] == "list") {
    if (rest.size() == 2) {
      absl::StatusOr<std::vector<std::string>> services = client.ListServices();
      if (!services.ok()) return Fail(services.status());
      std::sort(services->begin(), services->end());
      for (const std::string& s : *services) std::printf("%s\n", s.c_str());
      return 0;
    }
    if (absl::Status s = client.LoadSymbol(rest[2]); !s.ok()) return Fail(s);
    const auto* service = client.pool().FindServiceByName(rest[2]);
    if (service == nullptr) return Fail(absl::NotFoundError(rest[2]));
    for (int i = 0; i < service->method_count(); ++i) {
      std::printf("%s\n", service->method(i)->full_name().c_str());
    }
    return 0;
  }
  if (rest[1] == "describe") {
    if (rest.size() != 3) return Usage("describe needs one symbol");
    return Describe(client, rest[2]);
  }
  const size_t slash = rest[1].rfind('/');
  if (slash == std::string::npos || rest.size() != 2) {
    return Usage(absl::StrCat("unknown verb ", rest[1]).c_str());
  }
  absl::StatusOr<mrd::testing::ReflectionCallResult> result =
      client.Call(rest[1].substr(0, slash), rest[1].substr(slash + 1), data,
                  /*indent=*/true);
  if (!result.ok()) return Fail(result.status());
  if (result->status.ok()) std::printf("%s", result->json.c_str());
  if (verbose) {
    // Binary ("-bin") values in base64, as grpcurl shows them.
    std::printf("\nResponse trailers received:\n");
    for (const auto& [key, value] : result->trailers) {
      std::printf("%s: %s\n", key.c_str(),
                  absl::EndsWith(key, "-bin")
                      ? absl::Base64Escape(value).c_str()
                      : value.c_str());
    }
  }
  std::fflush(stdout);
  if (!result->status.ok()) {
    std::fprintf(stderr, "ERROR:\n  Code: %s\n  Message: %s\n",
                 CodeName(result->status.error_code()),
                 result->status.error_message().c_str());
    return 64 + static_cast<int>(result->status.error_code());
  }
  return 0;
}
