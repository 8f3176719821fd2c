// Fuzzes ParseProcCgroup (server/common/cgroup_identity.h), the parser of
// /proc/<pid>/cgroup that tells mrd which pod and container a client is in.
//
// An input starting with a digit is the text of a /proc/<pid>/cgroup file
// itself (the seeds are real-looking ones); the parse must not crash and its
// result must keep the documented forms: a pod UID empty, a canonical
// lower-case UUID, 32 hex digits (a static pod) or 64 (a podman pod, never
// kubelet's); a container id empty or 32 to 128 lower-case hex digits found
// verbatim in the text; a runtime and a QoS class from their lists, a QoS
// class only for a kubelet pod; an empty identity with no other field set;
// the same answer twice, and the same with "\r\n" line ends. Tenant keys of
// every kind are never empty and start with pod:, container: or uid:, taking
// the fallback order of TenantKeyFor.
//
// Any other input builds a well-formed file from fuzzed parts: a layout
// (kubelet's cgroupfs and systemd drivers with every QoS class, containerd,
// CRI-O, cri-dockerd and monitor scopes, crun's "container" child, Docker,
// podman with and without pods, rootless), the UUID (either case), ids of
// fuzzed length, what lies above (nothing, a kind node's docker container,
// other cgroups, a user's systemd delegation, "/.." components of a cgroup
// namespace, which may hide the kubepods and QoS parents), and the lines
// around it (v2 alone; hybrid with v1 lines; a v2 line naming nothing; a
// lower-ranked line naming another pod; junk lines that cannot name
// anything). The parse must give exactly the identity the layout means.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "server/common/cgroup_identity.h"
#include "tests/fuzz/fuzz_util.h"

