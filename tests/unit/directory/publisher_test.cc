// Publisher against a real three-member etcd cluster on loopback
// (EtcdCluster): keys published under the process's lease, rewritten,
// unpublished; a key another lease holds left alone; the bound; a clean
// stop, a process gone without one, a handover of the lease; then the lease
// revoked from outside and every member down. Nothing waits for time to
// pass: a wait is an etcd watch, a Done, or a poll of a condition (every
// few milliseconds) against a deadline.
#include "server/directory/publisher.h"

#include <functional>
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

constexpr absl::Duration kTtl = absl::Seconds(2);

EtcdClientOptions ClientOptions(const std::vector<std::string>& endpoints,
                                absl::Duration call_timeout) {
  EtcdClientOptions options;
  options.endpoints = endpoints;
  options.call_timeout = call_timeout;
  options.attempt_timeout = call_timeout / 4;
  options.reconnect_backoff_max = absl::Milliseconds(250);
  return options;
}

PublisherOptions Options(const std::vector<std::string>& endpoints,
                         absl::Duration call_timeout = absl::Seconds(5)) {
  PublisherOptions options;
  options.etcd = ClientOptions(endpoints, call_timeout);
  options.lease_ttl = kTtl;
  options.retry_min = absl::Milliseconds(20);
  options.retry_max = absl::Milliseconds(200);
  return options;
}

std::unique_ptr<Publisher> NewPublisher(PublisherOptions options) {
  absl::StatusOr<std::unique_ptr<Publisher>> publisher =
      Publisher::Start(std::move(options));
  EXPECT_TRUE(publisher.ok()) << publisher.status();
  return publisher.ok() ? std::move(*publisher) : nullptr;
}

// Polls `condition` every few milliseconds until it holds or `timeout`
// passes; whether it held.
bool Eventually(const std::function<bool()>& condition,
                absl::Duration timeout = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

bool IsState(const Publisher& publisher, const std::string& key,
             KeyState state) {
  absl::StatusOr<KeyState> got = publisher.StateOf(key);
  return got.ok() && *got == state;
}

// The keys under `prefix` (empty on an error, which fails the test).
std::vector<EtcdKeyValue> Keys(EtcdClient& client, absl::string_view prefix) {
  absl::StatusOr<EtcdRange> range = client.Get(prefix);
  EXPECT_TRUE(range.ok()) << range.status();
  return range.ok() ? std::move(range->kvs) : std::vector<EtcdKeyValue>{};
}

// Collects a watch's events; waits for them with a deadline.
class EventLog {
 public:
  EtcdWatchCallback Callback() {
    return [this](absl::StatusOr<std::vector<EtcdWatchEvent>> events) {
      absl::MutexLock lock(&mu_);
      if (!events.ok()) return;
      for (EtcdWatchEvent& event : *events) events_.push_back(std::move(event));
    };
  }
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
};

// One cluster for the suite's tests, which use distinct key prefixes and
// kill no member.
class PublisherTest : public ::testing::Test {
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
    absl::StatusOr<std::unique_ptr<EtcdClient>> client = EtcdClient::Create(
        ClientOptions(cluster_->endpoints(), absl::Seconds(5)));
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }
  // A prefix of this test's own.
  static std::string Prefix() {
    const ::testing::TestInfo* info =
        ::testing::UnitTest::GetInstance()->current_test_info();
    return absl::StrCat("/mrd-test/", info->name(), "/");
  }
  // Publishes Prefix() + key = value and waits until it is on etcd.
  static void PublishAndWait(Publisher& publisher, const std::string& key,
                             const std::string& value) {
    ASSERT_TRUE(publisher.Publish(Prefix() + key, value).ok());
    ASSERT_TRUE(Eventually([&] {
      return IsState(publisher, Prefix() + key, KeyState::kPublished);
    })) << key;
  }

  static EtcdCluster* cluster_;
  std::unique_ptr<EtcdClient> client_;
};
EtcdCluster* PublisherTest::cluster_ = nullptr;

