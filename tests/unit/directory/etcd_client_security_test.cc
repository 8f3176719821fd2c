// EtcdClient over TLS and with etcd's user/password authentication, against
// a real etcd of one member (three for a failover; EtcdCluster's modes):
// with the CA the calls work, with no TLS or another CA they fail
// UNAVAILABLE; a member that requires a client certificate refuses a client
// without one. With authentication on, the right password works for every
// kind of call, a wrong one is refused (ETCD_AUTH_FAILED) without the error
// showing it, a call that fails over signs in on its new member, and a
// token that expired is replaced, neither seen by the caller. Options that
// name files that cannot be read, are not PEM, or do not go together are
// refused at Create (ETCD_BAD_CREDENTIALS), naming the file and never what
// it holds. Waits poll a condition against a deadline, but for the token's
// expiry, which etcd does not announce (a bounded wait).
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "server/directory/etcd_client.h"
#include "tests/unit/directory/etcd_cluster.h"

namespace mrd::directory {
namespace {

using testing::EtcdCluster;
using testing::EtcdClusterOptions;

absl::StatusOr<std::unique_ptr<EtcdClient>> NewClient(
    EtcdClientOptions options, absl::Duration call_timeout = absl::Seconds(5)) {
  options.call_timeout = call_timeout;
  options.attempt_timeout = call_timeout / 2;
  options.reconnect_backoff_max = absl::Milliseconds(250);
  return EtcdClient::Create(std::move(options));
}

// The keys a watch delivered puts of, waited on by condition.
class Puts {
 public:
  EtcdWatchCallback Callback() {
    return [this](absl::StatusOr<std::vector<EtcdWatchEvent>> events) {
      absl::MutexLock lock(&mu_);
      if (!events.ok()) return;
      for (const EtcdWatchEvent& e : *events) {
        if (e.type == EtcdWatchEvent::Type::kPut) keys_.push_back(e.key);
      }
    };
  }
  bool WaitFor(const std::string& key, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    const auto seen = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const std::string& k : keys_) {
        if (k == key) return true;
      }
      return false;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&seen), timeout);
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> keys_ ABSL_GUARDED_BY(mu_);
};

std::string Prefix() {
  return absl::StrCat(
      "/mrd-test/",
      ::testing::UnitTest::GetInstance()->current_test_info()->name(), "/");
}

// Put, Get, a lease kept alive through a renewal, and a watch: every kind of
// call the directory makes.
void ExpectEveryCallWorks(EtcdClient& client) {
  absl::StatusOr<EtcdLease> lease = client.Grant(absl::Seconds(3));
  ASSERT_TRUE(lease.ok()) << lease.status();
  absl::StatusOr<std::unique_ptr<EtcdLeaseKeeper>> keeper =
      client.KeepAlive(*lease, nullptr);
  ASSERT_TRUE(keeper.ok()) << keeper.status();
  Puts puts;
  absl::StatusOr<std::unique_ptr<EtcdWatch>> watch =
      client.Watch(Prefix(), 0, puts.Callback());
  ASSERT_TRUE(watch.ok()) << watch.status();
  absl::StatusOr<int64_t> put = client.Put(Prefix() + "k", "v", lease->id);
  ASSERT_TRUE(put.ok()) << put.status();
  absl::StatusOr<EtcdRange> range = client.Get(Prefix());
  ASSERT_TRUE(range.ok()) << range.status();
  ASSERT_EQ(range->kvs.size(), 1u);
  EXPECT_EQ(range->kvs[0].value, "v");
  EXPECT_TRUE(puts.WaitFor(Prefix() + "k", absl::Seconds(10)));
  // The keeper renews every third of the TTL: a renewal acknowledged.
  const absl::Time started = (*keeper)->last_renewed();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while ((*keeper)->last_renewed() == started && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_GT((*keeper)->last_renewed(), started);
  EXPECT_TRUE((*keeper)->status().ok()) << (*keeper)->status();
  keeper->reset();
  watch->reset();
  EXPECT_TRUE(client.Revoke(lease->id).ok());
}

// ---------------------------------------------------------------------------
// TLS

class EtcdTlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    EtcdClusterOptions options;
    options.tls = true;
    absl::StatusOr<std::unique_ptr<EtcdCluster>> cluster =
        EtcdCluster::Start(1, options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster).release();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(cluster_, nullptr); }
  static EtcdCluster* cluster_;
};
EtcdCluster* EtcdTlsTest::cluster_ = nullptr;

