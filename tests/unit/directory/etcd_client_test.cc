// EtcdClient against a real three-member etcd cluster on loopback
// (EtcdCluster): leases that lapse and leases kept alive, puts, gets,
// deletes and watches; then members killed: one (the others serve on), and
// all (calls fail with UNAVAILABLE in bounded time, and work again once the
// members are back). Nothing waits by sleeping: every wait polls a
// condition against a deadline.
#include "server/directory/etcd_client.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "tests/unit/directory/etcd_cluster.h"

namespace mrd::directory {
namespace {

using testing::EtcdCluster;

std::unique_ptr<EtcdClient> NewClient(
    const std::vector<std::string>& endpoints,
    absl::Duration call_timeout = absl::Seconds(5)) {
  EtcdClientOptions options;
  options.endpoints = endpoints;
  options.call_timeout = call_timeout;
  options.attempt_timeout = call_timeout / 4;
  options.reconnect_backoff_max = absl::Milliseconds(250);
  absl::StatusOr<std::unique_ptr<EtcdClient>> client =
      EtcdClient::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? std::move(*client) : nullptr;
}

// The values under `prefix`, or the error's text.
std::vector<std::string> Values(EtcdClient& client, absl::string_view prefix) {
  absl::StatusOr<EtcdRange> range = client.Get(prefix);
  if (!range.ok()) return {std::string(range.status().ToString())};
  std::vector<std::string> values;
  for (const EtcdKeyValue& kv : range->kvs) values.push_back(kv.value);
  return values;
}

// Collects a watch's events; waits for a count of them with a deadline.
class EventLog {
 public:
  EtcdWatchCallback Callback() {
    return [this](absl::StatusOr<std::vector<EtcdWatchEvent>> events) {
      absl::MutexLock lock(&mu_);
      if (!events.ok()) {
        end_ = events.status();
        return;
      }
      for (EtcdWatchEvent& event : *events) events_.push_back(std::move(event));
    };
  }
  // The first `count` events, once there are that many (fewer at the
  // deadline).
  std::vector<EtcdWatchEvent> WaitFor(
      size_t count, absl::Duration timeout = absl::Seconds(10)) {
    absl::MutexLock lock(&mu_);
    const auto enough = [this, count]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return events_.size() >= count;
    };
    mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
    return events_;
  }
  // Whether a delete of `key` came within `timeout`: waits for it, not for
  // the time to pass.
  bool WaitForDelete(const std::string& key, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    const auto deleted = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const EtcdWatchEvent& event : events_) {
        if (event.type == EtcdWatchEvent::Type::kDelete && event.key == key) {
          return true;
        }
      }
      return false;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&deleted), timeout);
  }

 private:
  absl::Mutex mu_;
  std::vector<EtcdWatchEvent> events_ ABSL_GUARDED_BY(mu_);
  absl::Status end_ ABSL_GUARDED_BY(mu_);
};

// One cluster for the suite's tests, which use distinct key prefixes and
// kill no member.
class EtcdClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<EtcdCluster>> cluster =
        EtcdCluster::Start(3);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster).release();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(cluster_, nullptr);
    client_ = NewClient(cluster_->endpoints());
    ASSERT_NE(client_, nullptr);
  }
  // A prefix of this test's own.
  static std::string Prefix() {
    const ::testing::TestInfo* info =
        ::testing::UnitTest::GetInstance()->current_test_info();
    return absl::StrCat("/mrd-test/", info->name(), "/");
  }

  // A key, Prefix() + "k" = "v", under a fresh lease of 1 s, and a watch of
  // the prefix from after that put into `log`.
  struct WatchedLeasedKey {
    EtcdLease lease;
    absl::Time granted;
    std::unique_ptr<EtcdWatch> watch;
  };
  void PutWatchedLeasedKey(EventLog* log, WatchedLeasedKey* out) {
    absl::StatusOr<EtcdLease> lease = client_->Grant(absl::Seconds(1));
    ASSERT_TRUE(lease.ok()) << lease.status();
    out->lease = *lease;
    out->granted = absl::Now();
    absl::StatusOr<int64_t> put = client_->Put(Prefix() + "k", "v", lease->id);
    ASSERT_TRUE(put.ok()) << put.status();
    absl::StatusOr<std::unique_ptr<EtcdWatch>> watch =
        client_->Watch(Prefix(), *put + 1, log->Callback());
    ASSERT_TRUE(watch.ok()) << watch.status();
    out->watch = *std::move(watch);
  }

  static EtcdCluster* cluster_;
  std::unique_ptr<EtcdClient> client_;
};
EtcdCluster* EtcdClientTest::cluster_ = nullptr;

