// PodCgroup: a cgroup laid out the way the kubelet's cgroupfs driver lays
// out a pod's container (kubepods/besteffort/pod<UID>/<container id>), made
// in every cgroup hierarchy of the machine (each cgroup v1 hierarchy and
// the v2 one beside them), so that a test can put a real process in a "pod"
// and mrd reads its identity from /proc/<pid>/cgroup as it would on a node.
//
// Needs root and writable cgroup file systems; Create says why not
// otherwise (tests skip then). The destructor moves nothing: the processes
// in it must have exited; it removes the directories it made, innermost
// first.
#ifndef MRD_TESTS_SUPPORT_POD_CGROUP_H_
#define MRD_TESTS_SUPPORT_POD_CGROUP_H_

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace mrd::testing {

class PodCgroup {
 public:
  // A new pod UID and container id, and the cgroup directories for them.
  static absl::StatusOr<std::unique_ptr<PodCgroup>> Create(
      const std::string& qos = "besteffort") {
    if (::geteuid() != 0) {
      return absl::FailedPreconditionError("making cgroups needs root");
    }
    auto pod = std::unique_ptr<PodCgroup>(new PodCgroup());
    std::random_device random;
    std::mt19937_64 bits(random());
    pod->pod_uid_ = absl::StrFormat(
        "%08x-%04x-%04x-%04x-%012x", static_cast<uint32_t>(bits()),
        static_cast<uint32_t>(bits() & 0xffff),
        static_cast<uint32_t>((bits() & 0x0fff) | 0x4000),
        static_cast<uint32_t>((bits() & 0x3fff) | 0x8000),
        bits() & 0xffffffffffffULL);
    for (int i = 0; i < 4; ++i) {
      absl::StrAppend(&pod->container_id_, absl::Hex(bits(), absl::kZeroPad16));
    }
    const std::string relative = absl::StrCat(
        "kubepods/", qos, "/pod", pod->pod_uid_, "/", pod->container_id_);
    for (const std::string& root : Hierarchies()) {
      std::string path = root;
      for (const std::string& part :
           {std::string("kubepods"), qos, "pod" + pod->pod_uid_,
            pod->container_id_}) {
        path += "/" + part;
        if (::mkdir(path.c_str(), 0755) == 0) {
          pod->made_.push_back(path);
          // cpuset: a new cgroup has no CPUs or memory nodes until given
          // its parent's, and takes no process before.
          CopyFromParent(path, "cpuset.cpus");
          CopyFromParent(path, "cpuset.mems");
        } else if (errno != EEXIST) {
          return absl::FailedPreconditionError(
              absl::StrCat("mkdir ", path, ": ", std::strerror(errno)));
        }
      }
      pod->leaves_.push_back(path);
    }
    if (pod->leaves_.empty()) {
      return absl::FailedPreconditionError("no cgroup hierarchy mounted");
    }
    return pod;
  }

  ~PodCgroup() {
    for (auto it = made_.rbegin(); it != made_.rend(); ++it) {
      ::rmdir(it->c_str());
    }
  }

  const std::string& pod_uid() const { return pod_uid_; }
  const std::string& container_id() const { return container_id_; }
  std::string tenant() const { return "pod:" + pod_uid_; }

  // The cgroup.procs file of the pod's cgroup in each hierarchy (for
  // JoinSelf).
  std::vector<std::string> ProcsFiles() const {
    std::vector<std::string> files;
    for (const std::string& leaf : leaves_)
      files.push_back(leaf + "/cgroup.procs");
    return files;
  }

  // Moves process `pid` back to the root cgroup of every hierarchy (before
  // the pod it is in is removed).
  static bool LeaveAll(pid_t pid) {
    std::vector<std::string> files;
    for (const std::string& root : Hierarchies()) {
      files.push_back(root + "/cgroup.procs");
    }
    return WritePid(files, pid);
  }

  // Moves process `pid` into the pod's cgroup in every hierarchy. It
  // allocates: a child between fork and exec calls JoinSelf instead.
  bool Join(pid_t pid) const { return WritePid(ProcsFiles(), pid); }

  // Moves the calling process into the cgroups of `procs_files` (a pod's
  // ProcsFiles(), made before the fork): open, write and close only, so a
  // child may call it between fork and exec.
  static bool JoinSelf(const std::vector<std::string>& procs_files) {
    for (const std::string& procs : procs_files) {
      const int fd = ::open(procs.c_str(), O_WRONLY | O_CLOEXEC);
      if (fd < 0) return false;
      const bool written = ::write(fd, "0", 1) == 1;
      ::close(fd);
      if (!written) return false;
    }
    return true;
  }

 private:
  PodCgroup() = default;

  // Writes `pid` to each cgroup.procs file of `files`: whether every write
  // went through.
  static bool WritePid(const std::vector<std::string>& files, pid_t pid) {
    const std::string text = std::to_string(pid);
    bool written = true;
    for (const std::string& procs : files) {
      const int fd = ::open(procs.c_str(), O_WRONLY | O_CLOEXEC);
      if (fd < 0) {
        written = false;
        continue;
      }
      written = ::write(fd, text.data(), text.size()) ==
                    static_cast<ssize_t>(text.size()) &&
                written;
      ::close(fd);
    }
    return written;
  }

  // Every mounted hierarchy under /sys/fs/cgroup: the directories that
  // hold a cgroup.procs (v1 controllers, name=systemd, the v2 one), or
  // /sys/fs/cgroup itself when it is a v2 mount.
  static std::vector<std::string> Hierarchies() {
    std::vector<std::string> roots;
    struct stat st;
    if (::stat("/sys/fs/cgroup/cgroup.procs", &st) == 0) {
      roots.push_back("/sys/fs/cgroup");
      return roots;
    }
    DIR* dir = ::opendir("/sys/fs/cgroup");
    if (dir == nullptr) return roots;
    while (struct dirent* entry = ::readdir(dir)) {
      const std::string name = entry->d_name;
      if (name == "." || name == "..") continue;
      const std::string root = "/sys/fs/cgroup/" + name;
      struct stat link;
      if (::lstat(root.c_str(), &link) != 0 || S_ISLNK(link.st_mode)) {
        continue;  // cpu,cpuacct style aliases
      }
      if (::stat((root + "/cgroup.procs").c_str(), &st) == 0) {
        roots.push_back(root);
      }
    }
    ::closedir(dir);
    return roots;
  }

  static void CopyFromParent(const std::string& path, const char* file) {
    const std::string parent = path.substr(0, path.rfind('/'));
    std::ifstream in(parent + "/" + file);
    if (!in) return;
    std::string value;
    std::getline(in, value);
    std::ofstream out(path + "/" + file);
    out << value;
  }

  std::string pod_uid_;
  std::string container_id_;
  std::vector<std::string> made_;    // directories made, outermost first
  std::vector<std::string> leaves_;  // the container's, one per hierarchy
};

}  // namespace mrd::testing

#endif  // MRD_TESTS_SUPPORT_POD_CGROUP_H_
