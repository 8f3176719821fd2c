// The directory on etcd against the real mrd and a real three-member etcd
// cluster on loopback (docs/DIRECTORY.md): a registration published under a
// name is found by another mrd (another node), its entry leaves etcd before
// the call that ends the registration answers (DeregisterMr, ReleaseBuffer,
// CloseSession), an mrd killed with SIGKILL loses its entries within its
// lease's TTL, tenants publish only under their own prefix, and with every
// etcd member down registrations go on and the entries appear once etcd is
// back (the directory's health says so meanwhile), with one down nothing
// is lost and publishing goes on; an mrd of two devices publishes a token
// per device; a watcher of a name (the C++ client's NameWatch) hears it
// published and its token die, and a cancel from another thread ends its wait;
// over TLS with etcd's authentication, mrds publish and resolve and never log
// the password or key. Every wait is on an etcd watch or a condition with a
// deadline.
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "mrd/v1/mrd.grpc.pb.h"
#include "server/directory/etcd_client.h"
#include "tests/integration/test_env.h"
#include "tests/unit/core/mooncake_reader.h"
#include "tests/unit/directory/etcd_cluster.h"

namespace mrd::testing {
namespace {

using client::Buffer;
using client::Registration;
using client::Session;
using directory::EtcdClient;
using directory::EtcdWatchEvent;

constexpr absl::Duration kLeaseTtl = absl::Seconds(2);

// Polls `done` every 10 ms until it holds or `limit` passed (bounded); for
// what no event tells (mrd's view of etcd).
template <typename Fn>
bool PollUntil(Fn done, absl::Duration limit) {
  const absl::Time deadline = absl::Now() + limit;
  while (!done()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;
constexpr char kDirectoryHealth[] = "mrd.v1.MemoryRegistration/directory";

// mrd's health of `service`; UNKNOWN if the check failed.
ServingStatus HealthOf(const MrdProcess& mrd, const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel(
      mrd.grpc_target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  if (!stub->Check(&ctx, req, &resp).ok()) {
    return grpc::health::v1::HealthCheckResponse::UNKNOWN;
  }
  return resp.status();
}

// A client of `mrd`'s gRPC and fd sockets.
absl::StatusOr<client::Client> ConnectTo(const MrdProcess& mrd) {
  client::ClientOptions options;
  options.socket_path = mrd.grpc_socket();
  options.fd_socket_path = mrd.fd_socket();
  return client::Client::Connect(options);
}

struct Published {
  Buffer buffer;
  Registration registration;
  v1::PublishedEntry entry;
};

// A PublishRequest of `name` by `session`, naming nothing yet.
v1::PublishRequest PublishOf(const Session& session, const std::string& name) {
  v1::PublishRequest req;
  req.set_session(session.token());
  req.set_name(name);
  return req;
}

// A remote-readable registration of a fresh buffer of `session`, published
// as `name` through `client`.
absl::StatusOr<Published> RegisterAndPublishVia(client::Client& client,
                                                const Session& session,
                                                const std::string& name) {
  absl::StatusOr<Buffer> buffer = Buffer::Create(session, 64 << 10, name);
  if (!buffer.ok()) return buffer.status();
  client::RegisterOptions o;
  o.buffer = buffer->id();
  o.length = buffer->size();
  o.flags = kRemoteRead;
  absl::StatusOr<Registration> reg = Registration::Register(session, o);
  if (!reg.ok()) return reg.status();
  v1::PublishRequest req = PublishOf(session, name);
  req.set_registration(reg->id());
  absl::StatusOr<v1::PublishedEntry> entry = client.Publish(req);
  if (!entry.ok()) return entry.status();
  return Published{std::move(*buffer), std::move(*reg), std::move(*entry)};
}

// An mrd of a test's own (not a fixture's), a client of it and an fd
// session, destroyed in that order's reverse.
struct OwnMrd {
  std::unique_ptr<MrdProcess> mrd;
  std::unique_ptr<client::Client> client;
  std::unique_ptr<Session> session;
};
absl::StatusOr<OwnMrd> StartOwnMrd(const MrdProcessOptions& options) {
  OwnMrd out;
  absl::StatusOr<std::unique_ptr<MrdProcess>> mrd = MrdProcess::Start(options);
  if (!mrd.ok()) return mrd.status();
  out.mrd = std::move(*mrd);
  absl::StatusOr<client::Client> client = ConnectTo(*out.mrd);
  if (!client.ok()) return client.status();
  out.client = std::make_unique<client::Client>(std::move(*client));
  absl::StatusOr<Session> session = Session::OpenFd(*out.client);
  if (!session.ok()) return session.status();
  out.session = std::make_unique<Session>(std::move(*session));
  return out;
}

// Every event a watch delivered, waited on by condition.
class Events {
 public:
  directory::EtcdWatchCallback Callback() {
    return [this](absl::StatusOr<std::vector<EtcdWatchEvent>> events) {
      absl::MutexLock lock(&mu_);
      if (events.ok()) {
        for (EtcdWatchEvent& e : *events) events_.push_back(std::move(e));
      }
    };
  }
  // Waits until an event of `type` on `key` came; false after `timeout`.
  bool WaitFor(EtcdWatchEvent::Type type, const std::string& key,
               absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto seen = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const EtcdWatchEvent& e : events_) {
        if (e.type == type && e.key == key) return true;
      }
      return false;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&seen), timeout);
  }

 private:
  absl::Mutex mu_;
  std::vector<EtcdWatchEvent> events_ ABSL_GUARDED_BY(mu_);
};

class DirectoryTest : public MrdTest {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<EtcdCluster>> cluster =
        EtcdCluster::Start(3);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = cluster->release();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }

  MrdProcessOptions ServerOptions() override {
    // Each test its own cluster name: its keys are its own.
    cluster_name_ = absl::StrCat(
        "t", ::testing::UnitTest::GetInstance()->current_test_info()->name());
    MrdProcessOptions options = NodeOptions("node-a");
    options.metrics = true;
    for (const std::string& flag : more_flags_) {
      options.extra_flags.push_back(flag);
    }
    return options;
  }
  MrdProcessOptions NodeOptions(const std::string& node) {
    MrdProcessOptions options;
    options.extra_flags = {
        absl::StrCat("--etcd_endpoints=",
                     absl::StrJoin(cluster_->endpoints(), ",")),
        absl::StrCat("--directory_cluster=", cluster_name_),
        absl::StrCat("--node_name=", node),
        absl::StrCat("--directory_lease_ttl=", absl::FormatDuration(kLeaseTtl)),
        "--directory_unpublish_wait=5s",
        "--directory_max_watches=8"};
    return options;
  }

  void SetUp() override {
    MrdTest::SetUp();
    if (HasFatalFailure()) return;
    directory::EtcdClientOptions options;
    options.endpoints = cluster_->endpoints();
    absl::StatusOr<std::unique_ptr<EtcdClient>> etcd =
        EtcdClient::Create(options);
    ASSERT_TRUE(etcd.ok()) << etcd.status();
    etcd_ = std::move(*etcd);
    absl::StatusOr<std::unique_ptr<directory::EtcdWatch>> watch =
        etcd_->Watch(Prefix(), 0, events_.Callback());
    ASSERT_TRUE(watch.ok()) << watch.status();
    watch_ = std::move(*watch);
  }
  void TearDown() override {
    watch_.reset();
    etcd_.reset();
    MrdTest::TearDown();
  }

  std::string Prefix() const {
    return absl::StrCat("/mrd/v1/", cluster_name_, "/");
  }
  std::string KeyOf(const std::string& tenant, const std::string& name) const {
    return absl::StrCat(Prefix(), "tenants/", tenant, "/names/", name);
  }
  // The key's value on etcd now; empty if it has none.
  std::string ValueOf(const std::string& key) {
    absl::StatusOr<directory::EtcdRange> range = etcd_->Get(key);
    EXPECT_TRUE(range.ok()) << range.status();
    if (!range.ok()) return "";
    for (const directory::EtcdKeyValue& kv : range->kvs) {
      if (kv.key == key) return kv.value;
    }
    return "";
  }