TEST(EtcdClientOptionsTest, CreateRefusesMissingOrMalformedEndpoints) {
  EtcdClientOptions options;
  absl::StatusOr<std::unique_ptr<EtcdClient>> client =
      EtcdClient::Create(options);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GetErrorDetail(client.status()).reason(), "ETCD_BAD_ENDPOINT");
  for (const char* bad : {"127.0.0.1", "http://127.0.0.1:2379", ":2379"}) {
    options.endpoints = {"127.0.0.1:2379", bad};
    client = EtcdClient::Create(options);
    ASSERT_FALSE(client.ok()) << bad;
    EXPECT_EQ(GetErrorDetail(client.status()).reason(), "ETCD_BAD_ENDPOINT")
        << bad;
  }
  options.endpoints = {"127.0.0.1:2379"};
  options.call_timeout = absl::ZeroDuration();
  EXPECT_EQ(GetErrorDetail(EtcdClient::Create(options).status()).reason(),
            "ETCD_BAD_ARGUMENT");
}

TEST_F(EtcdClientTest, PutThenGetReturnsTheValueAndItsLease) {
  absl::StatusOr<EtcdLease> lease = client_->Grant(absl::Seconds(30));
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_GT(lease->id, 0);
  EXPECT_GE(lease->ttl, absl::Seconds(30));
  absl::StatusOr<int64_t> revision =
      client_->Put(Prefix() + "a", "value-a", lease->id);
  ASSERT_TRUE(revision.ok()) << revision.status();
  ASSERT_TRUE(client_->Put(Prefix() + "b", "value-b").ok());
  // A key beside the prefix, not under it.
  ASSERT_TRUE(
      client_->Put(Prefix().substr(0, Prefix().size() - 1) + "x", "x").ok());

  absl::StatusOr<EtcdRange> range = client_->Get(Prefix());
  ASSERT_TRUE(range.ok()) << range.status();
  ASSERT_EQ(range->kvs.size(), 2u);
  EXPECT_EQ(range->kvs[0].key, Prefix() + "a");
  EXPECT_EQ(range->kvs[0].value, "value-a");
  EXPECT_EQ(range->kvs[0].lease, lease->id);
  EXPECT_EQ(range->kvs[0].mod_revision, *revision);
  EXPECT_EQ(range->kvs[1].value, "value-b");
  EXPECT_EQ(range->kvs[1].lease, 0);
  EXPECT_GE(range->revision, *revision);
  EXPECT_TRUE(client_->Revoke(lease->id).ok());
}

TEST_F(EtcdClientTest, PutOfAnEmptyKeyIsRefused) {
  absl::StatusOr<int64_t> put = client_->Put("", "v");
  ASSERT_FALSE(put.ok());
  EXPECT_EQ(GetErrorDetail(put.status()).reason(), "ETCD_BAD_ARGUMENT");
}

TEST_F(EtcdClientTest, PutIfAbsentWritesOnceAndLeavesAnothersKeyAlone) {
  absl::StatusOr<EtcdLease> lease = client_->Grant(absl::Seconds(30));
  ASSERT_TRUE(lease.ok()) << lease.status();
  absl::StatusOr<int64_t> first =
      client_->PutIfAbsent(Prefix() + "name", "mine", lease->id);
  ASSERT_TRUE(first.ok()) << first.status();
  // The same write again (a retry): written already, same revision.
  absl::StatusOr<int64_t> again =
      client_->PutIfAbsent(Prefix() + "name", "mine", lease->id);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *first);
  // Another writer's value: refused, the key untouched.
  absl::StatusOr<int64_t> other =
      client_->PutIfAbsent(Prefix() + "name", "theirs", 0);
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(GetErrorDetail(other.status()).reason(), "ETCD_KEY_EXISTS");
  EXPECT_EQ(Values(*client_, Prefix()), std::vector<std::string>{"mine"});
  EXPECT_TRUE(client_->Revoke(lease->id).ok());
}

