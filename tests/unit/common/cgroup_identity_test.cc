// server/common/cgroup_identity.h: the pod, container and runtime that the
// cgroup paths of kubelet (both drivers), containerd, CRI-O, Docker and
// podman name, wherever the kubepods root sits and under cgroup namespaces;
// which /proc/<pid>/cgroup line wins; garbage gives nothing; tenant keys; and
// against the real kernel (as root), a peer moved into kubelet-shaped cgroups
// (v1 memory, v2) is named by ReadPeerCgroup (pidfd and start-time paths)
// until it is reaped, after which the read fails, also when its pid is taken
// at once by a process in another pod (clone3's set_tid); a peer in another
// pid namespace is refused with the hostPID advice.
#include "server/common/cgroup_identity.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "mrd/status.h"
#include "mrd/unique_fd.h"

namespace mrd {
namespace {

constexpr absl::string_view kUid = "17b563e5-7f7d-46e7-a68d-ac3d7163f2e3";
constexpr absl::string_view kUid2 = "400e85be-eaf3-4dcb-8952-5d1fe8407f43";
constexpr absl::string_view kCid =
    "f01befbf769383a8981d66ca62e78af477d69186d67e47007094d76090fc0f4d";
constexpr absl::string_view kCid2 =
    "d3f5b59e350dbf4c63c8502f8def201ddc2d2b99d006464860cab986d916ed1d";
constexpr absl::string_view kPodmanPod =
    "2c2514fb2473a32acd2f656f6308aa4e62ab505fdec1fbb5c5490eabc4913556";
constexpr absl::string_view kStaticPod = "45c3bf9073fad081fc4701256e59b5e4";
static_assert(kCid.size() == 64 && kCid2.size() == 64 &&
              kPodmanPod.size() == 64 && kStaticPod.size() == 32);

std::string Underscored(absl::string_view uid) {
  return absl::StrReplaceAll(uid, {{"-", "_"}});
}

CgroupIdentity Want(absl::string_view pod, absl::string_view container,
                    absl::string_view runtime, absl::string_view qos,
                    bool kubernetes, bool delegated = false) {
  CgroupIdentity id;
  id.pod_uid = std::string(pod);
  id.container_id = std::string(container);
  id.runtime = std::string(runtime);
  id.qos = std::string(qos);
  id.kubernetes = kubernetes;
  id.delegated = delegated;
  return id;
}

// Parses `path` as the only line of a v2 /proc/<pid>/cgroup.
CgroupIdentity ParseV2(absl::string_view path) {
  return ParseProcCgroup(absl::StrCat("0::", path, "\n"));
}

#define EXPECT_IDENTITY(actual, expected)                             \
  EXPECT_EQ((actual), (expected)) << "got " << (actual).DebugString() \
                                  << "\nwant " << (expected).DebugString()

// --- kubelet, cgroupfs driver ---

TEST(ParseProcCgroupTest, CgroupfsGuaranteedPodWithContainerdContainer) {
  EXPECT_IDENTITY(ParseV2(absl::StrCat("/kubepods/pod", kUid, "/", kCid)),
                  Want(kUid, kCid, "", "guaranteed", true));
}

TEST(ParseProcCgroupTest, CgroupfsBurstableOnAV1Line) {
  EXPECT_IDENTITY(
      ParseProcCgroup(absl::StrCat("4:memory:/kubepods/burstable/pod", kUid,
                                   "/", kCid, "\n")),
      Want(kUid, kCid, "", "burstable", true));
}

TEST(ParseProcCgroupTest, CgroupfsBestEffortCrioContainer) {
  EXPECT_IDENTITY(
      ParseV2(absl::StrCat("/kubepods/besteffort/pod", kUid, "/crio-", kCid)),
      Want(kUid, kCid, "crio", "besteffort", true));
}

TEST(ParseProcCgroupTest, CgroupfsCrioMonitorNamesThePodButNoContainer) {
  EXPECT_IDENTITY(ParseV2(absl::StrCat("/kubepods/besteffort/pod", kUid,
                                       "/crio-conmon-", kCid)),
                  Want(kUid, "", "", "besteffort", true));
}

TEST(ParseProcCgroupTest, ProcessInThePodCgroupItselfHasNoContainer) {
  EXPECT_IDENTITY(ParseV2(absl::StrCat("/kubepods/burstable/pod", kUid)),
                  Want(kUid, "", "", "burstable", true));
}

TEST(ParseProcCgroupTest, StaticPodUidOfThirtyTwoHexDigits) {
  EXPECT_IDENTITY(
      ParseV2(absl::StrCat("/kubepods/burstable/pod", kStaticPod, "/", kCid)),
      Want(kStaticPod, kCid, "", "burstable", true));
}

TEST(ParseProcCgroupTest, UpperCaseUidIsReportedInLowerCase) {
  EXPECT_IDENTITY(ParseV2(absl::StrCat("/kubepods/pod",
                                       absl::AsciiStrToUpper(kUid), "/", kCid)),
                  Want(kUid, kCid, "", "guaranteed", true));
}

// --- kubelet, systemd driver ---

std::string SystemdPod(absl::string_view qos, absl::string_view uid,
                       absl::string_view root = "kubepods") {
  if (qos.empty()) {
    return absl::StrCat("/", root, ".slice/", root, "-pod", Underscored(uid),
                        ".slice");
  }
  return absl::StrCat("/", root, ".slice/", root, "-", qos, ".slice/", root,
                      "-", qos, "-pod", Underscored(uid), ".slice");
}

TEST(ParseProcCgroupTest, SystemdBurstableContainerdScope) {
  EXPECT_IDENTITY(ParseV2(absl::StrCat(SystemdPod("burstable", kUid),
                                       "/cri-containerd-", kCid, ".scope")),
                  Want(kUid, kCid, "containerd", "burstable", true));
}

TEST(ParseProcCgroupTest, SystemdBestEffortCrioScope) {
  EXPECT_IDENTITY(ParseV2(absl::StrCat(SystemdPod("besteffort", kUid), "/crio-",
                                       kCid, ".scope")),
                  Want(kUid, kCid, "crio", "besteffort", true));
}

TEST(ParseProcCgroupTest, SystemdCrioScopeWithCrunsContainerChild) {
  // crun puts the payload in a "container" child of the scope.
  EXPECT_IDENTITY(ParseV2(absl::StrCat(SystemdPod("besteffort", kUid), "/crio-",
                                       kCid, ".scope/container")),
                  Want(kUid, kCid, "crio", "besteffort", true));
}

TEST(ParseProcCgroupTest, SystemdCriDockerdScope) {
  EXPECT_IDENTITY(ParseV2(absl::StrCat(SystemdPod("burstable", kUid),
                                       "/docker-", kCid, ".scope")),
                  Want(kUid, kCid, "docker", "burstable", true));
}

TEST(ParseProcCgroupTest, SystemdCrioMonitorScopeIsNotTheContainer) {
  EXPECT_IDENTITY(ParseV2(absl::StrCat(SystemdPod("burstable", kUid),
                                       "/crio-conmon-", kCid, ".scope")),
                  Want(kUid, "", "", "burstable", true));
}

TEST(ParseProcCgroupTest, SystemdGuaranteedPodRightUnderKubepodsSlice) {
  EXPECT_IDENTITY(ParseV2(absl::StrCat(SystemdPod("", kUid), "/cri-containerd-",
                                       kCid, ".scope")),
                  Want(kUid, kCid, "containerd", "guaranteed", true));
}

TEST(ParseProcCgroupTest, SystemdStaticPod) {
  EXPECT_IDENTITY(ParseV2(absl::StrCat(SystemdPod("burstable", kStaticPod),
                                       "/cri-containerd-", kCid, ".scope")),
                  Want(kStaticPod, kCid, "containerd", "burstable", true));
}

// --- the kubepods root somewhere else ---

TEST(ParseProcCgroupTest, KindNodeWithKubeletCgroupRoot) {
  // kind runs kubelet with --cgroup-root=/kubelet and the systemd driver.
  const std::string path = absl::StrCat(
      "/kubelet.slice/kubelet-kubepods.slice/"
      "kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod",
      Underscored(kUid), ".slice/cri-containerd-", kCid, ".scope");
  EXPECT_IDENTITY(ParseV2(path),
                  Want(kUid, kCid, "containerd", "besteffort", true));
}

TEST(ParseProcCgroupTest, KubepodsInsideADockerContainerCgroup) {
  // A k3d / kind node is a docker container; the pod inside it wins and the
  // node's container is not the pod's.
  EXPECT_IDENTITY(
      ParseV2(absl::StrCat("/docker/", kCid2, "/kubepods/burstable/pod", kUid,
                           "/", kCid)),
      Want(kUid, kCid, "", "burstable", true));
  EXPECT_IDENTITY(ParseV2(absl::StrCat("/docker/", kCid2,
                                       "/kubepods/besteffort/pod", kUid)),
                  Want(kUid, "", "", "besteffort", true));
}

TEST(ParseProcCgroupTest, InnermostPodWins) {
  EXPECT_IDENTITY(
      ParseV2(absl::StrCat("/kubepods/pod", kUid2, "/", kCid2,
                           "/kubepods/besteffort/pod", kUid, "/", kCid)),
      Want(kUid, kCid, "", "besteffort", true));
}

// --- cgroup namespaces: paths relative to the reader's own cgroup ---

TEST(ParseProcCgroupTest, NamespacedPathOfAPodInAnotherQosClass) {
  EXPECT_IDENTITY(
      ParseV2(absl::StrCat("/../../../besteffort/pod", kUid, "/", kCid)),
      Want(kUid, kCid, "", "besteffort", true));
}

TEST(ParseProcCgroupTest, NamespacedPathHidingTheQosParent) {
  EXPECT_IDENTITY(ParseV2(absl::StrCat("/../../../pod", kUid, "/", kCid)),
                  Want(kUid, kCid, "", "", true));
}

TEST(ParseProcCgroupTest, NamespacedSystemdPathStillNamesTheQos) {
  EXPECT_IDENTITY(
      ParseV2(absl::StrCat("/../../../kubepods-burstable.slice/"
                           "kubepods-burstable-pod",
                           Underscored(kUid), ".slice/cri-containerd-", kCid,
                           ".scope")),
      Want(kUid, kCid, "containerd", "burstable", true));
}

TEST(ParseProcCgroupTest, NamespacedSiblingContainerOfTheReader) {
  EXPECT_IDENTITY(ParseV2(absl::StrCat("/../", kCid)),
                  Want("", kCid, "", "", false));
}

// --- Docker and podman outside Kubernetes ---

TEST(ParseProcCgroupTest, DockerCgroupfs) {
  EXPECT_IDENTITY(ParseProcCgroup(absl::StrCat("12:pids:/docker/", kCid, "\n")),
                  Want("", kCid, "docker", "", false));
}

TEST(ParseProcCgroupTest, DockerSystemd) {
  EXPECT_IDENTITY(
      ParseV2(absl::StrCat("/system.slice/docker-", kCid, ".scope")),
      Want("", kCid, "docker", "", false));
}

TEST(ParseProcCgroupTest, PodmanSystemd) {
  EXPECT_IDENTITY(
      ParseV2(absl::StrCat("/machine.slice/libpod-", kCid, ".scope")),
      Want("", kCid, "podman", "", false));
}

TEST(ParseProcCgroupTest, PodmanCgroupfs) {
  EXPECT_IDENTITY(ParseV2(absl::StrCat("/libpod_parent/libpod-", kCid)),
                  Want("", kCid, "podman", "", false));
}

TEST(ParseProcCgroupTest, PodmanRootlessIsDelegated) {
  EXPECT_IDENTITY(
      ParseV2(absl::StrCat("/user.slice/user-1000.slice/user@1000.service/"
                           "user.slice/libpod-",
                           kCid, ".scope")),
      Want("", kCid, "podman", "", false, /*delegated=*/true));
}

TEST(ParseProcCgroupTest, PodmanSplitModePayload) {
  EXPECT_IDENTITY(ParseV2(absl::StrCat("/system.slice/app.service/"
                                       "libpod-payload-",
                                       kCid)),
                  Want("", kCid, "podman", "", false));
}

TEST(ParseProcCgroupTest, PodmanMonitorScopeIsNotAContainer) {
  EXPECT_IDENTITY(
      ParseV2(absl::StrCat("/machine.slice/libpod-conmon-", kCid, ".scope")),
      CgroupIdentity());
}

TEST(ParseProcCgroupTest, PodmanPodSystemd) {
  EXPECT_IDENTITY(
      ParseV2(absl::StrCat("/machine.slice/machine-libpod_pod_", kPodmanPod,
                           ".slice/libpod-", kCid, ".scope")),
      Want(kPodmanPod, kCid, "podman", "", false));
}

TEST(ParseProcCgroupTest, PodmanPodSystemdRootless) {
  EXPECT_IDENTITY(
      ParseV2(absl::StrCat("/user.slice/user-1000.slice/user@1000.service/"
                           "user.slice/user-libpod_pod_",
                           kPodmanPod, ".slice/libpod-", kCid, ".scope")),
      Want(kPodmanPod, kCid, "podman", "", false, /*delegated=*/true));
}

TEST(ParseProcCgroupTest, PodmanPodCgroupfs) {
  EXPECT_IDENTITY(
      ParseV2(absl::StrCat("/libpod_parent/", kPodmanPod, "/libpod-", kCid)),
      Want(kPodmanPod, kCid, "podman", "", false));
  // Its monitor.
  EXPECT_IDENTITY(
      ParseV2(absl::StrCat("/libpod_parent/", kPodmanPod, "/conmon")),
      Want(kPodmanPod, "", "podman", "", false));
  // Under another --cgroup-parent.
  EXPECT_IDENTITY(
      ParseV2(absl::StrCat("/mypods/", kPodmanPod, "/libpod-", kCid)),
      Want(kPodmanPod, kCid, "podman", "", false));
}

TEST(ParseProcCgroupTest, NoContainer) {
  EXPECT_IDENTITY(ParseProcCgroup("0::/user.slice/user-1000.slice/"
                                  "session-3.scope\n"),
                  CgroupIdentity());
  EXPECT_IDENTITY(ParseProcCgroup("0::/\n"), CgroupIdentity());
  EXPECT_IDENTITY(ParseProcCgroup("0::/system.slice/containerd.service\n"),
                  CgroupIdentity());
  // A bare id with nothing around it saying what it is.
  EXPECT_IDENTITY(ParseV2(absl::StrCat("/system.slice/", kCid)),
                  CgroupIdentity());
}

// --- which line wins ---

TEST(ParseProcCgroupTest, V1LineNamesThePodWhenTheV2LineDoesNot) {
  // Laid out as on a hybrid machine.
  const std::string text = absl::StrCat(
      "9:name=systemd:/\n8:pids:/\n4:memory:/kubepods/besteffort/pod", kUid,
      "/", kCid, "\n1:cpu:/\n0::/\n");
  EXPECT_IDENTITY(ParseProcCgroup(text),
                  Want(kUid, kCid, "", "besteffort", true));
}

TEST(ParseProcCgroupTest, V2LineWinsOverDisagreeingV1Lines) {
  const std::string text =
      absl::StrCat("4:memory:/kubepods/besteffort/pod", kUid2, "/", kCid2,
                   "\n0::", SystemdPod("burstable", kUid), "/cri-containerd-",
                   kCid, ".scope\n");
  EXPECT_IDENTITY(ParseProcCgroup(text),
                  Want(kUid, kCid, "containerd", "burstable", true));
}

TEST(ParseProcCgroupTest, V1LinesWinInTheFixedOrderNotInFileOrder) {
  const std::string text = absl::StrCat(
      "3:cpu,cpuacct:/kubepods/pod", kUid2, "/", kCid2,
      "\n4:memory:/kubepods/burstable/pod", kUid2, "/", kCid2,
      "\n9:name=systemd:/kubepods/besteffort/pod", kUid, "/", kCid, "\n0::/\n");
  EXPECT_IDENTITY(ParseProcCgroup(text),
                  Want(kUid, kCid, "", "besteffort", true));
  const std::string without_systemd =
      absl::StrCat("3:cpu,cpuacct:/kubepods/pod", kUid2, "/", kCid2,
                   "\n4:memory:/kubepods/burstable/pod", kUid, "/", kCid, "\n");
  EXPECT_IDENTITY(ParseProcCgroup(without_systemd),
                  Want(kUid, kCid, "", "burstable", true));
}

TEST(ParseProcCgroupTest, UnknownHierarchiesWinInFileOrder) {
  const std::string text =
      absl::StrCat("7:name=other:/kubepods/pod", kUid, "/", kCid,
                   "\n8:name=more:/kubepods/pod", kUid2, "/", kCid2, "\n");
  EXPECT_IDENTITY(ParseProcCgroup(text),
                  Want(kUid, kCid, "", "guaranteed", true));
}

TEST(ParseProcCgroupTest, AV2LineNamingNothingLetsV1Speak) {
  const std::string text =
      absl::StrCat("0::/garbage\n6:memory:/docker/", kCid, "\n");
  EXPECT_IDENTITY(ParseProcCgroup(text), Want("", kCid, "docker", "", false));
}

// --- garbage ---

TEST(ParseProcCgroupTest, GarbageGivesAnEmptyIdentity) {
  constexpr char kNuls[] = "\0\0\0:\0:\0/\0";
  const std::string nuls(kNuls, sizeof(kNuls));
  for (absl::string_view text : std::vector<absl::string_view>{
           "", "\n", "garbage", "0", "0:", "::", "0::", "0::relative/path",
           nuls, "\xff\xfe\xfd:\x80::/\xc0\xc1"}) {
    EXPECT_IDENTITY(ParseProcCgroup(text), CgroupIdentity())
        << absl::CHexEscape(text);
  }
}

TEST(ParseProcCgroupTest, LinesWithMissingOrBadFieldsAreSkipped) {
  const std::string good =
      absl::StrCat("/kubepods/besteffort/pod", kUid, "/", kCid);
  // One colon only; no hierarchy id; a hierarchy id that is no number.
  EXPECT_IDENTITY(ParseProcCgroup(absl::StrCat("0:", good, "\n")),
                  CgroupIdentity());
  EXPECT_IDENTITY(ParseProcCgroup(absl::StrCat("::", good, "\n")),
                  CgroupIdentity());
  EXPECT_IDENTITY(ParseProcCgroup(absl::StrCat("x::", good, "\n")),
                  CgroupIdentity());
  EXPECT_IDENTITY(ParseProcCgroup(absl::StrCat("12345678901::", good, "\n")),
                  CgroupIdentity());
  // A bad line does not hide a good one after it.
  EXPECT_IDENTITY(
      ParseProcCgroup(absl::StrCat("x::", good, "\n4:memory:", good, "\n")),
      Want(kUid, kCid, "", "besteffort", true));
}

TEST(ParseProcCgroupTest, CarriageReturnsAndRepeatedSlashesAreTolerated) {
  EXPECT_IDENTITY(
      ParseProcCgroup(absl::StrCat("0:://kubepods///besteffort//pod", kUid,
                                   "//", kCid, "//\r\n")),
      Want(kUid, kCid, "", "besteffort", true));
  // No newline at the end.
  EXPECT_IDENTITY(
      ParseProcCgroup(absl::StrCat("0::/kubepods/besteffort/pod", kUid)),
      Want(kUid, "", "", "besteffort", true));
}

TEST(ParseProcCgroupTest, NulsAndColonsInsideAPath) {
  std::string nul_in_id = absl::StrCat("0::/kubepods/pod", kUid, "/", kCid);
  nul_in_id[nul_in_id.size() - 3] = '\0';
  EXPECT_IDENTITY(ParseProcCgroup(nul_in_id),
                  Want(kUid, "", "", "guaranteed", true));
  // Only the first two colons separate fields.
  EXPECT_IDENTITY(
      ParseProcCgroup(absl::StrCat("0::/a:b/kubepods/pod", kUid, "/", kCid)),
      Want(kUid, kCid, "", "guaranteed", true));
}

TEST(ParseProcCgroupTest, PodUidMustBeExactlyAUuid) {
  const std::vector<std::string> bad = {
      "17b563e57f7d-46e7-a68d-ac3d7163f2e3",    // a group missing its dash
      "17b563e5-7f7d-46e7-a68d-ac3d7163f2e",    // short
      "17b563e5-7f7d-46e7-a68d-ac3d7163f2e3a",  // long
      "17b563e5-7f7d-46e7-a68d_ac3d7163f2e3",   // '_' in the cgroupfs form
      "17b563e5-7f7d-46e7-a68g-ac3d7163f2e3",   // not hex
      "17b563e5-7f7d46-e7-a68d-ac3d7163f2e3",   // dashes misplaced
      "",
  };
  for (const std::string& uid : bad) {
    EXPECT_TRUE(ParseV2(absl::StrCat("/kubepods/pod", uid)).empty()) << uid;
  }
  // The systemd form wants '_' everywhere.
  EXPECT_TRUE(ParseV2(absl::StrCat("/kubepods.slice/kubepods-pod17b563e5_7f7d_"
                                   "46e7_a68d_ac3d7163f2e3x.slice"))
                  .empty());
  EXPECT_TRUE(ParseV2("/kubepods.slice/kubepods-pod.slice").empty());
  // A pod slice outside any kubepods slice name is not kubelet's.
  EXPECT_TRUE(ParseV2(absl::StrCat("/other.slice/other-burstable-pod",
                                   Underscored(kUid), ".slice"))
                  .empty());
}

TEST(ParseProcCgroupTest, ContainerIdsMustBeSaneHex) {
  const std::string pod = absl::StrCat("/kubepods/pod", kUid, "/");
  EXPECT_EQ(ParseV2(pod + std::string(31, 'a')).container_id, "");
  EXPECT_EQ(ParseV2(pod + std::string(32, 'a')).container_id,
            std::string(32, 'a'));
  EXPECT_EQ(ParseV2(pod + std::string(128, 'b')).container_id,
            std::string(128, 'b'));
  EXPECT_EQ(ParseV2(pod + std::string(129, 'b')).container_id, "");
  EXPECT_EQ(ParseV2(pod + absl::AsciiStrToUpper(kCid)).container_id, "");
  EXPECT_EQ(ParseV2(absl::StrCat(pod, "crio-", kCid, "x")).container_id, "");
  EXPECT_EQ(ParseV2(absl::StrCat(pod, "cri-containerd-.scope")).container_id,
            "");
}

TEST(ParseProcCgroupTest, PathsTheKernelNeverWritesGiveNothing) {
  // ".." after a name, ".", and relative paths.
  EXPECT_TRUE(
      ParseV2(absl::StrCat("/kubepods/pod", kUid, "/../", kCid)).empty());
  EXPECT_TRUE(ParseV2(absl::StrCat("/kubepods/./pod", kUid)).empty());
  EXPECT_TRUE(ParseProcCgroup(absl::StrCat("0::kubepods/pod", kUid)).empty());
}

TEST(ParseProcCgroupTest, OnlyTheFirst64KiBCount) {
  const std::string good =
      absl::StrCat("4:memory:/kubepods/besteffort/pod", kUid, "/", kCid, "\n");
  // Lines of junk before a good line; the good line is found while it lies
  // within the cap.
  std::string junk;
  while (junk.size() + good.size() < kMaxProcCgroupBytes) {
    junk += "5:devices:/system.slice/some.service\n";
  }
  junk.resize(junk.rfind('\n', kMaxProcCgroupBytes - good.size() - 1) + 1);
  EXPECT_IDENTITY(ParseProcCgroup(junk + good),
                  Want(kUid, kCid, "", "besteffort", true));
  // Cut by the cap: ignored, even though its first part would be valid.
  std::string cut = junk;
  cut.append(kMaxProcCgroupBytes - cut.size() - good.size() + 10, 'x');
  cut += "\n";
  EXPECT_IDENTITY(ParseProcCgroup(cut + good + std::string(1 << 20, 'y')),
                  CgroupIdentity());
  // A huge single line.
  std::string huge = "0::";
  while (huge.size() < (2u << 20)) huge += "/a";
  EXPECT_TRUE(
      ParseProcCgroup(absl::StrCat(huge, "/kubepods/pod", kUid)).empty());
}

TEST(ParseProcCgroupTest, ALongPathWithinTheCapIsWalkedToTheEnd) {
  std::string path = "0::";
  while (path.size() < kMaxProcCgroupBytes - 200) path += "/ab";
  path += absl::StrCat("/kubepods/pod", kUid, "/", kCid, "\n");
  EXPECT_IDENTITY(ParseProcCgroup(path),
                  Want(kUid, kCid, "", "guaranteed", true));
}

// --- tenant keys ---

TEST(TenantKeyTest, ParsesKindNames) {
  EXPECT_EQ(*ParseTenantKeyKind("pod"), TenantKeyKind::kPod);
  EXPECT_EQ(*ParseTenantKeyKind("container"), TenantKeyKind::kContainer);
  EXPECT_EQ(*ParseTenantKeyKind("uid"), TenantKeyKind::kUid);
  for (absl::string_view bad : {"", "Pod", "pods", "uid ", "gid"}) {
    const absl::StatusOr<TenantKeyKind> kind = ParseTenantKeyKind(bad);
    ASSERT_FALSE(kind.ok()) << bad;
    EXPECT_EQ(kind.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(GetErrorDetail(kind.status()).reason(), "BAD_TENANT_KEY_KIND");
  }
  for (TenantKeyKind kind :
       {TenantKeyKind::kPod, TenantKeyKind::kContainer, TenantKeyKind::kUid}) {
    EXPECT_EQ(*ParseTenantKeyKind(TenantKeyKindName(kind)), kind);
  }
}

TEST(TenantKeyTest, KeysFallBackFromPodToContainerToUid) {
  const CgroupIdentity both = Want(kUid, kCid, "containerd", "", true);
  const CgroupIdentity container_only = Want("", kCid, "docker", "", false);
  const CgroupIdentity pod_only = Want(kUid, "", "", "burstable", true);
  const CgroupIdentity none;
  const std::string pod = absl::StrCat("pod:", kUid);
  const std::string container = absl::StrCat("container:", kCid);

  EXPECT_EQ(TenantKeyFor(both, TenantKeyKind::kPod, 1000), pod);
  EXPECT_EQ(TenantKeyFor(container_only, TenantKeyKind::kPod, 1000), container);
  EXPECT_EQ(TenantKeyFor(pod_only, TenantKeyKind::kPod, 1000), pod);
  EXPECT_EQ(TenantKeyFor(none, TenantKeyKind::kPod, 1000), "uid:1000");

  EXPECT_EQ(TenantKeyFor(both, TenantKeyKind::kContainer, 7), container);
  EXPECT_EQ(TenantKeyFor(container_only, TenantKeyKind::kContainer, 7),
            container);
  EXPECT_EQ(TenantKeyFor(pod_only, TenantKeyKind::kContainer, 7), pod);
  EXPECT_EQ(TenantKeyFor(none, TenantKeyKind::kContainer, 7), "uid:7");

  EXPECT_EQ(TenantKeyFor(both, TenantKeyKind::kUid, 0), "uid:0");
  EXPECT_EQ(TenantKeyFor(none, TenantKeyKind::kUid, 4294967295u),
            "uid:4294967295");
}

// --- /proc/<pid>/stat ---

std::string StatLine(absl::string_view comm, uint64_t start) {
  // Fields 3..21, then starttime (22), then a few more.
  return absl::StrCat("4242 (", comm,
                      ") S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 "
                      "0 ",
                      start, " 1000 200 18446744073709551615 1 1 0 0 0 0\n");
}

TEST(StatStartTimeTest, ReadsField22) {
  EXPECT_EQ(cgroup_internal::ParseStatStartTime(StatLine("sleep", 123456)),
            123456u);
}

TEST(StatStartTimeTest, CommandNamesWithSpacesAndParentheses) {
  EXPECT_EQ(cgroup_internal::ParseStatStartTime(StatLine("a) (b c", 77)), 77u);
  EXPECT_EQ(cgroup_internal::ParseStatStartTime(StatLine(") 1 2 3 4 5", 78)),
            78u);
  EXPECT_EQ(cgroup_internal::ParseStatStartTime(StatLine("", 79)), 79u);
}

TEST(StatStartTimeTest, MalformedTextIsRefused) {
  for (const std::string& bad :
       {std::string(""), std::string("4242 sleep S 1"),
        std::string("4242 (sleep) S 1 2 3"), std::string(")("),
        absl::StrReplaceAll(StatLine("x", 5), {{" 0 5 ", " 0 +5 "}}),
        absl::StrReplaceAll(StatLine("x", 5), {{" 0 5 ", " 0 x "}}),
        absl::StrReplaceAll(StatLine("x", 5), {{") S", ")  S"}})}) {
    EXPECT_FALSE(cgroup_internal::ParseStatStartTime(bad).has_value()) << bad;
  }
}

// --- the read path against a directory standing in for /proc ---

class FakeProcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/mrd-fakeproc-XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    root_ = dir;
    ASSERT_EQ(::mkdir((root_ + "/4242").c_str(), 0755), 0);
  }
  void TearDown() override {
    ::unlink((root_ + "/4242/stat").c_str());
    ::unlink((root_ + "/4242/cgroup").c_str());
    ::rmdir((root_ + "/4242").c_str());
    ::rmdir(root_.c_str());
  }
  void Write(absl::string_view name, absl::string_view text) {
    std::ofstream out(absl::StrCat(root_, "/4242/", name), std::ios::binary);
    out << text;
  }
  std::string root_;
};

TEST_F(FakeProcTest, ReadsAndParsesTheCgroupFile) {
  Write("stat", StatLine("client", 100));
  Write("cgroup",
        absl::StrCat("0::/kubepods/besteffort/pod", kUid, "/", kCid, "\n"));
  const absl::StatusOr<CgroupIdentity> id =
      cgroup_internal::ReadPidCgroupSince(4242, root_, 100);
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_IDENTITY(*id, Want(kUid, kCid, "", "besteffort", true));
}

TEST_F(FakeProcTest, OversizedCgroupFileIsCutAtTheCap) {
  Write("stat", StatLine("client", 100));
  std::string text;
  while (text.size() < 3 * kMaxProcCgroupBytes) text += "5:devices:/a/b\n";
  Write("cgroup", text + absl::StrCat("0::/kubepods/pod", kUid, "\n"));
  const absl::StatusOr<CgroupIdentity> id =
      cgroup_internal::ReadPidCgroupSince(4242, root_, 100);
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_TRUE(id->empty());
}

TEST_F(FakeProcTest, MalformedStatIsAnInternalError) {
  Write("stat", "4242 no parentheses here");
  Write("cgroup", "0::/\n");
  const absl::StatusOr<CgroupIdentity> id =
      cgroup_internal::ReadPidCgroupSince(4242, root_, 100);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(GetErrorDetail(id.status()).reason(), "PROC_STAT_MALFORMED");
}

TEST_F(FakeProcTest, MissingProcessIsGone) {
  const absl::StatusOr<CgroupIdentity> id =
      cgroup_internal::ReadPidCgroupSince(4243, root_, 100);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(GetErrorDetail(id.status()).reason(), "PEER_GONE");
}

// --- the real kernel ---

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream out;
  out << in.rdbuf();
  return out.str();
}