TEST_F(EtcdTlsTest, EveryCallWorksWithTheCa) {
  absl::StatusOr<std::unique_ptr<EtcdClient>> client =
      NewClient(cluster_->ClientOptions());
  ASSERT_TRUE(client.ok()) << client.status();
  ExpectEveryCallWorks(**client);
}

TEST_F(EtcdTlsTest, AClientWithoutTlsFailsUnavailable) {
  EtcdClientOptions options;
  options.endpoints = cluster_->endpoints();
  absl::StatusOr<std::unique_ptr<EtcdClient>> client =
      NewClient(options, absl::Seconds(1));
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<int64_t> put = (*client)->Put(Prefix() + "k", "v");
  ASSERT_FALSE(put.ok());
  EXPECT_EQ(put.status().code(), absl::StatusCode::kUnavailable)
      << put.status();
  EXPECT_EQ(GetErrorDetail(put.status()).reason(), "ETCD_UNAVAILABLE");
}

TEST_F(EtcdTlsTest, AClientTrustingAnotherCaFailsUnavailable) {
  EtcdClientOptions options = cluster_->ClientOptions();
  options.ca_file = cluster_->other_ca_file();
  absl::StatusOr<std::unique_ptr<EtcdClient>> client =
      NewClient(options, absl::Seconds(1));
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<int64_t> put = (*client)->Put(Prefix() + "k", "v");
  ASSERT_FALSE(put.ok());
  EXPECT_EQ(put.status().code(), absl::StatusCode::kUnavailable)
      << put.status();
  Puts puts;
  absl::StatusOr<std::unique_ptr<EtcdWatch>> watch =
      (*client)->Watch(Prefix(), 0, puts.Callback());
  ASSERT_FALSE(watch.ok());
  EXPECT_EQ(watch.status().code(), absl::StatusCode::kUnavailable);
}

class EtcdMutualTlsTest : public EtcdTlsTest {
 protected:
  static void SetUpTestSuite() {
    EtcdClusterOptions options;
    options.tls = true;
    options.client_cert_auth = true;
    absl::StatusOr<std::unique_ptr<EtcdCluster>> cluster =
        EtcdCluster::Start(1, options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster).release();
  }
};

TEST_F(EtcdMutualTlsTest, AClientWithItsCertificateWorks) {
  absl::StatusOr<std::unique_ptr<EtcdClient>> client =
      NewClient(cluster_->ClientOptions());
  ASSERT_TRUE(client.ok()) << client.status();
  ExpectEveryCallWorks(**client);
}

TEST_F(EtcdMutualTlsTest, AClientWithoutACertificateIsRefused) {
  EtcdClientOptions options = cluster_->ClientOptions();
  options.cert_file.clear();
  options.key_file.clear();
  absl::StatusOr<std::unique_ptr<EtcdClient>> client =
      NewClient(options, absl::Seconds(1));
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<int64_t> put = (*client)->Put(Prefix() + "k", "v");
  ASSERT_FALSE(put.ok());
  EXPECT_EQ(put.status().code(), absl::StatusCode::kUnavailable)
      << put.status();
}

// ---------------------------------------------------------------------------
// Authentication

class EtcdAuthTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    EtcdClusterOptions options;
    options.auth = true;
    absl::StatusOr<std::unique_ptr<EtcdCluster>> cluster =
        EtcdCluster::Start(1, options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster).release();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(cluster_, nullptr); }
  static EtcdCluster* cluster_;
};
EtcdCluster* EtcdAuthTest::cluster_ = nullptr;

