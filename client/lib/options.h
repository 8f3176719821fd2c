// Where the client finds mrd, and how long it waits. The defaults match the
// server's: <runtime_dir>/mrd.sock and <runtime_dir>/fd.sock, where
// runtime_dir is $MRD_RUNTIME_DIR if set, else /run/mrd for root, else
// $XDG_RUNTIME_DIR/mrd, else /tmp/mrd-<uid>. Explicit options override both.
//
// Thread-safe: the functions only read the environment.
#ifndef MRD_CLIENT_LIB_OPTIONS_H_
#define MRD_CLIENT_LIB_OPTIONS_H_

#include <sys/types.h>

#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace mrd::client {

struct ClientOptions {
  // Any gRPC target ("unix:/run/mrd/mrd.sock", "dns:///host:port"). Empty:
  // "unix:" + socket_path.
  std::string target;
  // The gRPC Unix socket. Empty: DefaultSocketPath().
  std::string socket_path;
  // The fd socket used by Session::OpenFd() without a path. Empty:
  // DefaultFdSocketPath().
  std::string fd_socket_path;
  // Deadline of every unary call and of every fd-socket exchange.
  // absl::InfiniteDuration(): none. Streams never get a deadline.
  absl::Duration rpc_timeout = absl::Seconds(30);
  // Client::Connect waits this long for the channel to become ready and
  // fails with UNAVAILABLE otherwise. Zero: connect lazily on the first call.
  absl::Duration connect_timeout = absl::Seconds(5);
};

// The runtime directory for `uid`, given the values of MRD_RUNTIME_DIR and
// XDG_RUNTIME_DIR (empty = unset). Pure; the rule above.
std::string ResolveRuntimeDir(uid_t uid, absl::string_view mrd_runtime_dir,
                              absl::string_view xdg_runtime_dir);

// The rule above applied to this process (geteuid() and its environment).
std::string DefaultRuntimeDir();
std::string DefaultSocketPath();    // DefaultRuntimeDir() + "/mrd.sock"
std::string DefaultFdSocketPath();  // DefaultRuntimeDir() + "/fd.sock"

// The target Client::Connect uses for `options`.
std::string TargetFor(const ClientOptions& options);
// The fd socket Session::OpenFd uses for `options` when given no path.
std::string FdSocketPathFor(const ClientOptions& options);

// The filesystem path of a "unix:" target ("unix:/p", "unix:///p",
// "unix:rel"); empty for any other target.
std::string UnixPathOfTarget(absl::string_view target);

}  // namespace mrd::client

#endif  // MRD_CLIENT_LIB_OPTIONS_H_
