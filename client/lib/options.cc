#include "client/lib/options.h"

#include <unistd.h>

#include <cstdlib>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace mrd::client {
namespace {

absl::string_view Env(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? absl::string_view() : absl::string_view(value);
}

}  // namespace

std::string ResolveRuntimeDir(uid_t uid, absl::string_view mrd_runtime_dir,
                              absl::string_view xdg_runtime_dir) {
  if (!mrd_runtime_dir.empty()) return std::string(mrd_runtime_dir);
  if (uid == 0) return "/run/mrd";
  if (!xdg_runtime_dir.empty()) return absl::StrCat(xdg_runtime_dir, "/mrd");
  return absl::StrCat("/tmp/mrd-", uid);
}

std::string DefaultRuntimeDir() {
  return ResolveRuntimeDir(::geteuid(), Env("MRD_RUNTIME_DIR"),
                           Env("XDG_RUNTIME_DIR"));
}

std::string DefaultSocketPath() {
  return absl::StrCat(DefaultRuntimeDir(), "/mrd.sock");
}

std::string DefaultFdSocketPath() {
  return absl::StrCat(DefaultRuntimeDir(), "/fd.sock");
}

std::string TargetFor(const ClientOptions& options) {
  if (!options.target.empty()) return options.target;
  return absl::StrCat("unix:", options.socket_path.empty()
                                   ? DefaultSocketPath()
                                   : options.socket_path);
}

std::string FdSocketPathFor(const ClientOptions& options) {
  return options.fd_socket_path.empty() ? DefaultFdSocketPath()
                                        : options.fd_socket_path;
}

std::string UnixPathOfTarget(absl::string_view target) {
  if (absl::StartsWith(target, "unix://")) {
    return std::string(target.substr(7));
  }
  if (absl::StartsWith(target, "unix:")) return std::string(target.substr(5));
  return "";
}

}  // namespace mrd::client