  // The node's entry on etcd now (empty if none).
  v1::DirectoryNode NodeOf(const std::string& node) {
    v1::DirectoryNode out;
    const std::string value = ValueOf(absl::StrCat(Prefix(), "nodes/", node));
    if (!value.empty()) {
      EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(value, &out).ok())
          << value;
    }
    return out;
  }

  // RegisterAndPublishVia the fixture's mrd.
  absl::StatusOr<Published> RegisterAndPublish(const Session& session,
                                               const std::string& name) {
    return RegisterAndPublishVia(*client_, session, name);
  }
  std::string TenantOf(const Session& session) {
    absl::StatusOr<v1::SessionInfo> info = session.Info();
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->tenant() : "";
  }

  // 4 KiB of shm file `file` (which anyone may read: an anonymous lease
  // opens only such files) registered by a new anonymous lease session,
  // of tenant "anonymous".
  struct Anonymous {
    Session session;
    Buffer buffer;
    Registration registration;
  };
  absl::StatusOr<Anonymous> RegisterAnonymously(const std::string& file) {
    absl::StatusOr<v1::SessionInfo> lease =
        client_->OpenLeaseSession(v1::OpenLeaseSessionRequest());
    if (!lease.ok()) return lease.status();
    EXPECT_EQ(lease->tenant(), "anonymous");
    Session session = Session::Attach(*client_, lease->session());
    MRD_RETURN_IF_ERROR(
        WriteShmFile(mrd_->shm_dir(), file, "anonymous data ", 4096));
    if (::chmod((mrd_->shm_dir() + "/" + file).c_str(), 0644) != 0) {
      return absl::InternalError("chmod");
    }
    absl::StatusOr<Buffer> buffer = Buffer::ImportFile(session, file, false);
    if (!buffer.ok()) return buffer.status();
    client::RegisterOptions o;
    o.buffer = buffer->id();
    o.length = 4096;
    o.flags = kRemoteRead;
    absl::StatusOr<Registration> reg = Registration::Register(session, o);
    if (!reg.ok()) return reg.status();
    return Anonymous{std::move(session), *std::move(buffer), *std::move(reg)};
  }

  // Each of `names` registered and published by `session`, in order.
  void RegisterAndPublishEach(const Session& session,
                              const std::vector<std::string>& names,
                              std::vector<Published>* out) {
    for (const std::string& name : names) {
      absl::StatusOr<Published> p = RegisterAndPublish(session, name);
      ASSERT_TRUE(p.ok()) << name << ": " << p.status();
      out->push_back(*std::move(p));
    }
  }

  static EtcdCluster* cluster_;
  std::vector<std::string> more_flags_;  // a fixture's own, for mrd
  std::string cluster_name_;
  std::unique_ptr<EtcdClient> etcd_;
  Events events_;
  std::unique_ptr<directory::EtcdWatch> watch_;
};
EtcdCluster* DirectoryTest::cluster_ = nullptr;

TEST_F(DirectoryTest,
       AnotherNodeResolvesThePublishedTokenAndDeregisterRemovesIt) {
  Session session = OpenFdSession();
  absl::StatusOr<Published> p = RegisterAndPublish(session, "weights.0");
  ASSERT_TRUE(p.ok()) << p.status();
  const std::string tenant = TenantOf(session);
  const std::string key = KeyOf(tenant, "weights.0");
  EXPECT_EQ(p->entry.key(), key);
  EXPECT_EQ(p->entry.tenant(), tenant);
  ASSERT_TRUE(
      events_.WaitFor(EtcdWatchEvent::Type::kPut, key, absl::Seconds(10)));

  // Another node's mrd, on the same etcd, finds it.
  absl::StatusOr<std::unique_ptr<MrdProcess>> other =
      MrdProcess::Start(NodeOptions("node-b"));
  ASSERT_TRUE(other.ok()) << other.status();
  absl::StatusOr<client::Client> remote = ConnectTo(**other);
  ASSERT_TRUE(remote.ok()) << remote.status();
  {
    absl::StatusOr<Session> peer = Session::OpenFd(*remote);
    ASSERT_TRUE(peer.ok()) << peer.status();
    v1::ResolveRequest resolve;
    resolve.set_session(peer->token());
    resolve.set_name("weights.0");
    resolve.set_tenant(tenant);
    absl::StatusOr<v1::PublishedEntry> found = remote->Resolve(resolve);
    ASSERT_TRUE(found.ok()) << found.status();
    EXPECT_EQ(found->node(), "node-a");
    EXPECT_EQ(found->name(), "weights.0");
    EXPECT_EQ(found->address(), p->registration.base_address());
    EXPECT_EQ(found->length(), p->buffer.size());
    EXPECT_EQ(found->epoch(), 1u);
    ASSERT_EQ(found->tokens_size(), 1);
    EXPECT_EQ(found->tokens(0).rkey(), p->registration.rkey());
    absl::StatusOr<v1::DeviceInfo> device = client_->GetDeviceInfo();
    ASSERT_TRUE(device.ok());
    EXPECT_EQ(found->tokens(0).peer_address(), device->peer_address());
    // A name nobody published.
    resolve.set_name("weights.1");
    absl::StatusOr<v1::PublishedEntry> none = remote->Resolve(resolve);
    ASSERT_FALSE(none.ok());
    EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(client::ReasonOf(none.status()), "NAME_NOT_PUBLISHED");
  }

  v1::ListPublishedRequest list;
  list.set_session(session.token());
  absl::StatusOr<v1::ListPublishedResponse> listed =
      client_->ListPublished(list);
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->directory_state(), "serving");
  ASSERT_EQ(listed->entries_size(), 1);
  EXPECT_EQ(listed->entries(0).state(), "published");
  EXPECT_EQ(listed->entries(0).registration(), p->registration.id());
  absl::StatusOr<std::string> scrape = ScrapeMetrics(mrd_->metrics_address());
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  EXPECT_TRUE(
      absl::StrContains(*scrape, "mrd_directory_state{state=\"serving\"} 1"))
      << *scrape;
  // The name's key and the node's.
  EXPECT_TRUE(absl::StrContains(
      *scrape, "mrd_directory_entries{state=\"published\"} 2"));
  EXPECT_TRUE(
      absl::StrContains(*scrape, "mrd_directory_leases_granted_total 1"));
  // Every directory family docs/METRICS.md lists (metrics_test checks the
  // rest of the table, on an mrd without a directory).
  for (const char* family :
       {"mrd_directory_state", "mrd_directory_entries",
        "mrd_directory_writes_total", "mrd_directory_failed_writes_total",
        "mrd_directory_leases_granted_total"}) {
    EXPECT_TRUE(absl::StrContains(*scrape, absl::StrCat("# TYPE ", family)))
        << family;
  }

  // The last reference goes: the entry is gone when DeregisterMr answers.
  ASSERT_TRUE(p->registration.Deregister().ok());
  EXPECT_EQ(ValueOf(key), "");
  absl::StatusOr<v1::SessionInfo> info = session.Info();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->published(), 0u);
  {
    const absl::Status stopped = (*other)->Stop();
    ASSERT_TRUE(stopped.ok()) << stopped;
  }
}

