// mrctl's commands: each runs one RPC (or a few) through mrd_client and
// prints the result. Run() is the whole program after argv is split.
//
// Not thread-safe: installs SIGINT/SIGTERM handlers for the waiting commands
// (completions, hold, watch).
#ifndef MRD_CLIENT_MRCTL_COMMANDS_H_
#define MRD_CLIENT_MRCTL_COMMANDS_H_

#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/lib/client.h"
#include "client/lib/options.h"
#include "client/mrctl/args.h"

namespace mrd::mrctl {

// Parses `args` (argv without argv[0]), runs the command, prints results to
// `out` and messages to `err`; returns the exit code (output.h).
int Run(const std::vector<std::string>& args, const Environment& env,
        std::FILE* out, std::FILE* err);

// Runs a parsed invocation (not a help one). The error is printed by Run.
absl::Status Execute(const Invocation& invocation, std::FILE* out,
                     std::FILE* err);

// The client options the global flags ask for: --target, else --socket,
// else <--runtime-dir>/mrd.sock, else the library default; --fd-socket, else
// <--runtime-dir>/fd.sock; --timeout as the per-call and connect deadline.
client::ClientOptions ClientOptionsFor(const GlobalOptions& global);
absl::StatusOr<client::Client> ConnectClient(const GlobalOptions& global);

// The peer path commands (peer_commands.cc, or a stub when mrctl is built
// without mrd_peer_client).
absl::Status PeerRead(const Invocation& invocation, std::FILE* out,
                      std::FILE* err);
absl::Status PeerWrite(const Invocation& invocation, std::FILE* out,
                       std::FILE* err);

}  // namespace mrd::mrctl

#endif  // MRD_CLIENT_MRCTL_COMMANDS_H_