TEST_F(EtcdAuthTest, TheRightPasswordWorksForEveryCall) {
  absl::StatusOr<std::unique_ptr<EtcdClient>> client =
      NewClient(cluster_->ClientOptions());
  ASSERT_TRUE(client.ok()) << client.status();
  ExpectEveryCallWorks(**client);
  EXPECT_EQ((*client)->authentications(), 1);
}

TEST_F(EtcdAuthTest, NoUserIsRefusedByEtcd) {
  EtcdClientOptions options = cluster_->ClientOptions();
  options.user.clear();
  options.password_file.clear();
  absl::StatusOr<std::unique_ptr<EtcdClient>> client = NewClient(options);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_FALSE((*client)->Put(Prefix() + "k", "v").ok());
}

TEST_F(EtcdAuthTest, AWrongPasswordIsRefusedWithoutShowingIt) {
  const std::string wrong = "wrong-" + cluster_->password();
  const std::string path = cluster_->dir() + "/wrong-password";
  {
    std::ofstream out(path);
    out << wrong << "\n";
  }
  EtcdClientOptions options = cluster_->ClientOptions();
  options.password_file = path;
  absl::StatusOr<std::unique_ptr<EtcdClient>> client = NewClient(options);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<int64_t> put = (*client)->Put(Prefix() + "k", "v");
  ASSERT_FALSE(put.ok());
  EXPECT_EQ(put.status().code(), absl::StatusCode::kUnauthenticated)
      << put.status();
  EXPECT_EQ(GetErrorDetail(put.status()).reason(), "ETCD_AUTH_FAILED");
  EXPECT_TRUE(absl::StrContains(put.status().message(), path)) << put.status();
  EXPECT_FALSE(absl::StrContains(put.status().ToString(), wrong));
  EXPECT_FALSE(
      absl::StrContains(put.status().ToString(), cluster_->password()));

  Puts puts;
  absl::StatusOr<std::unique_ptr<EtcdWatch>> watch =
      (*client)->Watch(Prefix(), 0, puts.Callback());
  ASSERT_FALSE(watch.ok());
  EXPECT_EQ(GetErrorDetail(watch.status()).reason(), "ETCD_AUTH_FAILED");
  EXPECT_FALSE(absl::StrContains(watch.status().ToString(), wrong));
  EXPECT_EQ((*client)->authentications(), 0);
}

// A user whose role may read only part of the keys: a watch elsewhere is
// refused at once with PERMISSION_DENIED (before, the client retried it on
// every member until its call timeout and said UNAVAILABLE), while a watch
// of what it may read works.
TEST_F(EtcdAuthTest, AWatchTheUserMayNotReadIsRefusedAtOnce) {
  const std::string root = "--user=root:" + cluster_->password();
  const std::string allowed = Prefix() + "allowed/";
  ASSERT_TRUE(
      cluster_
          ->Etcdctl(0, {root, "user", "add", "reader", "--interactive=false",
                        "--new-user-password=reader-secret"})
          .ok());
  ASSERT_TRUE(cluster_->Etcdctl(0, {root, "role", "add", "readers"}).ok());
  ASSERT_TRUE(cluster_
                  ->Etcdctl(0, {root, "role", "grant-permission", "readers",
                                "read", allowed, "--prefix=true"})
                  .ok());
  ASSERT_TRUE(
      cluster_->Etcdctl(0, {root, "user", "grant-role", "reader", "readers"})
          .ok());
  const std::string password_file = cluster_->dir() + "/reader-password";
  {
    std::ofstream out(password_file);
    out << "reader-secret\n";
  }
  EtcdClientOptions options = cluster_->ClientOptions();
  options.user = "reader";
  options.password_file = password_file;
  absl::StatusOr<std::unique_ptr<EtcdClient>> client =
      NewClient(options, absl::Seconds(20));
  ASSERT_TRUE(client.ok()) << client.status();

  Puts puts;
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<EtcdWatch>> refused =
      (*client)->Watch(Prefix() + "secret/", 0, puts.Callback());
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied)
      << refused.status();
  EXPECT_EQ(GetErrorDetail(refused.status()).reason(),
            "ETCD_PERMISSION_DENIED");
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "reader"));
  // Refused, not timed out (the call timeout is 20 s).
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));

  absl::StatusOr<std::unique_ptr<EtcdWatch>> watch =
      (*client)->Watch(allowed, 0, puts.Callback());
  ASSERT_TRUE(watch.ok()) << watch.status();
}