TEST_F(EtcdClientTest, PutIfAbsentOrOwnedRewritesOwnKeysOnly) {
  absl::StatusOr<EtcdLease> mine = client_->Grant(absl::Seconds(30));
  ASSERT_TRUE(mine.ok()) << mine.status();
  absl::StatusOr<EtcdLease> theirs = client_->Grant(absl::Seconds(30));
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  // Absent: written.
  absl::StatusOr<int64_t> first =
      client_->PutIfAbsentOrOwned(Prefix() + "name", "v1", mine->id);
  ASSERT_TRUE(first.ok()) << first.status();
  // The same again: written already, same revision.
  absl::StatusOr<int64_t> again =
      client_->PutIfAbsentOrOwned(Prefix() + "name", "v1", mine->id);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *first);
  // Ours: rewritten with the new value.
  absl::StatusOr<int64_t> rewritten =
      client_->PutIfAbsentOrOwned(Prefix() + "name", "v2", mine->id);
  ASSERT_TRUE(rewritten.ok()) << rewritten.status();
  EXPECT_GT(*rewritten, *first);
  EXPECT_EQ(Values(*client_, Prefix()), std::vector<std::string>{"v2"});
  // Another lease's, or no lease's: refused, untouched.
  absl::StatusOr<int64_t> other =
      client_->PutIfAbsentOrOwned(Prefix() + "name", "x", theirs->id);
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(GetErrorDetail(other.status()).reason(), "ETCD_KEY_EXISTS");
  ASSERT_TRUE(client_->Put(Prefix() + "plain", "p").ok());
  other = client_->PutIfAbsentOrOwned(Prefix() + "plain", "x", mine->id);
  EXPECT_EQ(GetErrorDetail(other.status()).reason(), "ETCD_KEY_EXISTS");
  EXPECT_EQ(Values(*client_, Prefix()), (std::vector<std::string>{"v2", "p"}));
  // No lease, or a lease that is gone.
  EXPECT_EQ(GetErrorDetail(
                client_->PutIfAbsentOrOwned(Prefix() + "k", "v", 0).status())
                .reason(),
            "ETCD_BAD_ARGUMENT");
  ASSERT_TRUE(client_->Revoke(theirs->id).ok());
  absl::StatusOr<int64_t> gone =
      client_->PutIfAbsentOrOwned(Prefix() + "k", "v", theirs->id);
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(GetErrorDetail(gone.status()).reason(), "ETCD_LEASE_NOT_FOUND");
  EXPECT_TRUE(client_->Revoke(mine->id).ok());
}

TEST_F(EtcdClientTest, DeleteIfOwnedDeletesOnlyTheLeasesKey) {
  absl::StatusOr<EtcdLease> mine = client_->Grant(absl::Seconds(30));
  ASSERT_TRUE(mine.ok()) << mine.status();
  absl::StatusOr<EtcdLease> theirs = client_->Grant(absl::Seconds(30));
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  ASSERT_TRUE(client_->Put(Prefix() + "a", "mine", mine->id).ok());
  ASSERT_TRUE(client_->Put(Prefix() + "b", "theirs", theirs->id).ok());
  ASSERT_TRUE(client_->Put(Prefix() + "c", "nobody's").ok());
  absl::StatusOr<int64_t> deleted =
      client_->DeleteIfOwned(Prefix() + "b", mine->id);
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_EQ(*deleted, 0);
  deleted = client_->DeleteIfOwned(Prefix() + "c", mine->id);
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_EQ(*deleted, 0);
  deleted = client_->DeleteIfOwned(Prefix() + "absent", mine->id);
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_EQ(*deleted, 0);
  deleted = client_->DeleteIfOwned(Prefix() + "a", mine->id);
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_EQ(*deleted, 1);
  EXPECT_EQ(Values(*client_, Prefix()),
            (std::vector<std::string>{"theirs", "nobody's"}));
  EXPECT_EQ(GetErrorDetail(client_->DeleteIfOwned(Prefix() + "b", 0).status())
                .reason(),
            "ETCD_BAD_ARGUMENT");
  EXPECT_TRUE(client_->Revoke(mine->id).ok());
  EXPECT_TRUE(client_->Revoke(theirs->id).ok());
}