// This process's cgroup path in the hierarchy whose /proc/self/cgroup line
// has `controllers` ("" for v2); nullopt if there is none.
std::optional<std::string> OwnCgroup(absl::string_view controllers) {
  for (absl::string_view line :
       absl::StrSplit(ReadFile("/proc/self/cgroup"), '\n')) {
    std::vector<absl::string_view> f =
        absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    if (controllers.empty() ? (f[0] == "0" && f[1].empty())
                            : f[1] == controllers) {
      return std::string(f[2]);
    }
  }
  return std::nullopt;
}

bool IsFs(const std::string& path, int64_t magic) {
  struct statfs st;
  return ::statfs(path.c_str(), &st) == 0 &&
         static_cast<int64_t>(st.f_type) == magic;
}

// A chain of cgroup directories, removed (innermost first) when destroyed.
class CgroupTree {
 public:
  CgroupTree() = default;
  CgroupTree(const CgroupTree&) = delete;
  CgroupTree& operator=(const CgroupTree&) = delete;
  ~CgroupTree() {
    for (auto it = dirs_.rbegin(); it != dirs_.rend(); ++it) {
      if (::rmdir(it->c_str()) != 0) {
        ADD_FAILURE() << "rmdir " << *it << ": " << std::strerror(errno);
      }
    }
  }
  // Creates `base`/`relative` one directory at a time; false on failure.
  bool Create(const std::string& base, absl::string_view relative) {
    std::string path = base;
    for (absl::string_view part :
         absl::StrSplit(relative, '/', absl::SkipEmpty())) {
      path = absl::StrCat(path, "/", part);
      if (::mkdir(path.c_str(), 0755) != 0) return false;
      dirs_.push_back(path);
    }
    return true;
  }
  const std::string& leaf() const { return dirs_.back(); }
  bool Move(pid_t pid) const {
    std::ofstream procs(leaf() + "/cgroup.procs");
    procs << pid << std::flush;
    return static_cast<bool>(procs);
  }