// Three members: a call that fails over signs in on the member it moves to
// (each member's token is its own), and the caller sees nothing of it.
TEST(EtcdAuthFailoverTest, AClientSignsInOnTheMemberItFailsOverTo) {
  EtcdClusterOptions cluster_options;
  cluster_options.auth = true;
  absl::StatusOr<std::unique_ptr<EtcdCluster>> cluster =
      EtcdCluster::Start(3, cluster_options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  absl::StatusOr<std::unique_ptr<EtcdClient>> client =
      NewClient((*cluster)->ClientOptions());
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->Put(Prefix() + "a", "1").ok());
  ASSERT_EQ((*client)->authentications(), 1);
  // The client starts on the first member; without it, the next.
  (*cluster)->Kill(0);
  absl::StatusOr<int64_t> put = (*client)->Put(Prefix() + "b", "2");
  ASSERT_TRUE(put.ok()) << put.status();
  // At least one more (a member tried while the others elect a leader
  // gives its token too); then each member's token is kept.
  const int64_t signed_in = (*client)->authentications();
  EXPECT_GE(signed_in, 2);
  absl::StatusOr<EtcdRange> range = (*client)->Get(Prefix());
  ASSERT_TRUE(range.ok()) << range.status();
  EXPECT_EQ(range->kvs.size(), 2u);
  EXPECT_EQ((*client)->authentications(), signed_in);
}

// Tokens that live 1 s unused (--auth-token-ttl). etcd drops a token within
// a second more (it looks every second) and says nothing then, so the test
// waits that long, a few times at most: a call that finds its token still
// good keeps it alive, and the next round tries again.
TEST(EtcdAuthTokenTest, AnExpiredTokenIsReplacedWithoutTheCallerSeeingIt) {
  EtcdClusterOptions cluster_options;
  cluster_options.auth = true;
  cluster_options.auth_token_ttl_seconds = 1;
  absl::StatusOr<std::unique_ptr<EtcdCluster>> cluster =
      EtcdCluster::Start(1, cluster_options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  absl::StatusOr<std::unique_ptr<EtcdClient>> writer =
      NewClient((*cluster)->ClientOptions());
  absl::StatusOr<std::unique_ptr<EtcdClient>> watcher =
      NewClient((*cluster)->ClientOptions());
  ASSERT_TRUE(writer.ok() && watcher.ok());
  ASSERT_TRUE((*writer)->Put(Prefix() + "a", "1").ok());
  ASSERT_TRUE((*watcher)->Get(Prefix()).ok());
  ASSERT_EQ((*writer)->authentications(), 1);
  ASSERT_EQ((*watcher)->authentications(), 1);

  // A watch (its stream cancelled for the token, then made again) and a
  // put (refused UNAUTHENTICATED, then tried again), each with a new token
  // and no error.
  Puts puts;
  std::unique_ptr<EtcdWatch> watch;
  for (int round = 0; round < 3; ++round) {
    if ((*watcher)->authentications() > 1 && (*writer)->authentications() > 1) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(2500));
    if ((*watcher)->authentications() == 1) {
      watch.reset();
      absl::StatusOr<std::unique_ptr<EtcdWatch>> made =
          (*watcher)->Watch(Prefix(), 0, puts.Callback());
      ASSERT_TRUE(made.ok()) << made.status();
      watch = std::move(*made);
    }
    if ((*writer)->authentications() == 1) {
      absl::StatusOr<int64_t> put =
          (*writer)->Put(absl::StrCat(Prefix(), "b", round), "2");
      ASSERT_TRUE(put.ok()) << put.status();
    }
  }
  EXPECT_EQ((*writer)->authentications(), 2);
  EXPECT_EQ((*watcher)->authentications(), 2);
  ASSERT_NE(watch, nullptr);
  const std::string after = Prefix() + "after";
  ASSERT_TRUE((*writer)->Put(after, "3").ok());
  EXPECT_TRUE(puts.WaitFor(after, absl::Seconds(10)));
  EXPECT_TRUE(absl::StrContains((*cluster)->Log(0), "invalid auth token"));
  watch.reset();
}

