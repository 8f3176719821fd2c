#include "server/daemon/process.h"

#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <iostream>
#include <map>
#include <utility>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "mrd/status.h"
#include "server/common/log.h"
#include "server/common/sd_notify.h"
#include "server/daemon/config.h"

namespace mrd::daemon {

// Starts `binary` with `args` (argv[0] = binary) as a process of its own
// that inherits nothing mrd set up for itself: an empty signal mask (mrd
// blocks SIGINT, SIGTERM, SIGHUP and SIGCHLD in every thread; a mask
// survives exec) and every signal at its default (SIGPIPE is ignored here,
// which exec keeps too), and no fd but 0, 1 and 2 (mrd's own are
// close-on-exec; this does not depend on it). posix_spawn: fork and exec
// without running anything of this multi-threaded process in the child.
absl::StatusOr<pid_t> Spawn(const std::string& binary,
                            const std::vector<std::string>& args) {
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(binary.c_str()));
  for (const std::string& a : args)
    argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawnattr_t attr;
  posix_spawn_file_actions_t actions;
  if (int e = posix_spawnattr_init(&attr); e != 0) {
    return ErrnoError(e, "posix_spawnattr_init", "RELOAD_FAILED");
  }
  if (int e = posix_spawn_file_actions_init(&actions); e != 0) {
    posix_spawnattr_destroy(&attr);
    return ErrnoError(e, "posix_spawn_file_actions_init", "RELOAD_FAILED");
  }
  sigset_t none;
  sigemptyset(&none);
  sigset_t defaults;
  sigemptyset(&defaults);
  for (int sig : {SIGPIPE, SIGINT, SIGTERM, SIGHUP, SIGCHLD}) {
    sigaddset(&defaults, sig);
  }
  int e = posix_spawnattr_setsigmask(&attr, &none);
  if (e == 0) e = posix_spawnattr_setsigdefault(&attr, &defaults);
  if (e == 0) {
    e = posix_spawnattr_setflags(
        &attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  }
  if (e == 0) e = posix_spawn_file_actions_addclosefrom_np(&actions, 3);
  pid_t pid = -1;
  if (e == 0) {
    e = posix_spawn(&pid, binary.c_str(), &actions, &attr, argv.data(),
                    environ);
  }
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (e != 0) return ErrnoError(e, "posix_spawn", "RELOAD_FAILED");
  return pid;
}

std::string DescribeExit(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exited ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return absl::StrCat("was killed by signal ", WTERMSIG(status));
  }
  return absl::StrCat("ended (status ", status, ")");
}

