// CgroupIdentity: which Kubernetes pod, which container and which container
// runtime a client process belongs to, as the paths in its
// /proc/<pid>/cgroup tell, so that quotas can be charged per pod (or per
// container) rather than per uid; and the race-free reading of that file for
// the process at the other end of a connected Unix socket.
//
// What is recognised (each path component on its own, anywhere in the path,
// so that a kubepods root nested under another cgroup (kind, k3d, a kubelet
// with --cgroup-root) or hidden by a cgroup namespace (the path then starts
// with "/.." components, relative to the reader's own cgroup) still names the
// pod; the innermost pod wins, and a container counts only below it):
//
//   kubelet, cgroupfs driver (v1 and v2):
//     /kubepods/pod<uid>/<cid>                       guaranteed
//     /kubepods/burstable/pod<uid>/<cid>             burstable
//     /kubepods/besteffort/pod<uid>/<cid>            besteffort
//     <cid> is a bare id (containerd, cri-dockerd: runtime ""),
//     crio-<id> (CRI-O) or crio-conmon-<id> (CRI-O's monitor).
//   kubelet, systemd driver:
//     /kubepods.slice/kubepods-burstable.slice/
//       kubepods-burstable-pod<uid with '_' for '-'>.slice/<scope>
//     (guaranteed: kubepods-pod<uid>.slice right under kubepods.slice; with
//     --cgroup-root=/kubelet every name gains a "kubelet-" prefix), where
//     <scope> is cri-containerd-<id>.scope, crio-<id>.scope, docker-<id>.scope
//     (cri-dockerd) or crio-conmon-<id>.scope.
//   Docker outside Kubernetes: /docker/<id>, /system.slice/docker-<id>.scope.
//   podman: libpod-<id>.scope (under machine.slice, or a user's
//     user@<uid>.service when rootless), /libpod_parent/libpod-<id>,
//     libpod-payload-<id> (--cgroups=split), libpod-conmon-<id>.scope
//     (podman's monitor); podman pods: machine-libpod_pod_<podid>.slice (any
//     "<parent>-libpod_pod_<podid>.slice") with systemd, and
//     /libpod_parent/<podid>/libpod-<id> (and <podid>/conmon) with cgroupfs.
//
// A monitor's cgroup (crio-conmon-..., libpod-conmon-..., a podman pod's
// "conmon") names no container: the monitor is the runtime's helper, not the
// workload. Its pod still counts.
//
// Accepted ids: a Kubernetes pod UID is a UUID, hex in 8-4-4-4-12 groups
// separated by '-' (cgroupfs) or '_' (systemd), or 32 hex digits (the
// UID kubelet gives a static pod: an MD5 of its manifest); either case,
// reported in lower case with dashes. A podman pod id and a container id are
// lower-case hex, 64 digits for a podman pod, 32 to 128 for a container. A
// bare id counts as a container only right under a pod, under "docker" or
// right after "/.." (a sibling of the reader's own cgroup in a cgroup
// namespace); a bare 64-hex id under "libpod_parent" or followed by a podman
// container is a podman pod. Anything else is no pod and no container.
//
// Which line wins: /proc/<pid>/cgroup has one "hierarchy-id:controllers:path"
// line per hierarchy (cgroup v2's is "0::path"; a hybrid machine has v1
// lines beside it). The identity is that of one line: the v2 line if it names
// a pod or a container; else the first v1 line that does, trying
// name=systemd, memory, pids, cpu, cpuacct, cpuset, blkio, io, devices,
// freezer, hugetlb, net_cls, net_prio, perf_event, rdma, misc in that order,
// then the other hierarchies in file order. A line whose path names neither
// contributes nothing; lines are never merged.
//
// Trust: the identity is only as good as the cgroup tree's writers. Whoever
// can create cgroups above a process can name them like kubelet's: root on
// the node, privileged containers (a kind node is one), and a user with a
// systemd delegation (user@<uid>.service, where rootless podman lives).
// `delegated` flags the last: a caller charging quotas by pod or container
// should not trust such an identity for a uid it would not trust to mint
// tenants.
//
// Thread safety: every function touches only its arguments, the kernel and
// /proc; all may be called from any thread.
#ifndef MRD_SERVER_COMMON_CGROUP_IDENTITY_H_
#define MRD_SERVER_COMMON_CGROUP_IDENTITY_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mrd {

// Who a process is, as its cgroup paths tell.
struct CgroupIdentity {
  // Kubernetes pod UID, canonical lower-case 8-4-4-4-12 with dashes, or the
  // 32 hex digits of a static pod; for a podman pod its 64-hex pod id;
  // "" = none.
  std::string pod_uid;
  // The container's id as the runtime names it (32 to 128 lower-case hex,
  // usually 64); "" = none.
  std::string container_id;
  // "containerd", "crio", "docker", "podman"; "" when unknown (a bare id, or
  // a kubelet pod without a container).
  std::string runtime;
  // "guaranteed", "burstable", "besteffort" for kubelet pods whose QoS
  // parent is visible in the path; else "".
  std::string qos;
  // The pod is kubelet's (pod_uid is a Kubernetes pod UID).
  bool kubernetes = false;
  // A systemd user delegation (a user@<uid>.service component) lies above
  // the pod or container: that user could have named these cgroups.
  bool delegated = false;

  bool empty() const { return pod_uid.empty() && container_id.empty(); }
  // "pod=... container=... runtime=... qos=... kubernetes delegated", for
  // logs and test output.
  std::string DebugString() const;
  friend bool operator==(const CgroupIdentity&,
                         const CgroupIdentity&) = default;
};

