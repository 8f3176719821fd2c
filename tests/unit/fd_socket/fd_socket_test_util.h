// Helpers for the session tests: memfds, fd counting, status assertions, a
// private directory, and a raw SOCK_SEQPACKET client for the fd socket (raw
// socket calls on purpose: the tests check the wire protocol, not a client
// library).
#ifndef MRD_TESTS_UNIT_FD_SOCKET_FD_SOCKET_TEST_UTIL_H_
#define MRD_TESTS_UNIT_FD_SOCKET_FD_SOCKET_TEST_UTIL_H_

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "mrd/unique_fd.h"
#include "mrd/v1/fd.pb.h"

namespace mrd::fd_socket::testing {

// A memfd of `contents` (MFD_ALLOW_SEALING) with `seals` added. Fails the
// test (and returns an invalid fd) if any step fails.
UniqueFd MakeMemfd(absl::string_view contents, int seals);
// A memfd of `size` zero bytes, sealed with F_SEAL_SHRINK.
UniqueFd MakeSealedMemfd(uint64_t size);

// Open descriptors of this process (entries of /proc/self/fd).
int CountOpenFds();

// Whether `fd` is an open descriptor.
bool FdIsOpen(int fd);

// Passes if `status` has `code` and ErrorDetail.reason `reason`.
::testing::AssertionResult HasError(const absl::Status& status,
                                    absl::StatusCode code,
                                    absl::string_view reason);
// Passes if `reply` is an FdReply.error with `code` and `reason`.
::testing::AssertionResult IsErrorReply(const v1::FdReply& reply,
                                        absl::StatusCode code,
                                        absl::string_view reason);

// A directory made with mkdtemp under `parent`, removed with everything in it
// on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& parent);
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string Sub(absl::string_view name) const;
  // Writes a file of `contents` with `mode` (exact: no umask).
  void WriteFile(absl::string_view name, absl::string_view contents,
                 mode_t mode = 0600) const;

 private:
  std::string path_;
};

// A blocking client of the fd socket with a receive timeout, so a missing
// reply fails the test instead of hanging it.
class RawClient {
 public:
  // Connects to `path`; valid() is false if that failed.
  explicit RawClient(const std::string& path);

  bool valid() const { return sock_.valid(); }
  int fd() const { return sock_.get(); }
  void Close() { sock_.Reset(); }

  // Sends one datagram with `fds` (if any) in one SCM_RIGHTS message.
  bool SendRaw(absl::string_view bytes, const std::vector<int>& fds = {},
               int flags = 0);
  bool Send(const v1::FdRequest& request, const std::vector<int>& fds = {});
  bool SendPing(uint64_t sequence);
  bool SendImport(uint64_t sequence, int memfd, bool writable = false,
                  uint64_t expected_size = 0);

  // The next reply; on EOF, timeout, error or unparsable bytes the test fails
  // with a message and nullopt comes back.
  std::optional<v1::FdReply> Receive();
  // True if the server closed the connection (recv returns 0).
  bool ReceiveEof();
  // The welcome, or nullopt (test failure) if something else arrived.
  std::optional<v1::FdWelcome> ReceiveWelcome();

 private:
  UniqueFd sock_;
};

}  // namespace mrd::fd_socket::testing

#endif  // MRD_TESTS_UNIT_FD_SOCKET_FD_SOCKET_TEST_UTIL_H_