// A fast-register MR object's mapping, published: its entry carries the
// mapping's rkey, which a peer reads through; InvalidateMr and CloseMr each
// remove it before they answer; mapped again, it is published again.
TEST_F(DirectoryTest, AFastRegisteredMappingIsPublishedUntilItsTokenEnds) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 3 * 4096, "fast");
  std::memcpy(static_cast<char*>(buffer.data()) + 100, "fast bytes", 10);
  client::CompletionStream stream = client::CompletionStream::Open(session);
  absl::StatusOr<client::Mr> mr = client::Mr::Create(session, true, true);
  ASSERT_TRUE(mr.ok()) << mr.status();
  client::BuildLamOptions lo;
  lo.buffer = buffer.id();
  lo.offset = 100;
  lo.length = 5000;
  absl::StatusOr<client::Lam> lam = client::Lam::Build(session, lo);
  ASSERT_TRUE(lam.ok()) << lam.status();
  v1::PublishRequest publish = PublishOf(session, "fast.0");
  publish.set_mr(mr->id());
  // Not fast-registered yet: no token to publish.
  absl::StatusOr<v1::PublishedEntry> early = client_->Publish(publish);
  ASSERT_FALSE(early.ok());
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client::ReasonOf(early.status()), "MR_NOT_MAPPED");

  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  NextOfKind(stream, v1::Completion::PEER_CONNECTED);
  client::FastRegisterOptions fr = client::FastRegisterOptions::FromLam(*lam);
  fr.connection = peer->connection_id();
  fr.base_address = 0x10000000 + fr.fbo;
  fr.flags = kOpRemoteRead;
  auto fast_register = [&]() -> uint32_t {
    absl::StatusOr<uint64_t> wr = mr->FastRegister(fr);
    EXPECT_TRUE(wr.ok()) << wr.status();
    v1::Completion c = NextOfKind(stream, v1::Completion::FAST_REGISTER);
    EXPECT_EQ(c.status(), ::mrd::STATUS_SUCCESS) << c.message();
    return c.rkey();
  };
  const uint32_t rkey = fast_register();
  absl::StatusOr<v1::PublishedEntry> entry = client_->Publish(publish);
  ASSERT_TRUE(entry.ok()) << entry.status();
  EXPECT_EQ(entry->mr(), mr->id());
  EXPECT_EQ(entry->address(), fr.base_address);
  EXPECT_EQ(entry->length(), 5000u);
  EXPECT_EQ(entry->flags(), 0x2u);  // NDK_MR_FLAG_ALLOW_REMOTE_READ
  ASSERT_EQ(entry->tokens_size(), 1);
  EXPECT_EQ(entry->tokens(0).rkey(), rkey);
  const std::string key = entry->key();
  ASSERT_TRUE(
      events_.WaitFor(EtcdWatchEvent::Type::kPut, key, absl::Seconds(10)));

  v1::ResolveRequest resolve;
  resolve.set_session(session.token());
  resolve.set_name("fast.0");
  absl::StatusOr<v1::PublishedEntry> found = client_->Resolve(resolve);
  ASSERT_TRUE(found.ok()) << found.status();
  ASSERT_EQ(found->tokens_size(), 1);
  absl::StatusOr<std::string> read =
      peer->Read(found->tokens(0).rkey(), found->address(), 10);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "fast bytes");
  v1::ListPublishedRequest list;
  list.set_session(session.token());
  absl::StatusOr<v1::ListPublishedResponse> listed =
      client_->ListPublished(list);
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->entries_size(), 1);
  EXPECT_EQ(listed->entries(0).mr(), mr->id());
  EXPECT_EQ(listed->entries(0).registration(), 0u);
  EXPECT_EQ(listed->entries(0).tokens(0).rkey(), rkey);

  // InvalidateMr: the name is gone when the call answers.
  ASSERT_TRUE(mr->Invalidate(peer->connection_id(), 99).ok());
  EXPECT_EQ(ValueOf(key), "");
  NextOfKind(stream, v1::Completion::INVALIDATE);
  absl::StatusOr<v1::SessionInfo> info = session.Info();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->published(), 0u);

  // Mapped again, published again; CloseMr removes it.
  const uint32_t again = fast_register();
  entry = client_->Publish(publish);
  ASSERT_TRUE(entry.ok()) << entry.status();
  EXPECT_EQ(entry->tokens(0).rkey(), again);
  ASSERT_TRUE(
      PollUntil([&] { return !ValueOf(key).empty(); }, absl::Seconds(10)));
  ASSERT_TRUE(mr->Close().ok());
  EXPECT_EQ(ValueOf(key), "");
}

TEST_F(DirectoryTest, TheNodeEntryNamesItsDevicesAndGoesWithItsMrd) {
  absl::StatusOr<v1::DeviceInfo> device = client_->GetDeviceInfo();
  ASSERT_TRUE(device.ok()) << device.status();
  // Written before this test's watch began: polled.
  ASSERT_TRUE(PollUntil([&] { return NodeOf("node-a").node() == "node-a"; },
                        absl::Seconds(10)));
  v1::DirectoryNode node = NodeOf("node-a");
  EXPECT_EQ(node.node(), "node-a");
  EXPECT_EQ(node.cluster(), cluster_name_);
  EXPECT_EQ(node.epoch(), 1u);
  EXPECT_GT(node.started_unix_ms(), 0);
  ASSERT_EQ(node.devices_size(), 1);
  EXPECT_EQ(node.devices(0).name(), device->name());
  EXPECT_EQ(node.devices(0).peer_address(), device->peer_address());

  // Another node's mrd has its own entry, gone when it stops (its lease is
  // revoked); this node's stays.
  absl::StatusOr<std::unique_ptr<MrdProcess>> other =
      MrdProcess::Start(NodeOptions("node-b"));
  ASSERT_TRUE(other.ok()) << other.status();
  const std::string key_b = absl::StrCat(Prefix(), "nodes/node-b");
  ASSERT_TRUE(
      events_.WaitFor(EtcdWatchEvent::Type::kPut, key_b, absl::Seconds(10)));
  {
    const absl::Status stopped = (*other)->Stop();
    ASSERT_TRUE(stopped.ok()) << stopped;
  }
  EXPECT_TRUE(
      events_.WaitFor(EtcdWatchEvent::Type::kDelete, key_b, absl::Seconds(10)));
  EXPECT_EQ(NodeOf("node-a").node(), "node-a");
}

TEST_F(DirectoryTest, AWatcherOfANameSeesItPublishedAndItsTokenDie) {
  Session session = OpenFdSession();
  v1::ResolveRequest req;
  req.set_session(session.token());
  req.set_name("watched");
  client::NameWatch watch = client_->WatchName(req);
  // First the state now: nothing under the name.
  absl::StatusOr<v1::NameEvent> event = watch.Next();
  ASSERT_TRUE(event.ok()) << event.status();
  EXPECT_EQ(event->kind(), v1::NameEvent::UNPUBLISHED);
  absl::StatusOr<Published> p = RegisterAndPublish(session, "watched");
  ASSERT_TRUE(p.ok()) << p.status();
  event = watch.Next();
  ASSERT_TRUE(event.ok()) << event.status();
  EXPECT_EQ(event->kind(), v1::NameEvent::PUBLISHED);
  ASSERT_EQ(event->entry().tokens_size(), 1);
  EXPECT_EQ(event->entry().tokens(0).rkey(), p->registration.rkey());
  EXPECT_EQ(event->entry().address(), p->registration.base_address());
  EXPECT_EQ(event->entry().node(), "node-a");
  // The token dies: the watcher hears it without asking.
  ASSERT_TRUE(p->registration.Deregister().ok());
  event = watch.Next();
  ASSERT_TRUE(event.ok()) << event.status();
  EXPECT_EQ(event->kind(), v1::NameEvent::UNPUBLISHED);

  // Nothing more comes: Next() waits until another thread cancels it.
  const absl::Time start = absl::Now();
  std::thread canceller([&watch] { watch.Cancel(); });
  event = watch.Next();
  canceller.join();
  EXPECT_EQ(event.status().code(), absl::StatusCode::kCancelled)
      << event.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // And so does every later call.
  EXPECT_EQ(watch.Next().status().code(), absl::StatusCode::kCancelled);
}

// One WatchName stream of a test: open until it is destroyed (cancelled).
struct NameStream {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<v1::NameEvent>> reader;

