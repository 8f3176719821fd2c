// The process side of mrd's wiring: how it was started, the successor a
// reload starts, --await_handover and --help.
#ifndef MRD_SERVER_DAEMON_PROCESS_H_
#define MRD_SERVER_DAEMON_PROCESS_H_

#include <sys/types.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace mrd::daemon {

// Starts `binary` with `args` as a process of its own that inherits
// nothing mrd set up for itself (process.cc says what).
absl::StatusOr<pid_t> Spawn(const std::string& binary,
                            const std::vector<std::string>& args);
// "exited 1", "was killed by signal 9": a waitpid status, for the log.
std::string DescribeExit(int status);
// The absolute path mrd was started from, for the successor of a reload.
absl::StatusOr<std::string> ResolveBinary(absl::string_view argv0);
// --await_handover: exit code 0 once the status file at `path` says no
// handover is in progress, 1 when it still does after `timeout`.
int AwaitHandover(const std::string& path, absl::Duration timeout);

// How this mrd was started, for the successor a reload starts.
struct Invocation {
  std::string binary;             // absolute; empty when it could not be...
  std::string unresolved;         // ...resolved, and why
  std::vector<std::string> args;  // argv[1..]
};
// Before the flags are parsed (and PATH or the directory could change).
Invocation InvocationOf(int argc, char** argv);

// SIGHUP starts the successor, mrd --takeover with this mrd's binary and
// arguments, which takes over through the handover socket like any other;
// SIGCHLD reaps it once it ended (it could not take over: this mrd serves
// on, and says so). One reload at a time. Main thread only.
class Reloader {
 public:
  explicit Reloader(Invocation invocation)
      : invocation_(std::move(invocation)) {}
  // SIGHUP. `committed`: this mrd handed over already; `listening`: it
  // listens on `handover_socket`, where the successor looks for it.
  void Reload(bool committed, bool listening,
              const std::string& handover_socket);
  // SIGCHLD.
  void Reap(bool committed);
  // This mrd stops: a reload in progress ends with it (it would take over
  // from it).
  void Stop();

 private:
  const Invocation invocation_;
  pid_t successor_ = 0;  // while it runs, or 0
};

// Every flag of mrd (those of server/) with its default and help, sorted by
// name, after `usage`.
void PrintHelp(absl::string_view usage);

}  // namespace mrd::daemon

#endif  // MRD_SERVER_DAEMON_PROCESS_H_