TEST_F(EtcdClientTest, WriteAllIfFreshWritesAllOrNothing) {
  absl::StatusOr<EtcdLease> mine = client_->Grant(absl::Seconds(30));
  ASSERT_TRUE(mine.ok()) << mine.status();
  ASSERT_TRUE(client_->Put(Prefix() + "old", "mine", mine->id).ok());
  ASSERT_TRUE(client_->Put(Prefix() + "theirs", "theirs").ok());
  using Write = EtcdClient::Write;
  // Two new keys and a delete of one of the lease's: all done.
  absl::StatusOr<bool> done = client_->WriteAllIfFresh(
      {Write{Prefix() + "a", "1"}, Write{Prefix() + "b", "2"},
       Write{Prefix() + "old", std::nullopt}},
      mine->id);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_TRUE(*done);
  EXPECT_EQ(Values(*client_, Prefix()),
            (std::vector<std::string>{"1", "2", "theirs"}));
  // A put of a key that exists, or a delete of a key not the lease's (or
  // absent): nothing at all is written.
  for (const Write& stale : {Write{Prefix() + "a", "again"},
                             Write{Prefix() + "theirs", std::nullopt},
                             Write{Prefix() + "absent", std::nullopt}}) {
    done =
        client_->WriteAllIfFresh({Write{Prefix() + "c", "3"}, stale}, mine->id);
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_FALSE(*done) << stale.key;
    EXPECT_EQ(Values(*client_, Prefix()),
              (std::vector<std::string>{"1", "2", "theirs"}));
  }
  // Refused before etcd: none, too many, a key twice, lease 0.
  std::vector<Write> many(EtcdClient::kMaxWritesPerTxn + 1);
  for (size_t i = 0; i < many.size(); ++i) {
    many[i] = Write{absl::StrCat(Prefix(), "m", i), "v"};
  }
  for (const absl::StatusOr<bool>& refused :
       {client_->WriteAllIfFresh({}, mine->id),
        client_->WriteAllIfFresh(many, mine->id),
        client_->WriteAllIfFresh(
            {Write{Prefix() + "d", "1"}, Write{Prefix() + "d", std::nullopt}},
            mine->id),
        client_->WriteAllIfFresh({Write{Prefix() + "d", "1"}}, 0)}) {
    EXPECT_EQ(GetErrorDetail(refused.status()).reason(), "ETCD_BAD_ARGUMENT")
        << refused.status();
  }
  EXPECT_TRUE(client_->Revoke(mine->id).ok());
}

TEST_F(EtcdClientTest, DeleteRemovesTheKey) {
  ASSERT_TRUE(client_->Put(Prefix() + "k", "v").ok());
  absl::StatusOr<int64_t> deleted = client_->Delete(Prefix() + "k");
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_EQ(*deleted, 1);
  EXPECT_TRUE(Values(*client_, Prefix()).empty());
  deleted = client_->Delete(Prefix() + "k");
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_EQ(*deleted, 0);
}