  // The first event, or the status the stream ended with.
  absl::StatusOr<v1::NameEvent> First() {
    v1::NameEvent event;
    if (reader->Read(&event)) return event;
    finished = true;
    return client::StatusFromGrpc(reader->Finish(), context);
  }
  ~NameStream() {
    if (finished) return;
    context.TryCancel();
    v1::NameEvent event;
    while (reader->Read(&event)) {
    }
    (void)reader->Finish();
  }
  bool finished = false;
};

// WatchName streams of one session on one name, opened on demand.
class NameWatches {
 public:
  NameWatches(const std::string& target, const std::string& session,
              const std::string& name)
      : stub_(v1::MemoryRegistration::NewStub(
            grpc::CreateChannel(target, grpc::InsecureChannelCredentials()))) {
    request_.set_session(session);
    request_.set_name(name);
  }
  std::unique_ptr<NameStream> Open() {
    auto stream = std::make_unique<NameStream>();
    stream->reader = stub_->WatchName(&stream->context, request_);
    return stream;
  }

 private:
  std::unique_ptr<v1::MemoryRegistration::Stub> stub_;
  v1::ResolveRequest request_;
};

TEST_F(DirectoryTest, ATenantHoldsAQuarterOfTheWatchesAtMost) {
  Session session = OpenFdSession();
  NameWatches watches(mrd_->grpc_target(), session.token(), "n");
  auto open = [&] { return watches.Open(); };
  // --directory_max_watches=8: this tenant gets 2.
  std::unique_ptr<NameStream> first = open();
  ASSERT_TRUE(first->First().ok());
  std::unique_ptr<NameStream> second = open();
  ASSERT_TRUE(second->First().ok());
  absl::StatusOr<v1::NameEvent> refused = open()->First();
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(client::ReasonOf(refused.status()), "WATCH_LIMIT");
  // One cancelled: its slot is free again once mrd has seen the cancel.
  first.reset();
  EXPECT_TRUE(
      PollUntil([&] { return open()->First().ok(); }, absl::Seconds(10)));
}

// A cancelled watch's etcd stream is torn down off gRPC's own threads: mrd
// once joined the watch's thread from OnCancel, on a gRPC executor thread
// the stream's cancel itself could be queued to, and both waited forever
// (the slot was never freed and SIGTERM could not stop mrd).
TEST_F(DirectoryTest, WatchesCancelledOverAndOverFreeTheirSlots) {
  Session session = OpenFdSession();
  NameWatches watches(mrd_->grpc_target(), session.token(), "n");
  // A watch in one of the tenant's two slots, once one is free again.
  auto take = [&](std::unique_ptr<NameStream>* stream) {
    return PollUntil(
        [&] {
          *stream = watches.Open();
          return (*stream)->First().ok();
        },
        absl::Seconds(10));
  };
  for (int round = 0; round < 20; ++round) {
    std::unique_ptr<NameStream> a;
    std::unique_ptr<NameStream> b;
    ASSERT_TRUE(take(&a)) << "round " << round;
    ASSERT_TRUE(take(&b)) << "round " << round;
    // Cancelled together.
    std::thread cancel_a([&] { a.reset(); });
    b.reset();
    cancel_a.join();
  }
}

// A tenant holds at most its share of --directory_max_entries (25 % by
// default, as of every total): one publishing without end leaves the
// others room.
class DirectoryShareTest : public DirectoryTest {
 protected:
  DirectoryShareTest() { more_flags_ = {"--directory_max_entries=8"}; }
};

TEST_F(DirectoryShareTest, ATenantPastItsShareIsRefusedAndOthersPublish) {
  Session session = OpenFdSession();
  std::vector<Published> held;
  ASSERT_NO_FATAL_FAILURE(RegisterAndPublishEach(session, {"a", "b"}, &held));
  absl::StatusOr<Published> c = RegisterAndPublish(session, "c");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(client::ReasonOf(c.status()), "LIMIT_TENANT_PUBLISHED");
  EXPECT_TRUE(absl::StrContains(c.status().message(), "of its quota of 2"))
      << c.status();

  // Another tenant (anonymous leases): its own share.
  ASSERT_TRUE(WriteShmFile(mrd_->shm_dir(), "f", "file", 64 << 10).ok());
  // Anyone's to write: an anonymous lease may import it.
  ASSERT_EQ(chmod((mrd_->shm_dir() + "/f").c_str(), 0666), 0);
  v1::OpenLeaseSessionRequest open;
  open.set_ttl_seconds(60);  // and vouched for by nobody
  absl::StatusOr<v1::SessionInfo> info = client_->OpenLeaseSession(open);
  ASSERT_TRUE(info.ok()) << info.status();
  Session lease = Session::Attach(*client_, info->session());
  absl::StatusOr<Buffer> buffer = Buffer::ImportFile(lease, "f", true);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  client::RegisterOptions o;
  o.buffer = buffer->id();
  o.length = buffer->size();
  o.flags = kRemoteRead;
  absl::StatusOr<Registration> reg = Registration::Register(lease, o);
  ASSERT_TRUE(reg.ok()) << reg.status();
  v1::PublishRequest publish = PublishOf(lease, "theirs");
  publish.set_registration(reg->id());
  absl::StatusOr<v1::PublishedEntry> theirs = client_->Publish(publish);
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  EXPECT_EQ(theirs->tenant(), "anonymous");

  // A name unpublished is the tenant's to use again.
  v1::UnpublishRequest unpublish;
  unpublish.set_session(session.token());
  unpublish.set_name("a");
  ASSERT_TRUE(client_->Unpublish(unpublish).ok());
  c = RegisterAndPublish(session, "c");
  EXPECT_TRUE(c.ok()) << c.status();
}

TEST_F(DirectoryTest, ReleaseBufferAndCloseSessionRemoveTheirEntriesFirst) {
  Session session = OpenFdSession();
  std::vector<Published> held;
  ASSERT_NO_FATAL_FAILURE(RegisterAndPublishEach(session, {"a", "b"}, &held));
  const Published* a = &held[0];
  const std::string tenant = TenantOf(session);
  ASSERT_TRUE(events_.WaitFor(EtcdWatchEvent::Type::kPut, KeyOf(tenant, "a"),
                              absl::Seconds(10)));
  ASSERT_TRUE(events_.WaitFor(EtcdWatchEvent::Type::kPut, KeyOf(tenant, "b"),
                              absl::Seconds(10)));
  // W11: releasing the buffer invalidates its registration, and the entry.
  v1::ReleaseBufferRequest release;
  release.set_session(session.token());
  release.set_buffer(a->buffer.id());
  ASSERT_TRUE(client_->ReleaseBuffer(release).ok());
  EXPECT_EQ(ValueOf(KeyOf(tenant, "a")), "");
  EXPECT_NE(ValueOf(KeyOf(tenant, "b")), "");
  // CloseSession removes the rest before it answers.
  v1::CloseSessionRequest close;
  close.set_session(session.token());
  ASSERT_TRUE(client_->CloseSession(close).ok());
  EXPECT_EQ(ValueOf(KeyOf(tenant, "b")), "");
}

TEST_F(DirectoryTest, AnFdSessionThatHangsUpTakesItsEntriesAlong) {
  Session session = OpenFdSession();
  absl::StatusOr<Published> p = RegisterAndPublish(session, "gone-with-fd");
  ASSERT_TRUE(p.ok()) << p.status();
  const std::string key = KeyOf(TenantOf(session), "gone-with-fd");
  ASSERT_TRUE(
      events_.WaitFor(EtcdWatchEvent::Type::kPut, key, absl::Seconds(10)));
  // No call to answer: the socket closes and mrd deletes the entry.
  ASSERT_TRUE(session.Close().ok());
  EXPECT_TRUE(
      events_.WaitFor(EtcdWatchEvent::Type::kDelete, key, absl::Seconds(10)));
}

