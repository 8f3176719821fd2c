// An owned file descriptor: closed exactly once, on destruction or Reset().
// Shared by the server and the client library (fds are half of fd.proto's
// protocol).
#ifndef MRD_PROTO_MRD_UNIQUE_FD_H_
#define MRD_PROTO_MRD_UNIQUE_FD_H_

#include <unistd.h>

#include <utility>

namespace mrd {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { Reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) Reset(std::exchange(other.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int Release() { return std::exchange(fd_, -1); }
  void Reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

}  // namespace mrd

#endif  // MRD_PROTO_MRD_UNIQUE_FD_H_
