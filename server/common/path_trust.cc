#include "server/common/path_trust.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <pwd.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "mrd/status.h"
#include "mrd/unique_fd.h"

namespace mrd {
namespace {

enum class Kind {
  kAbove,    // a directory above the one named: the sticky exception applies
  kRuntime,  // the runtime directory: writable by its owner only
  kShm,      // the shared-memory directory: may be sticky world-writable
};

std::string UserName(uid_t uid) {
  std::vector<char> buffer(16384);
  passwd pw;
  passwd* result = nullptr;
  if (getpwuid_r(uid, &pw, buffer.data(), buffer.size(), &result) == 0 &&
      result != nullptr) {
    return absl::StrCat("uid ", uid, " (", result->pw_name, ")");
  }
  return absl::StrCat("uid ", uid);
}

absl::Status Untrusted(const std::string& dir, const std::string& why) {
  return MrdError(absl::StatusCode::kFailedPrecondition, "UNTRUSTED_DIRECTORY",
                  absl::StrCat(dir, " ", why,
                               ": whoever can change it could replace mrd's "
                               "sockets or files. Fix the ownership or mode, "
                               "or choose another directory."));
}

absl::Status CheckDir(const std::string& dir, const struct stat& st, uid_t uid,
                      Kind kind) {
  if (!S_ISDIR(st.st_mode)) return Untrusted(dir, "is not a directory");
  if (st.st_uid != 0 && st.st_uid != uid) {
    return Untrusted(
        dir, absl::StrCat("is owned by ", UserName(st.st_uid),
                          ", not by root or mrd's own ", UserName(uid)));
  }
  const mode_t mode = st.st_mode & 07777;
  const bool writable = (mode & (S_IWGRP | S_IWOTH)) != 0;
  if (!writable) return absl::OkStatus();
  const bool sticky = (mode & S_ISVTX) != 0;
  const std::string mode_text = absl::StrFormat("mode %04o", mode);
  const char* who = (mode & S_IWOTH) != 0 ? "everyone" : "its group";
  switch (kind) {
    case Kind::kAbove:
    case Kind::kShm:
      if (sticky) return absl::OkStatus();
      return Untrusted(dir, absl::StrCat("is writable by ", who, " (",
                                         mode_text, ", not sticky)"));
    case Kind::kRuntime:
      return Untrusted(
          dir, absl::StrCat("is writable by ", who, " (", mode_text,
                            "); the runtime directory must be writable by "
                            "its owner only (under a shared directory such "
                            "as /tmp, use a private subdirectory)"));
  }
  return absl::OkStatus();
}

// `path` without trailing slashes, split into its canonical parent (symbolic
// links resolved) and its last component.
absl::Status SplitCanonical(const std::string& flag_path, std::string* parent,
                            std::string* name) {
  std::string path = flag_path;
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  if (path.empty() || path == "/") {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "BAD_PATH",
        absl::StrCat("'", flag_path, "' must name a directory below /"));
  }
  size_t slash = path.rfind('/');
  std::string raw_parent = slash == std::string::npos ? "."
                           : slash == 0               ? "/"
                                                      : path.substr(0, slash);
  *name = slash == std::string::npos ? path : path.substr(slash + 1);
  if (*name == "." || *name == "..") {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "BAD_PATH",
        absl::StrCat("'", flag_path, "' must end in a directory name, not '",
                     *name, "'"));
  }
  char resolved[PATH_MAX];
  if (realpath(raw_parent.c_str(), resolved) == nullptr) {
    return ErrnoError(
        errno, absl::StrCat("realpath ", raw_parent, " (of ", flag_path, ")"),
        "BAD_PATH");
  }
  *parent = resolved;
  return absl::OkStatus();
}

std::string Join(const std::string& parent, const std::string& name) {
  return parent == "/" ? "/" + name : parent + "/" + name;
}