TEST_F(DirectoryTest, NamesAreTheTenantsOwnAndCheckedOnThisMrd) {
  Session session = OpenFdSession();
  absl::StatusOr<Published> p = RegisterAndPublish(session, "shared");
  ASSERT_TRUE(p.ok()) << p.status();
  // The same tenant again, from another session: the name is taken.
  Session second = OpenFdSession();
  absl::StatusOr<Published> again = RegisterAndPublish(second, "shared");
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(client::ReasonOf(again.status()), "NAME_TAKEN");
  // ... and it cannot unpublish what the other session published.
  v1::UnpublishRequest unpublish;
  unpublish.set_session(second.token());
  unpublish.set_name("shared");
  absl::StatusOr<v1::UnpublishResponse> refused = client_->Unpublish(unpublish);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(client::ReasonOf(refused.status()), "NOT_PUBLISHED");

  // Another tenant (an anonymous lease) publishes the same name under its
  // own prefix; the first entry stays as it was.
  absl::StatusOr<Anonymous> anonymous = RegisterAnonymously("anon");
  ASSERT_TRUE(anonymous.ok()) << anonymous.status();
  const Registration* reg = &anonymous->registration;
  v1::PublishRequest publish = PublishOf(anonymous->session, "shared");
  publish.set_registration(reg->id());
  absl::StatusOr<v1::PublishedEntry> theirs = client_->Publish(publish);
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  EXPECT_EQ(theirs->key(), KeyOf("anonymous", "shared"));
  EXPECT_NE(theirs->key(), p->entry.key());

  // Bad names and registrations are refused, and nothing is written.
  for (const std::string& bad :
       std::vector<std::string>{"", "a/b", "sp ace", std::string(129, 'x')}) {
    publish.set_name(bad);
    absl::StatusOr<v1::PublishedEntry> r = client_->Publish(publish);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(client::ReasonOf(r.status()), "BAD_PUBLISH_NAME") << bad;
  }
  publish.set_name("other");
  publish.set_registration(reg->id() + 1000);
  absl::StatusOr<v1::PublishedEntry> unknown = client_->Publish(publish);
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(events_.WaitFor(EtcdWatchEvent::Type::kPut,
                              KeyOf("anonymous", "shared"), absl::Seconds(10)));
  absl::StatusOr<directory::EtcdRange> all =
      etcd_->Get(absl::StrCat(Prefix(), "tenants/"));
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->kvs.size(), 2u);
}

TEST_F(DirectoryTest, AnMrdKilledOutrightLosesItsEntriesWithinTheLeaseTtl) {
  Session session = OpenFdSession();
  absl::StatusOr<Published> p = RegisterAndPublish(session, "doomed");
  ASSERT_TRUE(p.ok()) << p.status();
  const std::string key = KeyOf(TenantOf(session), "doomed");
  ASSERT_TRUE(
      events_.WaitFor(EtcdWatchEvent::Type::kPut, key, absl::Seconds(10)));
  ASSERT_EQ(::kill(mrd_->pid(), SIGKILL), 0);
  const absl::Time killed = absl::Now();
  ASSERT_TRUE(mrd_->WaitExited(absl::Seconds(10)));
  // etcd expires the lease on its own: nothing of mrd runs any more.
  ASSERT_TRUE(events_.WaitFor(EtcdWatchEvent::Type::kDelete, key,
                              kLeaseTtl + absl::Seconds(3)));
  const absl::Duration took = absl::Now() - killed;
  EXPECT_LE(took, kLeaseTtl + absl::Seconds(3));
  std::cerr << "entry gone " << absl::FormatDuration(took)
            << " after SIGKILL (lease TTL " << absl::FormatDuration(kLeaseTtl)
            << ")\n";
  mrd_.reset();  // killed: nothing to stop
}

TEST_F(DirectoryTest, RegistrationsOfABatchArePublishedAsTheyAreMade) {
  Session session = OpenFdSession();
  absl::StatusOr<Buffer> buffer = Buffer::Create(session, 4 << 20, "batch");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  v1::RegisterMrBatchRequest batch;
  batch.set_session(session.token());
  for (int i = 0; i < 4; ++i) {
    v1::RegisterMrRequest* item = batch.add_items();
    item->set_buffer(buffer->id());
    item->set_offset(static_cast<uint64_t>(i) << 20);
    item->set_length(1 << 20);
    item->set_flags(kRemoteRead);
    // The third cannot be published: it is refused and leaves nothing.
    item->set_publish_name(i == 2 ? "not/a/name" : absl::StrCat("part-", i));
  }
  absl::StatusOr<v1::RegisterMrBatchResponse> made =
      client_->RegisterMrBatch(batch);
  ASSERT_TRUE(made.ok()) << made.status();
  ASSERT_EQ(made->items_size(), 4);
  const std::string tenant = TenantOf(session);
  v1::DeregisterMrBatchRequest undo;
  undo.set_session(session.token());
  for (int i = 0; i < 4; ++i) {
    const v1::RegisterMrBatchResult& item = made->items(i);
    if (i == 2) {
      EXPECT_EQ(item.status().detail().reason(), "BAD_PUBLISH_NAME");
      continue;
    }
    ASSERT_EQ(item.status().code(), 0) << item.status().message();
    EXPECT_EQ(item.registration().published_key(),
              KeyOf(tenant, absl::StrCat("part-", i)));
    undo.add_items()->set_registration(item.registration().registration());
    EXPECT_TRUE(events_.WaitFor(EtcdWatchEvent::Type::kPut,
                                KeyOf(tenant, absl::StrCat("part-", i)),
                                absl::Seconds(10)));
  }
  absl::StatusOr<v1::SessionInfo> info = session.Info();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->registrations(), 3u);
  EXPECT_EQ(info->published(), 3u);
  // Deregistered in one batch: every entry is gone when it answers.
  ASSERT_TRUE(client_->DeregisterMrBatch(undo).ok());
  absl::StatusOr<directory::EtcdRange> left =
      etcd_->Get(absl::StrCat(Prefix(), "tenants/"));
  ASSERT_TRUE(left.ok());
  EXPECT_TRUE(left->kvs.empty());
}