TEST_F(EtcdClientTest, KeyOfALeaseNotKeptAliveVanishesWithinItsTtl) {
  EventLog log;
  WatchedLeasedKey key;
  ASSERT_NO_FATAL_FAILURE(PutWatchedLeasedKey(&log, &key));
  const EtcdLease* lease = &key.lease;
  const absl::Time granted = key.granted;
  // etcd's leader looks for expired leases every 500 ms and revokes them in
  // a proposal of its own: the TTL and a little more.
  EXPECT_TRUE(log.WaitForDelete(
      Prefix() + "k", granted + lease->ttl + absl::Seconds(2) - absl::Now()));
  EXPECT_TRUE(Values(*client_, Prefix()).empty());
  absl::StatusOr<absl::Duration> left = client_->TimeToLive(lease->id);
  ASSERT_FALSE(left.ok());
  EXPECT_EQ(GetErrorDetail(left.status()).reason(), "ETCD_LEASE_NOT_FOUND");
  absl::StatusOr<int64_t> put = client_->Put(Prefix() + "k", "v", lease->id);
  ASSERT_FALSE(put.ok());
  EXPECT_EQ(put.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(GetErrorDetail(put.status()).reason(), "ETCD_LEASE_NOT_FOUND");
}

TEST_F(EtcdClientTest, KeyOfALeaseKeptAliveOutlivesItsTtl) {
  EventLog log;
  WatchedLeasedKey key;
  ASSERT_NO_FATAL_FAILURE(PutWatchedLeasedKey(&log, &key));
  const EtcdLease* lease = &key.lease;
  const absl::Time granted = key.granted;
  absl::Mutex mu;
  absl::Status lost;
  absl::StatusOr<std::unique_ptr<EtcdLeaseKeeper>> keeper =
      client_->KeepAlive(*lease, [&](absl::Status status) {
        absl::MutexLock lock(&mu);
        lost = std::move(status);
      });
  ASSERT_TRUE(keeper.ok()) << keeper.status();
  // No delete for three TTLs; the key and the lease are still there.
  EXPECT_FALSE(log.WaitForDelete(Prefix() + "k", 3 * lease->ttl));
  EXPECT_EQ(Values(*client_, Prefix()), std::vector<std::string>{"v"});
  absl::StatusOr<absl::Duration> left = client_->TimeToLive(lease->id);
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_TRUE((*keeper)->status().ok());
  EXPECT_GT((*keeper)->last_renewed(), granted + lease->ttl);
  keeper->reset();
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(lost.ok()) << lost;
  }
  EXPECT_TRUE(client_->Revoke(lease->id).ok());
}

TEST_F(EtcdClientTest, RevokeDeletesTheKeysAndTheKeeperReportsTheLoss) {
  absl::StatusOr<EtcdLease> lease = client_->Grant(absl::Seconds(3));
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE(client_->Put(Prefix() + "k", "v", lease->id).ok());
  absl::Mutex mu;
  absl::Status lost;
  bool called = false;
  absl::StatusOr<std::unique_ptr<EtcdLeaseKeeper>> keeper =
      client_->KeepAlive(*lease, [&](absl::Status status) {
        absl::MutexLock lock(&mu);
        lost = std::move(status);
        called = true;
      });
  ASSERT_TRUE(keeper.ok()) << keeper.status();
  ASSERT_TRUE(client_->Revoke(lease->id).ok());
  EXPECT_TRUE(Values(*client_, Prefix()).empty());
  {
    absl::MutexLock lock(&mu);
    // The next renewal, a third of the TTL on, finds the lease gone.
    mu.AwaitWithTimeout(absl::Condition(&called), lease->ttl);
    ASSERT_TRUE(called);
    EXPECT_EQ(lost.code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(GetErrorDetail(lost).reason(), "ETCD_LEASE_NOT_FOUND");
  }
  EXPECT_EQ(GetErrorDetail((*keeper)->status()).reason(),
            "ETCD_LEASE_NOT_FOUND");
  absl::Status again = client_->Revoke(lease->id);
  EXPECT_EQ(GetErrorDetail(again).reason(), "ETCD_LEASE_NOT_FOUND") << again;
}

TEST_F(EtcdClientTest, WatchDeliversAPutAndADelete) {
  EventLog log;
  absl::StatusOr<std::unique_ptr<EtcdWatch>> watch =
      client_->Watch(Prefix(), 0, log.Callback());
  ASSERT_TRUE(watch.ok()) << watch.status();
  absl::StatusOr<EtcdLease> lease = client_->Grant(absl::Seconds(30));
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE(client_->Put(Prefix() + "k", "v", lease->id).ok());
  ASSERT_TRUE(client_->Put("/mrd-test/elsewhere", "not watched").ok());
  ASSERT_TRUE(client_->Delete(Prefix() + "k").ok());

  std::vector<EtcdWatchEvent> events = log.WaitFor(2);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].type, EtcdWatchEvent::Type::kPut);
  EXPECT_EQ(events[0].key, Prefix() + "k");
  EXPECT_EQ(events[0].value, "v");
  EXPECT_EQ(events[0].lease, lease->id);
  EXPECT_EQ(events[1].type, EtcdWatchEvent::Type::kDelete);
  EXPECT_EQ(events[1].key, Prefix() + "k");
  EXPECT_GT(events[1].mod_revision, events[0].mod_revision);
  EXPECT_EQ((*watch)->reconnects(), 0);
  EXPECT_TRUE(client_->Revoke(lease->id).ok());
}