 private:
  std::vector<std::string> dirs_;
};

// A child process connected to us over a Unix stream socket; it waits until
// told to exit. Killed and reaped on destruction if still there.
class ConnectedChild {
 public:
  ConnectedChild() = default;
  ConnectedChild(const ConnectedChild&) = delete;
  ConnectedChild& operator=(const ConnectedChild&) = delete;
  ~ConnectedChild() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

  // Forks the child; `conn` is our end of its connection.
  ::testing::AssertionResult Start() {
    UniqueFd listener(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!listener.valid()) return ::testing::AssertionFailure() << "socket";
    struct sockaddr_un addr;
    std::memset(&addr, 0, sizeof(addr));
    addr.sun_family = AF_UNIX;
    // An abstract address: nothing to clean up in the file system.
    const std::string name = absl::StrCat("mrd-cgroup-test-", ::getpid(), "-",
                                          reinterpret_cast<uintptr_t>(this));
    std::memcpy(addr.sun_path + 1, name.data(), name.size());
    const socklen_t len = static_cast<socklen_t>(
        offsetof(sockaddr_un, sun_path) + 1 + name.size());
    if (::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
        ::listen(listener.get(), 1) != 0) {
      return ::testing::AssertionFailure()
             << "bind/listen: " << std::strerror(errno);
    }
    int control[2];
    if (::pipe2(control, O_CLOEXEC) != 0) {
      return ::testing::AssertionFailure() << "pipe";
    }
    UniqueFd control_read(control[0]);
    control_.Reset(control[1]);
    pid_ = ::fork();
    if (pid_ < 0) return ::testing::AssertionFailure() << "fork";
    if (pid_ == 0) {
      ::close(control[1]);  // or the pipe never reads as closed
      const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
      if (s < 0 || ::connect(s, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
        ::_exit(2);
      }
      char byte;
      while (::read(control_read.get(), &byte, 1) < 0 && errno == EINTR) {
      }
      ::_exit(0);
    }
    conn_.Reset(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!conn_.valid()) return ::testing::AssertionFailure() << "accept";
    return ::testing::AssertionSuccess();
  }

  // Tells the child to exit and reaps it.
  void ExitAndReap() {
    control_.Reset();
    int status = 0;
    ASSERT_EQ(::waitpid(pid_, &status, 0), pid_);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
    pid_ = -1;
  }

  pid_t pid() const { return pid_; }
  int conn() const { return conn_.get(); }

 private:
  pid_t pid_ = -1;
  UniqueFd control_;
  UniqueFd conn_;
};

// Where this test may create cgroups: under its own cgroup of a v1 memory
// hierarchy or of the v2 hierarchy.
struct CgroupBase {
  std::string path;   // in the file system
  std::string label;  // for messages
};

std::optional<CgroupBase> V1MemoryBase() {
  const std::optional<std::string> own = OwnCgroup("memory");
  const std::string mount = "/sys/fs/cgroup/memory";
  if (!own.has_value() || !IsFs(mount, CGROUP_SUPER_MAGIC)) return std::nullopt;
  return CgroupBase{mount + (*own == "/" ? "" : *own), "v1 memory"};
}

std::optional<CgroupBase> V2Base() {
  const std::optional<std::string> own = OwnCgroup("");
  if (!own.has_value() || absl::StartsWith(*own, "/..")) return std::nullopt;
  for (const char* mount : {"/sys/fs/cgroup", "/sys/fs/cgroup/unified"}) {
    if (IsFs(mount, CGROUP2_SUPER_MAGIC)) {
      return CgroupBase{absl::StrCat(mount, *own == "/" ? "" : *own), "v2"};
    }
  }
  return std::nullopt;
}

std::string UniqueName() {
  return absl::StrCat("mrd-cgroup-test-", ::getpid());
}

class PeerCgroupTest : public ::testing::Test {
 public:
  void SetUp() override {
    if (::geteuid() != 0) {
      GTEST_SKIP() << "needs root: creating cgroups and moving a process into "
                      "them is root's";
    }
  }

