// Path trust: mrd refuses to put its sockets, or to look for ImportFile
// files, in a directory that someone other than itself (or root) could
// change. Whoever can write to the runtime directory, or to any directory
// above it, can rename fd.sock and listen in its place; clients would then
// hand that user their memfds (issue 8, item 8).
//
// The rule, for every directory from / down to the one named:
//  * owned by root or by mrd's effective uid;
//  * not writable by group or others -- except a directory above with the
//    sticky bit (like /tmp or /dev/shm), where others may create entries but
//    not rename or remove ours: the next directory down must then itself
//    pass (be ours or root's and not writable by others).
// The runtime directory itself must not be writable by group or others at
// all, sticky or not. The shared-memory directory may be sticky and
// world-writable (mrd creates it 01777, like /dev/shm: tenants put their
// files there), and must be on tmpfs or hugetlbfs, which ImportFile needs.
//
// Every directory is opened with O_NOFOLLOW one component at a time from /
// and checked with fstat, so what is checked is what is there. Symbolic
// links above the named directory are resolved first (realpath) and the
// canonical path is what mrd then uses; the named directory itself must not
// be a symbolic link.
#ifndef MRD_SERVER_COMMON_PATH_TRUST_H_
#define MRD_SERVER_COMMON_PATH_TRUST_H_

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace mrd {

// Creates the runtime directory (mode 0755, so that allowed clients of other
// uids can reach the sockets) when it is missing, and checks it and every
// directory above it. Returns its canonical path. Errors:
// FAILED_PRECONDITION "UNTRUSTED_DIRECTORY" naming the directory, its owner
// and its mode; INVALID_ARGUMENT "BAD_PATH"; errno errors of mkdir/open.
absl::StatusOr<std::string> PrepareRuntimeDir(const std::string& path,
                                              uid_t uid);

// Checks the directory a socket given by its own path lives in, and every
// directory above it (the sticky exception applies to the socket's
// directory too). Returns the socket's canonical path.
absl::StatusOr<std::string> CheckSocketPath(const std::string& path, uid_t uid);

// Creates the shared-memory directory (01777) when it is missing, checks it
// as above and that it is on tmpfs or hugetlbfs (FAILED_PRECONDITION
// "SHM_DIR_NOT_TMPFS" naming the filesystem type). Returns its canonical
// path.
absl::StatusOr<std::string> PrepareShmDir(const std::string& path, uid_t uid);

// "ext2/ext3/ext4", "xfs", "tmpfs", ... for a statfs f_type; unknown types
// as "unknown filesystem (magic 0x...)".
std::string FilesystemTypeName(uint64_t magic);

}  // namespace mrd

#endif  // MRD_SERVER_COMMON_PATH_TRUST_H_
