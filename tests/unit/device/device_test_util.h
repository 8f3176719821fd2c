// Helpers for the device unit tests: real memfd-backed buffers, a sink that
// records every event and lets a test wait for them, the process's locked
// memory as the kernel reports it, and status matchers on mrd's reasons.
#ifndef MRD_TESTS_UNIT_DEVICE_DEVICE_TEST_UTIL_H_
#define MRD_TESTS_UNIT_DEVICE_DEVICE_TEST_UTIL_H_

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "mrd/status.h"
#include "server/device/device.h"

namespace mrd::device::testing {

inline uint64_t PageSize() {
  return static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

// A memfd of `pages` pages, mapped shared and read-write, filled with a
// pattern that differs per byte and per buffer.
class MemfdBuffer {
 public:
  static std::unique_ptr<MemfdBuffer> Create(uint64_t pages, uint8_t seed = 1) {
    int fd = memfd_create("mrd-device-test", MFD_CLOEXEC);
    if (fd < 0) return nullptr;
    uint64_t size = pages * PageSize();
    if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
      close(fd);
      return nullptr;
    }
    void* map = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
      close(fd);
      return nullptr;
    }
    auto* bytes = static_cast<uint8_t*>(map);
    for (uint64_t i = 0; i < size; ++i) {
      bytes[i] = static_cast<uint8_t>(i * 7 + seed + i / PageSize());
    }
    return std::unique_ptr<MemfdBuffer>(new MemfdBuffer(fd, map, size));
  }
  ~MemfdBuffer() {
    if (data_ != nullptr) munmap(data_, size_);
    close(fd_);
  }

  // [offset, offset + length) of the buffer as the device sees it.
  MemorySpan Span(uint64_t offset, uint64_t length) const {
    return MemorySpan{data() + offset, length, fd_, offset};
  }
  char* data() const { return static_cast<char*>(data_); }
  uint64_t size() const { return size_; }
  int fd() const { return fd_; }
  std::string Bytes(uint64_t offset, uint64_t length) const {
    return std::string(data() + offset, length);
  }

 private:
  MemfdBuffer(int fd, void* data, uint64_t size)
      : fd_(fd), data_(data), size_(size) {}
  int fd_;
  void* data_;
  uint64_t size_;
};

// Records every event of one PD.
class RecordingSink final : public PdEventSink {
 public:
  struct Event {
    enum class Kind { kCompletion, kConnected, kDisconnected };
    Kind kind;
    WorkCompletion completion;
    ConnectionId connection = 0;
  };

  void OnCompletion(const WorkCompletion& completion) override {
    absl::MutexLock lock(&mu_);
    events_.push_back(
        {Event::Kind::kCompletion, completion, completion.connection});
  }
  void OnPeerConnected(ConnectionId connection,
                       const std::string& peer) override {
    absl::MutexLock lock(&mu_);
    events_.push_back({Event::Kind::kConnected, {}, connection});
    last_peer_ = peer;
  }
  void OnPeerDisconnected(ConnectionId connection) override {
    absl::MutexLock lock(&mu_);
    events_.push_back({Event::Kind::kDisconnected, {}, connection});
  }

  std::vector<Event> Events() const {
    absl::MutexLock lock(&mu_);
    return events_;
  }
  std::vector<WorkCompletion> Completions() const {
    absl::MutexLock lock(&mu_);
    std::vector<WorkCompletion> out;
    for (const Event& e : events_) {
      if (e.kind == Event::Kind::kCompletion) out.push_back(e.completion);
    }
    return out;
  }
  size_t CountOf(Event::Kind kind) const {
    absl::MutexLock lock(&mu_);
    size_t n = 0;
    for (const Event& e : events_) n += e.kind == kind ? 1 : 0;
    return n;
  }
  // Waits until at least `n` events of `kind` arrived.
  bool WaitFor(Event::Kind kind, size_t n,
               absl::Duration timeout = absl::Seconds(10)) const {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      size_t count = 0;
      for (const Event& e : events_) count += e.kind == kind ? 1 : 0;
      return count >= n;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
  }
  bool WaitForCompletions(size_t n) const {
    return WaitFor(Event::Kind::kCompletion, n);
  }
  std::string last_peer() const {
    absl::MutexLock lock(&mu_);
    return last_peer_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<Event> events_ ABSL_GUARDED_BY(mu_);
  std::string last_peer_ ABSL_GUARDED_BY(mu_);
};

// A status with this code and mrd reason.
MATCHER_P2(IsMrdError, code, reason,
           ::testing::PrintToString(code) + " with reason " + reason) {
  const absl::Status& status = arg;
  *result_listener << "status is " << status.ToString() << ", reason "
                   << ::mrd::GetErrorDetail(status).reason();
  return status.code() == code &&
         ::mrd::GetErrorDetail(status).reason() == reason;
}

// A status carrying this seed outcome and reason.
MATCHER_P2(IsSeedError, seed, reason,
           std::string(::mrd::SeedStatusName(seed)) + " with reason " +
               reason) {
  const absl::Status& status = arg;
  ::mrd::ErrorDetail detail = ::mrd::GetErrorDetail(status);
  *result_listener << "status is " << status.ToString() << ", seed "
                   << ::mrd::SeedStatusName(detail.seed_status()) << ", reason "
                   << detail.reason();
  return status.code() == ::mrd::CodeForSeed(seed) &&
         detail.seed_status() == seed && detail.reason() == reason;
}

}  // namespace mrd::device::testing

#endif  // MRD_TESTS_UNIT_DEVICE_DEVICE_TEST_UTIL_H_