namespace mrd::fuzz {
namespace {

bool IsLowerHex(absl::string_view s) {
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

bool IsCanonicalUuid(absl::string_view s) {
  if (s.size() != 36) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const bool dash = i == 8 || i == 13 || i == 18 || i == 23;
    if (dash ? s[i] != '-' : !IsLowerHex(s.substr(i, 1))) return false;
  }
  return true;
}

std::string Describe(const CgroupIdentity& id) { return id.DebugString(); }

void CheckInvariants(absl::string_view text, const CgroupIdentity& id) {
  const std::string got = Describe(id);
  const bool uuid = IsCanonicalUuid(id.pod_uid);
  const bool hex32 = id.pod_uid.size() == 32 && IsLowerHex(id.pod_uid);
  const bool hex64 = id.pod_uid.size() == 64 && IsLowerHex(id.pod_uid);
  FUZZ_CHECK(id.pod_uid.empty() || uuid || hex32 || hex64, got);
  FUZZ_CHECK(!id.kubernetes || uuid || hex32, got);
  FUZZ_CHECK(!hex64 || !id.kubernetes, got);
  FUZZ_CHECK(id.container_id.empty() ||
                 (id.container_id.size() >= 32 &&
                  id.container_id.size() <= 128 && IsLowerHex(id.container_id)),
             got);
  FUZZ_CHECK(
      id.container_id.empty() || absl::StrContains(text, id.container_id), got);
  FUZZ_CHECK(id.runtime.empty() || id.runtime == "containerd" ||
                 id.runtime == "crio" || id.runtime == "docker" ||
                 id.runtime == "podman",
             got);
  FUZZ_CHECK(id.qos.empty() || id.qos == "guaranteed" ||
                 id.qos == "burstable" || id.qos == "besteffort",
             got);
  FUZZ_CHECK(id.qos.empty() || id.kubernetes, got);
  if (id.empty()) FUZZ_CHECK(id == CgroupIdentity(), got);

  for (uint32_t uid : {0u, 1000u, 4294967295u}) {
    const std::string uid_key = absl::StrCat("uid:", uid);
    const std::string pod_key =
        id.pod_uid.empty() ? "" : absl::StrCat("pod:", id.pod_uid);
    const std::string container_key =
        id.container_id.empty() ? ""
                                : absl::StrCat("container:", id.container_id);
    const std::string pod_first = !pod_key.empty()         ? pod_key
                                  : !container_key.empty() ? container_key
                                                           : uid_key;
    const std::string container_first = !container_key.empty() ? container_key
                                        : !pod_key.empty()     ? pod_key
                                                               : uid_key;
    FUZZ_CHECK(TenantKeyFor(id, TenantKeyKind::kPod, uid) == pod_first, got);
    FUZZ_CHECK(
        TenantKeyFor(id, TenantKeyKind::kContainer, uid) == container_first,
        got);
    FUZZ_CHECK(TenantKeyFor(id, TenantKeyKind::kUid, uid) == uid_key, got);
  }
}

void CheckText(absl::string_view text) {
  const CgroupIdentity id = ParseProcCgroup(text);
  CheckInvariants(text, id);
  FUZZ_CHECK(ParseProcCgroup(text) == id, "not deterministic");
  if (text.find('\r') == absl::string_view::npos &&
      2 * text.size() <= kMaxProcCgroupBytes) {
    const std::string crlf = absl::StrReplaceAll(text, {{"\n", "\r\n"}});
    const CgroupIdentity with_crlf = ParseProcCgroup(crlf);
    FUZZ_CHECK(with_crlf == id, "with \\r\\n: ", Describe(with_crlf),
               "; with \\n: ", Describe(id));
  }
}

std::string Hex(Reader& in, size_t length) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(length);
  for (size_t i = 0; i < length; ++i) out.push_back(kDigits[in.Byte() & 15]);
  return out;
}

// A pod UUID (lower case) and its spelling in the path.
struct Uid {
  std::string canonical;
  std::string spelled;  // maybe upper case; separators per driver
};

Uid MakeUid(Reader& in, char separator) {
  Uid uid;
  if (in.ConsumeIntegralInRange<int>(0, 7) == 0) {
    uid.canonical = Hex(in, 32);  // a static pod
  } else {
    uid.canonical = absl::StrCat(Hex(in, 8), "-", Hex(in, 4), "-", Hex(in, 4),
                                 "-", Hex(in, 4), "-", Hex(in, 12));
  }
  uid.spelled = uid.canonical;
  if (in.ConsumeBool()) uid.spelled = absl::AsciiStrToUpper(uid.spelled);
  if (separator != '-') {
    uid.spelled = absl::StrReplaceAll(uid.spelled, {{"-", "_"}});
  }
  return uid;
}

// A path and the identity it means.
struct Layout {
  std::string path;
  CgroupIdentity want;
};

absl::string_view Qos(Reader& in) {
  return in.PickValueInArray<absl::string_view>(
      {"guaranteed", "burstable", "besteffort"});
}

// Renders `parts` as a cgroup namespace would when `hidden`: some of the
// components above the pod (at `pod_index`) replaced by one to three "..".
// Returns how many were replaced.
size_t Render(Reader& in, bool hidden, size_t pod_index,
              std::vector<std::string> parts, std::string* path) {
  size_t replaced = 0;
  if (hidden) {
    replaced = in.ConsumeIntegralInRange<size_t>(0, pod_index);
    parts.erase(parts.begin(),
                parts.begin() + static_cast<std::ptrdiff_t>(replaced));
    const size_t dots = in.ConsumeIntegralInRange<size_t>(1, 3);
    parts.insert(parts.begin(), dots, "..");
  }
  *path = "/" + absl::StrJoin(parts, "/");
  return replaced;
}

// kubelet's cgroupfs driver.
Layout KubeCgroupfs(Reader& in, bool hidden, const std::string& cid) {
  Layout l;
  const Uid uid = MakeUid(in, '-');
  const absl::string_view qos = Qos(in);
  std::vector<std::string> parts = {"kubepods"};
  if (qos != "guaranteed") parts.push_back(std::string(qos));
  const size_t pod_index = parts.size();
  parts.push_back("pod" + uid.spelled);
  l.want.pod_uid = uid.canonical;
  l.want.kubernetes = true;
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0:
      parts.push_back(cid);
      l.want.container_id = cid;
      break;
    case 1:
      parts.push_back("crio-" + cid);
      l.want.container_id = cid;
      l.want.runtime = "crio";
      break;
    case 2:
      parts.push_back("crio-conmon-" + cid);
      break;
    default:
      break;
  }
  // The QoS parent (right above the pod) tells the class unless hidden.
  const size_t replaced = Render(in, hidden, pod_index, parts, &l.path);
  l.want.qos = replaced == pod_index ? "" : std::string(qos);
  return l;
}

