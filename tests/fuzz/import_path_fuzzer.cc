// Fuzzes the path resolution of ImportFile (OpenSharedFile in
// server/fd_socket/memory_file.cc: openat2 with RESOLVE_BENEATH and no
// symlinks) with fuzzed paths against a real directory on tmpfs holding
// regular files, an empty one, read-only and mode-0000 ones, one over the
// size limit, one owned by another uid, hard links, symlinks to a file
// inside, to a file outside, to a directory and to "..", nested
// subdirectories, a FIFO and a socket; next to the directory (outside it)
// lies a secret file.
//
// Each input is a path (components picked from the names above, "..", ".",
// "", or arbitrary bytes, including NUL and over-long names) and import
// options. The harness resolves the path itself, component by component
// with lstat, under the documented rules (no "..", no symlink anywhere, no
// leaving the directory, a regular tmpfs file with exactly one name, an
// allowed owner, a mode granting the access, a size within the limit), and
// checks that OpenSharedFile agrees: it succeeds exactly when the rules
// allow, then maps exactly that file (same inode and size), and otherwise
// fails with the documented reason. No fd is left open either way.
#include <fcntl.h>
#include <limits.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "fuzzer/FuzzedDataProvider.h"
#include "mrd/status.h"
#include "mrd/unique_fd.h"
#include "server/fd_socket/memory_file.h"
#include "tests/fuzz/fuzz_util.h"

