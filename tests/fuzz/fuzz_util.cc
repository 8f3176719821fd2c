#include "tests/fuzz/fuzz_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "google/protobuf/stubs/logging.h"
#include "server/common/log.h"

namespace mrd::fuzz {

void Fail(absl::string_view message) {
  std::fprintf(stderr, "\n==== mrd fuzz invariant violated: %.*s\n",
               static_cast<int>(message.size()), message.data());
  std::fflush(stderr);
  std::abort();
}

UniqueFd MakeMemfd(uint64_t size, absl::string_view pattern) {
  UniqueFd fd(::memfd_create("mrd-fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  FUZZ_CHECK(fd.valid(), "memfd_create: ", std::strerror(errno));
  if (size == 0) return fd;
  FUZZ_CHECK(::ftruncate(fd.get(), static_cast<off_t>(size)) == 0,
             "ftruncate: ", std::strerror(errno));
  if (!pattern.empty()) {
    std::string data(size, '\0');
    for (uint64_t i = 0; i < size; ++i) data[i] = pattern[i % pattern.size()];
    FUZZ_CHECK(::pwrite(fd.get(), data.data(), data.size(), 0) ==
                   static_cast<ssize_t>(data.size()),
               "pwrite: ", std::strerror(errno));
  }
  return fd;
}

int ConnectRetrying(int fd, const void* addr, unsigned addr_len) {
  if (::connect(fd, static_cast<const struct sockaddr*>(addr),
                static_cast<socklen_t>(addr_len)) == 0) {
    return 0;
  }
  if (errno != EINTR && errno != EINPROGRESS) return errno;
  // The connection is being made: wait until the socket says how it ended.
  struct pollfd pfd = {fd, POLLOUT, 0};
  while (::poll(&pfd, 1, 10000) < 0) {
    if (errno != EINTR) return errno;
  }
  int err = 0;
  socklen_t len = sizeof(err);
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) return errno;
  return err;
}

int CountOpenFds() {
  DIR* dir = ::opendir("/proc/self/fd");
  FUZZ_CHECK(dir != nullptr, "opendir /proc/self/fd: ", std::strerror(errno));
  int count = 0;
  while (struct dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') ++count;
  }
  ::closedir(dir);
  return count - 1;  // the directory's own fd
}

std::string MakeTempDir(const std::string& parent, absl::string_view prefix) {
  std::string templ = absl::StrCat(parent, "/", prefix, "XXXXXX");
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  FUZZ_CHECK(::mkdtemp(buf.data()) != nullptr, "mkdtemp ", templ, ": ",
             std::strerror(errno));
  return std::string(buf.data());
}

void RemoveTree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

void QuietLogs() {
  SetMinLogLevel(LogLevel::kError);
  // Protobuf's complaints about fuzzed strings that are not UTF-8.
  google::protobuf::SetLogHandler(nullptr);
}

}  // namespace mrd::fuzz