// kubelet's systemd driver, with a cgroup root of "kubepods" or
// "kubelet-kubepods" (kind).
Layout KubeSystemd(Reader& in, bool hidden, const std::string& cid) {
  Layout l;
  const Uid uid = MakeUid(in, '_');
  const absl::string_view qos = Qos(in);
  std::vector<std::string> parts;
  std::string prefix = "kubepods";
  if (in.ConsumeBool()) {
    parts.push_back("kubelet.slice");
    prefix = "kubelet-kubepods";
  }
  parts.push_back(prefix + ".slice");
  if (qos != "guaranteed") {
    prefix = absl::StrCat(prefix, "-", qos);
    parts.push_back(prefix + ".slice");
  }
  const size_t pod_index = parts.size();
  parts.push_back(absl::StrCat(prefix, "-pod", uid.spelled, ".slice"));
  l.want.pod_uid = uid.canonical;
  l.want.kubernetes = true;
  l.want.qos = std::string(qos);  // the pod slice's name always tells
  struct Scope {
    absl::string_view prefix;
    absl::string_view runtime;
    bool container;
  };
  const Scope scope = in.PickValueInArray<Scope>({
      {"cri-containerd-", "containerd", true},
      {"crio-", "crio", true},
      {"docker-", "docker", true},
      {"crio-conmon-", "", false},
      {"", "", false},
  });
  if (!scope.prefix.empty()) {
    parts.push_back(absl::StrCat(scope.prefix, cid, ".scope"));
    if (scope.container) {
      l.want.container_id = cid;
      l.want.runtime = std::string(scope.runtime);
      if (in.ConsumeBool()) parts.push_back("container");  // crun
    }
  }
  Render(in, hidden, pod_index, parts, &l.path);
  return l;
}

Layout Docker(Reader& in, const std::string& cid) {
  Layout l;
  l.path = in.ConsumeBool()
               ? "/docker/" + cid
               : absl::StrCat("/system.slice/docker-", cid, ".scope");
  l.want.container_id = cid;
  l.want.runtime = "docker";
  return l;
}

Layout Podman(Reader& in, const std::string& cid) {
  Layout l;
  const std::string pod = Hex(in, 64);
  switch (in.ConsumeIntegralInRange<int>(0, 7)) {
    case 0:
      l.path = absl::StrCat("/machine.slice/libpod-", cid, ".scope");
      break;
    case 1:
      l.path = "/libpod_parent/libpod-" + cid;
      break;
    case 2:
      l.path = "/system.slice/app.service/libpod-payload-" + cid;
      break;
    case 3:
      l.path = absl::StrCat("/machine.slice/libpod-conmon-", cid, ".scope");
      return l;  // a monitor: nothing
    case 4:
      l.path = absl::StrCat("/machine.slice/machine-libpod_pod_", pod,
                            ".slice/libpod-", cid, ".scope");
      l.want.pod_uid = pod;
      break;
    case 5:
      l.path = absl::StrCat("/libpod_parent/", pod, "/libpod-", cid);
      l.want.pod_uid = pod;
      break;
    case 6:
      l.path = absl::StrCat("/libpod_parent/", pod, "/conmon");
      l.want.pod_uid = pod;
      l.want.runtime = "podman";
      return l;
    default:
      l.path = absl::StrCat("/mypods/", pod, "/libpod-", cid);
      l.want.pod_uid = pod;
      break;
  }
  l.want.container_id = cid;
  l.want.runtime = "podman";
  return l;
}