namespace mrd::fuzz {
namespace {

constexpr uint64_t kMaxSize = 1 << 20;
constexpr uid_t kOtherUid = 65534;

struct Fixture {
  std::string parent;  // holds "secret" and the shm dir "root"
  std::string root;
  UniqueFd root_fd;
  uint64_t secret_inode = 0;
};

void WriteFile(const std::string& path, uint64_t size, mode_t mode) {
  UniqueFd fd(
      ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, mode));
  FUZZ_CHECK(fd.valid(), "create ", path, ": ", std::strerror(errno));
  FUZZ_CHECK(::ftruncate(fd.get(), static_cast<off_t>(size)) == 0);
  FUZZ_CHECK(::fchmod(fd.get(), mode) == 0);
}

Fixture* GetFixture() {
  static Fixture* fixture = [] {
    QuietLogs();
    auto* f = new Fixture;
    f->parent = MakeTempDir("/dev/shm", "mrd-fuzz-import-");
    f->root = f->parent + "/root";
    const std::string& r = f->root;
    FUZZ_CHECK(::mkdir(r.c_str(), 0755) == 0);
    WriteFile(f->parent + "/secret", 4096, 0600);
    struct stat st;
    FUZZ_CHECK(::stat((f->parent + "/secret").c_str(), &st) == 0);
    f->secret_inode = st.st_ino;
    WriteFile(r + "/a", 4096, 0600);
    WriteFile(r + "/empty", 0, 0600);
    WriteFile(r + "/ro", 8192, 0400);
    WriteFile(r + "/none", 4096, 0000);
    WriteFile(r + "/big", kMaxSize + 1, 0600);
    WriteFile(r + "/other", 4096, 0600);
    if (::getuid() == 0) {
      FUZZ_CHECK(::chown((r + "/other").c_str(), kOtherUid, kOtherUid) == 0);
    }
    FUZZ_CHECK(::mkdir((r + "/sub").c_str(), 0755) == 0);
    FUZZ_CHECK(::mkdir((r + "/sub/deeper").c_str(), 0755) == 0);
    WriteFile(r + "/sub/b", 100, 0644);
    WriteFile(r + "/sub/deeper/c", 3 * 4096 + 1, 0600);
    WriteFile(r + "/hard1", 4096, 0600);
    FUZZ_CHECK(::link((r + "/hard1").c_str(), (r + "/sub/hard2").c_str()) == 0);
    FUZZ_CHECK(::symlink("a", (r + "/link_in").c_str()) == 0);
    FUZZ_CHECK(::symlink("../secret", (r + "/link_out").c_str()) == 0);
    FUZZ_CHECK(::symlink((f->parent + "/secret").c_str(),
                         (r + "/link_abs").c_str()) == 0);
    FUZZ_CHECK(::symlink("sub", (r + "/link_dir").c_str()) == 0);
    FUZZ_CHECK(::symlink("..", (r + "/sub/up").c_str()) == 0);
    FUZZ_CHECK(::symlink("/proc/self/fd/0", (r + "/magic").c_str()) == 0);
    FUZZ_CHECK(::mkfifo((r + "/fifo").c_str(), 0600) == 0);
    {
      UniqueFd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
      struct sockaddr_un addr;
      std::memset(&addr, 0, sizeof(addr));
      addr.sun_family = AF_UNIX;
      const std::string path = r + "/sock";
      FUZZ_CHECK(path.size() < sizeof(addr.sun_path));
      std::memcpy(addr.sun_path, path.data(), path.size());
      FUZZ_CHECK(::bind(s.get(), reinterpret_cast<struct sockaddr*>(&addr),
                        sizeof(addr)) == 0);
    }
    f->root_fd.Reset(::open(r.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    FUZZ_CHECK(f->root_fd.valid());
    std::atexit([] { RemoveTree(GetFixture()->parent); });
    return f;
  }();
  return fixture;
}

// What the rules say about a path.
struct Verdict {
  bool ok = false;
  std::set<std::string> reasons;  // acceptable reasons of the refusal
  uint64_t inode = 0;
  uint64_t size = 0;
};

Verdict Refuse(std::initializer_list<const char*> reasons) {
  Verdict v;
  for (const char* r : reasons) v.reasons.insert(r);
  return v;
}

Verdict Judge(const Fixture& f, const std::string& path,
              const fd_socket::SharedFileOptions& options) {
  if (path.empty() || path.size() >= PATH_MAX ||
      path.find('\0') != std::string::npos || path.front() == '/') {
    return Refuse({"BAD_PATH"});
  }
  std::vector<std::string> parts = absl::StrSplit(path, '/');
  for (const std::string& p : parts) {
    if (p == "..") return Refuse({"BAD_PATH"});
  }
  std::string cur = f.root;
  struct stat st;
  FUZZ_CHECK(::lstat(cur.c_str(), &st) == 0);
  for (const std::string& p : parts) {
    if (p.empty() || p == ".") {
      if (!S_ISDIR(st.st_mode)) return Refuse({"BAD_PATH"});  // ENOTDIR
      continue;
    }
    if (!S_ISDIR(st.st_mode)) return Refuse({"BAD_PATH"});
    if (p.size() > NAME_MAX) return Refuse({"BAD_PATH"});  // ENAMETOOLONG
    cur += "/" + p;
    if (::lstat(cur.c_str(), &st) != 0) {
      FUZZ_CHECK(errno == ENOENT, "lstat ", cur, ": ", std::strerror(errno));
      return Refuse({"NO_SUCH_FILE"});
    }
    if (S_ISLNK(st.st_mode)) return Refuse({"BAD_PATH"});  // ELOOP
  }
  if (S_ISDIR(st.st_mode)) {
    // Read-only: opened, then refused; read-write: open says EISDIR.
    return options.writable ? Refuse({"OPEN_FAILED"})
                            : Refuse({"NOT_REGULAR_FILE"});
  }
  if (!S_ISREG(st.st_mode)) return Refuse({"NOT_REGULAR_FILE"});
  if (st.st_nlink != 1) return Refuse({"HARD_LINKED"});
  if (!options.allowed_owner_uids.empty()) {
    bool allowed = false;
    for (uint32_t uid : options.allowed_owner_uids) {
      allowed = allowed || uid == st.st_uid;
    }
    if (!allowed) return Refuse({"OWNER_NOT_ALLOWED"});
  }
  const mode_t needed = S_IRUSR | (options.writable ? S_IWUSR : 0);
  if ((st.st_mode & needed) != needed) return Refuse({"MODE_DENIES_ACCESS"});
  if (st.st_size == 0) return Refuse({"EMPTY_FILE"});
  if (static_cast<uint64_t>(st.st_size) > options.max_size) {
    return Refuse({"LIMIT_BUFFER_SIZE"});
  }
  Verdict v;
  v.ok = true;
  v.inode = st.st_ino;
  v.size = static_cast<uint64_t>(st.st_size);
  return v;
}

std::string MakePath(FuzzedDataProvider& in) {
  if (in.ConsumeIntegralInRange<int>(0, 15) == 0) {
    return in.ConsumeRandomLengthString(PATH_MAX + 16);
  }
  static const char* const kNames[] = {
      "a",        "empty",    "ro", "none",  "big",    "other",   "sub",
      "deeper",   "b",        "c",  "hard1", "hard2",  "link_in", "link_out",
      "link_abs", "link_dir", "up", "magic", "fifo",   "sock",    "secret",
      "root",     "..",       ".",  "",      "missing"};
  std::vector<std::string> parts;
  const int count = in.ConsumeIntegralInRange<int>(1, 6);
  for (int i = 0; i < count; ++i) {
    switch (in.ConsumeIntegralInRange<int>(0, 15)) {
      case 0:
        parts.push_back(in.ConsumeRandomLengthString(300));
        break;
      case 1:
        parts.push_back(
            std::string(in.ConsumeIntegralInRange<size_t>(250, 260), 'n'));
        break;
      default:
        parts.push_back(in.PickValueInArray(kNames));
    }
  }
  std::string path = absl::StrJoin(parts, "/");
  if (in.ConsumeIntegralInRange<int>(0, 7) == 0) path = "/" + path;
  if (in.ConsumeIntegralInRange<int>(0, 7) == 0) path += "/";
  return path;
}

}  // namespace
}  // namespace mrd::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mrd::fuzz;  // NOLINT(build/namespaces)
  using mrd::fd_socket::MappedFile;
  Fixture* f = GetFixture();
  FuzzedDataProvider in(data, size);
  mrd::fd_socket::SharedFileOptions options;
  options.writable = in.ConsumeBool();
  options.max_size = kMaxSize;
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 1:
      options.allowed_owner_uids = {0};
      break;
    case 2:
      options.allowed_owner_uids = {kOtherUid, 12345};
      break;
    default:
      break;
  }
  const std::string path = MakePath(in);
  const int fds_before = CountOpenFds();
  const Verdict verdict = Judge(*f, path, options);
  {
    absl::StatusOr<std::unique_ptr<MappedFile>> file =
        mrd::fd_socket::OpenSharedFile(f->root_fd.get(), path, options);
    if (file.ok()) {
      FUZZ_CHECK((*file)->inode() != f->secret_inode,
                 "the file outside the directory was opened through \"", path,
                 "\"");
      FUZZ_CHECK(verdict.ok, "\"", path, "\" was imported; the rules say ",
                 absl::StrJoin(verdict.reasons, "|"));
      FUZZ_CHECK((*file)->inode() == verdict.inode, "\"", path,
                 "\" opened another file");
      FUZZ_CHECK((*file)->size() == verdict.size);
      FUZZ_CHECK((*file)->writable() == options.writable);
      FUZZ_CHECK((*file)->source() == "file:" + path);
    } else {
      const std::string reason = mrd::GetErrorDetail(file.status()).reason();
      FUZZ_CHECK(!verdict.ok, "\"", path,
                 "\" was refused: ", file.status().ToString());
      FUZZ_CHECK(verdict.reasons.count(reason) == 1, "\"", path,
                 "\" refused with ", reason, " (", file.status().ToString(),
                 "); expected ", absl::StrJoin(verdict.reasons, "|"));
    }
  }
  const int fds_after = CountOpenFds();
  FUZZ_CHECK(fds_after == fds_before, "open fds ", fds_before, " -> ",
             fds_after);
  return 0;
}