TEST_F(EtcdClientTest, WatchFromAGetsRevisionMissesNothingWrittenBetween) {
  ASSERT_TRUE(client_->Put(Prefix() + "before", "1").ok());
  absl::StatusOr<EtcdRange> range = client_->Get(Prefix());
  ASSERT_TRUE(range.ok()) << range.status();
  ASSERT_TRUE(client_->Put(Prefix() + "between", "2").ok());
  EventLog log;
  absl::StatusOr<std::unique_ptr<EtcdWatch>> watch =
      client_->Watch(Prefix(), range->revision + 1, log.Callback());
  ASSERT_TRUE(watch.ok()) << watch.status();
  ASSERT_TRUE(client_->Put(Prefix() + "after", "3").ok());
  std::vector<EtcdWatchEvent> events = log.WaitFor(2);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].key, Prefix() + "between");
  EXPECT_EQ(events[1].key, Prefix() + "after");
}

// Members killed and restarted: a cluster of the suite's own, every test
// leaving all its members running.
class EtcdFailoverTest : public EtcdClientTest {
 protected:
  void TearDown() override {
    if (cluster_ == nullptr) return;
    for (int i = 0; i < cluster_->size(); ++i) {
      if (!cluster_->running(i)) {
        EXPECT_TRUE(cluster_->Restart(i).ok());
      }
    }
    for (int i = 0; i < cluster_->size(); ++i) {
      absl::Status ready = cluster_->WaitReady(i, absl::Seconds(20));
      EXPECT_TRUE(ready.ok()) << ready << "\n" << cluster_->Log(i);
    }
  }
};

TEST_F(EtcdFailoverTest, OneMemberKilledPutsGetsWatchesAndLeasesGoOn) {
  // Longer than an election (up to twice the 500 ms election timeout) if the
  // member killed is the leader: no renewal is acknowledged until then; and
  // with room for renewals slowed by a loaded host (each member gets a
  // quarter of the TTL).
  absl::StatusOr<EtcdLease> lease = client_->Grant(absl::Seconds(3));
  ASSERT_TRUE(lease.ok()) << lease.status();
  absl::StatusOr<std::unique_ptr<EtcdLeaseKeeper>> keeper =
      client_->KeepAlive(*lease, [](absl::Status) {});
  ASSERT_TRUE(keeper.ok()) << keeper.status();
  ASSERT_TRUE(client_->Put(Prefix() + "leased", "v", lease->id).ok());
  EventLog log;
  // The client starts at the first member: the watch and the calls below
  // are on the member that dies.
  absl::StatusOr<std::unique_ptr<EtcdWatch>> watch =
      client_->Watch(Prefix(), 0, log.Callback());
  ASSERT_TRUE(watch.ok()) << watch.status();
  ASSERT_TRUE(client_->Put(Prefix() + "0", "0").ok());

  cluster_->Kill(0);
  const absl::Time killed = absl::Now();
  for (int i = 1; i <= 5; ++i) {
    absl::StatusOr<int64_t> put =
        client_->Put(absl::StrCat(Prefix(), i), absl::StrCat(i));
    ASSERT_TRUE(put.ok()) << put.status();
  }
  EXPECT_EQ(Values(*client_, Prefix() + "leased"),
            std::vector<std::string>{"v"});
  EXPECT_EQ(Values(*client_, Prefix()).size(), 7u);
  // The watch moved to another member and missed nothing.
  std::vector<EtcdWatchEvent> events = log.WaitFor(6);
  ASSERT_EQ(events.size(), 6u);
  for (int i = 0; i <= 5; ++i) {
    EXPECT_EQ(events[static_cast<size_t>(i)].key, absl::StrCat(Prefix(), i));
  }
  EXPECT_GE((*watch)->reconnects(), 1);
  // The keeper renews through the others: the leased key outlives two TTLs
  // after the kill.
  EXPECT_FALSE(log.WaitForDelete(Prefix() + "leased",
                                 killed + 2 * lease->ttl - absl::Now()));
  EXPECT_EQ(Values(*client_, Prefix() + "leased"),
            std::vector<std::string>{"v"});
  EXPECT_TRUE((*keeper)->status().ok()) << (*keeper)->status();
  keeper->reset();
  EXPECT_TRUE(client_->Revoke(lease->id).ok());
}

