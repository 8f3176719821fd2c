// mrctl's command line: the table of commands and flags (which also renders
// `mrctl help`), the parser, and the parsers of flag values. Kept apart from
// the commands so that it is tested without a server.
//
// Errors from this module are usage errors (IsUsageError(): exit code 1).
// Thread-safe: no state besides the constant command table.
#ifndef MRD_CLIENT_MRCTL_ARGS_H_
#define MRD_CLIENT_MRCTL_ARGS_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace mrd::mrctl {

struct FlagSpec {
  std::string name;   // without the leading "--"
  std::string value;  // placeholder of the value; empty: a boolean flag
  std::string help;
};

struct CommandSpec {
  std::string name;        // "info", "lease open", ...
  std::string positional;  // e.g. "PATH"; empty: none
  int positional_count = 0;
  bool needs_session = false;  // --session / MRD_SESSION required
  std::string summary;         // one line
  std::string details;         // more lines for `mrctl help CMD`
  std::vector<FlagSpec> flags;
};

const std::vector<CommandSpec>& Commands();
const std::vector<FlagSpec>& GlobalFlags();
// By full name ("lease open"); null if unknown.
const CommandSpec* FindCommand(absl::string_view name);

struct GlobalOptions {
  std::string socket;                     // --socket
  std::string target;                     // --target
  std::string fd_socket;                  // --fd-socket
  std::string runtime_dir;                // --runtime-dir
  std::string session;                    // --session, else $MRD_SESSION
  bool json = false;                      // --json
  bool quiet = false;                     // -q / --quiet
  std::optional<absl::Duration> timeout;  // --timeout
};

struct Invocation {
  // Null with help=true: the overview. Null with help=false never happens.
  const CommandSpec* command = nullptr;
  // `mrctl help lease` / `mrctl lease --help`: the group's commands.
  std::string help_group;
  bool help = false;
  GlobalOptions global;
  std::vector<std::string> positional;
  std::map<std::string, std::string> flags;  // command flags as given
};

// What the parser takes from the environment.
struct Environment {
  std::string session;  // $MRD_SESSION
};

// Parses argv[1..]. Global flags may appear anywhere; command flags after the
// command. "--name=value" or "--name value"; booleans as "--name" or
// "--name=true|false". "--" ends the flags.
absl::StatusOr<Invocation> ParseArgs(const std::vector<std::string>& args,
                                     const Environment& env);

std::string OverviewHelp();
std::string CommandHelp(const CommandSpec& command);
std::string GroupHelp(absl::string_view group);

// Typed access to the command flags of an invocation.
class FlagValues {
 public:
  explicit FlagValues(const Invocation& invocation)
      : flags_(invocation.flags) {}

  bool Has(absl::string_view name) const;
  std::optional<std::string> String(absl::string_view name) const;
  absl::StatusOr<std::string> RequiredString(absl::string_view name) const;
  absl::StatusOr<bool> Bool(absl::string_view name) const;  // absent: false
  absl::StatusOr<uint64_t> Uint64(absl::string_view name) const;  // required
  absl::StatusOr<uint64_t> Uint64Or(absl::string_view name,
                                    uint64_t fallback) const;
  absl::StatusOr<uint32_t> Uint32Or(absl::string_view name,
                                    uint32_t fallback) const;
  absl::StatusOr<std::optional<uint64_t>> OptionalUint64(
      absl::string_view name) const;
  // Byte counts (ParseSize): --size, --length, --offset.
  absl::StatusOr<uint64_t> Size(absl::string_view name) const;  // required
  absl::StatusOr<uint64_t> SizeOr(absl::string_view name,
                                  uint64_t fallback) const;

 private:
  // A required number, read with `parse`; errors name the flag.
  absl::StatusOr<uint64_t> Number(
      absl::string_view name,
      absl::StatusOr<uint64_t> (*parse)(absl::string_view)) const;

  const std::map<std::string, std::string>& flags_;
};

// Value parsers.
// Decimal, or hex with 0x.
absl::StatusOr<uint64_t> ParseUint64(absl::string_view text);
// A byte count as mrd/byte_size.h reads it (ParseByteSize: "8G" is 8 GiB),
// its error a usage error.
absl::StatusOr<uint64_t> ParseSize(absl::string_view text);
// NDK_MR_FLAG_*: a number, or names joined by ',' or '|': local_read (0),
// local_write (0x1), remote_read (0x2), remote_write (0x5), read_sink (0x8).
absl::StatusOr<uint32_t> ParseMrFlags(absl::string_view text);
// NDK_OP_FLAG_*: a number, or names: none, silent_success (0x1), read_fence
// (0x2), remote_read (0x8), local_write (0x10), remote_write (0x30),
// read_sink (0x40), defer (0x200).
absl::StatusOr<uint32_t> ParseOpFlags(absl::string_view text);
// MEM_*: none, read, write, readwrite (or a number).
absl::StatusOr<uint32_t> ParseMemFlags(absl::string_view text);
// --devices: device names joined by ',' (as GetDeviceInfo names them), or
// "all" alone.
struct DeviceChoice {
  std::vector<std::string> names;
  bool all = false;
  bool nearest = false;  // "nearest": the devices near the memory
};
absl::StatusOr<DeviceChoice> ParseDevices(absl::string_view text);
// "a,b,c" of ParseUint64 values.
absl::StatusOr<std::vector<uint64_t>> ParseUint64List(absl::string_view text);
// An absl duration ("1.5s", "250ms", "1m") or a bare number of seconds.
absl::StatusOr<absl::Duration> ParseDurationFlag(absl::string_view text);
// Hex digits (whitespace and an 0x prefix allowed) to bytes.
absl::StatusOr<std::string> DecodeHex(absl::string_view text);
std::string EncodeHex(absl::string_view bytes);

// A usage error: INVALID_ARGUMENT marked as mrctl's own, exit code 1.
absl::Status UsageError(absl::string_view message);
bool IsUsageError(const absl::Status& status);

}  // namespace mrd::mrctl

#endif  // MRD_CLIENT_MRCTL_ARGS_H_