// Lines that cannot name anything: no hex run, no digits in their paths.
std::string JunkLine(Reader& in, absl::string_view hierarchy) {
  static constexpr char kAlphabet[] = "ghijklmnopqrstuvwxyz/._-";
  std::string path = "/";
  const size_t length = in.ConsumeIntegralInRange<size_t>(0, 40);
  for (size_t i = 0; i < length; ++i) {
    path.push_back(kAlphabet[in.Byte() % (sizeof(kAlphabet) - 1)]);
  }
  return absl::StrCat(hierarchy, ":", path, "\n");
}

void CheckLayout(Reader& in) {
  const std::string cid = Hex(in, in.ConsumeIntegralInRange<size_t>(32, 128));
  const int kind = in.ConsumeIntegralInRange<int>(0, 3);
  // "/.." components of a cgroup namespace (kubelet's layouts only).
  const bool hidden = kind < 2 && in.ConsumeIntegralInRange<int>(0, 3) == 0;
  Layout l;
  switch (kind) {
    case 0:
      l = KubeCgroupfs(in, hidden, cid);
      break;
    case 1:
      l = KubeSystemd(in, hidden, cid);
      break;
    case 2:
      l = Docker(in, cid);
      break;
    default:
      l = Podman(in, cid);
      break;
  }
  if (!hidden) {
    switch (in.ConsumeIntegralInRange<int>(0, 4)) {
      case 1:  // a kind node: the pod's own identity wins over the node's
        l.path = absl::StrCat("/docker/", Hex(in, 64), l.path);
        break;
      case 2:
        l.path = "/some/parent.slice" + l.path;
        break;
      case 3:
        l.path =
            "/user.slice/user-1000.slice/user@1000.service/user.slice" + l.path;
        if (!l.want.empty()) l.want.delegated = true;
        break;
      default:
        break;
    }
  }
  if (in.ConsumeBool()) l.path = absl::StrReplaceAll(l.path, {{"/", "//"}});

  // The file around it.
  std::string text;
  const int junk_before = in.ConsumeIntegralInRange<int>(0, 3);
  for (int i = 0; i < junk_before; ++i) {
    text += JunkLine(in, in.PickValueInArray<absl::string_view>(
                             {"5:devices:", "3:cpu,cpuacct:", "12:pids:"}));
  }
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0:  // cgroup v2 only
      text += absl::StrCat("0::", l.path, "\n");
      break;
    case 1:  // hybrid: v2 names nothing, the memory line does
      text += absl::StrCat("4:memory:", l.path, "\n0::/\n");
      break;
    case 2: {  // a lower-ranked line names another pod first
      const std::string other = absl::StrCat(
          "1:cpu:/kubepods/pod", Hex(in, 8), "-", Hex(in, 4), "-", Hex(in, 4),
          "-", Hex(in, 4), "-", Hex(in, 12), "/", Hex(in, 64), "\n");
      text += other + absl::StrCat("9:name=systemd:", l.path, "\n");
      if (l.want.empty()) {
        // Then the other line is the only one that names something.
        CheckText(text);
        return;
      }
      break;
    }
    default:
      text += absl::StrCat("0::", l.path, "\n4:memory:/\n");
      break;
  }
  const int junk_after = in.ConsumeIntegralInRange<int>(0, 3);
  for (int i = 0; i < junk_after; ++i) text += JunkLine(in, "7:freezer:");
  const CgroupIdentity got = ParseProcCgroup(text);
  FUZZ_CHECK(got == l.want, "text:\n", text, "got  ", Describe(got), "\nwant ",
             Describe(l.want));
  CheckText(text);
}

}  // namespace
}  // namespace mrd::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mrd::fuzz;  // NOLINT(build/namespaces)
  if (size > 0 && data[0] >= '0' && data[0] <= '9') {
    CheckText(absl::string_view(reinterpret_cast<const char*>(data), size));
    return 0;
  }
  Reader in(size > 0 ? data + 1 : data, size > 0 ? size - 1 : 0);
  CheckLayout(in);
  return 0;
}
