#include "tests/unit/fd_socket/fd_socket_test_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"

namespace mrd::fd_socket::testing {

UniqueFd MakeMemfd(absl::string_view contents, int seals) {
  UniqueFd fd(::memfd_create("mrd-test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) {
    ADD_FAILURE() << "memfd_create: " << std::strerror(errno);
    return fd;
  }
  if (!contents.empty() &&
      ::pwrite(fd.get(), contents.data(), contents.size(), 0) !=
          static_cast<ssize_t>(contents.size())) {
    ADD_FAILURE() << "pwrite: " << std::strerror(errno);
    return UniqueFd();
  }
  if (seals != 0 && ::fcntl(fd.get(), F_ADD_SEALS, seals) != 0) {
    ADD_FAILURE() << "F_ADD_SEALS: " << std::strerror(errno);
    return UniqueFd();
  }
  return fd;
}

UniqueFd MakeSealedMemfd(uint64_t size) {
  UniqueFd fd = MakeMemfd("", 0);
  if (!fd.valid()) return fd;
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) {
    ADD_FAILURE() << "ftruncate: " << std::strerror(errno);
    return UniqueFd();
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
    ADD_FAILURE() << "F_ADD_SEALS: " << std::strerror(errno);
    return UniqueFd();
  }
  return fd;
}

int CountOpenFds() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) {
    ADD_FAILURE() << "opendir /proc/self/fd: " << std::strerror(errno);
    return -1;
  }
  int count = 0;
  while (struct dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  ::closedir(dir);
  return count;
}

bool FdIsOpen(int fd) { return ::fcntl(fd, F_GETFD) >= 0; }

::testing::AssertionResult HasError(const absl::Status& status,
                                    absl::StatusCode code,
                                    absl::string_view reason) {
  const std::string got_reason = GetErrorDetail(status).reason();
  if (status.code() == code && got_reason == reason) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "expected " << absl::StatusCodeToString(code) << " " << reason
         << ", got " << status.ToString() << " reason \"" << got_reason << "\"";
}

::testing::AssertionResult IsErrorReply(const v1::FdReply& reply,
                                        absl::StatusCode code,
                                        absl::string_view reason) {
  if (!reply.has_error()) {
    return ::testing::AssertionFailure()
           << "expected an error reply, got " << reply.ShortDebugString();
  }
  const v1::FdError& error = reply.error();
  if (error.code() == static_cast<int32_t>(code) &&
      error.detail().reason() == reason) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "expected " << absl::StatusCodeToString(code) << " " << reason
         << ", got " << reply.ShortDebugString();
}

TempDir::TempDir(const std::string& parent) {
  std::string templ = parent + "/mrd-session-test-XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) {
    ADD_FAILURE() << "mkdtemp " << templ << ": " << std::strerror(errno);
    return;
  }
  path_ = templ;
}

TempDir::~TempDir() {
  if (path_.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
  if (ec) ADD_FAILURE() << "remove_all " << path_ << ": " << ec.message();
}

std::string TempDir::Sub(absl::string_view name) const {
  return absl::StrCat(path_, "/", name);
}

void TempDir::WriteFile(absl::string_view name, absl::string_view contents,
                        mode_t mode) const {
  const std::string path = Sub(name);
  UniqueFd fd(
      ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!fd.valid()) {
    ADD_FAILURE() << "open " << path << ": " << std::strerror(errno);
    return;
  }
  if (::write(fd.get(), contents.data(), contents.size()) !=
      static_cast<ssize_t>(contents.size())) {
    ADD_FAILURE() << "write " << path << ": " << std::strerror(errno);
  }
  if (::fchmod(fd.get(), mode) != 0) {
    ADD_FAILURE() << "fchmod " << path << ": " << std::strerror(errno);
  }
}

RawClient::RawClient(const std::string& path) {
  UniqueFd sock(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!sock.valid()) {
    ADD_FAILURE() << "socket: " << std::strerror(errno);
    return;
  }
  struct timeval timeout;
  timeout.tv_sec = 10;
  timeout.tv_usec = 0;
  ::setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  struct sockaddr_un addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (::connect(sock.get(), reinterpret_cast<const struct sockaddr*>(&addr),
                sizeof(addr)) != 0) {
    ADD_FAILURE() << "connect " << path << ": " << std::strerror(errno);
    return;
  }
  sock_ = std::move(sock);
}

bool RawClient::SendRaw(absl::string_view bytes, const std::vector<int>& fds,
                        int flags) {
  struct iovec iov;
  iov.iov_base = const_cast<char*>(bytes.data());
  iov.iov_len = bytes.size();
  struct msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control;
  if (!fds.empty()) {
    control.resize(CMSG_SPACE(fds.size() * sizeof(int)));
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    struct cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
    std::memcpy(CMSG_DATA(c), fds.data(), fds.size() * sizeof(int));
  }
  if (::sendmsg(sock_.get(), &msg, MSG_NOSIGNAL | flags) < 0) {
    if (errno != EAGAIN) {
      ADD_FAILURE() << "sendmsg: " << std::strerror(errno);
    }
    return false;
  }
  return true;
}

bool RawClient::Send(const v1::FdRequest& request,
                     const std::vector<int>& fds) {
  return SendRaw(request.SerializeAsString(), fds);
}

bool RawClient::SendPing(uint64_t sequence) {
  v1::FdRequest request;
  request.set_sequence(sequence);
  request.mutable_ping();
  return Send(request);
}

bool RawClient::SendImport(uint64_t sequence, int memfd, bool writable,
                           uint64_t expected_size) {
  v1::FdRequest request;
  request.set_sequence(sequence);
  request.mutable_import_memfd()->set_writable(writable);
  request.mutable_import_memfd()->set_expected_size(expected_size);
  return Send(request, {memfd});
}

std::optional<v1::FdReply> RawClient::Receive() {
  char buffer[65536];
  const ssize_t n = ::recv(sock_.get(), buffer, sizeof(buffer), 0);
  if (n < 0) {
    ADD_FAILURE() << "recv: " << std::strerror(errno);
    return std::nullopt;
  }
  if (n == 0) {
    ADD_FAILURE() << "recv: the server closed the connection";
    return std::nullopt;
  }
  v1::FdReply reply;
  if (!reply.ParseFromArray(buffer, static_cast<int>(n))) {
    ADD_FAILURE() << "unparsable reply of " << n << " bytes";
    return std::nullopt;
  }
  return reply;
}

bool RawClient::ReceiveEof() {
  char buffer[65536];
  const ssize_t n = ::recv(sock_.get(), buffer, sizeof(buffer), 0);
  if (n < 0) {
    ADD_FAILURE() << "recv: " << std::strerror(errno);
    return false;
  }
  if (n > 0) {
    v1::FdReply reply;
    reply.ParseFromArray(buffer, static_cast<int>(n));
    ADD_FAILURE() << "expected EOF, got " << reply.ShortDebugString();
    return false;
  }
  return true;
}

std::optional<v1::FdWelcome> RawClient::ReceiveWelcome() {
  std::optional<v1::FdReply> reply = Receive();
  if (!reply.has_value()) return std::nullopt;
  if (!reply->has_welcome()) {
    ADD_FAILURE() << "expected a welcome, got " << reply->ShortDebugString();
    return std::nullopt;
  }
  return reply->welcome();
}

}  // namespace mrd::fd_socket::testing
