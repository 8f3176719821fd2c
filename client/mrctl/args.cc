#include "client/mrctl/args.h"

#include <algorithm>
#include <cctype>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "mrd/byte_size.h"

namespace mrd::mrctl {
namespace {

constexpr absl::string_view kUsagePayloadUrl = "mrctl/usage-error";

const char kMrFlagsHelp[] =
    "NDK_MR_FLAG_* bits: a number (0x5) or names joined by ',': local_read, "
    "local_write, remote_read, remote_write, read_sink (default 0: local "
    "read only)";
const char kOpFlagsHelp[] =
    "NDK_OP_FLAG_* bits: a number or names joined by ',': silent_success, "
    "read_fence, remote_read, local_write, remote_write, read_sink, defer";

const char kDevicesHelp[] =
    "the devices to register on: names joined by ',' (info's "
    "devices[].name), or all (default: mrd's first device); it is on all of "
    "them or on none, with one token per device";

const char kPeerDeviceHelp[] =
    "the local mrd's device whose peer path to use (info's devices[].name): "
    "the default of --address and --kind; its ticket and token must be of "
    "that device";

const char kObjectDeviceHelp[] =
    "the device it belongs to (info's devices[].name; default: mrd's first); "
    "a LAM's pages serve fast registrations of that device's MR objects only";

const char kProgressHelp[] =
    "while mrd pins (ranges of 32 MiB or more, after a second), print its "
    "progress reports to stderr (reads the session's completion stream); "
    "--timeout or Ctrl-C cancels the registration, leaving nothing pinned";

std::vector<CommandSpec> BuildCommands() {
  std::vector<CommandSpec> c;
  c.push_back(
      {"info", "", 0, false, "Device attributes (GetDeviceInfo).", "", {}});
  c.push_back({"health",
               "",
               0,
               false,
               "grpc.health.v1 Check; exit 0 only when SERVING.",
               "Prints status=SERVING|NOT_SERVING|SERVICE_UNKNOWN|UNKNOWN; any "
               "status but SERVING exits 6.",
               {{"service", "NAME",
                 "the service to check (default \"\": the "
                 "whole server)"}}});
  c.push_back({"lease open",
               "",
               0,
               false,
               "Open a lease session (OpenLeaseSession).",
               "With -q prints only the token, for\n"
               "  export MRD_SESSION=$(mrctl lease open -q --ttl=10m)\n"
               "The lease carries your uid when the fd socket lets you in\n"
               "(it vouches for the lease); otherwise it is anonymous and\n"
               "may import only files anyone reaching mrd could open.",
               {{"ttl", "DURATION",
                 "lease time, renewed by every call naming the session "
                 "(default: the server's)"},
                {"anonymous", "",
                 "do not vouch through the fd socket: an anonymous "
                 "lease"}}});
  c.push_back({"lease close",
               "",
               0,
               true,
               "End the session now, releasing all it holds (CloseSession).",
               "",
               {}});
  c.push_back({"session",
               "",
               0,
               true,
               "Describe the session and renew its lease (GetSession).",
               "",
               {}});
  c.push_back(
      {"import-file",
       "PATH",
       1,
       true,
       "Import a file under mrd's shared-memory directory (ImportFile).",
       "PATH is relative to the server's shared-memory directory.",
       {{"writable", "",
         "map it for write too (needed for write "
         "flags)"}}});
  c.push_back({"release-buffer",
               "ID",
               1,
               true,
               "Release a buffer and invalidate what is on it (ReleaseBuffer).",
               "",
               {}});
  c.push_back(
      {"create-mr",
       "",
       0,
       true,
       "Create an MR object (CreateMr).",
       "",
       {{"fast-register", "", "for fast registration only (C1)"},
        {"allow-remote", "", "fast registrations may grant remote access (F4)"},
        {"device", "NAME", kObjectDeviceHelp}}});
  c.push_back(
      {"close-mr", "ID", 1, true, "Destroy an MR object (CloseMr).", "", {}});
  c.push_back(
      {"register",
       "",
       0,
       true,
       "Register a buffer range and print its rkey (RegisterMr).",
       "The same buffer, range and access again returns the same registration "
       "with one more reference.",
       {{"buffer", "ID", "the buffer (required)"},
        {"offset", "SIZE", "start in the buffer (default 0)"},
        {"length", "SIZE", "bytes (required)"},
        {"flags", "FLAGS", kMrFlagsHelp},
        {"mem", "read|write|readwrite",
         "MEM_* access instead of --flags (WSPRegisterRdmaMemory form)"},
        {"base", "ADDR", "base address on the wire (default: mrd's mapping)"},
        {"mr", "ID", "register through this MR object (create-mr)"},
        {"capacity", "N", "descriptor space in bytes (W2; default no limit)"},
        {"request-id", "KEY", "idempotency key for retries"},
        {"devices", "NAME,...|all", kDevicesHelp},
        {"progress", "", kProgressHelp}}});
  c.push_back(
      {"register-batch",
       "",
       0,
       true,
       "Register COUNT ranges of a buffer in one call (RegisterMrBatch).",
       "Ranges of --length bytes at --offset, --offset + --stride, ... Each\n"
       "range is registered as by `register` and gets its own result; one\n"
       "that fails leaves nothing behind and does not stop the others; the\n"
       "exit status is then that of the first failure (as from `register`).",
       {{"buffer", "ID", "the buffer (required)"},
        {"offset", "SIZE", "start of the first range (default 0)"},
        {"length", "SIZE", "bytes of each range (required)"},
        {"count", "N", "how many ranges (required)"},
        {"stride", "SIZE",
         "from one range's start to the next (default: length)"},
        {"flags", "FLAGS", kMrFlagsHelp},
        {"mem", "read|write|readwrite",
         "MEM_* access instead of --flags (WSPRegisterRdmaMemory form)"},
        {"devices", "NAME,...|all", kDevicesHelp}}});
  c.push_back({"deregister-batch",
               "",
               0,
               true,
               "Drop one reference of each of many registrations in one call "
               "(DeregisterMrBatch).",
               "Each gets its own result, as from `deregister`; the exit "
               "status is that of the first failure.",
               {{"registrations", "ID,ID,...",
                 "implicit registrations, joined by ',' (required)"}}});
  c.push_back({"deregister",
               "",
               0,
               true,
               "Drop one reference of a registration (DeregisterMr).",
               "Give exactly one of --registration and --mr.",
               {{"registration", "ID", "an implicit registration"},
                {"mr", "ID", "the registration held by this MR object"}}});
  c.push_back({"build-lam",
               "",
               0,
               true,
               "Pin a range and print its page array (BuildLam).",
               "",
               {{"buffer", "ID", "the buffer (required)"},
                {"offset", "SIZE", "start in the buffer (default 0)"},
                {"length", "SIZE", "bytes (required)"},
                {"capacity", "N",
                 "mapping space in bytes, 8 + 8*pages (L2; default no "
                 "limit)"},
                {"device", "NAME", kObjectDeviceHelp},
                {"progress", "", kProgressHelp}}});
  c.push_back({"release-lam",
               "ID",
               1,
               true,
               "Release a logical address mapping (ReleaseLam).",
               "",
               {}});
  c.push_back({"fast-register",
               "",
               0,
               true,
               "Post a fast registration on a peer connection (FastRegister).",
               "Prints the work request; the result arrives on `mrctl "
               "completions`.",
               {{"connection", "ID", "the peer connection (required)"},
                {"mr", "ID", "a fast-register MR object (required)"},
                {"pages", "A,B,...", "logical page addresses from build-lam"},
                {"fbo", "N", "first byte offset (default 0)"},
                {"length", "SIZE", "bytes (required)"},
                {"base", "ADDR", "base address, FBO + n*PAGE_SIZE (required)"},
                {"flags", "FLAGS", kOpFlagsHelp},
                {"context", "N", "request context echoed in the completion"}}});
  c.push_back({"invalidate",
               "",
               0,
               true,
               "Post an invalidation of a fast-registered MR (InvalidateMr).",
               "",
               {{"connection", "ID", "the peer connection (required)"},
                {"mr", "ID", "the MR object (required)"},
                {"flags", "FLAGS", kOpFlagsHelp},
                {"context", "N", "request context echoed in the completion"}}});
  c.push_back({"completions",
               "",
               0,
               true,
               "Print completions as they arrive (StreamCompletions).",
               "Runs until --count completions arrived, --timeout passed, the "
               "session ended, or SIGINT/SIGTERM. Here --timeout bounds the "
               "whole wait (default: none); ending by timeout is not an error "
               "unless --count was not reached (exit 6).",
               {{"count", "N", "stop after N completions"}}});
  c.push_back({"peer-ticket",
               "",
               0,
               true,
               "Create a ticket for remote peers (CreatePeerTicket).",
               "A ticket opens the peer path of one device; a registration's "
               "token on that device is used with it.",
               {{"device", "NAME",
                 "the device whose peer path it opens (info's "
                 "devices[].name; default: mrd's first)"}}});
  c.push_back({"list",
               "",
               0,
               true,
               "Everything the session holds (ListRegistrations).",
               "",
               {}});
  c.push_back(
      {"publish",
       "NAME",
       1,
       true,
       "Publish a registration under NAME in the directory (Publish).",
       "NAME: 1 to 128 characters of [A-Za-z0-9._-], in the session's "
       "tenant's part of the directory on etcd (mrd needs --etcd_endpoints; "
       "exit 7 DIRECTORY_OFF otherwise). Give exactly one of --registration "
       "and --mr. Returns at once with the entry; etcd is written in the "
       "background (`mrctl published` shows when). The entry goes when the "
       "registration does, or the MR object's mapping (InvalidateMr).",
       {{"registration", "ID", "the session's registration to publish"},
        {"mr", "ID",
         "a fast-register MR object of the session, fast-registered now: "
         "its mapping's token"}}});
  c.push_back({"unpublish",
               "NAME",
               1,
               true,
               "Remove a name the session published (Unpublish).",
               "Waits (at most mrd's --directory_unpublish_wait) for etcd's "
               "delete; prints deleted=false if it is still queued then.",
               {}});
  c.push_back({"published",
               "",
               0,
               true,
               "The names the session published and their state on etcd "
               "(ListPublished).",
               "Prints directory_state (off, connecting, serving, "
               "unavailable) and each entry with its state (pending, "
               "published, conflict).",
               {}});
  c.push_back({"resolve",
               "NAME",
               1,
               true,
               "Look a published name up in the directory (Resolve).",
               "Finds any node's entry: node, address, length, flags, per "
               "device its rkey and peer_address, and the publishing mrd's "
               "epoch. Exit 3 when nobody published NAME.",
               {{"tenant", "TENANT",
                 "look in this tenant's names (default: the session's "
                 "tenant)"}}});
  c.push_back({"watch",
               "NAME",
               1,
               true,
               "Print each change of a published name as it happens "
               "(WatchName).",
               "One JSON line per event, flushed at once: first the name's "
               "state now ({\"kind\":\"PUBLISHED\",\"entry\":{...}} or "
               "UNPUBLISHED, which is not an error), then every change. Runs "
               "until --count events were printed, the stream ended, "
               "--timeout passed, or SIGINT/SIGTERM. Here --timeout bounds the "
               "whole wait (default: none); ending by timeout is not an error "
               "unless --count was not reached (exit 6). The stream ends with "
               "exit 6 UNAVAILABLE when mrd stops or hands over.",
               {{"tenant", "TENANT",
                 "watch this tenant's name (default: the session's tenant)"},
                {"count", "N", "stop after N events (0: no limit)"}}});
  c.push_back(
      {"peer read",
       "",
       0,
       false,
       "One-sided RDMA READ as a remote peer (software device: its TCP peer "
       "path; verbs device: an RC queue pair via librdmacm).",
       "Writes the bytes read to stdout, raw (or hex with --hex). Exit 4 on "
       "a remote access error or a bad ticket.",
       {{"address", "HOST:PORT",
         "the device's peer address (default: info's peer_address, or "
         "--device's)"},
        {"kind", "KIND",
         "software or verbs (default: the local mrd's device kind)"},
        {"ticket", "TICKET", "a ticket from peer-ticket (required)"},
        {"rkey", "KEY", "the remote token (required)"},
        {"va", "ADDR", "remote address (required)"},
        {"device", "NAME", kPeerDeviceHelp},
        {"length", "SIZE", "bytes to read (required)"},
        {"hex", "", "print hex instead of raw bytes"}}});
  c.push_back({"peer write",
               "",
               0,
               false,
               "One-sided RDMA WRITE as a remote peer (software or verbs).",
               "",
               {{"address", "HOST:PORT",
                 "the device's peer address (default: info's peer_address, or "
                 "--device's)"},
                {"kind", "KIND",
                 "software or verbs (default: the local mrd's device kind)"},
                {"ticket", "TICKET", "a ticket from peer-ticket (required)"},
                {"rkey", "KEY", "the remote token (required)"},
                {"va", "ADDR", "remote address (required)"},
                {"device", "NAME", kPeerDeviceHelp},
                {"data", "STRING", "bytes to write"},
                {"hex", "HEX", "bytes to write, in hex (instead of --data)"}}});
  c.push_back(
      {"hold",
       "",
       0,
       false,
       "Make a memfd, import it on an fd session, register it, and hold it.",
       "Prints the session, buffer and registration, then waits until stdin "
       "closes, SIGINT/SIGTERM, --duration, or mrd ending the session; then "
       "releases everything (exit 0; 7 if mrd ended the session). The token "
       "printed works with --session for other commands while it holds.\n"
       "Note: `mrctl hold ... </dev/null` returns at once; use e.g.\n"
       "  sleep infinity | mrctl hold --size=4096 --flags=remote_read",
       {{"size", "SIZE", "buffer size in bytes (required)"},
        {"fill", "STRING", "write STRING at the start of the buffer"},
        {"repeat", "", "with --fill: repeat STRING over the whole buffer"},
        {"name", "NAME", "memfd name (default mrctl-hold)"},
        {"huge-pages", "",
         "a hugetlbfs memfd in 2 MiB pages (vm.nr_hugepages; --size a "
         "multiple of 2 MiB)"},
        {"writable", "",
         "import writable (default: when the flags need write access)"},
        {"offset", "SIZE", "registered range start (default 0)"},
        {"length", "SIZE", "registered range length (default: to the end)"},
        {"flags", "FLAGS", kMrFlagsHelp},
        {"mem", "read|write|readwrite", "MEM_* access instead of --flags"},
        {"base", "ADDR", "base address on the wire (default: mrd's mapping)"},
        {"devices", "NAME,...|all", kDevicesHelp},
        {"progress", "", kProgressHelp},
        {"duration", "DURATION", "hold at most this long"},
        {"until-written", "STRING",
         "release once the registered range starts with STRING (a peer "
         "wrote it); prints written=STRING. stdin is not watched then"}}});
  const std::vector<FlagSpec> admin_socket = {
      {"admin-socket", "PATH",
       "mrd's administrative socket (default <runtime-dir>/admin.sock)"}};
  c.push_back({"tenant list", "", 0, false,
               "List every tenant with its use, quotas, weight and queue "
               "(root or mrd's uid).",
               "Calls TenantAdmin.ListTenants on mrd's administrative socket, "
               "which only root and the uid mrd runs as may use.",
               admin_socket});
  std::vector<FlagSpec> set_flags = admin_socket;
  for (const char* resource : {"sessions", "buffers", "registrations", "lams",
                               "mrs", "peer-connections", "memory-maps"}) {
    set_flags.push_back({resource, "N", absl::StrCat("quota of ", resource)});
  }
  set_flags.push_back(
      {"pinned-bytes", "SIZE", "quota of pinned bytes (e.g. 8G)"});
  set_flags.push_back(
      {"weight", "N", "share of mrd's workers relative to other tenants'"});
  c.push_back(
      {"tenant set", "TENANT", 1, false,
       "Set a tenant's quotas and weight while mrd runs (root or mrd's uid).",
       "TENANT as GetSession names it: pod:<uid>, container:<id>, uid:<uid>, "
       "anonymous or a named tenant. Unset quotas keep their value; a quota "
       "below what the tenant holds refuses its new work and revokes "
       "nothing. Settings survive a live handover.",
       set_flags});
  c.push_back({"tenant clear", "TENANT", 1, false,
               "Drop a tenant's settings: the tenants file's or the default "
               "quotas and weight apply again.",
               "", admin_socket});
  return c;
}

std::vector<FlagSpec> BuildGlobalFlags() {
  return {
      {"socket", "PATH",
       "mrd's gRPC Unix socket (default <runtime-dir>/mrd.sock)"},
      {"target", "TARGET", "any gRPC target instead of --socket"},
      {"fd-socket", "PATH", "mrd's fd socket (default <runtime-dir>/fd.sock)"},
      {"runtime-dir", "DIR",
       "where the sockets are (default $MRD_RUNTIME_DIR, /run/mrd for root, "
       "$XDG_RUNTIME_DIR/mrd, /tmp/mrd-<uid>)"},
      {"session", "TOKEN", "the session (default $MRD_SESSION)"},
      {"json", "",
       "print results as JSON (protobuf JSON mapping), one "
       "object per line"},
      {"quiet", "", "-q: only the essential output (lease open: the token)"},
      {"timeout", "DURATION", "per-call deadline (default 30s)"},
      {"help", "", "-h: help"},
  };
}

const FlagSpec* FindFlag(const std::vector<FlagSpec>& flags,
                         absl::string_view name) {
  for (const FlagSpec& f : flags) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

absl::StatusOr<bool> ParseBool(absl::string_view name,
                               absl::string_view value) {
  std::string v = absl::AsciiStrToLower(value);
  if (v == "true" || v == "1" || v == "yes") return true;
  if (v == "false" || v == "0" || v == "no") return false;
  return UsageError(
      absl::StrCat("--", name, " takes true or false, not '", value, "'"));
}

bool IsGroup(absl::string_view word) {
  return word == "lease" || word == "peer" || word == "tenant";
}

absl::Status ApplyGlobal(GlobalOptions& g, bool& help, absl::string_view name,
                         const std::string& value) {
  if (name == "socket") {
    g.socket = value;
  } else if (name == "target") {
    g.target = value;
  } else if (name == "fd-socket") {
    g.fd_socket = value;
  } else if (name == "runtime-dir") {
    g.runtime_dir = value;
  } else if (name == "session") {
    g.session = value;
  } else if (name == "json") {
    absl::StatusOr<bool> b = ParseBool(name, value);
    if (!b.ok()) return b.status();
    g.json = *b;
  } else if (name == "quiet") {
    absl::StatusOr<bool> b = ParseBool(name, value);
    if (!b.ok()) return b.status();
    g.quiet = *b;
  } else if (name == "help") {
    absl::StatusOr<bool> b = ParseBool(name, value);
    if (!b.ok()) return b.status();
    help = *b;
  } else if (name == "timeout") {
    absl::StatusOr<absl::Duration> d = ParseDurationFlag(value);
    if (!d.ok()) return d.status();
    g.timeout = *d;
  }
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> ParseNamedBits(
    absl::string_view text, absl::string_view what,
    const std::vector<std::pair<absl::string_view, uint32_t>>& names) {
  absl::string_view trimmed = absl::StripAsciiWhitespace(text);
  if (trimmed.empty()) return UsageError(absl::StrCat("empty ", what));
  if (std::isdigit(static_cast<unsigned char>(trimmed[0]))) {
    absl::StatusOr<uint64_t> n = ParseUint64(trimmed);
    if (!n.ok()) return n.status();
    if (*n > UINT32_MAX) {
      return UsageError(absl::StrCat(what, " ", trimmed, " exceeds 32 bits"));
    }
    return static_cast<uint32_t>(*n);
  }
  uint32_t bits = 0;
  for (absl::string_view part :
       absl::StrSplit(trimmed, absl::ByAnyChar(",|"))) {
    std::string word = absl::AsciiStrToLower(absl::StripAsciiWhitespace(part));
    if (word.empty()) continue;
    bool found = false;
    for (const auto& [n, v] : names) {
      if (word == n) {
        bits |= v;
        found = true;
        break;
      }
    }
    if (!found) {
      std::vector<std::string> known;
      for (const auto& entry : names) known.emplace_back(entry.first);
      return UsageError(absl::StrCat("unknown ", what, " '", word,
                                     "' (known: ", absl::StrJoin(known, ", "),
                                     ", or a number)"));
    }
  }
  return bits;
}

}  // namespace

const std::vector<CommandSpec>& Commands() {
  static const std::vector<CommandSpec>* const kCommands =
      new std::vector<CommandSpec>(BuildCommands());
  return *kCommands;
}

const std::vector<FlagSpec>& GlobalFlags() {
  static const std::vector<FlagSpec>* const kFlags =
      new std::vector<FlagSpec>(BuildGlobalFlags());
  return *kFlags;
}

const CommandSpec* FindCommand(absl::string_view name) {
  for (const CommandSpec& c : Commands()) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

absl::StatusOr<Invocation> ParseArgs(const std::vector<std::string>& args,
                                     const Environment& env) {
  Invocation inv;
  bool help_word = false;  // `mrctl help ...`
  std::string group;       // "lease"/"peer" waiting for its subcommand
  bool flags_done = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (!flags_done && arg == "--") {
      flags_done = true;
      continue;
    }
    if (!flags_done && arg.size() > 1 && arg[0] == '-') {
      std::string name;
      std::optional<std::string> value;
      if (arg == "-q") {
        name = "quiet";
      } else if (arg == "-h") {
        name = "help";
      } else if (absl::StartsWith(arg, "--")) {
        absl::string_view body = absl::string_view(arg).substr(2);
        size_t eq = body.find('=');
        name = std::string(body.substr(0, eq));
        if (eq != absl::string_view::npos) {
          value = std::string(body.substr(eq + 1));
        }
      } else {
        return UsageError(absl::StrCat("unknown option '", arg,
                                       "' (flags are --name=value)"));
      }
      const FlagSpec* spec = FindFlag(GlobalFlags(), name);
      bool global = spec != nullptr;
      if (!global) {
        if (inv.command == nullptr) {
          return UsageError(
              absl::StrCat("unknown flag --", name,
                           group.empty() && !help_word
                               ? " (command flags go after the command)"
                               : ""));
        }
        spec = FindFlag(inv.command->flags, name);
        if (spec == nullptr) {
          return UsageError(
              absl::StrCat("unknown flag --", name, " for '", inv.command->name,
                           "' (see mrctl help ", inv.command->name, ")"));
        }
      }
      if (!value.has_value()) {
        if (spec->value.empty()) {
          value = "true";
        } else if (i + 1 < args.size()) {
          value = args[++i];
        } else {
          return UsageError(
              absl::StrCat("--", name, " needs a value (", spec->value, ")"));
        }
      }
      if (global) {
        absl::Status s = ApplyGlobal(inv.global, inv.help, name, *value);
        if (!s.ok()) return s;
      } else {
        if (spec->value.empty()) {
          absl::StatusOr<bool> b = ParseBool(name, *value);
          if (!b.ok()) return b.status();
          *value = *b ? "true" : "false";
        }
        inv.flags[name] = *value;
      }
      continue;
    }
    // A word.
    if (inv.command == nullptr) {
      if (!help_word && group.empty() && arg == "help") {
        help_word = true;
        continue;
      }
      if (group.empty() && IsGroup(arg)) {
        group = arg;
        continue;
      }
      std::string full = group.empty() ? arg : absl::StrCat(group, " ", arg);
      const CommandSpec* command = FindCommand(full);
      if (command == nullptr) {
        return UsageError(
            absl::StrCat("unknown command '", full, "' (see mrctl help)"));
      }
      inv.command = command;
      group.clear();
      continue;
    }
    inv.positional.push_back(arg);
  }
  if (help_word) inv.help = true;
  if (inv.command == nullptr && !group.empty()) {
    if (inv.help) {
      inv.help_group = group;
      return inv;
    }
    return UsageError(absl::StrCat(
        "'", group, "' needs a subcommand (see mrctl help ", group, ")"));
  }
  if (inv.help) return inv;
  if (inv.command == nullptr) {
    return UsageError("no command given (see mrctl help)");
  }
  if (static_cast<int>(inv.positional.size()) !=
      inv.command->positional_count) {
    if (inv.command->positional_count == 0) {
      return UsageError(absl::StrCat("'", inv.command->name,
                                     "' takes no arguments, got '",
                                     inv.positional[0], "'"));
    }
    return UsageError(absl::StrCat("'", inv.command->name, "' takes ",
                                   inv.command->positional));
  }
  if (inv.global.session.empty()) inv.global.session = env.session;
  if (inv.command->needs_session && inv.global.session.empty()) {
    return UsageError(absl::StrCat(
        "'", inv.command->name,
        "' needs a session: pass --session=TOKEN or set MRD_SESSION (mrctl "
        "lease open -q prints one)"));
  }
  return inv;
}

namespace {

constexpr size_t kHelpWidth = 79;
constexpr size_t kFlagColumn = 28;

// Word-wraps `text` to kHelpWidth; continuation lines start with `indent`
// spaces, the first line continues at column `first_column`. Keeps the
// text's own line breaks.
std::string Wrap(absl::string_view text, size_t first_column, size_t indent) {
  std::string out;
  size_t column = first_column;
  bool first_line = true;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!first_line) {
      out += "\n";
      out.append(indent, ' ');
      column = indent;
    }
    first_line = false;
    bool first_word = true;
    for (absl::string_view word : absl::StrSplit(line, ' ')) {
      if (!first_word && column + 1 + word.size() > kHelpWidth &&
          column > indent) {
        out += "\n";
        out.append(indent, ' ');
        column = indent;
      } else if (!first_word) {
        out += ' ';
        ++column;
      }
      out.append(word.data(), word.size());
      column += word.size();
      first_word = false;
    }
  }
  return out;
}

std::string FlagLines(const std::vector<FlagSpec>& flags) {
  std::string out;
  for (const FlagSpec& f : flags) {
    std::string left = absl::StrCat("  --", f.name);
    if (!f.value.empty()) absl::StrAppend(&left, "=", f.value);
    if (left.size() < kFlagColumn) {
      left.resize(kFlagColumn, ' ');
    } else {
      absl::StrAppend(&left, "\n", std::string(kFlagColumn, ' '));
    }
    absl::StrAppend(&out, left, Wrap(f.help, kFlagColumn, kFlagColumn), "\n");
  }
  return out;
}

std::string Synopsis(const CommandSpec& c) {
  std::string out = absl::StrCat("mrctl ", c.name);
  if (!c.positional.empty()) absl::StrAppend(&out, " ", c.positional);
  if (!c.flags.empty()) absl::StrAppend(&out, " [flags]");
  return out;
}

}  // namespace

std::string OverviewHelp() {
  std::string out =
      "mrctl: command-line client of mrd, the RDMA memory-registration "
      "service.\n\n"
      "Usage: mrctl [global flags] COMMAND [args] [flags]\n\nCommands:\n";
  for (const CommandSpec& c : Commands()) {
    std::string left = absl::StrCat("  ", c.name);
    left.resize(std::max<size_t>(left.size() + 1, 20), ' ');
    absl::StrAppend(&out, left, Wrap(c.summary, left.size(), 20), "\n");
  }
  absl::StrAppend(&out, "\nGlobal flags:\n", FlagLines(GlobalFlags()));
  absl::StrAppend(
      &out,
      "\nResults go to stdout (key=value lines, or --json), messages to "
      "stderr.\n"
      "Exit codes: 0 ok, 1 usage, 2 RPC failed (INVALID_ARGUMENT, "
      "OUT_OF_RANGE, ...),\n"
      "  3 NOT_FOUND, 4 PERMISSION_DENIED/UNAUTHENTICATED/remote access "
      "error,\n"
      "  5 RESOURCE_EXHAUSTED, 6 UNAVAILABLE/DEADLINE_EXCEEDED, 7 "
      "FAILED_PRECONDITION.\n"
      "`mrctl help COMMAND` or `mrctl COMMAND --help` for a command's "
      "flags.\n");
  return out;
}

std::string CommandHelp(const CommandSpec& c) {
  std::string out =
      absl::StrCat("Usage: ", Synopsis(c), "\n\n", c.summary, "\n");
  if (!c.details.empty()) absl::StrAppend(&out, Wrap(c.details, 0, 0), "\n");
  if (c.needs_session) {
    absl::StrAppend(&out,
                    "Needs a session: --session=TOKEN or $MRD_SESSION.\n");
  }
  if (!c.flags.empty()) absl::StrAppend(&out, "\nFlags:\n", FlagLines(c.flags));
  absl::StrAppend(&out, "\n",
                  Wrap("Global flags (see mrctl help): --socket, --target, "
                       "--fd-socket, --runtime-dir, --session, --json, -q, "
                       "--timeout",
                       0, 2),
                  "\n");
  return out;
}

std::string GroupHelp(absl::string_view group) {
  std::string out;
  for (const CommandSpec& c : Commands()) {
    if (absl::StartsWith(c.name, absl::StrCat(group, " "))) {
      if (!out.empty()) out += "\n";
      absl::StrAppend(&out, CommandHelp(c));
    }
  }
  return out;
}

bool FlagValues::Has(absl::string_view name) const {
  return flags_.find(std::string(name)) != flags_.end();
}

std::optional<std::string> FlagValues::String(absl::string_view name) const {
  auto it = flags_.find(std::string(name));
  if (it == flags_.end()) return std::nullopt;
  return it->second;
}

absl::StatusOr<std::string> FlagValues::RequiredString(
    absl::string_view name) const {
  std::optional<std::string> v = String(name);
  if (!v.has_value() || v->empty()) {
    return UsageError(absl::StrCat("--", name, " is required"));
  }
  return *v;
}

absl::StatusOr<bool> FlagValues::Bool(absl::string_view name) const {
  std::optional<std::string> v = String(name);
  if (!v.has_value()) return false;
  return ParseBool(name, *v);
}

absl::StatusOr<uint64_t> FlagValues::Number(
    absl::string_view name,
    absl::StatusOr<uint64_t> (*parse)(absl::string_view)) const {
  std::optional<std::string> v = String(name);
  if (!v.has_value()) {
    return UsageError(absl::StrCat("--", name, " is required"));
  }
  absl::StatusOr<uint64_t> n = parse(*v);
  if (!n.ok()) {
    return UsageError(absl::StrCat("--", name, ": ", n.status().message()));
  }
  return n;
}

absl::StatusOr<uint64_t> FlagValues::Uint64(absl::string_view name) const {
  return Number(name, ParseUint64);
}

absl::StatusOr<uint64_t> FlagValues::Uint64Or(absl::string_view name,
                                              uint64_t fallback) const {
  if (!Has(name)) return fallback;
  return Uint64(name);
}

absl::StatusOr<uint32_t> FlagValues::Uint32Or(absl::string_view name,
                                              uint32_t fallback) const {
  absl::StatusOr<uint64_t> n = Uint64Or(name, fallback);
  if (!n.ok()) return n.status();
  if (*n > UINT32_MAX) {
    return UsageError(absl::StrCat("--", name, " exceeds 32 bits"));
  }
  return static_cast<uint32_t>(*n);
}

absl::StatusOr<std::optional<uint64_t>> FlagValues::OptionalUint64(
    absl::string_view name) const {
  if (!Has(name)) return std::optional<uint64_t>();
  absl::StatusOr<uint64_t> n = Uint64(name);
  if (!n.ok()) return n.status();
  return std::optional<uint64_t>(*n);
}

absl::StatusOr<uint64_t> ParseUint64(absl::string_view text) {
  absl::string_view t = absl::StripAsciiWhitespace(text);
  uint64_t value = 0;
  bool ok = false;
  if (absl::StartsWithIgnoreCase(t, "0x")) {
    absl::string_view digits = t.substr(2);
    ok = !digits.empty() && absl::SimpleHexAtoi(digits, &value) &&
         std::all_of(digits.begin(), digits.end(), [](char ch) {
           return std::isxdigit(static_cast<unsigned char>(ch)) != 0;
         });
  } else {
    ok = !t.empty() && std::all_of(t.begin(), t.end(), [](char ch) {
      return std::isdigit(static_cast<unsigned char>(ch)) != 0;
    }) && absl::SimpleAtoi(t, &value);
  }
  if (!ok) {
    return UsageError(absl::StrCat("'", text,
                                   "' is not an unsigned 64-bit number "
                                   "(decimal or 0x hex)"));
  }
  return value;
}

absl::StatusOr<uint64_t> ParseSize(absl::string_view text) {
  absl::StatusOr<uint64_t> size = ParseByteSize(text);
  if (!size.ok()) return UsageError(size.status().message());
  return size;
}

absl::StatusOr<uint64_t> FlagValues::Size(absl::string_view name) const {
  return Number(name, ParseSize);
}

absl::StatusOr<uint64_t> FlagValues::SizeOr(absl::string_view name,
                                            uint64_t fallback) const {
  if (!Has(name)) return fallback;
  return Size(name);
}

absl::StatusOr<uint32_t> ParseMrFlags(absl::string_view text) {
  return ParseNamedBits(text, "MR flag",
                        {{"local_read", 0x0},
                         {"local_write", 0x1},
                         {"remote_read", 0x2},
                         {"remote_write", 0x5},
                         {"read_sink", 0x8}});
}

absl::StatusOr<uint32_t> ParseOpFlags(absl::string_view text) {
  return ParseNamedBits(text, "op flag",
                        {{"none", 0x0},
                         {"silent_success", 0x1},
                         {"read_fence", 0x2},
                         {"remote_read", 0x8},
                         {"local_write", 0x10},
                         {"remote_write", 0x30},
                         {"read_sink", 0x40},
                         {"defer", 0x200}});
}

absl::StatusOr<uint32_t> ParseMemFlags(absl::string_view text) {
  absl::string_view t = absl::StripAsciiWhitespace(text);
  if (!t.empty() && std::isdigit(static_cast<unsigned char>(t[0]))) {
    return ParseNamedBits(t, "mem flag", {});
  }
  std::string word = absl::AsciiStrToLower(t);
  if (word == "none") return 0u;
  if (word == "read") return 1u;
  if (word == "write") return 2u;
  if (word == "readwrite" || word == "read,write" || word == "rw") return 3u;
  return UsageError(
      absl::StrCat("--mem takes read, write or readwrite, not '", text, "'"));
}

absl::StatusOr<DeviceChoice> ParseDevices(absl::string_view text) {
  DeviceChoice choice;
  for (absl::string_view part :
       absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::string name(absl::StripAsciiWhitespace(part));
    if (name == "all") {
      choice.all = true;
    } else if (name == "nearest") {
      choice.nearest = true;
    } else {
      choice.names.push_back(std::move(name));
    }
  }
  if (int{choice.all} + int{choice.nearest} + int{!choice.names.empty()} > 1) {
    return UsageError(absl::StrCat(
        "give device names, all or nearest, one of them; got '", text, "'"));
  }
  if (!choice.all && !choice.nearest && choice.names.empty()) {
    return UsageError("give device names joined by ',', all or nearest");
  }
  return choice;
}

absl::StatusOr<std::vector<uint64_t>> ParseUint64List(absl::string_view text) {
  std::vector<uint64_t> out;
  for (absl::string_view part :
       absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    absl::StatusOr<uint64_t> n = ParseUint64(part);
    if (!n.ok()) return n.status();
    out.push_back(*n);
  }
  return out;
}

absl::StatusOr<absl::Duration> ParseDurationFlag(absl::string_view text) {
  absl::string_view t = absl::StripAsciiWhitespace(text);
  absl::Duration d;
  double seconds = 0;
  if (absl::ParseDuration(t, &d)) {
    // "inf" is accepted by absl.
  } else if (absl::SimpleAtod(t, &seconds)) {
    d = absl::Seconds(seconds);
  } else {
    return UsageError(
        absl::StrCat("'", text, "' is not a duration (e.g. 30s, 250ms, 5m)"));
  }
  if (d < absl::ZeroDuration()) {
    return UsageError(absl::StrCat("negative duration '", text, "'"));
  }
  return d;
}

absl::StatusOr<std::string> DecodeHex(absl::string_view text) {
  std::string digits;
  absl::string_view t = absl::StripAsciiWhitespace(text);
  if (absl::StartsWithIgnoreCase(t, "0x")) t.remove_prefix(2);
  for (char ch : t) {
    if (std::isspace(static_cast<unsigned char>(ch)) || ch == ':') continue;
    if (!std::isxdigit(static_cast<unsigned char>(ch))) {
      return UsageError(absl::StrCat("'", text, "' is not hex"));
    }
    digits.push_back(ch);
  }
  if (digits.size() % 2 != 0) {
    return UsageError("hex data needs an even number of digits");
  }
  std::string out;
  out.reserve(digits.size() / 2);
  auto nibble = [](char ch) {
    return std::isdigit(static_cast<unsigned char>(ch))
               ? ch - '0'
               : std::tolower(static_cast<unsigned char>(ch)) - 'a' + 10;
  };
  for (size_t i = 0; i < digits.size(); i += 2) {
    out.push_back(
        static_cast<char>(nibble(digits[i]) * 16 + nibble(digits[i + 1])));
  }
  return out;
}

std::string EncodeHex(absl::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char ch : bytes) {
    unsigned char b = static_cast<unsigned char>(ch);
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 0xf]);
  }
  return out;
}

absl::Status UsageError(absl::string_view message) {
  absl::Status status = absl::InvalidArgumentError(message);
  status.SetPayload(kUsagePayloadUrl, absl::Cord("1"));
  return status;
}

bool IsUsageError(const absl::Status& status) {
  return status.GetPayload(kUsagePayloadUrl).has_value();
}

}  // namespace mrd::mrctl
