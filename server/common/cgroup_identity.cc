#include "server/common/cgroup_identity.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <iterator>
#include <limits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "mrd/status.h"
#include "mrd/unique_fd.h"

// Linux 6.5; glibc 2.36's headers lack it.
#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif

namespace mrd {
namespace {

constexpr size_t kMaxStatBytes = 4096;
constexpr size_t kMinContainerIdLength = 32;
constexpr size_t kMaxContainerIdLength = 128;
constexpr size_t kPodmanIdLength = 64;
constexpr size_t kStaticPodUidLength = 32;

bool IsLowerHex(absl::string_view s) {
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

bool IsHex(absl::string_view s) {
  for (char c : s) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

bool IsDecimal(absl::string_view s, size_t max_digits) {
  if (s.empty() || s.size() > max_digits) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

bool IsContainerId(absl::string_view s) {
  return s.size() >= kMinContainerIdLength &&
         s.size() <= kMaxContainerIdLength && IsLowerHex(s);
}

bool IsPodmanId(absl::string_view s) {
  return s.size() == kPodmanIdLength && IsLowerHex(s);
}

// A Kubernetes pod UID with `separator` between the UUID's groups (or a
// static pod's 32 hex digits), in canonical form; nullopt if it is none.
std::optional<std::string> CanonicalPodUid(absl::string_view s,
                                           char separator) {
  if (s.size() == kStaticPodUidLength && IsHex(s)) {
    return absl::AsciiStrToLower(s);
  }
  static constexpr size_t kGroups[] = {8, 4, 4, 4, 12};
  if (s.size() != 36) return std::nullopt;
  std::string out;
  out.reserve(36);
  size_t pos = 0;
  for (size_t i = 0; i < 5; ++i) {
    if (i > 0) {
      if (s[pos] != separator) return std::nullopt;
      out.push_back('-');
      ++pos;
    }
    const absl::string_view group = s.substr(pos, kGroups[i]);
    if (!IsHex(group)) return std::nullopt;
    out.append(absl::AsciiStrToLower(group));
    pos += kGroups[i];
  }
  return out;
}

// What one path component says.
enum class Kind {
  kNone,
  kKubePod,     // pod<uid>, or a kubepods...-pod<uid>.slice
  kPodmanPod,   // ...-libpod_pod_<id>.slice, or a bare id (by context)
  kContainer,   // a container's cgroup
  kMonitor,     // conmon: in a pod, but no container
  kDelegation,  // user@<uid>.service
};

struct Component {
  Kind kind = Kind::kNone;
  absl::string_view id;  // container or podman pod id
  std::string pod_uid;   // canonical Kubernetes pod UID
  absl::string_view runtime;
  absl::string_view qos;
};

absl::string_view QosOfParent(absl::string_view parent) {
  if (parent == "burstable" || parent == "besteffort") return parent;
  if (parent == "kubepods") return "guaranteed";
  return "";
}

// pod<uid>: kubelet's cgroupfs name of a pod.
bool KubePodCgroupfs(absl::string_view name, absl::string_view parent,
                     Component* out) {
  if (!absl::ConsumePrefix(&name, "pod")) return false;
  std::optional<std::string> uid = CanonicalPodUid(name, '-');
  if (!uid.has_value()) return false;
  out->kind = Kind::kKubePod;
  out->pod_uid = *std::move(uid);
  out->qos = QosOfParent(parent);
  return true;
}

// Slices: [prefix-]kubepods[-burstable|-besteffort]-pod<uid_>.slice and
// <parent>-libpod_pod_<id>.slice.
bool PodSlice(absl::string_view name, Component* out) {
  if (!absl::ConsumeSuffix(&name, ".slice")) return false;
  const size_t last_dash = name.rfind('-');
  if (last_dash == absl::string_view::npos) return false;
  absl::string_view last = name.substr(last_dash + 1);
  if (absl::ConsumePrefix(&last, "libpod_pod_")) {
    if (!IsPodmanId(last)) return false;
    out->kind = Kind::kPodmanPod;
    out->id = last;
    out->runtime = "podman";
    return true;
  }
  if (!absl::ConsumePrefix(&last, "pod")) return false;
  // What precedes the pod element: "...kubepods" (guaranteed) or
  // "...kubepods-<qos>".
  absl::string_view before = name.substr(0, last_dash);
  absl::string_view qos = "guaranteed";
  const size_t dash = before.rfind('-');
  const absl::string_view element =
      dash == absl::string_view::npos ? before : before.substr(dash + 1);
  if (element == "burstable" || element == "besteffort") {
    qos = element;
    if (dash == absl::string_view::npos) return false;
    before = before.substr(0, dash);
  }
  if (!(before == "kubepods" || absl::EndsWith(before, "-kubepods"))) {
    return false;
  }
  std::optional<std::string> uid = CanonicalPodUid(last, '_');
  if (!uid.has_value()) return false;
  out->kind = Kind::kKubePod;
  out->pod_uid = *std::move(uid);
  out->qos = qos;
  return true;
}

// Runtime-prefixed names: <prefix><id>[.scope].
bool PrefixedContainer(absl::string_view name, Component* out) {
  absl::ConsumeSuffix(&name, ".scope");
  struct Prefix {
    absl::string_view prefix;
    absl::string_view runtime;
    Kind kind;
  };
  // Monitors first: "crio-" and "libpod-" are prefixes of theirs.
  static constexpr Prefix kPrefixes[] = {
      {"crio-conmon-", "", Kind::kMonitor},
      {"libpod-conmon-", "", Kind::kMonitor},
      {"libpod-payload-", "podman", Kind::kContainer},
      {"cri-containerd-", "containerd", Kind::kContainer},
      {"crio-", "crio", Kind::kContainer},
      {"docker-", "docker", Kind::kContainer},
      {"libpod-", "podman", Kind::kContainer},
  };
  for (const Prefix& p : kPrefixes) {
    absl::string_view id = name;
    if (!absl::ConsumePrefix(&id, p.prefix)) continue;
    if (!IsContainerId(id)) return false;
    out->kind = p.kind;
    out->runtime = p.runtime;
    if (p.kind == Kind::kContainer) out->id = id;
    return true;
  }
  return false;
}

// systemd's per-user manager, which owns (and may create cgroups in) its
// subtree.
bool IsDelegation(absl::string_view name) {
  return absl::ConsumePrefix(&name, "user@") &&
         absl::ConsumeSuffix(&name, ".service") && IsDecimal(name, 10);
}

// A podman pod's children: its containers and its monitors.
bool IsPodmanChild(absl::string_view next) {
  Component c;
  return next == "conmon" ||
         (absl::StartsWith(next, "libpod-") && PrefixedContainer(next, &c));
}

// What `name` says, given the components around it ("" at either end).
Component Classify(absl::string_view parent, absl::string_view name,
                   absl::string_view next, Kind parent_kind) {
  Component c;
  if (KubePodCgroupfs(name, parent, &c) || PodSlice(name, &c) ||
      PrefixedContainer(name, &c)) {
    return c;
  }
  if (IsDelegation(name)) {
    c.kind = Kind::kDelegation;
    return c;
  }
  if (!IsContainerId(name)) return c;
  // A bare id: its meaning comes from where it is.
  if (parent_kind == Kind::kKubePod) {
    c.kind = Kind::kContainer;
    c.id = name;
  } else if (parent == "docker") {
    c.kind = Kind::kContainer;
    c.id = name;
    c.runtime = "docker";
  } else if (IsPodmanId(name) &&
             (parent == "libpod_parent" || IsPodmanChild(next))) {
    c.kind = Kind::kPodmanPod;
    c.id = name;
    c.runtime = "podman";
  } else if (parent == "..") {
    c.kind = Kind::kContainer;
    c.id = name;
  }
  return c;
}

// The identity one path names; empty if it names none (or is not a path the
// kernel writes: relative, or with "." or ".." after a name).
CgroupIdentity ParsePath(absl::string_view path) {
  if (path.empty() || path.front() != '/') return CgroupIdentity();
  // The components are walked with one of lookahead; nothing is kept per
  // component, so a huge path costs time, not memory.
  auto next_component = [&path](size_t* pos) -> absl::string_view {
    while (*pos < path.size() && path[*pos] == '/') ++*pos;
    const size_t start = *pos;
    while (*pos < path.size() && path[*pos] != '/') ++*pos;
    return path.substr(start, *pos - start);
  };
  CgroupIdentity id;
  std::string pod_runtime;     // the runtime a podman pod implies
  bool pod_delegated = false;  // a user@<uid>.service above the pod
  bool delegation = false;     // a user@<uid>.service seen so far
  bool seen_name = false;      // a component other than ".." seen so far
  absl::string_view parent;
  Kind parent_kind = Kind::kNone;
  size_t pos = 0;
  absl::string_view name = next_component(&pos);
  while (!name.empty()) {
    const absl::string_view next = next_component(&pos);
    if (name == "." || (name == ".." && seen_name)) return CgroupIdentity();
    seen_name = seen_name || name != "..";
    Component c = Classify(parent, name, next, parent_kind);
    switch (c.kind) {
      case Kind::kKubePod:
      case Kind::kPodmanPod:
        // The innermost pod wins; a container above it is not its.
        id = CgroupIdentity();
        if (c.kind == Kind::kKubePod) {
          id.pod_uid = std::move(c.pod_uid);
          id.kubernetes = true;
        } else {
          id.pod_uid = std::string(c.id);
        }
        id.qos = std::string(c.qos);
        pod_runtime = std::string(c.runtime);
        pod_delegated = delegation;
        id.runtime = pod_runtime;
        id.delegated = pod_delegated;
        break;
      case Kind::kContainer:
        id.container_id = std::string(c.id);
        id.runtime = std::string(c.runtime);
        id.delegated = delegation;
        break;
      case Kind::kMonitor:
        // Not a workload: only its pod (if any) counts.
        id.container_id.clear();
        id.runtime = pod_runtime;
        id.delegated = pod_delegated;
        break;
      case Kind::kDelegation:
        delegation = true;
        break;
      case Kind::kNone:
        break;
    }
    parent = name;
    parent_kind = c.kind;
    name = next;
  }
  if (id.empty()) return CgroupIdentity();
  return id;
}

// The place of a hierarchy in the order of precedence (lower wins); v2 is 0.
int Rank(absl::string_view hierarchy_id, absl::string_view controllers) {
  if (hierarchy_id == "0" && controllers.empty()) return 0;
  static constexpr absl::string_view kOrder[] = {
      "name=systemd", "memory",     "pids",    "cpu",     "cpuacct", "cpuset",
      "blkio",        "io",         "devices", "freezer", "hugetlb", "net_cls",
      "net_prio",     "perf_event", "rdma",    "misc"};
  constexpr int kOthers = static_cast<int>(std::size(kOrder)) + 1;
  int best = kOthers;
  size_t start = 0;
  while (start <= controllers.size()) {
    size_t end = controllers.find(',', start);
    if (end == absl::string_view::npos) end = controllers.size();
    const absl::string_view controller = controllers.substr(start, end - start);
    for (size_t i = 0; i < std::size(kOrder); ++i) {
      if (controller == kOrder[i]) {
        best = std::min(best, static_cast<int>(i) + 1);
      }
    }
    start = end + 1;
  }
  return best;
}

absl::Status PeerGone(pid_t pid, absl::string_view how) {
  return MrdError(
      absl::StatusCode::kNotFound, "PEER_GONE",
      absl::StrCat("the peer process (pid ", pid, ") has exited: ", how));
}

absl::Status PidNamespace() {
  return MrdError(
      absl::StatusCode::kFailedPrecondition, "PEER_PID_NAMESPACE",
      "the peer's pid is 0: it runs in a pid namespace mrd cannot see into, "
      "so mrd cannot read its cgroup; run mrd in the host's pid namespace "
      "(hostPID: true in its pod spec)");
}

// Opens /proc/<pid> as a directory: the fd stays bound to that process
// (reads through it fail once it is reaped, even if the pid is reused).
absl::StatusOr<UniqueFd> OpenProcDir(pid_t pid, const std::string& proc_root) {
  const std::string path = absl::StrCat(proc_root, "/", pid);
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) {
    const int err = errno;
    if (err == ENOENT || err == ESRCH) return PeerGone(pid, "open " + path);
    return ErrnoError(err, "open " + path, "PROC_UNREADABLE");
  }
  return fd;
}

// Reads up to `max` bytes of `name` under `dir`.
absl::StatusOr<std::string> ReadAt(int dir, const char* name, size_t max,
                                   pid_t pid) {
  UniqueFd fd(::openat(dir, name, O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    const int err = errno;
    if (err == ENOENT || err == ESRCH) {
      return PeerGone(pid, absl::StrCat("open /proc/", pid, "/", name));
    }
    return ErrnoError(err, absl::StrCat("open /proc/", pid, "/", name),
                      "PROC_UNREADABLE");
  }
  std::string out;
  out.resize(max);
  size_t got = 0;
  while (got < max) {
    const ssize_t n = ::read(fd.get(), out.data() + got, max - got);
    if (n < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      if (err == ESRCH) {
        return PeerGone(pid, absl::StrCat("read /proc/", pid, "/", name));
      }
      return ErrnoError(err, absl::StrCat("read /proc/", pid, "/", name),
                        "PROC_UNREADABLE");
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  out.resize(got);
  return out;
}

absl::StatusOr<uint64_t> ReadStartTime(int dir, pid_t pid) {
  MRD_ASSIGN_OR_RETURN(std::string stat,
                       ReadAt(dir, "stat", kMaxStatBytes, pid));
  std::optional<uint64_t> start = cgroup_internal::ParseStatStartTime(stat);
  if (!start.has_value()) {
    // A process being reaped may leave an empty file behind.
    if (stat.empty()) return PeerGone(pid, "empty /proc/<pid>/stat");
    return MrdError(absl::StatusCode::kInternal, "PROC_STAT_MALFORMED",
                    absl::StrCat("/proc/", pid, "/stat could not be parsed"));
  }
  return *start;
}

// The cgroup text of the process `dir` is bound to; one byte more than the
// cap is read so that the parser knows when the text was cut.
absl::StatusOr<std::string> ReadCgroupText(int dir, pid_t pid) {
  return ReadAt(dir, "cgroup", kMaxProcCgroupBytes + 1, pid);
}

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
};

absl::StatusOr<PeerCredentials> GetPeerCredentials(int socket_fd) {
  struct ucred cred;
  socklen_t len = sizeof(cred);
  if (::getsockopt(socket_fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return ErrnoError(errno, "getsockopt(SO_PEERCRED)", "PEER_CREDENTIALS");
  }
  if (cred.pid == 0) {
    // No peer at all reads as pid 0 and uid -1; a peer in another pid
    // namespace has its uid.
    if (cred.uid == static_cast<uid_t>(-1)) {
      return MrdError(absl::StatusCode::kFailedPrecondition, "NO_PEER",
                      "the socket has no peer process");
    }
    return PidNamespace();
  }
  return PeerCredentials{cred.pid, cred.uid};
}

}  // namespace

std::string CgroupIdentity::DebugString() const {
  std::string out = absl::StrCat("pod=", pod_uid, " container=", container_id,
                                 " runtime=", runtime, " qos=", qos);
  if (kubernetes) absl::StrAppend(&out, " kubernetes");
  if (delegated) absl::StrAppend(&out, " delegated");
  return out;
}

CgroupIdentity ParseProcCgroup(absl::string_view text) {
  if (text.size() > kMaxProcCgroupBytes) {
    // Only whole lines within the cap count.
    text = text.substr(0, kMaxProcCgroupBytes);
    const size_t last_newline = text.rfind('\n');
    text = last_newline == absl::string_view::npos
               ? absl::string_view()
               : text.substr(0, last_newline);
  }
  CgroupIdentity best;
  int best_rank = std::numeric_limits<int>::max();
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == absl::string_view::npos) end = text.size();
    absl::string_view line = text.substr(start, end - start);
    start = end + 1;
    absl::ConsumeSuffix(&line, "\r");
    const size_t colon1 = line.find(':');
    if (colon1 == absl::string_view::npos) continue;
    const size_t colon2 = line.find(':', colon1 + 1);
    if (colon2 == absl::string_view::npos) continue;
    const absl::string_view hierarchy = line.substr(0, colon1);
    const absl::string_view controllers =
        line.substr(colon1 + 1, colon2 - colon1 - 1);
    if (!IsDecimal(hierarchy, 10)) continue;
    // Ties go to the earlier line, so a line is parsed only if it could win.
    const int rank = Rank(hierarchy, controllers);
    if (rank >= best_rank) continue;
    CgroupIdentity id = ParsePath(line.substr(colon2 + 1));
    if (id.empty()) continue;
    best = std::move(id);
    best_rank = rank;
    if (rank == 0) break;
  }
  return best;
}

absl::StatusOr<CgroupIdentity> ReadPeerCgroup(int socket_fd,
                                              const std::string& proc_root) {
  int raw_pidfd = -1;
  socklen_t len = sizeof(raw_pidfd);
  if (::getsockopt(socket_fd, SOL_SOCKET, SO_PEERPIDFD, &raw_pidfd, &len) !=
      0) {
    const int err = errno;
    switch (err) {
      case ENOPROTOOPT:
        return cgroup_internal::ReadPeerCgroupByCredentials(socket_fd,
                                                            proc_root);
      case ENODATA:
        return MrdError(absl::StatusCode::kFailedPrecondition, "NO_PEER",
                        "the socket has no peer process");
      case EINVAL:
      case ESRCH: {
        // The kernel has no live task behind the peer's pid any more.
        absl::StatusOr<PeerCredentials> cred = GetPeerCredentials(socket_fd);
        if (!cred.ok()) return cred.status();
        return PeerGone(cred->pid, "getsockopt(SO_PEERPIDFD)");
      }
      default:
        return ErrnoError(err, "getsockopt(SO_PEERPIDFD)", "PEER_CREDENTIALS");
    }
  }
  const UniqueFd pidfd(raw_pidfd);
  // The same struct pid as the pidfd's, as a number in mrd's namespace.
  MRD_ASSIGN_OR_RETURN(const PeerCredentials cred,
                       GetPeerCredentials(socket_fd));
  MRD_ASSIGN_OR_RETURN(UniqueFd dir, OpenProcDir(cred.pid, proc_root));
  MRD_ASSIGN_OR_RETURN(std::string text, ReadCgroupText(dir.get(), cred.pid));
  // Still there (a zombie counts: its pid is not free until it is reaped)
  // after the read, so /proc/<pid> was the peer's all along. Signal 0 is
  // not sent; EPERM also proves the process exists.
  if (::syscall(SYS_pidfd_send_signal, pidfd.get(), 0, nullptr, 0) != 0) {
    const int err = errno;
    if (err == ESRCH) return PeerGone(cred.pid, "pidfd_send_signal");
    if (err != EPERM) {
      return ErrnoError(err, "pidfd_send_signal", "PEER_CREDENTIALS");
    }
  }
  return ParseProcCgroup(text);
}

absl::StatusOr<CgroupIdentity> ReadPidCgroup(pid_t pid,
                                             const std::string& proc_root) {
  return cgroup_internal::ReadPidCgroupSince(pid, proc_root,
                                             cgroup_internal::BoottimeTicks());
}

absl::StatusOr<TenantKeyKind> ParseTenantKeyKind(absl::string_view name) {
  if (name == "pod") return TenantKeyKind::kPod;
  if (name == "container") return TenantKeyKind::kContainer;
  if (name == "uid") return TenantKeyKind::kUid;
  return MrdError(absl::StatusCode::kInvalidArgument, "BAD_TENANT_KEY_KIND",
                  absl::StrCat("tenant key kind \"", absl::CHexEscape(name),
                               "\" is none of pod, container, uid"));
}

absl::string_view TenantKeyKindName(TenantKeyKind kind) {
  switch (kind) {
    case TenantKeyKind::kPod:
      return "pod";
    case TenantKeyKind::kContainer:
      return "container";
    case TenantKeyKind::kUid:
      return "uid";
  }
  return "uid";
}

std::string TenantKeyFor(const CgroupIdentity& identity, TenantKeyKind kind,
                         uint32_t uid) {
  const std::string pod =
      identity.pod_uid.empty() ? "" : absl::StrCat("pod:", identity.pod_uid);
  const std::string container =
      identity.container_id.empty()
          ? ""
          : absl::StrCat("container:", identity.container_id);
  switch (kind) {
    case TenantKeyKind::kPod:
      if (!pod.empty()) return pod;
      if (!container.empty()) return container;
      break;
    case TenantKeyKind::kContainer:
      if (!container.empty()) return container;
      if (!pod.empty()) return pod;
      break;
    case TenantKeyKind::kUid:
      break;
  }
  return absl::StrCat("uid:", uid);
}

absl::StatusOr<std::string> KubeletPodName(const std::string& logs_dir,
                                           absl::string_view pod_uid) {
  const bool sane =
      !pod_uid.empty() && pod_uid.size() <= 64 &&
      std::all_of(pod_uid.begin(), pod_uid.end(), [](char c) {
        return absl::ascii_isxdigit(static_cast<unsigned char>(c)) || c == '-';
      });
  if (!sane) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_POD_UID",
                    absl::StrCat("'", pod_uid, "' is not a pod UID"));
  }
  const std::string suffix = absl::StrCat("_", pod_uid);
  DIR* dir = ::opendir(logs_dir.c_str());
  if (dir != nullptr) {
    std::string found;
    while (struct dirent* entry = ::readdir(dir)) {
      absl::string_view name = entry->d_name;
      if (!absl::ConsumeSuffix(&name, suffix)) continue;
      const size_t cut = name.find('_');
      if (cut == 0 || cut == absl::string_view::npos ||
          cut + 1 >= name.size() ||
          name.find('_', cut + 1) != absl::string_view::npos) {
        continue;
      }
      found = absl::StrCat(name.substr(0, cut), "/", name.substr(cut + 1));
      break;
    }
    ::closedir(dir);
    if (!found.empty()) return found;
  }
  return MrdError(
      absl::StatusCode::kNotFound, "POD_NAME_UNKNOWN",
      absl::StrCat("no entry of ", logs_dir, " names pod ", pod_uid));
}

namespace cgroup_internal {

std::optional<uint64_t> ParseStatStartTime(absl::string_view stat) {
  // "pid (comm) state ppid ...": comm may hold anything but is at most 16
  // bytes, and nothing after it holds ')', so the last ')' ends it.
  const size_t close = stat.rfind(')');
  if (close == absl::string_view::npos || stat.find('(') > close) {
    return std::nullopt;
  }
  absl::string_view rest = stat.substr(close + 1);
  // Fields 3 (state) onwards; starttime is field 22.
  constexpr int kStartTimeField = 22;
  int field = 2;
  size_t pos = 0;
  while (true) {
    if (pos >= rest.size() || rest[pos] != ' ') return std::nullopt;
    ++pos;
    const size_t end = std::min(rest.find(' ', pos), rest.size());
    if (end == pos) return std::nullopt;  // an empty field
    ++field;
    if (field == kStartTimeField) {
      absl::string_view value = rest.substr(pos, end - pos);
      absl::ConsumeSuffix(&value, "\n");
      uint64_t start = 0;
      if (!IsDecimal(value, 20) || !absl::SimpleAtoi(value, &start)) {
        return std::nullopt;
      }
      return start;
    }
    pos = end;
  }
}

uint64_t BoottimeTicks() {
  struct timespec now;
  ::clock_gettime(CLOCK_BOOTTIME, &now);
  const long hz = ::sysconf(_SC_CLK_TCK);
  const uint64_t ticks_per_second = hz > 0 ? static_cast<uint64_t>(hz) : 100;
  // Exact floor of (seconds * 1e9 + nanoseconds) * hz / 1e9.
  return static_cast<uint64_t>(now.tv_sec) * ticks_per_second +
         static_cast<uint64_t>(now.tv_nsec) * ticks_per_second / 1000000000u;
}

absl::StatusOr<CgroupIdentity> ReadPidCgroupSince(pid_t pid,
                                                  const std::string& proc_root,
                                                  uint64_t check_began_ticks) {
  if (pid <= 0) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_PID",
                    absl::StrCat("pid ", pid, " names no process"));
  }
  MRD_ASSIGN_OR_RETURN(UniqueFd dir, OpenProcDir(pid, proc_root));
  MRD_ASSIGN_OR_RETURN(const uint64_t started, ReadStartTime(dir.get(), pid));
  MRD_ASSIGN_OR_RETURN(std::string text, ReadCgroupText(dir.get(), pid));
  MRD_ASSIGN_OR_RETURN(const uint64_t started_after,
                       ReadStartTime(dir.get(), pid));
  if (started != started_after) {
    return MrdError(
        absl::StatusCode::kAborted, "PEER_PID_REUSED",
        absl::StrCat("pid ", pid, " changed hands while its cgroup was read ",
                     "(start time ", started, ", then ", started_after, ")"));
  }
  if (started > check_began_ticks) {
    return MrdError(
        absl::StatusCode::kAborted, "PEER_PID_REUSED",
        absl::StrCat("the process at pid ", pid, " started (tick ", started,
                     ") after the check began (tick ", check_began_ticks,
                     "): it cannot be the one meant, whose pid was reused"));
  }
  return ParseProcCgroup(text);
}

absl::StatusOr<CgroupIdentity> ReadPeerCgroupByCredentials(
    int socket_fd, const std::string& proc_root) {
  const uint64_t began = BoottimeTicks();
  MRD_ASSIGN_OR_RETURN(const PeerCredentials cred,
                       GetPeerCredentials(socket_fd));
  return ReadPidCgroupSince(cred.pid, proc_root, began);
}

}  // namespace cgroup_internal
}  // namespace mrd