TEST(PublisherOptionsTest, StartRefusesBadOptions) {
  PublisherOptions options = Options({"127.0.0.1:2379"});
  options.lease_ttl = absl::Milliseconds(500);
  absl::StatusOr<std::unique_ptr<Publisher>> publisher =
      Publisher::Start(options);
  ASSERT_FALSE(publisher.ok());
  EXPECT_EQ(publisher.status().code(), absl::StatusCode::kInvalidArgument);
  options = Options({"127.0.0.1:2379"});
  options.max_keys = 0;
  EXPECT_EQ(Publisher::Start(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = Options({"127.0.0.1:2379"});
  options.write_delay = absl::Milliseconds(-1);
  EXPECT_EQ(GetErrorDetail(Publisher::Start(options).status()).reason(),
            "DIRECTORY_BAD_OPTIONS");
  options = Options({"not an endpoint"});
  EXPECT_EQ(GetErrorDetail(Publisher::Start(options).status()).reason(),
            "ETCD_BAD_ENDPOINT");
}

TEST_F(PublisherTest, PublishWritesTheKeyUnderTheLeaseAndRewritesIt) {
  std::unique_ptr<Publisher> publisher =
      NewPublisher(Options(cluster_->endpoints()));
  ASSERT_NE(publisher, nullptr);
  const std::string key = Prefix() + "k";
  const absl::Time start = absl::Now();
  ASSERT_TRUE(publisher->Publish(key, "v1").ok());
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(100));  // no etcd wait
  ASSERT_TRUE(Eventually(
      [&] { return IsState(*publisher, key, KeyState::kPublished); }));
  PublisherStats stats = publisher->Stats();
  EXPECT_EQ(stats.state, DirectoryState::kServing);
  EXPECT_NE(stats.lease, 0);
  EXPECT_EQ(stats.published, 1u);
  EXPECT_EQ(stats.pending, 0u);
  EXPECT_EQ(stats.leases_granted, 1u);
  EXPECT_GE(stats.writes, 1u);
  std::vector<EtcdKeyValue> kvs = Keys(*client_, Prefix());
  ASSERT_EQ(kvs.size(), 1u);
  EXPECT_EQ(kvs[0].key, key);
  EXPECT_EQ(kvs[0].value, "v1");
  EXPECT_EQ(kvs[0].lease, stats.lease);

  // Another value: rewritten, under the same lease.
  ASSERT_TRUE(publisher->Publish(key, "v2").ok());
  ASSERT_TRUE(Eventually([&] {
    std::vector<EtcdKeyValue> now = Keys(*client_, Prefix());
    return now.size() == 1 && now[0].value == "v2";
  }));
  ASSERT_TRUE(Eventually(
      [&] { return IsState(*publisher, key, KeyState::kPublished); }));
  kvs = Keys(*client_, Prefix());
  ASSERT_EQ(kvs.size(), 1u);
  EXPECT_EQ(kvs[0].lease, stats.lease);
  EXPECT_EQ(publisher->Stats().conflicts, 0u);

  // Bad and unknown keys.
  absl::Status empty = publisher->Publish("", "v");
  EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GetErrorDetail(empty).reason(), "DIRECTORY_BAD_KEY");
  absl::StatusOr<KeyState> unknown = publisher->StateOf(Prefix() + "nope");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(GetErrorDetail(unknown.status()).reason(), "DIRECTORY_NO_KEY");
  EXPECT_TRUE(publisher->Stop().ok());
}

