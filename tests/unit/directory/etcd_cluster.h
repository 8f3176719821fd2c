// EtcdCluster: a real etcd cluster for the directory's tests, its members
// etcd processes (Debian's etcd-server) on 127.0.0.1 ports picked free, with
// their data in a temporary directory. Short heartbeat and election timeouts
// (50 ms, 500 ms) keep elections, and the tests, fast.
//
// Members can be killed (SIGKILL) and restarted on the same ports and data,
// as a member that crashed comes back. Each member dies with the test
// process (PR_SET_PDEATHSIG), so a crashed test leaves no etcd behind; the
// destructor kills them and removes the directory.
//
// Modes (EtcdClusterOptions): client URLs over TLS, with a CA, a server
// certificate for 127.0.0.1 and a client certificate made by the openssl
// command line in the cluster's directory (EC P-256 keys: fast), and a
// client certificate required or not; and etcd's authentication on, user
// root with a password in a file there (enabled with etcdctl once the
// members are ready). ClientOptions() are an EtcdClient's options for it.
//
// Not thread-safe: one thread (the test's main thread: a member's death
// signal is tied to the thread that started it) drives the cluster.
#ifndef MRD_TESTS_UNIT_DIRECTORY_ETCD_CLUSTER_H_
#define MRD_TESTS_UNIT_DIRECTORY_ETCD_CLUSTER_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/directory/etcd_client.h"

namespace mrd::testing {

struct EtcdClusterOptions {
  // Client URLs https://, certificates made in the cluster's directory.
  bool tls = false;
  // With tls: every client must show a certificate the CA signed.
  bool client_cert_auth = false;
  // etcd's authentication on: user root, password in password_file().
  bool auth = false;
  // etcd's --auth-token-ttl (simple tokens, seconds); 0: etcd's default.
  int auth_token_ttl_seconds = 0;
};

class EtcdCluster {
 public:
  // Starts `members` members and waits (polling, up to `timeout`) until
  // every one answers a linearizable read, which needs an elected leader.
  static absl::StatusOr<std::unique_ptr<EtcdCluster>> Start(
      int members, absl::Duration timeout = absl::Seconds(30));
  static absl::StatusOr<std::unique_ptr<EtcdCluster>> Start(
      int members, const EtcdClusterOptions& options,
      absl::Duration timeout = absl::Seconds(30));
  ~EtcdCluster();
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  int size() const { return static_cast<int>(members_.size()); }
  // "127.0.0.1:port" of every member's client URL, or of one.
  std::vector<std::string> endpoints() const;
  const std::string& endpoint(int member) const;
  // Options of a client of every member (or of one) in this cluster's
  // mode: the CA, the client certificate when it is required, the user.
  directory::EtcdClientOptions ClientOptions() const;
  directory::EtcdClientOptions ClientOptions(int member) const;

  // The mode's files (PEM; the password's, which ends in a newline).
  std::string ca_file() const { return dir_ + "/ca.crt"; }
  std::string other_ca_file() const { return dir_ + "/other-ca.crt"; }
  std::string client_cert_file() const { return dir_ + "/client.crt"; }
  std::string client_key_file() const { return dir_ + "/client.key"; }
  std::string password_file() const { return dir_ + "/password"; }
  const std::string& password() const { return password_; }
  static constexpr char kUser[] = "root";
  const std::string& dir() const { return dir_; }

  // SIGKILLs the member and reaps it. No-op if it is not running.
  void Kill(int member);
  // Starts a killed member again, on its ports and data; does not wait.
  absl::Status Restart(int member);
  // Polls until `member` answers a linearizable read, up to `timeout`.
  absl::Status WaitReady(int member, absl::Duration timeout);
  bool running(int member) const { return members_[member].pid > 0; }
  // The member's process; -1 when it is not running.
  pid_t pid(int member) const { return members_[member].pid; }
  // Runs etcdctl against `member` with `args` (TLS options added in the TLS
  // modes; with auth on, pass "--user=root:<password()>"), waits for it.
  absl::Status Etcdctl(int member, const std::vector<std::string>& args);
  // The member's output (for failure messages).
  std::string Log(int member) const;

 private:
  struct Member {
    std::string name;
    int client_port = 0;
    int peer_port = 0;
    pid_t pid = -1;
  };
  EtcdCluster() = default;
  static absl::StatusOr<std::unique_ptr<EtcdCluster>> StartOnce(
      int members, const EtcdClusterOptions& options, absl::Time deadline,
      bool* port_taken);
  absl::Status Spawn(int member);
  absl::Status MakeCertificates();
  std::string Url(int port) const;

  EtcdClusterOptions options_;
  std::string password_;
  std::string dir_;
  std::string initial_cluster_;
  std::string token_;
  std::vector<Member> members_;
  std::vector<std::string> endpoints_;
};

}  // namespace mrd::testing

#endif  // MRD_TESTS_UNIT_DIRECTORY_ETCD_CLUSTER_H_