TEST_F(DirectoryTest, ALiveHandoverKeepsEveryEntryAndBumpsTheEpoch) {
  char dir_template[] = "/tmp/mrd-directory-handover-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string runtime_dir = dir_template;
  // Not the fixture's mrd's node: a node has one mrd.
  MrdProcessOptions options = NodeOptions("node-h");
  options.runtime_dir = runtime_dir;
  absl::StatusOr<std::unique_ptr<MrdProcess>> old = MrdProcess::Start(options);
  ASSERT_TRUE(old.ok()) << old.status();
  absl::StatusOr<client::Client> client = ConnectTo(**old);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Session> session = Session::OpenFd(*client);
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<Published> kept =
      RegisterAndPublishVia(*client, *session, "kept");
  ASSERT_TRUE(kept.ok()) << kept.status();
  Registration* reg = &kept->registration;
  const std::string key = kept->entry.key();
  ASSERT_TRUE(
      events_.WaitFor(EtcdWatchEvent::Type::kPut, key, absl::Seconds(10)));
  absl::StatusOr<directory::EtcdRange> before = etcd_->Get(key);
  ASSERT_TRUE(before.ok() && before->kvs.size() == 1u);
  // A fast-register MR object's mapping, published too.
  Buffer fast = NewBuffer(*session, 4096, "mapped ");
  client::CompletionStream stream = client::CompletionStream::Open(*session);
  absl::StatusOr<client::Mr> mr = client::Mr::Create(*session, true, true);
  ASSERT_TRUE(mr.ok()) << mr.status();
  client::BuildLamOptions lo;
  lo.buffer = fast.id();
  lo.length = 4096;
  absl::StatusOr<client::Lam> lam = client::Lam::Build(*session, lo);
  ASSERT_TRUE(lam.ok()) << lam.status();
  auto peer = ConnectPeer(*session);
  ASSERT_NE(peer, nullptr);
  NextCompletionOfKind(stream, v1::Completion::PEER_CONNECTED);
  client::FastRegisterOptions fr = client::FastRegisterOptions::FromLam(*lam);
  fr.connection = peer->connection_id();
  fr.base_address = 0x20000000;
  fr.flags = kOpRemoteRead;
  ASSERT_TRUE(mr->FastRegister(fr).ok());
  const uint32_t rkey =
      NextCompletionOfKind(stream, v1::Completion::FAST_REGISTER).rkey();
  v1::PublishRequest publish = PublishOf(*session, "mapped");
  publish.set_mr(mr->id());
  absl::StatusOr<v1::PublishedEntry> mapped = client->Publish(publish);
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  ASSERT_TRUE(events_.WaitFor(EtcdWatchEvent::Type::kPut, mapped->key(),
                              absl::Seconds(10)));

  // The successor takes over; the old mrd exits.
  options.extra_flags.push_back("--takeover");
  absl::StatusOr<std::unique_ptr<MrdProcess>> successor =
      MrdProcess::Start(options);
  ASSERT_TRUE(successor.ok()) << successor.status();
  ASSERT_TRUE((*old)->WaitExited(absl::Seconds(30))) << (*old)->Log();

  // The entry is written again by the new process, epoch 2, on the same
  // lease; at no time was it deleted.
  v1::ResolveRequest resolve;
  resolve.set_session(session->token());
  resolve.set_name("kept");
  uint64_t epoch = 0;
  EXPECT_TRUE(PollUntil(
      [&] {
        absl::StatusOr<v1::PublishedEntry> found = client->Resolve(resolve);
        epoch = found.ok() ? found->epoch() : 0;
        return epoch == 2;
      },
      absl::Seconds(10)));
  EXPECT_EQ(epoch, 2u);
  // The node entry says which process serves the node now.
  EXPECT_TRUE(PollUntil([&] { return NodeOf("node-h").epoch() == 2; },
                        absl::Seconds(10)));
  absl::StatusOr<directory::EtcdRange> after = etcd_->Get(key);
  ASSERT_TRUE(after.ok() && after->kvs.size() == 1u);
  EXPECT_EQ(after->kvs[0].lease, before->kvs[0].lease);
  EXPECT_FALSE(events_.WaitFor(EtcdWatchEvent::Type::kDelete, key,
                               absl::ZeroDuration()));
  // The mapping's name too, with its token, written again by epoch 2.
  resolve.set_name("mapped");
  EXPECT_TRUE(PollUntil(
      [&] {
        absl::StatusOr<v1::PublishedEntry> found = client->Resolve(resolve);
        return found.ok() && found->epoch() == 2 && found->tokens_size() == 1 &&
               found->tokens(0).rkey() == rkey;
      },
      absl::Seconds(10)));
  EXPECT_FALSE(events_.WaitFor(EtcdWatchEvent::Type::kDelete, mapped->key(),
                               absl::ZeroDuration()));
  // CloseMr on the new process removes it before it answers.
  peer.reset();
  ASSERT_TRUE(mr->Close().ok());
  EXPECT_EQ(ValueOf(mapped->key()), "");
  // Longer than the lease's TTL after the old process exited: the new one
  // keeps the lease alive.
  EXPECT_FALSE(events_.WaitFor(EtcdWatchEvent::Type::kDelete, key,
                               kLeaseTtl + absl::Seconds(1)));
  // And the new process removes it when the registration goes.
  ASSERT_TRUE(reg->Deregister().ok());
  EXPECT_EQ(ValueOf(key), "");
  session->Close().IgnoreError();
  {
    const absl::Status stopped = (*successor)->Stop();
    EXPECT_TRUE(stopped.ok()) << stopped;
  }
  std::error_code ignored;
  std::filesystem::remove_all(runtime_dir, ignored);
}

// mrd with the Mooncake layout: each name is also a Mooncake segment.
class DirectoryMooncakeTest : public DirectoryTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions options = DirectoryTest::ServerOptions();
    options.extra_flags.push_back(
        absl::StrCat("--directory_mooncake_prefix=", MooncakePrefix()));
    return options;
  }
  // The test's own: "mooncake/<cluster>/", as a reader's
  // MC_METADATA_CLUSTER_ID makes it.
  std::string MooncakePrefix() const {
    return absl::StrCat("mooncake/", cluster_name_, "/");
  }
};

TEST_F(DirectoryMooncakeTest, ANameIsASegmentItsReadersParseAndGoesWithIt) {
  Events segments;
  absl::StatusOr<std::unique_ptr<directory::EtcdWatch>> watch =
      etcd_->Watch(MooncakePrefix(), 0, segments.Callback());
  ASSERT_TRUE(watch.ok()) << watch.status();
  Session session = OpenFdSession();
  // Mooncake names a segment host:port.
  const std::string name = "10.0.0.7:17001";
  absl::StatusOr<Published> p = RegisterAndPublish(session, name);
  ASSERT_TRUE(p.ok()) << p.status();
  const std::string segment = absl::StrCat(MooncakePrefix(), "ram/", name);
  EXPECT_EQ(p->entry.mooncake_key(), segment);
  ASSERT_TRUE(
      segments.WaitFor(EtcdWatchEvent::Type::kPut, segment, absl::Seconds(10)));
  const std::string json = ValueOf(segment);
  MooncakeSegmentRead read;
  absl::Status parsed = ReadMooncakeSegment(json, &read);
  ASSERT_TRUE(parsed.ok()) << parsed << "\n" << json;
  absl::StatusOr<v1::DeviceInfo> device = client_->GetDeviceInfo();
  ASSERT_TRUE(device.ok());
  EXPECT_EQ(read.name, name);
  ASSERT_EQ(read.devices.size(), 1u);
  EXPECT_EQ(read.devices[0], device->name());
  EXPECT_EQ(read.length, p->buffer.size());
  ASSERT_EQ(read.rkeys.size(), 1u);
  EXPECT_EQ(read.rkeys[0], p->registration.rkey());
  EXPECT_TRUE(absl::StrContains(
      json, absl::StrCat("\"addr\":", p->registration.base_address(), ",")))
      << json;
  // mrd's own entry is there too, and ListPublished shows both keys.
  EXPECT_NE(ValueOf(p->entry.key()), "");
  v1::ListPublishedRequest list;
  list.set_session(session.token());
  EXPECT_TRUE(PollUntil(
      [&] {
        absl::StatusOr<v1::ListPublishedResponse> listed =
            client_->ListPublished(list);
        return listed.ok() && listed->entries_size() == 1 &&
               listed->entries(0).mooncake_key() == segment &&
               listed->entries(0).state() == "published";
      },
      absl::Seconds(10)));

  // Segment keys have no tenant: another tenant cannot take this one.
  absl::StatusOr<Anonymous> theirs = RegisterAnonymously("anon");
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  v1::PublishRequest publish = PublishOf(theirs->session, name);
  publish.set_registration(theirs->registration.id());
  absl::StatusOr<v1::PublishedEntry> taken = client_->Publish(publish);
  ASSERT_FALSE(taken.ok());
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(client::ReasonOf(taken.status()), "SEGMENT_TAKEN");

  // Deregistered: both keys are gone when DeregisterMr answers.
  ASSERT_TRUE(p->registration.Deregister().ok());
  EXPECT_EQ(ValueOf(segment), "");
  EXPECT_EQ(ValueOf(p->entry.key()), "");
  // Then the name is free for the other tenant.
  absl::StatusOr<v1::PublishedEntry> now = client_->Publish(publish);
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->mooncake_key(), segment);
}