// At most this much of /proc/<pid>/cgroup is read and parsed; a line cut
// there is ignored.
inline constexpr size_t kMaxProcCgroupBytes = 64 * 1024;

// Parses the text of /proc/<pid>/cgroup (untrusted: any bytes). Never fails:
// garbage, empty text or a process in no container give an empty identity.
// Linear in min(text.size(), kMaxProcCgroupBytes); allocates only the result.
CgroupIdentity ParseProcCgroup(absl::string_view text);

// Reads the cgroup of the process at the other end of a connected Unix
// socket, race-free: the process read is the one that connected.
//
// With SO_PEERPIDFD (Linux >= 6.5) it opens /proc/<pid> (the pid as
// SO_PEERCRED gives it in mrd's pid namespace), reads its cgroup and then
// checks through the peer's pidfd that the process that connected is still
// there (not reaped, so its pid cannot have been reused during the read).
// Without it (ENOPROTOOPT) it falls back to SO_PEERCRED's pid and compares
// the process's start time before and after the read, accepting only if both
// are equal and not later than the moment the check began: a process started
// after that cannot be the one that connected. That check knows only that
// the peer existed when the check began, so call it as soon as the
// connection is accepted: a pid reused between the accept and the check goes
// unnoticed there, as does a process started within the same clock tick
// (1/sysconf(_SC_CLK_TCK) s) as the check began. The pidfd path has neither
// gap.
//
// `proc_root` is where procfs is mounted; tests may point it elsewhere for
// the pure read path only.
//
// Errors (mrd/status.h):
//   FAILED_PRECONDITION PEER_PID_NAMESPACE: the peer's pid is 0 (it is in a
//     pid namespace mrd cannot see into; mrd needs the host's, hostPID).
//   FAILED_PRECONDITION NO_PEER: the socket has no peer process.
//   NOT_FOUND PEER_GONE: the peer process has exited (and been reaped).
//   ABORTED PEER_PID_REUSED: the process at the peer's pid is not the one
//     that connected (another start time, or started after the check began).
//   INTERNAL PROC_STAT_MALFORMED: /proc/<pid>/stat could not be parsed.
//   From errno (ErrnoError): PEER_CREDENTIALS (getsockopt failed: not a
//     socket, not AF_UNIX, ...), PROC_UNREADABLE (/proc/<pid> could not be
//     opened or read for another reason than the process being gone).
absl::StatusOr<CgroupIdentity> ReadPeerCgroup(
    int socket_fd, const std::string& proc_root = "/proc");

// The same for a pid without a socket: no pidfd stands for "the process
// meant", so only the start-time check applies (the process at `pid` when
// the call began). INVALID_ARGUMENT BAD_PID for pid <= 0; otherwise the
// errors of ReadPeerCgroup.
absl::StatusOr<CgroupIdentity> ReadPidCgroup(
    pid_t pid, const std::string& proc_root = "/proc");

// Which identity a tenant key is made of (a flag chooses).
enum class TenantKeyKind { kPod, kContainer, kUid };

// "pod", "container", "uid"; INVALID_ARGUMENT BAD_TENANT_KEY_KIND otherwise.
absl::StatusOr<TenantKeyKind> ParseTenantKeyKind(absl::string_view name);
absl::string_view TenantKeyKindName(TenantKeyKind kind);

// The tenant key of a process: for kPod "pod:<pod_uid>" if it is in a pod,
// else "container:<id>" if it is in a container, else "uid:<uid>"; for
// kContainer "container:<id>", else the pod's key, else the uid's; for kUid
// always "uid:<uid>". Never empty. (Whether to trust a `delegated` identity
// is the caller's policy; see "Trust" above.)
std::string TenantKeyFor(const CgroupIdentity& identity, TenantKeyKind kind,
                         uint32_t uid);

// The "<namespace>/<name>" of the Kubernetes pod `pod_uid`, as the kubelet's
// pod log directory tells it: `logs_dir` (/var/log/pods on a node) holds one
// directory per pod, "<namespace>_<name>_<uid>" (namespaces and names never
// hold '_'). NOT_FOUND POD_NAME_UNKNOWN when no entry names the pod (or the
// directory cannot be read); INVALID_ARGUMENT BAD_POD_UID for a uid that is
// not one.
absl::StatusOr<std::string> KubeletPodName(const std::string& logs_dir,
                                           absl::string_view pod_uid);

// Pieces of the above, exposed for tests.
namespace cgroup_internal {

// Field 22 (starttime, clock ticks after boot) of a /proc/<pid>/stat text;
// the command name in parentheses may hold spaces and ')'. nullopt when the
// text is malformed.
std::optional<uint64_t> ParseStatStartTime(absl::string_view stat);

// CLOCK_BOOTTIME now, in clock ticks (sysconf(_SC_CLK_TCK)), rounded down as
// the kernel rounds a process's start time.
uint64_t BoottimeTicks();

// ReadPidCgroup with the moment the check began given, in BoottimeTicks().
absl::StatusOr<CgroupIdentity> ReadPidCgroupSince(pid_t pid,
                                                  const std::string& proc_root,
                                                  uint64_t check_began_ticks);

// ReadPeerCgroup as on a kernel without SO_PEERPIDFD (SO_PEERCRED's pid and
// the start-time check).
absl::StatusOr<CgroupIdentity> ReadPeerCgroupByCredentials(
    int socket_fd, const std::string& proc_root);

}  // namespace cgroup_internal
}  // namespace mrd

#endif  // MRD_SERVER_COMMON_CGROUP_IDENTITY_H_