// ---------------------------------------------------------------------------
// Options refused at Create

class EtcdCredentialOptionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir();
    if (dir_.empty() || dir_.back() != '/') dir_ += '/';
    dir_ += absl::StrCat(
        "etcd-credentials-", getpid(), "-",
        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    options_.endpoints = {"127.0.0.1:2379"};
  }
  void TearDown() override {
    for (const std::string& path : written_) std::remove(path.c_str());
  }
  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "-" + name;
    std::ofstream out(path);
    out << text;
    written_.push_back(path);
    return path;
  }
  void ExpectRefused(const std::string& names, const std::string& secret) {
    absl::StatusOr<std::unique_ptr<EtcdClient>> client =
        EtcdClient::Create(options_);
    ASSERT_FALSE(client.ok());
    EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(GetErrorDetail(client.status()).reason(), "ETCD_BAD_CREDENTIALS")
        << client.status();
    EXPECT_TRUE(absl::StrContains(client.status().message(), names))
        << client.status();
    if (!secret.empty()) {
      EXPECT_FALSE(absl::StrContains(client.status().ToString(), secret))
          << client.status();
    }
  }
  std::string dir_;
  std::vector<std::string> written_;  // removed by TearDown
  EtcdClientOptions options_;
};

TEST_F(EtcdCredentialOptionsTest, AnUnreadableCaFileIsRefused) {
  options_.ca_file = dir_ + "-absent.crt";
  ExpectRefused(options_.ca_file, "");
}

TEST_F(EtcdCredentialOptionsTest, FilesThatAreNotPemAreRefusedUnshown) {
  const std::string secret = "not-pem-but-secret-bytes";
  options_.ca_file = Write("ca.crt", secret);
  ExpectRefused(options_.ca_file, secret);
  // A key where the certificate should be, and the other way round.
  const std::string key =
      "-----BEGIN PRIVATE KEY-----\nc2VjcmV0LWtleQ==\n-----END PRIVATE "
      "KEY-----\n";
  const std::string cert =
      "-----BEGIN CERTIFICATE-----\nY2VydA==\n-----END CERTIFICATE-----\n";
  options_.ca_file = Write("key-as-ca.crt", key);
  ExpectRefused(options_.ca_file, "c2VjcmV0LWtleQ");
  options_.ca_file.clear();
  options_.cert_file = Write("client.crt", cert);
  options_.key_file = Write("cert-as.key", cert);
  ExpectRefused(options_.key_file, "");
}

TEST_F(EtcdCredentialOptionsTest, ACertificateWithoutItsKeyIsRefused) {
  options_.cert_file = dir_ + "-client.crt";
  ExpectRefused("without its key", "");
  options_.cert_file.clear();
  options_.key_file = dir_ + "-client.key";
  ExpectRefused("without its certificate", "");
}

TEST_F(EtcdCredentialOptionsTest, UserAndPasswordFileGoTogether) {
  options_.user = "root";
  ExpectRefused("without a password file", "");
  options_.user.clear();
  options_.password_file = Write("password", "hunter2\n");
  ExpectRefused("without a user", "hunter2");
  options_.user = "root";
  options_.password_file = Write("empty-password", "\n");
  ExpectRefused(options_.password_file, "");
  options_.password_file = dir_ + "-absent-password";
  ExpectRefused(options_.password_file, "");
}

}  // namespace
}  // namespace mrd::directory