// An mrd of two devices publishes a token per device: mrd's entry as a
// peer resolves it, the node entry, and the Mooncake segment (its buffer's
// rkeys in the devices' order), each the registration's own.
class DirectoryTwoDevicesTest : public DirectoryMooncakeTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions options = DirectoryMooncakeTest::ServerOptions();
    options.extra_flags.push_back("--software_devices=2");
    return options;
  }
  void SetUp() override {
    if (TestDeviceKind() != "software") {
      GTEST_SKIP() << "software devices only";
    }
    DirectoryMooncakeTest::SetUp();
  }
};

TEST_F(DirectoryTwoDevicesTest, EveryEntryCarriesATokenPerDevice) {
  Session session = OpenFdSession();
  absl::StatusOr<Buffer> buffer = Buffer::Create(session, 64 << 10, "both ");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  client::RegisterOptions o;
  o.buffer = buffer->id();
  o.length = buffer->size();
  o.flags = kRemoteRead;
  o.all_devices = true;
  absl::StatusOr<Registration> reg = Registration::Register(session, o);
  ASSERT_TRUE(reg.ok()) << reg.status();
  ASSERT_EQ(reg->tokens().size(), 2);
  const std::string name = "10.0.0.8:17002";
  v1::PublishRequest publish = PublishOf(session, name);
  publish.set_registration(reg->id());
  absl::StatusOr<v1::PublishedEntry> entry = client_->Publish(publish);
  ASSERT_TRUE(entry.ok()) << entry.status();
  ASSERT_TRUE(events_.WaitFor(EtcdWatchEvent::Type::kPut, entry->key(),
                              absl::Seconds(10)));
  absl::StatusOr<v1::DeviceInfo> info = client_->GetDeviceInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->devices_size(), 2);

  v1::ResolveRequest resolve;
  resolve.set_session(session.token());
  resolve.set_name(name);
  absl::StatusOr<v1::PublishedEntry> found = client_->Resolve(resolve);
  ASSERT_TRUE(found.ok()) << found.status();
  ASSERT_EQ(found->tokens_size(), 2);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(found->tokens(i).device(), reg->tokens()[i].device());
    EXPECT_EQ(found->tokens(i).rkey(), reg->tokens()[i].rkey());
    EXPECT_EQ(found->tokens(i).peer_address(), info->devices(i).peer_address());
  }
  EXPECT_NE(found->tokens(0).peer_address(), found->tokens(1).peer_address());

  ASSERT_TRUE(PollUntil([&] { return NodeOf("node-a").devices_size() == 2; },
                        absl::Seconds(10)));
  v1::DirectoryNode node = NodeOf("node-a");
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(node.devices(i).name(), info->devices(i).name());
  }

  const std::string segment = absl::StrCat(MooncakePrefix(), "ram/", name);
  ASSERT_TRUE(
      PollUntil([&] { return !ValueOf(segment).empty(); }, absl::Seconds(10)));
  MooncakeSegmentRead read;
  const std::string json = ValueOf(segment);
  absl::Status parsed = ReadMooncakeSegment(json, &read);
  ASSERT_TRUE(parsed.ok()) << parsed << "\n" << json;
  ASSERT_EQ(read.devices.size(), 2u);
  ASSERT_EQ(read.rkeys.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(read.devices[static_cast<size_t>(i)], reg->tokens()[i].device());
    EXPECT_EQ(read.rkeys[static_cast<size_t>(i)], reg->tokens()[i].rkey());
  }

  ASSERT_TRUE(reg->Deregister().ok());
  EXPECT_EQ(ValueOf(entry->key()), "");
  EXPECT_EQ(ValueOf(segment), "");
}

// Not in a suite with a shared cluster: it kills every member.
TEST(DirectoryOutageTest, RegistrationsGoOnAndEntriesAppearOnceEtcdIsBack) {
  absl::StatusOr<std::unique_ptr<EtcdCluster>> cluster = EtcdCluster::Start(3);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  MrdProcessOptions options;
  options.extra_flags = {
      absl::StrCat("--etcd_endpoints=",
                   absl::StrJoin((*cluster)->endpoints(), ",")),
      "--node_name=node-a", "--directory_lease_ttl=2s"};
  absl::StatusOr<OwnMrd> own = StartOwnMrd(options);
  ASSERT_TRUE(own.ok()) << own.status();
  MrdProcess& mrd = *own->mrd;
  client::Client& client = *own->client;
  Session& session = *own->session;
  // The directory's health follows etcd; readiness does not.
  EXPECT_TRUE(PollUntil(
      [&] {
        return HealthOf(mrd, kDirectoryHealth) ==
               grpc::health::v1::HealthCheckResponse::SERVING;
      },
      absl::Seconds(10)));
  for (int i = 0; i < (*cluster)->size(); ++i) (*cluster)->Kill(i);

  // Registering and publishing do not wait for etcd.
  absl::StatusOr<Buffer> buffer = Buffer::Create(session, 64 << 10, "late");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  client::RegisterOptions o;
  o.buffer = buffer->id();
  o.length = buffer->size();
  o.flags = kRemoteRead;
  const absl::Time start = absl::Now();
  absl::StatusOr<Registration> reg = Registration::Register(session, o);
  ASSERT_TRUE(reg.ok()) << reg.status();
  v1::PublishRequest publish = PublishOf(session, "late");
  publish.set_registration(reg->id());
  absl::StatusOr<v1::PublishedEntry> entry = client.Publish(publish);
  ASSERT_TRUE(entry.ok()) << entry.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  EXPECT_EQ(entry->state(), "pending");
  v1::ListPublishedRequest list;
  list.set_session(session.token());
  // The directory's state and the entry's, as ListPublished reports them.
  auto states = [&]() -> std::pair<std::string, std::string> {
    absl::StatusOr<v1::ListPublishedResponse> listed =
        client.ListPublished(list);
    if (!listed.ok() || listed->entries_size() != 1) return {"?", "?"};
    return {listed->directory_state(), listed->entries(0).state()};
  };
  EXPECT_TRUE(PollUntil([&] { return states().first == "unavailable"; },
                        absl::Seconds(15)));
  EXPECT_EQ(states().second, "pending");
  EXPECT_TRUE(PollUntil(
      [&] {
        return HealthOf(mrd, kDirectoryHealth) ==
               grpc::health::v1::HealthCheckResponse::NOT_SERVING;
      },
      absl::Seconds(5)));
  EXPECT_EQ(HealthOf(mrd, "mrd.v1.MemoryRegistration"),
            grpc::health::v1::HealthCheckResponse::SERVING);

  for (int i = 0; i < (*cluster)->size(); ++i) {
    ASSERT_TRUE((*cluster)->Restart(i).ok());
  }
  // Once etcd is back the entry appears, without another call.
  EXPECT_TRUE(PollUntil([&] { return states().second == "published"; },
                        absl::Seconds(30)));
  EXPECT_EQ(states().first, "serving");
  EXPECT_TRUE(PollUntil(
      [&] {
        return HealthOf(mrd, kDirectoryHealth) ==
               grpc::health::v1::HealthCheckResponse::SERVING;
      },
      absl::Seconds(5)));
  ASSERT_TRUE(reg->Deregister().ok());
  session.Close().IgnoreError();
  {
    const absl::Status stopped = mrd.Stop();
    EXPECT_TRUE(stopped.ok()) << stopped;
  }
}