// Opens `canonical` (absolute, no symbolic links) one component at a time
// with O_NOFOLLOW, checking each directory as one above the named one.
absl::StatusOr<UniqueFd> OpenTrustedChain(const std::string& canonical,
                                          uid_t uid) {
  UniqueFd fd(::open("/", O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) return ErrnoError(errno, "open /", "BAD_PATH");
  struct stat st;
  if (::fstat(fd.get(), &st) != 0)
    return ErrnoError(errno, "fstat /", "BAD_PATH");
  MRD_RETURN_IF_ERROR(CheckDir("/", st, uid, Kind::kAbove));
  std::string so_far;
  for (absl::string_view part :
       absl::StrSplit(canonical, '/', absl::SkipEmpty())) {
    so_far = absl::StrCat(so_far, "/", part);
    UniqueFd next(::openat(fd.get(), std::string(part).c_str(),
                           O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!next.valid()) {
      int err = errno;
      if (err == ELOOP || err == ENOTDIR) {
        return Untrusted(so_far,
                         "is no longer a directory (it changed while mrd "
                         "started)");
      }
      return ErrnoError(err, absl::StrCat("open ", so_far), "BAD_PATH");
    }
    if (::fstat(next.get(), &st) != 0) {
      return ErrnoError(errno, absl::StrCat("fstat ", so_far), "BAD_PATH");
    }
    MRD_RETURN_IF_ERROR(CheckDir(so_far, st, uid, Kind::kAbove));
    fd = std::move(next);
  }
  return fd;
}

// Opens (creating with `create_mode` when missing) the last directory of the
// chain, refusing a symbolic link, and checks it as `kind`.
absl::StatusOr<UniqueFd> OpenNamedDir(const std::string& flag_path, uid_t uid,
                                      Kind kind, mode_t create_mode,
                                      std::string* canonical) {
  std::string parent, name;
  MRD_RETURN_IF_ERROR(SplitCanonical(flag_path, &parent, &name));
  *canonical = Join(parent, name);
  MRD_ASSIGN_OR_RETURN(UniqueFd parent_fd, OpenTrustedChain(parent, uid));

  struct stat st;
  bool created = false;
  if (::fstatat(parent_fd.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno != ENOENT) {
      return ErrnoError(errno, absl::StrCat("stat ", *canonical), "BAD_PATH");
    }
    if (::mkdirat(parent_fd.get(), name.c_str(), create_mode) == 0) {
      created = true;
    } else if (errno != EEXIST) {
      return ErrnoError(errno, absl::StrCat("mkdir ", *canonical), "BAD_PATH");
    }
  } else if (S_ISLNK(st.st_mode)) {
    return Untrusted(*canonical,
                     "is a symbolic link; name the directory itself");
  }
  // The directory itself, never through a link: what is checked is what
  // mrd then uses (every directory above is trusted, so it stays put).
  UniqueFd fd(::openat(
      parent_fd.get(), name.c_str(),
      (created ? O_RDONLY : O_PATH) | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd.valid()) {
    int err = errno;
    if (err == ELOOP || err == ENOTDIR) {
      return Untrusted(*canonical, "is not a directory");
    }
    return ErrnoError(err, absl::StrCat("open ", *canonical), "BAD_PATH");
  }
  if (created && ::fchmod(fd.get(), create_mode) != 0) {  // past the umask
    return ErrnoError(errno, absl::StrCat("chmod ", *canonical), "BAD_PATH");
  }
  if (::fstat(fd.get(), &st) != 0) {
    return ErrnoError(errno, absl::StrCat("fstat ", *canonical), "BAD_PATH");
  }
  if (created && st.st_uid != uid) {
    return Untrusted(*canonical,
                     absl::StrCat("was created by mrd but is owned by ",
                                  UserName(st.st_uid)));
  }
  MRD_RETURN_IF_ERROR(CheckDir(*canonical, st, uid, kind));
  return fd;
}

}  // namespace

std::string FilesystemTypeName(uint64_t magic) {
  switch (magic) {
    case TMPFS_MAGIC:
      return "tmpfs";
    case HUGETLBFS_MAGIC:
      return "hugetlbfs";
    case EXT4_SUPER_MAGIC:
      return "ext2/ext3/ext4";
    case XFS_SUPER_MAGIC:
      return "xfs";
    case BTRFS_SUPER_MAGIC:
      return "btrfs";
    case 0x2fc12fc1:
      return "zfs";
    case F2FS_SUPER_MAGIC:
      return "f2fs";
    case OVERLAYFS_SUPER_MAGIC:
      return "overlayfs";
    case NFS_SUPER_MAGIC:
      return "nfs";
    case 0xFF534D42:
      return "cifs";
    case 0xFE534D42:
      return "smb2";
    case V9FS_MAGIC:
      return "9p";
    case FUSE_SUPER_MAGIC:
      return "fuse";
    case RAMFS_MAGIC:
      return "ramfs";
    case SQUASHFS_MAGIC:
      return "squashfs";
    case MSDOS_SUPER_MAGIC:
      return "vfat/msdos";
    case 0x2011BAB0:
      return "exfat";
    case 0x5346544e:
      return "ntfs";
    case PROC_SUPER_MAGIC:
      return "proc";
    case SYSFS_MAGIC:
      return "sysfs";
    case DEVPTS_SUPER_MAGIC:
      return "devpts";
    case CGROUP2_SUPER_MAGIC:
      return "cgroup2";
    case ECRYPTFS_SUPER_MAGIC:
      return "ecryptfs";
    case 0x9660:
      return "iso9660";
    default:
      return absl::StrFormat("unknown filesystem (magic 0x%x)", magic);
  }
}

absl::StatusOr<std::string> PrepareRuntimeDir(const std::string& path,
                                              uid_t uid) {
  std::string canonical;
  MRD_ASSIGN_OR_RETURN(
      UniqueFd fd, OpenNamedDir(path, uid, Kind::kRuntime, 0755, &canonical));
  return canonical;
}

absl::StatusOr<std::string> CheckSocketPath(const std::string& path,
                                            uid_t uid) {
  std::string parent, name;
  MRD_RETURN_IF_ERROR(SplitCanonical(path, &parent, &name));
  MRD_ASSIGN_OR_RETURN(UniqueFd fd, OpenTrustedChain(parent, uid));
  return Join(parent, name);
}

absl::StatusOr<std::string> PrepareShmDir(const std::string& path, uid_t uid) {
  std::string canonical;
  MRD_ASSIGN_OR_RETURN(UniqueFd fd,
                       OpenNamedDir(path, uid, Kind::kShm, 01777, &canonical));
  struct statfs fs;
  if (::fstatfs(fd.get(), &fs) != 0) {
    return ErrnoError(errno, absl::StrCat("statfs ", canonical), "BAD_PATH");
  }
  const auto type = static_cast<uint64_t>(static_cast<uint32_t>(fs.f_type));
  if (type != TMPFS_MAGIC && type != HUGETLBFS_MAGIC) {
    return MrdError(
        absl::StatusCode::kFailedPrecondition, "SHM_DIR_NOT_TMPFS",
        absl::StrCat(canonical, " is on ", FilesystemTypeName(type),
                     ", not on tmpfs or hugetlbfs: ImportFile maps only "
                     "shared-memory files. Use a directory under /dev/shm "
                     "(or a hugetlbfs mount), or --shm_dir= to turn "
                     "ImportFile off."));
  }
  return canonical;
}

}  // namespace mrd