TEST_F(PublisherTest, UnpublishIsDoneOnceTheKeyIsGone) {
  std::unique_ptr<Publisher> publisher =
      NewPublisher(Options(cluster_->endpoints()));
  ASSERT_NE(publisher, nullptr);
  ASSERT_NO_FATAL_FAILURE(PublishAndWait(*publisher, "a", "1"));
  ASSERT_NO_FATAL_FAILURE(PublishAndWait(*publisher, "b", "2"));
  Publisher::Done done = publisher->Unpublish(Prefix() + "a");
  ASSERT_TRUE(done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  std::vector<EtcdKeyValue> kvs = Keys(*client_, Prefix());
  ASSERT_EQ(kvs.size(), 1u);
  EXPECT_EQ(kvs[0].key, Prefix() + "b");
  EXPECT_EQ(
      GetErrorDetail(publisher->StateOf(Prefix() + "a").status()).reason(),
      "DIRECTORY_NO_KEY");
  // A key never published is done already.
  EXPECT_TRUE(publisher->Unpublish(Prefix() + "never")->HasBeenNotified());
  EXPECT_TRUE(publisher->Stop().ok());
}

TEST_F(PublisherTest, AKeyAnotherLeaseHoldsIsAConflictLeftAlone) {
  absl::StatusOr<EtcdLease> theirs = client_->Grant(absl::Seconds(30));
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  ASSERT_TRUE(client_->Put(Prefix() + "name", "theirs", theirs->id).ok());
  std::unique_ptr<Publisher> publisher =
      NewPublisher(Options(cluster_->endpoints()));
  ASSERT_NE(publisher, nullptr);
  ASSERT_TRUE(publisher->Publish(Prefix() + "name", "mine").ok());
  ASSERT_TRUE(publisher->Publish(Prefix() + "other", "mine").ok());
  ASSERT_TRUE(Eventually([&] {
    return IsState(*publisher, Prefix() + "name", KeyState::kConflict) &&
           IsState(*publisher, Prefix() + "other", KeyState::kPublished);
  }));
  EXPECT_EQ(publisher->Stats().conflicts, 1u);
  EXPECT_EQ(publisher->Stats().published, 1u);
  std::vector<EtcdKeyValue> kvs = Keys(*client_, Prefix() + "name");
  ASSERT_EQ(kvs.size(), 1u);
  EXPECT_EQ(kvs[0].value, "theirs");
  EXPECT_EQ(kvs[0].lease, theirs->id);
  // Unpublishing it deletes nothing of theirs.
  Publisher::Done done = publisher->Unpublish(Prefix() + "name");
  ASSERT_TRUE(done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  kvs = Keys(*client_, Prefix() + "name");
  ASSERT_EQ(kvs.size(), 1u);
  EXPECT_EQ(kvs[0].value, "theirs");
  EXPECT_EQ(kvs[0].lease, theirs->id);
  EXPECT_TRUE(publisher->Stop().ok());
  EXPECT_EQ(Keys(*client_, Prefix()).size(), 1u);  // theirs only
  EXPECT_TRUE(client_->Revoke(theirs->id).ok());
}

// Keys queued together go to etcd together: a transaction holds up to
// EtcdClient::kMaxWritesPerTxn of them (one key per transaction took 9 s
// for 10,000 keys). A key another lease holds, in the midst of them, is a
// conflict and the rest are written all the same; deletes go together too.
TEST_F(PublisherTest, KeysQueuedTogetherGoInFewTransactions) {
  absl::StatusOr<EtcdLease> theirs = client_->Grant(absl::Seconds(30));
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  ASSERT_TRUE(client_->Put(Prefix() + "k500", "theirs", theirs->id).ok());
  std::unique_ptr<Publisher> publisher =
      NewPublisher(Options(cluster_->endpoints()));
  ASSERT_NE(publisher, nullptr);
  constexpr int kKeys = 1000;
  for (int i = 0; i < kKeys; ++i) {
    ASSERT_TRUE(
        publisher->Publish(absl::StrCat(Prefix(), "k", i), "value").ok());
  }
  ASSERT_TRUE(Eventually(
      [&] {
        PublisherStats stats = publisher->Stats();
        return stats.published == kKeys - 1 && stats.conflicts == 1;
      },
      absl::Seconds(30)));
  PublisherStats stats = publisher->Stats();
  // 16 full transactions and a few short ones while the queue filled, and
  // the batch with the conflict once more, one key at a time (64).
  EXPECT_LT(stats.transactions, 200u) << stats.writes;
  std::vector<EtcdKeyValue> kvs = Keys(*client_, Prefix());
  ASSERT_EQ(kvs.size(), static_cast<size_t>(kKeys));
  for (const EtcdKeyValue& kv : kvs) {
    EXPECT_EQ(kv.lease, kv.key == Prefix() + "k500" ? theirs->id : stats.lease)
        << kv.key;
  }

  std::vector<Publisher::Done> done;
  for (int i = 0; i < kKeys; ++i) {
    done.push_back(publisher->Unpublish(absl::StrCat(Prefix(), "k", i)));
  }
  for (Publisher::Done& d : done) {
    ASSERT_TRUE(d->WaitForNotificationWithTimeout(absl::Seconds(30)));
  }
  EXPECT_LT(publisher->Stats().transactions - stats.transactions, 200u);
  kvs = Keys(*client_, Prefix());
  ASSERT_EQ(kvs.size(), 1u);  // theirs
  EXPECT_EQ(kvs[0].lease, theirs->id);
  EXPECT_TRUE(publisher->Stop().ok());
  EXPECT_TRUE(client_->Revoke(theirs->id).ok());
}

// A put waits options.write_delay in the queue (the call that queued it
// answers first; others join its transaction), unless a transaction's worth
// is queued or an Unpublish waits for a delete. A name unpublished within
// the delay never reaches etcd. With a delay of a minute, what the test
// sees written was written for one of those reasons.
TEST_F(PublisherTest, AWriteDelayEndsWithAFullBatchOrADeleteWaitedFor) {
  PublisherOptions options = Options(cluster_->endpoints());
  options.write_delay = absl::Minutes(1);
  std::unique_ptr<Publisher> publisher = NewPublisher(std::move(options));
  ASSERT_NE(publisher, nullptr);
  const size_t full = EtcdClient::kMaxWritesPerTxn;
  for (size_t i = 0; i < full; ++i) {
    ASSERT_TRUE(publisher->Publish(absl::StrCat(Prefix(), "k", i), "v").ok());
  }
  ASSERT_TRUE(Eventually([&] { return publisher->Stats().published == full; },
                         absl::Seconds(20)));
  // One more waits; a delete waited for takes it along.
  ASSERT_TRUE(publisher->Publish(Prefix() + "late", "v").ok());
  Publisher::Done done = publisher->Unpublish(Prefix() + "k0");
  ASSERT_TRUE(done->WaitForNotificationWithTimeout(absl::Seconds(20)));
  ASSERT_TRUE(Eventually(
      [&] {
        return IsState(*publisher, Prefix() + "late", KeyState::kPublished);
      },
      absl::Seconds(20)));
  // Published and unpublished within the delay: nothing to delete.
  ASSERT_TRUE(publisher->Publish(Prefix() + "short", "v").ok());
  EXPECT_TRUE(publisher->Unpublish(Prefix() + "short")->HasBeenNotified());
  EXPECT_EQ(Keys(*client_, Prefix() + "short").size(), 0u);
  EXPECT_EQ(Keys(*client_, Prefix()).size(), full);  // k1.. and late
  EXPECT_TRUE(publisher->Stop().ok());
}

// The delay is each name's own, counted from when it was queued: a stream
// of names that each live a sixth of it, one after another, never reaches
// etcd. (It was counted from when the queue last filled, and the worker
// woke at that deadline even after that name was gone: it then wrote
// whichever name was queued at that moment, however young, and that name's
// deregistration had to wait for etcd's delete.)
TEST_F(PublisherTest, TheWriteDelayIsCountedForEachNameFromItsOwnQueueing) {
  PublisherOptions options = Options(cluster_->endpoints());
  options.write_delay = absl::Milliseconds(300);
  std::unique_ptr<Publisher> publisher = NewPublisher(std::move(options));
  ASSERT_NE(publisher, nullptr);
  ASSERT_TRUE(Eventually([&] { return publisher->Stats().lease != 0; },
                         absl::Seconds(20)));
  // 12 names of 50 ms each: 600 ms, twice the delay, with a name queued
  // nearly all the time.
  for (int i = 0; i < 12; ++i) {
    const std::string key = absl::StrCat(Prefix(), "short", i);
    ASSERT_TRUE(publisher->Publish(key, "v").ok());
    absl::SleepFor(absl::Milliseconds(50));
    EXPECT_TRUE(publisher->Unpublish(key)->HasBeenNotified())
        << key << " was sent to etcd " << 50 * i + 50 << " ms in";
  }
  EXPECT_EQ(publisher->Stats().transactions, 0u);
  EXPECT_TRUE(Keys(*client_, Prefix()).empty());
  EXPECT_TRUE(publisher->Stop().ok());
}

TEST_F(PublisherTest, MaxKeysBoundsKeysWantedAndDeletesPending) {
  PublisherOptions options = Options(cluster_->endpoints());
  options.max_keys = 2;
  std::unique_ptr<Publisher> publisher = NewPublisher(options);
  ASSERT_NE(publisher, nullptr);
  ASSERT_NO_FATAL_FAILURE(PublishAndWait(*publisher, "a", "1"));
  ASSERT_NO_FATAL_FAILURE(PublishAndWait(*publisher, "b", "1"));
  absl::Status full = publisher->Publish(Prefix() + "c", "1");
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetErrorDetail(full).reason(), "DIRECTORY_FULL");
  // A key wanted already may change.
  EXPECT_TRUE(publisher->Publish(Prefix() + "a", "2").ok());
  Publisher::Done done = publisher->Unpublish(Prefix() + "b");
  ASSERT_TRUE(done->WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_NO_FATAL_FAILURE(PublishAndWait(*publisher, "c", "1"));
  EXPECT_EQ(Keys(*client_, Prefix()).size(), 2u);
  EXPECT_TRUE(publisher->Stop().ok());
}

TEST_F(PublisherTest, StopRemovesEveryKeyAtOnce) {
  std::unique_ptr<Publisher> publisher =
      NewPublisher(Options(cluster_->endpoints()));
  ASSERT_NE(publisher, nullptr);
  for (const char* key : {"a", "b", "c"}) {
    ASSERT_NO_FATAL_FAILURE(PublishAndWait(*publisher, key, "v"));
  }
  ASSERT_EQ(Keys(*client_, Prefix()).size(), 3u);
  const int64_t lease = publisher->Stats().lease;
  ASSERT_TRUE(publisher->Stop().ok());
  EXPECT_TRUE(Keys(*client_, Prefix()).empty());
  EXPECT_EQ(GetErrorDetail(client_->TimeToLive(lease).status()).reason(),
            "ETCD_LEASE_NOT_FOUND");
  absl::Status after = publisher->Publish(Prefix() + "d", "v");
  EXPECT_EQ(after.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(GetErrorDetail(after).reason(), "DIRECTORY_STOPPED");
}

TEST_F(PublisherTest, KeysOfAPublisherGoneWithoutStopLastUntilTheTtl) {
  std::unique_ptr<Publisher> publisher =
      NewPublisher(Options(cluster_->endpoints()));
  ASSERT_NE(publisher, nullptr);
  const std::string key = Prefix() + "k";
  ASSERT_NO_FATAL_FAILURE(PublishAndWait(*publisher, "k", "v"));
  absl::StatusOr<EtcdRange> range = client_->Get(Prefix());
  ASSERT_TRUE(range.ok()) << range.status();
  EventLog log;
  absl::StatusOr<std::unique_ptr<EtcdWatch>> watch =
      client_->Watch(Prefix(), range->revision + 1, log.Callback());
  ASSERT_TRUE(watch.ok()) << watch.status();
  // Kept alive: no delete for well past a TTL.
  EXPECT_FALSE(log.WaitForDelete(key, kTtl + kTtl / 2));
  const int64_t lease = publisher->Stats().lease;
  publisher.reset();  // as a process killed: no Stop
  const absl::Time gone = absl::Now();
  // The last renewal was at most a third of the TTL ago: the key outlives
  // the rest of it, and is gone within the TTL (etcd's leader looks for
  // expired leases every 500 ms) and a margin. The margin is wide: a leader
  // elected meanwhile (a loaded host, 500 ms election timeout) restarts
  // every lease's TTL.
  EXPECT_FALSE(log.WaitForDelete(key, kTtl / 2));
  const bool deleted =
      log.WaitForDelete(key, gone + 2 * kTtl + absl::Seconds(2) - absl::Now());
  EXPECT_TRUE(deleted) << "lease " << lease << " has "
                       << client_->TimeToLive(lease).status() << " / "
                       << absl::FormatDuration(
                              client_->TimeToLive(lease).value_or(
                                  absl::ZeroDuration()))
                       << " left";
  EXPECT_GE(absl::Now() - gone, kTtl / 2);
  EXPECT_TRUE(Keys(*client_, Prefix()).empty());
}

TEST_F(PublisherTest, HandoverPassesTheLeaseAndTheKeysWithoutADelete) {
  std::unique_ptr<Publisher> before =
      NewPublisher(Options(cluster_->endpoints()));
  ASSERT_NE(before, nullptr);
  ASSERT_NO_FATAL_FAILURE(PublishAndWait(*before, "a", "old"));
  ASSERT_NO_FATAL_FAILURE(PublishAndWait(*before, "b", "old"));
  absl::StatusOr<EtcdRange> range = client_->Get(Prefix());
  ASSERT_TRUE(range.ok()) << range.status();
  EventLog log;
  absl::StatusOr<std::unique_ptr<EtcdWatch>> watch =
      client_->Watch(Prefix(), range->revision + 1, log.Callback());
  ASSERT_TRUE(watch.ok()) << watch.status();
  const int64_t lease = before->Handover();
  EXPECT_EQ(lease, before->Stats().lease);
  ASSERT_NE(lease, 0);

  PublisherOptions options = Options(cluster_->endpoints());
  options.adopt_lease = lease;
  std::unique_ptr<Publisher> after = NewPublisher(options);
  ASSERT_NE(after, nullptr);
  ASSERT_NO_FATAL_FAILURE(PublishAndWait(*after, "a", "new"));
  ASSERT_NO_FATAL_FAILURE(PublishAndWait(*after, "b", "new"));
  PublisherStats stats = after->Stats();
  EXPECT_EQ(stats.lease, lease);
  EXPECT_EQ(stats.leases_granted, 0u);
  EXPECT_EQ(stats.conflicts, 0u);
  std::vector<EtcdKeyValue> kvs = Keys(*client_, Prefix());
  ASSERT_EQ(kvs.size(), 2u);
  for (const EtcdKeyValue& kv : kvs) {
    EXPECT_EQ(kv.value, "new") << kv.key;
    EXPECT_EQ(kv.lease, lease) << kv.key;
  }
  before.reset();  // its keeper stops; the new one keeps the lease
  // No delete: not at the hand-over, nor for a TTL after the old process.
  EXPECT_FALSE(log.WaitForDelete(Prefix() + "a", kTtl + kTtl / 4));
  std::vector<EtcdWatchEvent> events = log.WaitFor(2);
  ASSERT_EQ(events.size(), 2u);
  for (const EtcdWatchEvent& event : events) {
    EXPECT_EQ(event.type, EtcdWatchEvent::Type::kPut) << event.key;
    EXPECT_EQ(event.value, "new") << event.key;
  }
  EXPECT_TRUE(after->Stop().ok());
  EXPECT_TRUE(Keys(*client_, Prefix()).empty());
}

TEST_F(PublisherTest, ALeaseRevokedFromOutsideIsReplacedAndKeysRewritten) {
  std::unique_ptr<Publisher> publisher =
      NewPublisher(Options(cluster_->endpoints()));
  ASSERT_NE(publisher, nullptr);
  ASSERT_NO_FATAL_FAILURE(PublishAndWait(*publisher, "a", "1"));
  ASSERT_NO_FATAL_FAILURE(PublishAndWait(*publisher, "b", "2"));
  const int64_t old_lease = publisher->Stats().lease;
  ASSERT_TRUE(client_->Revoke(old_lease).ok());
  // The keeper finds it gone within a third of the TTL; then a new lease
  // and both keys again.
  ASSERT_TRUE(Eventually([&] {
    std::vector<EtcdKeyValue> kvs = Keys(*client_, Prefix());
    const int64_t lease = publisher->Stats().lease;
    if (kvs.size() != 2 || lease == 0 || lease == old_lease) return false;
    for (const EtcdKeyValue& kv : kvs) {
      if (kv.lease != lease) return false;
    }
    return true;
  }));
  ASSERT_TRUE(Eventually([&] { return publisher->Stats().published == 2; }));
  PublisherStats stats = publisher->Stats();
  EXPECT_EQ(stats.leases_granted, 2u);
  EXPECT_EQ(stats.state, DirectoryState::kServing);
  EXPECT_TRUE(publisher->Stop().ok());
  EXPECT_TRUE(Keys(*client_, Prefix()).empty());
}

// Members killed and restarted: a cluster of the suite's own, every test
// leaving all its members running.
class PublisherFailoverTest : public PublisherTest {
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

TEST_F(PublisherFailoverTest, AllMembersDownWritesQueueThenCatchUp) {
  std::unique_ptr<Publisher> publisher =
      NewPublisher(Options(cluster_->endpoints(), absl::Seconds(1)));
  ASSERT_NE(publisher, nullptr);
  ASSERT_NO_FATAL_FAILURE(PublishAndWait(*publisher, "a", "1"));
  ASSERT_NO_FATAL_FAILURE(PublishAndWait(*publisher, "b", "1"));
  for (int i = 0; i < cluster_->size(); ++i) cluster_->Kill(i);

  const absl::Time start = absl::Now();
  ASSERT_TRUE(publisher->Publish(Prefix() + "c", "1").ok());
  Publisher::Done done = publisher->Unpublish(Prefix() + "b");
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(100));  // no etcd wait
  ASSERT_TRUE(Eventually([&] {
    return publisher->Stats().state == DirectoryState::kUnavailable;
  }));
  PublisherStats stats = publisher->Stats();
  EXPECT_GE(stats.failed_writes, 1u);
  EXPECT_EQ(stats.last_error.code(), absl::StatusCode::kUnavailable)
      << stats.last_error;
  EXPECT_FALSE(done->HasBeenNotified());
  EXPECT_TRUE(IsState(*publisher, Prefix() + "c", KeyState::kPending));

  for (int i = 0; i < cluster_->size(); ++i) {
    ASSERT_TRUE(cluster_->Restart(i).ok());
  }
  ASSERT_TRUE(done->WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(Eventually(
      [&] {
        return IsState(*publisher, Prefix() + "a", KeyState::kPublished) &&
               IsState(*publisher, Prefix() + "c", KeyState::kPublished) &&
               publisher->Stats().state == DirectoryState::kServing;
      },
      absl::Seconds(30)));
  const int64_t lease = publisher->Stats().lease;
  std::vector<EtcdKeyValue> kvs = Keys(*client_, Prefix());
  ASSERT_EQ(kvs.size(), 2u);
  EXPECT_EQ(kvs[0].key, Prefix() + "a");
  EXPECT_EQ(kvs[1].key, Prefix() + "c");
  for (const EtcdKeyValue& kv : kvs) EXPECT_EQ(kv.lease, lease) << kv.key;
  EXPECT_TRUE(publisher->Stop().ok());
  EXPECT_TRUE(Keys(*client_, Prefix()).empty());
}

TEST_F(PublisherFailoverTest, StopWithEveryMemberDownIsUnavailable) {
  std::unique_ptr<Publisher> publisher =
      NewPublisher(Options(cluster_->endpoints(), absl::Seconds(1)));
  ASSERT_NE(publisher, nullptr);
  ASSERT_NO_FATAL_FAILURE(PublishAndWait(*publisher, "a", "1"));
  for (int i = 0; i < cluster_->size(); ++i) cluster_->Kill(i);
  const absl::Time start = absl::Now();
  absl::Status stopped = publisher->Stop();
  EXPECT_EQ(stopped.code(), absl::StatusCode::kUnavailable) << stopped;
  EXPECT_EQ(GetErrorDetail(stopped).reason(), "ETCD_UNAVAILABLE");
  // The revoke's call timeout, and a write in flight's.
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

}  // namespace
}  // namespace mrd::directory