  // Expects both ways of reading the peer's cgroup (pidfd, start time) and
  // the pid read to give `want`.
  static void ExpectPeerIs(const ConnectedChild& child,
                           const CgroupIdentity& want) {
    const absl::StatusOr<CgroupIdentity> by_pidfd =
        ReadPeerCgroup(child.conn());
    ASSERT_TRUE(by_pidfd.ok()) << by_pidfd.status();
    EXPECT_IDENTITY(*by_pidfd, want);
    const absl::StatusOr<CgroupIdentity> by_start_time =
        cgroup_internal::ReadPeerCgroupByCredentials(child.conn(), "/proc");
    ASSERT_TRUE(by_start_time.ok()) << by_start_time.status();
    EXPECT_IDENTITY(*by_start_time, want);
    const absl::StatusOr<CgroupIdentity> by_pid = ReadPidCgroup(child.pid());
    ASSERT_TRUE(by_pid.ok()) << by_pid.status();
    EXPECT_IDENTITY(*by_pid, want);
  }

  // After the child is reaped every read fails and names no one.
  static void ExpectGone(const ConnectedChild& child, pid_t old_pid) {
    for (const absl::StatusOr<CgroupIdentity>& read :
         {ReadPeerCgroup(child.conn()),
          cgroup_internal::ReadPeerCgroupByCredentials(child.conn(), "/proc"),
          ReadPidCgroup(old_pid)}) {
      ASSERT_FALSE(read.ok()) << read->DebugString();
      const std::string reason = GetErrorDetail(read.status()).reason();
      EXPECT_TRUE(reason == "PEER_GONE" || reason == "PEER_PID_REUSED")
          << read.status();
    }
  }
};

TEST_F(PeerCgroupTest, PeerInKubeletCgroupfsLayoutOnV1MemoryHierarchy) {
  const std::optional<CgroupBase> base = V1MemoryBase();
  if (!base.has_value()) GTEST_SKIP() << "no cgroup v1 memory hierarchy";
  CgroupTree tree;
  ASSERT_TRUE(tree.Create(
      base->path,
      absl::StrCat(UniqueName(), "/kubepods/besteffort/pod", kUid, "/", kCid)))
      << base->path << ": " << std::strerror(errno);
  ConnectedChild child;
  ASSERT_TRUE(child.Start());
  ASSERT_TRUE(tree.Move(child.pid())) << tree.leaf();
  ExpectPeerIs(child, Want(kUid, kCid, "", "besteffort", true));
  const pid_t pid = child.pid();
  child.ExitAndReap();
  ExpectGone(child, pid);
}

TEST_F(PeerCgroupTest, PeerInKubeletSystemdLayoutOnV2Hierarchy) {
  const std::optional<CgroupBase> base = V2Base();
  if (!base.has_value()) GTEST_SKIP() << "no cgroup v2 hierarchy to write";
  CgroupTree tree;
  ASSERT_TRUE(tree.Create(
      base->path, absl::StrCat(UniqueName(), SystemdPod("burstable", kUid),
                               "/cri-containerd-", kCid, ".scope")))
      << base->path << ": " << std::strerror(errno);
  ConnectedChild child;
  ASSERT_TRUE(child.Start());
  ASSERT_TRUE(tree.Move(child.pid())) << tree.leaf();
  ExpectPeerIs(child, Want(kUid, kCid, "containerd", "burstable", true));
  const pid_t pid = child.pid();
  child.ExitAndReap();
  ExpectGone(child, pid);
}

TEST_F(PeerCgroupTest, V2LineWinsWhenBothHierarchiesNameAPod) {
  const std::optional<CgroupBase> v1 = V1MemoryBase();
  const std::optional<CgroupBase> v2 = V2Base();
  if (!v1.has_value() || !v2.has_value()) {
    GTEST_SKIP() << "needs both a v1 memory and a v2 hierarchy (hybrid)";
  }
  CgroupTree v1_tree;
  ASSERT_TRUE(v1_tree.Create(
      v1->path,
      absl::StrCat(UniqueName(), "/kubepods/pod", kUid2, "/", kCid2)));
  CgroupTree v2_tree;
  ASSERT_TRUE(v2_tree.Create(
      v2->path, absl::StrCat(UniqueName(), SystemdPod("besteffort", kUid),
                             "/crio-", kCid, ".scope")));
  ConnectedChild child;
  ASSERT_TRUE(child.Start());
  ASSERT_TRUE(v1_tree.Move(child.pid()));
  ASSERT_TRUE(v2_tree.Move(child.pid()));
  ExpectPeerIs(child, Want(kUid, kCid, "crio", "besteffort", true));
}

// clone3's arguments (linux/sched.h's struct clone_args, whose header does
// not mix with glibc's <sched.h>).
struct CloneArgs {
  uint64_t flags = 0;
  uint64_t pidfd = 0;
  uint64_t child_tid = 0;
  uint64_t parent_tid = 0;
  uint64_t exit_signal = 0;
  uint64_t stack = 0;
  uint64_t stack_size = 0;
  uint64_t tls = 0;
  uint64_t set_tid = 0;
  uint64_t set_tid_size = 0;
  uint64_t cgroup = 0;
};

// A child that waits until its pipe closes; killed and reaped when
// destroyed.
struct WaitingChild {
  pid_t pid = -1;
  UniqueFd release;
  ~WaitingChild() {
    release.Reset();
    if (pid > 0) ::waitpid(pid, nullptr, 0);
  }
};

TEST_F(PeerCgroupTest, PidReusedByAProcessInAnotherPodIsNeverNamed) {
  std::optional<CgroupBase> base = V1MemoryBase();
  if (!base.has_value()) base = V2Base();
  if (!base.has_value()) GTEST_SKIP() << "no cgroup hierarchy to write";
  CgroupTree first_pod;
  ASSERT_TRUE(first_pod.Create(
      base->path, absl::StrCat(UniqueName(), "-a/kubepods/besteffort/pod", kUid,
                               "/", kCid)));
  CgroupTree second_pod;
  ASSERT_TRUE(second_pod.Create(
      base->path, absl::StrCat(UniqueName(), "-b/kubepods/burstable/pod", kUid2,
                               "/", kCid2)));
  ConnectedChild peer;
  ASSERT_TRUE(peer.Start());
  ASSERT_TRUE(first_pod.Move(peer.pid()));
  ExpectPeerIs(peer, Want(kUid, kCid, "", "besteffort", true));
  // The start-time check as it would begin right after the accept.
  const uint64_t accepted = cgroup_internal::BoottimeTicks();
  const pid_t pid = peer.pid();
  peer.ExitAndReap();
  // Two clock ticks later, another process takes the peer's pid (clone3's
  // set_tid: the kernel hands out exactly that pid) in another pod.
  ::usleep(30000);
  int release[2];
  ASSERT_EQ(::pipe2(release, O_CLOEXEC), 0);
  UniqueFd release_read(release[0]);
  WaitingChild successor;
  successor.release.Reset(release[1]);
  CloneArgs args;
  args.exit_signal = SIGCHLD;
  args.set_tid = reinterpret_cast<uintptr_t>(&pid);
  args.set_tid_size = 1;
  const long cloned = ::syscall(SYS_clone3, &args, sizeof(args));
  if (cloned == 0) {
    ::close(release[1]);
    char byte;
    while (::read(release_read.get(), &byte, 1) < 0 && errno == EINTR) {
    }
    ::_exit(0);
  }
  if (cloned < 0) {
    GTEST_SKIP() << "clone3 with set_tid " << pid << ": "
                 << std::strerror(errno) << " (taken again, or unsupported)";
  }
  successor.pid = static_cast<pid_t>(cloned);
  ASSERT_EQ(successor.pid, pid);
  ASSERT_TRUE(second_pod.Move(successor.pid));
  // The pid now names the other pod...
  const absl::StatusOr<CgroupIdentity> now = ReadPidCgroup(pid);
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_IDENTITY(*now, Want(kUid2, kCid2, "", "burstable", true));
  // ...but the connection's peer is gone: the pidfd says so, and the start
  // time is later than the accept.
  const absl::StatusOr<CgroupIdentity> by_pidfd = ReadPeerCgroup(peer.conn());
  ASSERT_FALSE(by_pidfd.ok()) << by_pidfd->DebugString();
  EXPECT_EQ(GetErrorDetail(by_pidfd.status()).reason(), "PEER_GONE")
      << by_pidfd.status();
  const absl::StatusOr<CgroupIdentity> by_start_time =
      cgroup_internal::ReadPidCgroupSince(pid, "/proc", accepted);
  ASSERT_FALSE(by_start_time.ok()) << by_start_time->DebugString();
  EXPECT_EQ(by_start_time.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(GetErrorDetail(by_start_time.status()).reason(), "PEER_PID_REUSED")
      << by_start_time.status();
}

TEST_F(PeerCgroupTest, PeerInAnotherPidNamespaceIsRefusedWithHostPidAdvice) {
  // A checker in a new pid namespace accepts a connection from us: we are
  // invisible there, so SO_PEERCRED gives it pid 0.
  UniqueFd listener(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(listener.valid());
  struct sockaddr_un addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  const std::string name = absl::StrCat(UniqueName(), "-pidns");
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  const socklen_t len =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  ASSERT_EQ(::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), len), 0);
  ASSERT_EQ(::listen(listener.get(), 1), 0);
  constexpr int kNoNamespace = 77;
  const pid_t checker = ::fork();
  ASSERT_GE(checker, 0);
  if (checker == 0) {
    if (::unshare(CLONE_NEWPID) != 0) ::_exit(kNoNamespace);
    const pid_t inner = ::fork();
    if (inner < 0) ::_exit(3);
    if (inner == 0) {
      UniqueFd conn(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (!conn.valid()) ::_exit(4);
      int code = 0;
      for (const absl::StatusOr<CgroupIdentity>& read :
           {ReadPeerCgroup(conn.get()),
            cgroup_internal::ReadPeerCgroupByCredentials(conn.get(),
                                                         "/proc")}) {
        if (read.ok()) {
          code = 5;
        } else if (GetErrorDetail(read.status()).reason() !=
                       "PEER_PID_NAMESPACE" ||
                   read.status().code() !=
                       absl::StatusCode::kFailedPrecondition ||
                   read.status().message().find("hostPID") ==
                       absl::string_view::npos) {
          code = 6;
        }
      }
      ::_exit(code);
    }
    int status = 0;
    if (::waitpid(inner, &status, 0) != inner || !WIFEXITED(status)) {
      ::_exit(7);
    }
    ::_exit(WEXITSTATUS(status));
  }
  UniqueFd client(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(client.valid());
  ASSERT_EQ(::connect(client.get(), reinterpret_cast<sockaddr*>(&addr), len),
            0);
  int status = 0;
  ASSERT_EQ(::waitpid(checker, &status, 0), checker);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  if (WEXITSTATUS(status) == kNoNamespace) {
    GTEST_SKIP() << "unshare(CLONE_NEWPID) refused here";
  }
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "5: the read succeeded; 6: another error; 3, 4, 7: harness";
}

// Not root tests: no cgroup is created.
TEST(ReadPeerCgroupTest, ChildInOurCgroupsIsNamedAsWeAreUntilReaped) {
  ConnectedChild child;
  ASSERT_TRUE(child.Start());
  const CgroupIdentity own = ParseProcCgroup(ReadFile("/proc/self/cgroup"));
  PeerCgroupTest::ExpectPeerIs(child, own);
  const pid_t pid = child.pid();
  child.ExitAndReap();
  PeerCgroupTest::ExpectGone(child, pid);
}

TEST(ReadPidCgroupTest, ThisProcess) {
  const absl::StatusOr<CgroupIdentity> id = ReadPidCgroup(::getpid());
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_IDENTITY(*id, ParseProcCgroup(ReadFile("/proc/self/cgroup")));
}

TEST(ReadPidCgroupTest, AProcessStartedAfterTheCheckBeganIsRefused) {
  // This process started after boot tick 0: as seen from a check that began
  // then, it is a newcomer at a reused pid.
  const absl::StatusOr<CgroupIdentity> id =
      cgroup_internal::ReadPidCgroupSince(::getpid(), "/proc", 0);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(GetErrorDetail(id.status()).reason(), "PEER_PID_REUSED");
}

TEST(ReadPidCgroupTest, BadPidsAndReapedProcesses) {
  for (pid_t pid : {0, -1}) {
    const absl::StatusOr<CgroupIdentity> id = ReadPidCgroup(pid);
    ASSERT_FALSE(id.ok());
    EXPECT_EQ(GetErrorDetail(id.status()).reason(), "BAD_PID");
  }
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  const absl::StatusOr<CgroupIdentity> id = ReadPidCgroup(child);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(GetErrorDetail(id.status()).reason(), "PEER_GONE");
}

TEST(ReadPeerCgroupTest, SocketpairPeerIsThisProcess) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  UniqueFd a(fds[0]);
  UniqueFd b(fds[1]);
  const absl::StatusOr<CgroupIdentity> id = ReadPeerCgroup(a.get());
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_IDENTITY(*id, ParseProcCgroup(ReadFile("/proc/self/cgroup")));
}

TEST(ReadPeerCgroupTest, NotASocketOrNoPeer) {
  int pipe_fds[2];
  ASSERT_EQ(::pipe2(pipe_fds, O_CLOEXEC), 0);
  UniqueFd r(pipe_fds[0]);
  UniqueFd w(pipe_fds[1]);
  for (const absl::StatusOr<CgroupIdentity>& read :
       {ReadPeerCgroup(r.get()),
        cgroup_internal::ReadPeerCgroupByCredentials(r.get(), "/proc")}) {
    ASSERT_FALSE(read.ok());
    EXPECT_EQ(GetErrorDetail(read.status()).reason(), "PEER_CREDENTIALS")
        << read.status();
  }
  UniqueFd unconnected(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(unconnected.valid());
  for (const absl::StatusOr<CgroupIdentity>& read :
       {ReadPeerCgroup(unconnected.get()),
        cgroup_internal::ReadPeerCgroupByCredentials(unconnected.get(),
                                                     "/proc")}) {
    ASSERT_FALSE(read.ok());
    EXPECT_EQ(GetErrorDetail(read.status()).reason(), "NO_PEER")
        << read.status();
  }
}

}  // namespace
// The kubelet's pod log directory names each pod "<namespace>_<name>_<uid>".
TEST(KubeletPodNameTest, FindsThePodsNamespaceAndName) {
  char dir[] = "/tmp/mrd-pod-logs-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string logs = dir;
  const std::string uid = "0f3e2d1c-4b5a-4c6d-8e7f-901a2b3c4d5e";
  for (const std::string& entry :
       {std::string("kube-system_coredns-5d78c9869d-abcde_11111111-2222-4333-"
                    "8444-555555555555"),
        "prod_inference-0_" + uid}) {
    ASSERT_EQ(::mkdir((logs + "/" + entry).c_str(), 0755), 0);
  }
  absl::StatusOr<std::string> name = KubeletPodName(logs, uid);
  ASSERT_TRUE(name.ok()) << name.status();
  EXPECT_EQ(*name, "prod/inference-0");
  EXPECT_EQ(GetErrorDetail(KubeletPodName(logs,
                                          "aaaaaaaa-bbbb-4ccc-8ddd-"
                                          "eeeeeeeeeeee")
                               .status())
                .reason(),
            "POD_NAME_UNKNOWN");
  EXPECT_EQ(GetErrorDetail(KubeletPodName(logs, "../x").status()).reason(),
            "BAD_POD_UID");
  EXPECT_EQ(
      GetErrorDetail(KubeletPodName(logs + "/missing", uid).status()).reason(),
      "POD_NAME_UNKNOWN");
  for (const char* entry : {"/kube-system_coredns-5d78c9869d-abcde_11111111-"
                            "2222-4333-8444-555555555555",
                            "/prod_inference-0_0f3e2d1c-4b5a-4c6d-8e7f-"
                            "901a2b3c4d5e"}) {
    ::rmdir((logs + entry).c_str());
  }
  ::rmdir(dir);
}

}  // namespace mrd