TEST_F(EtcdFailoverTest, AllMembersDownCallsFailUnavailableThenRecover) {
  std::unique_ptr<EtcdClient> client =
      NewClient(cluster_->endpoints(), absl::Seconds(1));
  ASSERT_TRUE(client->Put(Prefix() + "k", "before").ok());
  // A watch made before the outage, to see what is written after it.
  EventLog survivor;
  absl::StatusOr<std::unique_ptr<EtcdWatch>> survivor_watch =
      client->Watch(Prefix(), 0, survivor.Callback());
  ASSERT_TRUE(survivor_watch.ok()) << survivor_watch.status();
  for (int i = 0; i < cluster_->size(); ++i) cluster_->Kill(i);

  const absl::Time start = absl::Now();
  absl::StatusOr<int64_t> put = client->Put(Prefix() + "k", "during");
  absl::StatusOr<EtcdRange> get = client->Get(Prefix());
  absl::StatusOr<EtcdLease> grant = client->Grant(absl::Seconds(5));
  const absl::Duration took = absl::Now() - start;
  for (const absl::Status& status :
       {put.status(), get.status(), grant.status()}) {
    ASSERT_FALSE(status.ok());
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
    EXPECT_EQ(GetErrorDetail(status).reason(), "ETCD_UNAVAILABLE") << status;
    EXPECT_NE(status.message().find(cluster_->endpoint(2)),
              absl::string_view::npos)
        << status;
  }
  // Three calls of a 1 s timeout each: bounded, not a hang.
  EXPECT_LT(took, absl::Seconds(4));
  // A watch cannot be created either, within the call timeout.
  EventLog log;
  absl::StatusOr<std::unique_ptr<EtcdWatch>> watch =
      client->Watch(Prefix(), 0, log.Callback());
  ASSERT_FALSE(watch.ok());
  EXPECT_EQ(GetErrorDetail(watch.status()).reason(), "ETCD_UNAVAILABLE");

  for (int i = 0; i < cluster_->size(); ++i) {
    ASSERT_TRUE(cluster_->Restart(i).ok());
  }
  // Back: the same client succeeds again once a leader is elected.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  do {
    put = client->Put(Prefix() + "k", "after");
  } while (!put.ok() && absl::Now() < deadline);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(Values(*client, Prefix()), std::vector<std::string>{"after"});
  // The watch made before the outage found a member again and resumed. It
  // sees one put of "after" per attempt that the cluster committed: an
  // attempt may commit yet answer after its 1 s deadline (a slow build, a
  // fresh leader), and the loop above then puts again. Nothing else is seen.
  std::vector<EtcdWatchEvent> events = survivor.WaitFor(1);
  ASSERT_GE(events.size(), 1u);
  for (const EtcdWatchEvent& event : events) {
    EXPECT_EQ(event.type, EtcdWatchEvent::Type::kPut);
    EXPECT_EQ(event.key, Prefix() + "k");
    EXPECT_EQ(event.value, "after");
  }
  EXPECT_GE((*survivor_watch)->reconnects(), 1);
}

}  // namespace
}  // namespace mrd::directory
