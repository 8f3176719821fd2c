// FakeMrd: an in-process stand-in for mrd for the client library's tests: a
// gRPC MemoryRegistration service on a temporary Unix socket and an fd socket
// (SOCK_SEQPACKET) speaking fd.proto. It keeps just enough state (sessions,
// buffers, registration references, MRs, LAMs) for the tests to assert that
// every handle the client made was released: each test is a leak test.
//
// Thread-safe: all state under mu_.
#ifndef MRD_TESTS_UNIT_CLIENT_FAKE_MRD_H_
#define MRD_TESTS_UNIT_CLIENT_FAKE_MRD_H_

#include <grpcpp/server.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mrd/v1/fd.pb.h"
#include "mrd/v1/mrd.grpc.pb.h"
#include "server/common/fd.h"

namespace mrd::testing {

class FakeMrd {
 public:
  FakeMrd();
  ~FakeMrd();

  const std::string& dir() const { return dir_; }
  std::string grpc_socket() const { return dir_ + "/mrd.sock"; }
  std::string fd_socket() const { return dir_ + "/fd.sock"; }

  // RegisterMr waits this long before answering (PENDING work).
  void set_register_delay(absl::Duration d) {
    absl::MutexLock l(&mu_);
    register_delay_ = d;
  }
  // The next fd-socket connection gets this error instead of a welcome.
  void RefuseNextFdConnection(absl::StatusCode code, std::string message);
  // Completions StreamCompletions sends for `session`.
  void QueueCompletion(const std::string& session, v1::Completion c);
  // Closes every fd-socket connection from the server side.
  void DropFdConnections();

  int sessions() const;
  int buffers() const;
  int registration_references() const;
  int mrs() const;
  int lams() const;
  int max_concurrent_registers() const;
  // Seals of the last fd imported, and its size.
  int last_import_seals() const;
  uint64_t last_import_size() const;
  int streams_open() const;

  // Exposed for the service implementation.
  class Service;
  friend class Service;

 private:
  struct Session {
    std::string kind;
    std::set<uint64_t> buffers;
  };
  struct Registration {
    std::string session;
    uint64_t buffer;
    uint64_t offset;
    uint64_t length;
    uint32_t flags;
    uint32_t references;
    uint64_t mr;
  };

  void AcceptLoop();
  void ServeFdConnection(UniqueFd conn);
  void EndSession(const std::string& token);
  std::string NewSession(const std::string& kind);

  std::string dir_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  UniqueFd listener_;
  UniqueFd stop_pipe_read_;
  UniqueFd stop_pipe_write_;
  std::thread acceptor_;

  mutable absl::Mutex mu_;
  std::vector<std::thread> fd_threads_ ABSL_GUARDED_BY(mu_);
  std::vector<int> fd_connections_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, Session> sessions_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::string> buffers_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Registration> registrations_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::string> mrs_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::string> lams_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<v1::Completion>> completions_
      ABSL_GUARDED_BY(mu_);
  absl::Duration register_delay_ ABSL_GUARDED_BY(mu_);
  int registers_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int max_registers_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int last_seals_ ABSL_GUARDED_BY(mu_) = -1;
  uint64_t last_size_ ABSL_GUARDED_BY(mu_) = 0;
  int streams_open_ ABSL_GUARDED_BY(mu_) = 0;
  bool refuse_next_ ABSL_GUARDED_BY(mu_) = false;
  absl::StatusCode refuse_code_ ABSL_GUARDED_BY(mu_);
  std::string refuse_message_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mrd::testing

#endif  // MRD_TESTS_UNIT_CLIENT_FAKE_MRD_H_