// --await_handover: the state --handover_status_file says, every 100 ms,
// until it is neither taking-over nor handing-over (or there is no such
// file: no mrd wrote one).
int AwaitHandover(const std::string& path, absl::Duration timeout) {
  if (path.empty()) {
    LogError("--await_handover needs --handover_status_file");
    return 1;
  }
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    absl::StatusOr<std::string> read = ReadSmallFile(path);
    const std::string state =
        read.ok() ? std::string(absl::StripAsciiWhitespace(*read)) : "";
    if (state != "taking-over" && state != "handing-over") {
      LogInfo("--await_handover: ", path,
              read.ok() ? absl::StrCat(" says ", state)
                        : absl::StrCat(": ", read.status().message()),
              "; no handover in progress");
      return 0;
    }
    if (absl::Now() >= deadline) {
      LogError("--await_handover: ", path, " still says ", state, " after ",
               absl::FormatDuration(timeout));
      return 1;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
}

// The absolute path mrd was started from, for the successor of a reload:
// argv[0] made absolute, or found in $PATH as the shell found it. Neither
// /proc/self/exe (after an upgrade it names the old, deleted binary) nor
// symlinks resolved (a link that an upgrade points elsewhere is what must
// be followed again).
absl::StatusOr<std::string> ResolveBinary(absl::string_view argv0) {
  auto absolute = [](absl::string_view path) -> absl::StatusOr<std::string> {
    if (absl::StartsWith(path, "/")) return std::string(path);
    char cwd[4096];
    if (getcwd(cwd, sizeof(cwd)) == nullptr) {
      return ErrnoError(errno, "getcwd", "RELOAD_FAILED");
    }
    return absl::StrCat(cwd, "/", path);
  };
  if (absl::StrContains(argv0, '/')) return absolute(argv0);
  const char* path = std::getenv("PATH");
  for (absl::string_view dir :
       absl::StrSplit(path != nullptr ? path : "", ':')) {
    const std::string candidate =
        absl::StrCat(dir.empty() ? "." : dir, "/", argv0);
    struct stat st {};
    if (access(candidate.c_str(), X_OK) == 0 &&
        stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      return absolute(candidate);
    }
  }
  return MrdError(absl::StatusCode::kNotFound, "RELOAD_FAILED",
                  absl::StrCat("'", argv0, "' is not in PATH"));
}

Invocation InvocationOf(int argc, char** argv) {
  Invocation invocation;
  absl::StatusOr<std::string> binary = ResolveBinary(argv[0]);
  if (binary.ok()) {
    invocation.binary = *std::move(binary);
  } else {
    invocation.unresolved = binary.status().ToString();
  }
  invocation.args.assign(argv + 1, argv + argc);
  return invocation;
}

void Reloader::Reload(bool committed, bool listening,
                      const std::string& handover_socket) {
  if (committed) {
    LogInfo("SIGHUP: this mrd has handed over; nothing to reload");
    return;
  }
  if (successor_ != 0) {
    LogWarning("SIGHUP: a reload is in progress (pid ", successor_,
               " is taking over); ignored");
    return;
  }
  if (invocation_.binary.empty()) {
    LogError("SIGHUP: cannot reload, mrd's binary is unknown: ",
             invocation_.unresolved);
    return;
  }
  if (!listening) {
    LogError("SIGHUP: cannot reload, this mrd does not listen on ",
             handover_socket, " (see the error at start)");
    return;
  }
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  (void)SdNotify(absl::StrCat(
      "RELOADING=1\nMONOTONIC_USEC=",
      static_cast<uint64_t>(now.tv_sec) * 1000000 + now.tv_nsec / 1000));
  std::vector<std::string> args = invocation_.args;
  args.push_back("--takeover");
  absl::StatusOr<pid_t> child = Spawn(invocation_.binary, args);
  if (!child.ok()) {
    LogError("SIGHUP: cannot start ", invocation_.binary, ": ",
             child.status().ToString(), "; this mrd serves on");
    (void)SdNotify("READY=1");
    return;
  }
  successor_ = *child;
  LogInfo("SIGHUP: reloading, pid ", successor_, " (", invocation_.binary,
          " --takeover) takes over");
}

void Reloader::Reap(bool committed) {
  if (successor_ == 0) return;
  int status = 0;
  const pid_t reaped = waitpid(successor_, &status, WNOHANG);
  if (reaped == 0 || (reaped < 0 && errno == EINTR)) return;  // still runs
  const pid_t pid = successor_;
  successor_ = 0;
  if (committed) {
    LogInfo("pid ", pid, ", which took over from this mrd, ",
            DescribeExit(status));
    return;
  }
  LogError("reload failed: pid ", pid, " ", DescribeExit(status),
           " without taking over (its log says why); this mrd serves on");
  (void)SdNotify("READY=1");
}

void Reloader::Stop() {
  if (successor_ != 0) kill(successor_, SIGTERM);
}

// Every flag of mrd (those of server/) with its default and help, sorted by
// name, after `usage`.
void PrintHelp(absl::string_view usage) {
  std::cout << usage << "\n\nFlags (docs/CONFIG.md):\n";
  std::map<std::string, const absl::CommandLineFlag*> ours;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::StrContains(flag->Filename(), "server/")) {
      ours.emplace(std::string(name), flag);
    }
  }
  for (const auto& [name, flag] : ours) {
    std::cout << "  --" << name << " (default: \"" << flag->DefaultValue()
              << "\")\n      " << flag->Help() << "\n";
  }
  std::cout << "  --flagfile=<file>\n      Read flags, one per line, from "
               "<file>.\n  --help, --version\n";
}

}  // namespace mrd::daemon