// One member of three killed, the first (mrd's client calls it first):
// nothing published is lost, the lease outlives its TTL through the other
// two, and publishing and deleting go on.
TEST(DirectoryMemberLossTest, EntriesStayAndPublishingGoesOnWithOneMemberDown) {
  absl::StatusOr<std::unique_ptr<EtcdCluster>> cluster = EtcdCluster::Start(3);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::vector<std::string> endpoints = (*cluster)->endpoints();
  MrdProcessOptions options;
  options.extra_flags = {
      absl::StrCat("--etcd_endpoints=", absl::StrJoin(endpoints, ",")),
      "--node_name=node-a", "--directory_cluster=loss",
      "--directory_lease_ttl=2s"};
  absl::StatusOr<OwnMrd> own = StartOwnMrd(options);
  ASSERT_TRUE(own.ok()) << own.status();
  MrdProcess& mrd = *own->mrd;
  client::Client& client = *own->client;
  Session& session = *own->session;
  std::vector<Published> published;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<Published> p =
        RegisterAndPublishVia(client, session, absl::StrCat("before-", i));
    ASSERT_TRUE(p.ok()) << p.status();
    published.push_back(*std::move(p));
  }
  // etcd as the two members that stay see it.
  directory::EtcdClientOptions survivors;
  survivors.endpoints = {endpoints[1], endpoints[2]};
  absl::StatusOr<std::unique_ptr<EtcdClient>> etcd =
      EtcdClient::Create(survivors);
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  const std::string prefix = "/mrd/v1/loss/";
  auto names = [&]() -> std::vector<directory::EtcdKeyValue> {
    absl::StatusOr<directory::EtcdRange> range = (*etcd)->Get(prefix);
    std::vector<directory::EtcdKeyValue> out;
    if (!range.ok()) return out;
    for (directory::EtcdKeyValue& kv : range->kvs) {
      if (absl::StrContains(kv.key, "/names/")) out.push_back(std::move(kv));
    }
    return out;
  };
  ASSERT_TRUE(
      PollUntil([&] { return names().size() == 3; }, absl::Seconds(10)));
  const int64_t lease = names()[0].lease;
  ASSERT_NE(lease, 0);

  (*cluster)->Kill(0);
  absl::StatusOr<Published> after =
      RegisterAndPublishVia(client, session, "after");
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(
      PollUntil([&] { return names().size() == 4; }, absl::Seconds(10)));
  // A TTL and a half later every name is still there, on the same lease.
  const absl::Time until = absl::Now() + absl::Seconds(3);
  while (absl::Now() < until) {
    const std::vector<directory::EtcdKeyValue> now = names();
    ASSERT_EQ(now.size(), 4u);
    for (const directory::EtcdKeyValue& kv : now) {
      EXPECT_EQ(kv.lease, lease) << kv.key;
    }
    absl::SleepFor(absl::Milliseconds(250));
  }
  // A deregistration's delete goes through the others before it answers.
  ASSERT_TRUE(published[0].registration.Deregister().ok());
  EXPECT_EQ(names().size(), 3u);
  EXPECT_EQ(HealthOf(mrd, kDirectoryHealth),
            grpc::health::v1::HealthCheckResponse::SERVING);
  session.Close().IgnoreError();
  {
    const absl::Status stopped = mrd.Stop();
    EXPECT_TRUE(stopped.ok()) << stopped;
  }
}

// etcd over mutual TLS with authentication on (one member is enough): two
// mrds given the CA, a client certificate and a user with a password file
// publish and resolve a name, and neither's log, debug lines included,
// holds the password or the key; an mrd given a wrong password says so
// (ETCD_AUTH_FAILED) without showing it either.
TEST(DirectorySecureTest, MrdsOverTlsWithAUserPublishAndResolveAndLogNoSecret) {
  EtcdClusterOptions cluster_options;
  cluster_options.tls = true;
  cluster_options.client_cert_auth = true;
  cluster_options.auth = true;
  absl::StatusOr<std::unique_ptr<EtcdCluster>> cluster =
      EtcdCluster::Start(1, cluster_options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const EtcdCluster& etcd = **cluster;
  auto node = [&](const std::string& name, const std::string& password_file) {
    MrdProcessOptions options;
    options.extra_flags = {
        absl::StrCat("--etcd_endpoints=", absl::StrJoin(etcd.endpoints(), ",")),
        "--etcd_ca_file=" + etcd.ca_file(),
        "--etcd_cert_file=" + etcd.client_cert_file(),
        "--etcd_key_file=" + etcd.client_key_file(),
        absl::StrCat("--etcd_user=", EtcdCluster::kUser),
        "--etcd_password_file=" + password_file,
        "--node_name=" + name,
        "--directory_lease_ttl=2s",
        "--verbose"};
    return MrdProcess::Start(options);
  };
  // What no log line may hold: the password, and the client key's body.
  std::vector<std::string> secrets = {etcd.password()};
  {
    std::ifstream in(etcd.client_key_file());
    std::string line;
    while (std::getline(in, line)) {
      if (!line.empty() && !absl::StartsWith(line, "-----")) {
        secrets.push_back(line);
      }
    }
  }
  ASSERT_GE(secrets.size(), 2u);
  auto expect_no_secret = [&](const std::string& log) {
    for (const std::string& secret : secrets) {
      EXPECT_FALSE(absl::StrContains(log, secret)) << "a secret in mrd's log:\n"
                                                   << log;
    }
  };

  absl::StatusOr<std::unique_ptr<MrdProcess>> a =
      node("node-a", etcd.password_file());
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<client::Client> client = ConnectTo(**a);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Session> session = Session::OpenFd(*client);
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<Published> published =
      RegisterAndPublishVia(*client, *session, "secure.0");
  ASSERT_TRUE(published.ok()) << published.status();
  Registration* reg = &published->registration;
  v1::ListPublishedRequest list;
  list.set_session(session->token());
  auto state = [&]() -> std::string {
    absl::StatusOr<v1::ListPublishedResponse> listed =
        client->ListPublished(list);
    if (!listed.ok() || listed->entries_size() != 1) return "?";
    return listed->entries(0).state();
  };
  ASSERT_TRUE(
      PollUntil([&] { return state() == "published"; }, absl::Seconds(20)))
      << state() << "\n"
      << (*a)->Log();

  absl::StatusOr<std::unique_ptr<MrdProcess>> b =
      node("node-b", etcd.password_file());
  ASSERT_TRUE(b.ok()) << b.status();
  absl::StatusOr<client::Client> remote = ConnectTo(**b);
  ASSERT_TRUE(remote.ok()) << remote.status();
  absl::StatusOr<Session> peer = Session::OpenFd(*remote);
  ASSERT_TRUE(peer.ok()) << peer.status();
  absl::StatusOr<v1::SessionInfo> info = session->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  v1::ResolveRequest resolve;
  resolve.set_session(peer->token());
  resolve.set_name("secure.0");
  resolve.set_tenant(info->tenant());
  absl::StatusOr<v1::PublishedEntry> found = remote->Resolve(resolve);
  ASSERT_TRUE(found.ok()) << found.status() << "\n" << (*b)->Log();
  EXPECT_EQ(found->node(), "node-a");
  EXPECT_EQ(found->address(), reg->base_address());
  EXPECT_TRUE(absl::StrContains((*a)->Log(),
                                "(TLS, client certificate), "
                                "user root"))
      << (*a)->Log();

  // A wrong password: mrd starts, and says etcd refused it.
  const std::string wrong_file = etcd.dir() + "/wrong-password";
  const std::string wrong = "not-" + etcd.password();
  {
    std::ofstream out(wrong_file);
    out << wrong << "\n";
  }
  secrets.push_back(wrong);
  absl::StatusOr<std::unique_ptr<MrdProcess>> c = node("node-c", wrong_file);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(PollUntil(
      [&] { return absl::StrContains((*c)->Log(), "refused user 'root'"); },
      absl::Seconds(20)))
      << (*c)->Log();
  ASSERT_TRUE(reg->Deregister().ok());
  session->Close().IgnoreError();
  peer->Close().IgnoreError();
  for (auto* mrd : {&*c, &*b, &*a}) {
    absl::Status stopped = (*mrd)->Stop();
    EXPECT_TRUE(stopped.ok()) << stopped << "\n" << (*mrd)->Log();
  }
  expect_no_secret((*a)->Log());
  expect_no_secret((*b)->Log());
  expect_no_secret((*c)->Log());
}

}  // namespace
}  // namespace mrd::testing
