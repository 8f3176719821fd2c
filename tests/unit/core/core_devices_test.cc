// The core serving two real software devices (issue 26): a registration on
// both is made on both or on neither — whichever step of either device's
// RegisterMr fails, the other device is left holding nothing of it — gives
// one token per device, each usable only on its own device's peer path, and
// its deregistration (or the session's end) releases it on both. The cache
// keeps one registration per (range, access, device set).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "client/peer/soft_peer.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "mrd/unique_fd.h"
#include "server/common/clock.h"
#include "server/common/log.h"
#include "server/core/core.h"
#include "server/device/fault_points.h"
#include "server/device/software/software_device.h"
#include "tests/unit/core/core_test_util.h"

namespace mrd::core_test {
namespace {

constexpr uint64_t kPages = 8;

// The parameters: whether the second device shares the first's pins, as
// mrd's software devices do, and whether the devices register side by side
// (on threads of their own, as big registrations do) or one after the other.
class CoreDevicesTest
    : public ::testing::TestWithParam<std::tuple<bool, bool>> {
 protected:
  void SetUp() override {
    SetMinLogLevel(LogLevel::kError);
    page_ = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    for (int i = 0; i < 2; ++i) {
      device::SoftwareDeviceOptions options;
      options.name = i == 0 ? "software" : "software1";
      options.peer_listen_address = "127.0.0.1:0";
      options.fault_points = &faults_[i];
      options.connection_id_base = uint64_t{1} * i
                                   << core::Session::kDeviceShift;
      if (i == 1 && Shared()) options.share_pins_with = devices_[0].get();
      auto device = device::SoftwareDevice::Create(options);
      ASSERT_TRUE(device.ok()) << device.status();
      devices_[i] = std::move(*device);
      ASSERT_OK(devices_[i]->Start());
    }
    core::CoreOptions options;
    options.max_session_pinned_bytes = 16 * kPages * page_;
    options.max_total_pinned_bytes = 16 * kPages * page_;
    if (std::get<1>(GetParam())) options.parallel_devices_min_bytes = 0;
    core_ = std::make_unique<core::Core>(
        std::vector<device::Device*>{devices_[0].get(), devices_[1].get()},
        RealClock::Get(), options);
    absl::StatusOr<SessionWithBuffer> opened =
        OpenSessionWithBuffer(*core_, kPages * page_);
    ASSERT_TRUE(opened.ok()) << opened.status();
    own_ = std::move(*opened);
  }

  void TearDown() override {
    if (core_ != nullptr) core_->Shutdown();
    for (auto& device : devices_) {
      if (device == nullptr) continue;
      ExpectEmpty(*device);
      device->Shutdown();
    }
  }

  static bool Shared() { return std::get<0>(GetParam()); }

  // The device holds nothing of the session's memory.
  static void ExpectEmpty(const device::SoftwareDevice& device) {
    const device::SoftwareDevice::ResourceCounts counts =
        device.CountResources();
    EXPECT_EQ(counts.mrs, 0u) << device.Attributes().name;
    EXPECT_EQ(counts.keys, 0u) << device.Attributes().name;
    EXPECT_EQ(device.PinnedBytes(), 0u) << device.Attributes().name;
  }

  v1::RegisterMrRequest Request(uint64_t offset, uint64_t length,
                                const std::vector<std::string>& devices,
                                bool all = false, bool nearest = false) {
    v1::RegisterMrRequest req;
    req.set_session(own_.session);
    req.set_buffer(own_.buffer.buffer());
    req.set_offset(offset);
    req.set_length(length);
    req.set_flags(kMrRemoteRead);
    for (const std::string& d : devices) req.mutable_devices()->add_names(d);
    if (all) req.mutable_devices()->set_all(true);
    if (nearest) req.mutable_devices()->set_nearest(true);
    return req;
  }
  absl::StatusOr<v1::RegisterMrResponse> Register(
      const v1::RegisterMrRequest& req) {
    return RegisterOn(*core_, req);
  }
  absl::Status Deregister(uint64_t registration) {
    return DeregisterOn(*core_, own_.session, registration).status();
  }
  // A peer on `device`'s peer path, with the session's ticket there.
  std::unique_ptr<peer::SoftPeer> PeerOn(const std::string& device) {
    v1::CreatePeerTicketRequest req;
    req.set_session(own_.session);
    req.set_device(device);
    v1::PeerTicket ticket;
    absl::Status s = core_->CreatePeerTicket(req, &ticket);
    EXPECT_TRUE(s.ok()) << s;
    if (!s.ok()) return nullptr;
    EXPECT_EQ(ticket.device(), device);
    absl::StatusOr<std::unique_ptr<peer::SoftPeer>> p =
        peer::SoftPeer::Connect(ticket.peer_address(), ticket.ticket());
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  }

  uint64_t page_ = 0;
  device::FaultPoints faults_[2];
  std::unique_ptr<device::SoftwareDevice> devices_[2];
  std::unique_ptr<core::Core> core_;
  SessionWithBuffer own_;  // the test's session and buffer
};

TEST_P(CoreDevicesTest, GetDeviceInfoListsBothDevicesWithTheirPeerPaths) {
  v1::DeviceInfo info;
  ASSERT_OK(core_->GetDeviceInfo(&info));
  EXPECT_EQ(info.name(), "software");
  ASSERT_EQ(info.devices_size(), 2);
  EXPECT_EQ(info.devices(0).name(), "software");
  EXPECT_EQ(info.devices(1).name(), "software1");
  EXPECT_NE(info.devices(0).peer_address(), info.devices(1).peer_address());
  EXPECT_EQ(info.devices(1).kind(), "software");
  EXPECT_EQ(info.devices(1).numa_node(), -1);
}

TEST_P(CoreDevicesTest, ARegistrationOnBothHasATokenPerDeviceUsableOnlyThere) {
  absl::StatusOr<v1::RegisterMrResponse> both =
      Register(Request(page_, 2 * page_, {}, /*all=*/true));
  ASSERT_TRUE(both.ok()) << both.status();
  ASSERT_EQ(both->tokens_size(), 2);
  EXPECT_EQ(both->tokens(0).device(), "software");
  EXPECT_EQ(both->tokens(1).device(), "software1");
  EXPECT_EQ(both->tokens(0).rkey(), both->rkey());
  EXPECT_EQ(both->tokens(0).peer_address(),
            devices_[0]->Attributes().peer_address);
  EXPECT_EQ(both->tokens(1).peer_address(),
            devices_[1]->Attributes().peer_address);
  EXPECT_EQ(devices_[0]->CountResources().mrs, 1u);
  EXPECT_EQ(devices_[1]->CountResources().mrs, 1u);
  // The core counts the memory once, whatever the devices pin.
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 2 * page_);

  const uint64_t base = both->base_address();
  for (int i = 0; i < 2; ++i) {
    std::unique_ptr<peer::SoftPeer> peer = PeerOn(both->tokens(i).device());
    ASSERT_NE(peer, nullptr);
    absl::StatusOr<std::string> read =
        peer->Read(both->tokens(i).rkey(), base + 8, 64);
    ASSERT_TRUE(read.ok()) << i << ": " << read.status();
    EXPECT_EQ(*read, own_.pattern.substr(page_ + 8, 64));
  }

  // A registration on the second device only: the first holds no key at
  // all, so its token is refused there whatever its value.
  absl::StatusOr<v1::RegisterMrResponse> second =
      Register(Request(0, page_, {"software1"}));
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_EQ(second->tokens_size(), 1);
  EXPECT_EQ(second->tokens(0).device(), "software1");
  ASSERT_OK(Deregister(both->registration()));
  std::unique_ptr<peer::SoftPeer> first_peer = PeerOn("software");
  ASSERT_NE(first_peer, nullptr);
  EXPECT_FALSE(
      first_peer->Read(second->rkey(), second->base_address(), 64).ok());
  std::unique_ptr<peer::SoftPeer> second_peer = PeerOn("software1");
  ASSERT_NE(second_peer, nullptr);
  absl::StatusOr<std::string> read =
      second_peer->Read(second->rkey(), second->base_address(), 64);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, own_.pattern.substr(0, 64));
  // The deregistered tokens are dead on both devices.
  std::unique_ptr<peer::SoftPeer> again = PeerOn("software1");
  ASSERT_NE(again, nullptr);
  EXPECT_FALSE(again->Read(both->tokens(1).rkey(), base, 64).ok());
  EXPECT_EQ(devices_[0]->CountResources().mrs, 0u);
  EXPECT_EQ(devices_[1]->CountResources().mrs, 1u);
  ASSERT_OK(Deregister(second->registration()));
  ExpectEmpty(*devices_[0]);
  ExpectEmpty(*devices_[1]);
}

TEST_P(CoreDevicesTest, TheCacheKeepsOneRegistrationPerDeviceSet) {
  absl::StatusOr<v1::RegisterMrResponse> first =
      Register(Request(0, page_, {}));
  absl::StatusOr<v1::RegisterMrResponse> both =
      Register(Request(0, page_, {"software", "software1"}));
  absl::StatusOr<v1::RegisterMrResponse> both_again =
      Register(Request(0, page_, {}, /*all=*/true));
  ASSERT_TRUE(first.ok() && both.ok() && both_again.ok());
  EXPECT_FALSE(both->cache_hit());
  EXPECT_NE(both->registration(), first->registration());
  EXPECT_TRUE(both_again->cache_hit());
  EXPECT_EQ(both_again->registration(), both->registration());
  EXPECT_EQ(both_again->references(), 2u);
  ASSERT_EQ(both_again->tokens_size(), 2);
  EXPECT_EQ(both_again->tokens(1).rkey(), both->tokens(1).rkey());
  EXPECT_EQ(first->tokens_size(), 1);
  // ListRegistrations gives each its tokens.
  v1::ListRegistrationsRequest list_req;
  list_req.set_session(own_.session);
  v1::ListRegistrationsResponse list;
  ASSERT_OK(core_->ListRegistrations(list_req, &list));
  ASSERT_EQ(list.registrations_size(), 2);
  for (const v1::RegistrationInfo& r : list.registrations()) {
    EXPECT_EQ(r.tokens_size(),
              r.registration() == first->registration() ? 1 : 2);
  }
  ASSERT_OK(Deregister(both->registration()));
  EXPECT_EQ(devices_[1]->CountResources().mrs, 1u);  // one reference left
  ASSERT_OK(Deregister(both->registration()));
  ASSERT_OK(Deregister(first->registration()));
  ExpectEmpty(*devices_[1]);
}

TEST_P(CoreDevicesTest, AnUnknownDeviceIsRefusedByNameAndNothingIsPinned) {
  absl::StatusOr<v1::RegisterMrResponse> r =
      Register(Request(0, page_, {"software", "mlx5_9"}));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GetErrorDetail(r.status()).reason(), "UNKNOWN_DEVICE");
  EXPECT_TRUE(absl::StrContains(r.status().message(), "mlx5_9"));
  EXPECT_TRUE(absl::StrContains(r.status().message(), "software1"));
  v1::CreatePeerTicketRequest ticket_req;
  ticket_req.set_session(own_.session);
  ticket_req.set_device("mlx5_9");
  v1::PeerTicket ticket;
  EXPECT_EQ(
      GetErrorDetail(core_->CreatePeerTicket(ticket_req, &ticket)).reason(),
      "UNKNOWN_DEVICE");
  ExpectEmpty(*devices_[0]);
  ExpectEmpty(*devices_[1]);
  EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 0u);
}

// Every step of either device's RegisterMr fails once: the call fails with
// that device's error and names it, neither device keeps an MR, a key or a
// pinned page of it, the core accounts nothing, and the same call then
// succeeds.
TEST_P(CoreDevicesTest, AFailureAtAnyStepOfEitherDeviceUndoesTheOther) {
  const v1::RegisterMrRequest req = Request(page_, 3 * page_, {}, true);
  std::vector<std::string> steps[2];
  faults_[0].Reset();
  faults_[1].Reset();
  {
    absl::StatusOr<v1::RegisterMrResponse> clean = Register(req);
    ASSERT_TRUE(clean.ok()) << clean.status();
    steps[0] = faults_[0].Steps();
    steps[1] = faults_[1].Steps();
    ASSERT_OK(Deregister(clean->registration()));
  }
  ASSERT_FALSE(steps[1].empty());
  std::cout << "[ STEPS    ] software1: " << absl::StrJoin(steps[1], ", ")
            << "\n";
  // Sharing the first's pins, the second pins nothing itself.
  EXPECT_EQ(absl::c_linear_search(steps[1], "pin.mlock"), !Shared());
  int failures = 0;
  for (int device = 0; device < 2; ++device) {
    for (size_t k = 1; k <= steps[device].size(); ++k) {
      SCOPED_TRACE(absl::StrCat("device ", device, " step ", k, " (",
                                steps[device][k - 1], ")"));
      const absl::Status injected =
          MrdError(absl::StatusCode::kResourceExhausted, "INJECTED",
                   absl::StrCat("injected at ", steps[device][k - 1]));
      faults_[device].Arm(static_cast<int>(k), injected);
      absl::StatusOr<v1::RegisterMrResponse> r = Register(req);
      ASSERT_FALSE(r.ok());
      ++failures;
      EXPECT_EQ(GetErrorDetail(r.status()).reason(), "INJECTED");
      EXPECT_TRUE(absl::StrContains(
          r.status().message(),
          absl::StrCat("on device ", device == 0 ? "software" : "software1")))
          << r.status();
      faults_[device].Reset();
      ExpectEmpty(*devices_[0]);
      ExpectEmpty(*devices_[1]);
      EXPECT_EQ(core_->Stats().accounted_pinned_bytes, 0u);
      EXPECT_EQ(core_->Stats().cache.entries, 0u);
      absl::StatusOr<v1::RegisterMrResponse> again = Register(req);
      ASSERT_TRUE(again.ok()) << again.status();
      ASSERT_EQ(again->tokens_size(), 2);
      ASSERT_OK(Deregister(again->registration()));
    }
  }
  EXPECT_EQ(failures, static_cast<int>(steps[0].size() + steps[1].size()));
}

TEST_P(CoreDevicesTest, TheSessionsEndReleasesItsRegistrationsOnBothDevices) {
  absl::StatusOr<v1::RegisterMrResponse> r =
      Register(Request(0, 4 * page_, {}, /*all=*/true));
  ASSERT_TRUE(r.ok()) << r.status();
  std::unique_ptr<peer::SoftPeer> peer = PeerOn("software1");
  ASSERT_NE(peer, nullptr);
  EXPECT_EQ(devices_[1]->CountResources().pds, 1u);
  core_->OnDisconnect(own_.session);
  EXPECT_FALSE(peer->Read(r->tokens(1).rkey(), r->base_address(), 64).ok());
  ExpectEmpty(*devices_[0]);
  ExpectEmpty(*devices_[1]);
  EXPECT_EQ(devices_[0]->CountResources().pds, 0u);
  EXPECT_EQ(devices_[1]->CountResources().pds, 0u);
}

// The registrations a tenant's quota counts now (one per device).
uint64_t TenantRegistrations(core::Core& core) {
  v1::ListTenantsResponse tenants;
  EXPECT_OK(core.ListTenants(&tenants));
  uint64_t used = 0;
  for (const v1::TenantInfo& t : tenants.tenants()) {
    for (const v1::TenantResourceUse& r : t.resources()) {
      if (r.resource() == "registrations") used += r.used();
    }
  }
  return used;
}

// DeregisterMrBatch of registrations on both devices: the second device's
// MRs go beside the first's (Registrations::OthersBatch), and when the call
// returns both devices hold nothing, no token works and the quota counts
// nothing; twice over, so nothing leaks from one batch to the next.
TEST_P(CoreDevicesTest,
       ADeregistrationBatchReleasesBothDevicesBeforeItReturns) {
  for (int round = 0; round < 2; ++round) {
    std::vector<v1::RegisterMrResponse> made;
    for (uint64_t page = 0; page < kPages; ++page) {
      absl::StatusOr<v1::RegisterMrResponse> r =
          Register(Request(page * page_, page_, {}, /*all=*/true));
      ASSERT_TRUE(r.ok()) << r.status();
      made.push_back(*r);
    }
    EXPECT_EQ(TenantRegistrations(*core_), 2 * kPages);
    std::unique_ptr<peer::SoftPeer> peer = PeerOn("software1");
    ASSERT_NE(peer, nullptr);
    ASSERT_TRUE(
        peer->Read(made[3].tokens(1).rkey(), made[3].base_address(), 8).ok());
    v1::DeregisterMrBatchRequest batch;
    batch.set_session(own_.session);
    for (const v1::RegisterMrResponse& r : made) {
      v1::DeregisterMrRequest* item = batch.add_items();
      item->set_session(own_.session);
      item->set_registration(r.registration());
    }
    v1::DeregisterMrBatchResponse out;
    ASSERT_OK(core_->DeregisterMrBatch(batch, &out));
    for (const v1::DeregisterMrBatchResult& item : out.items()) {
      EXPECT_EQ(item.status().code(), 0) << item.status().message();
    }
    ExpectEmpty(*devices_[0]);
    ExpectEmpty(*devices_[1]);
    EXPECT_EQ(TenantRegistrations(*core_), 0u);
    EXPECT_FALSE(
        peer->Read(made[3].tokens(1).rkey(), made[3].base_address(), 8).ok());
  }
}

// The second device goes down (shut down: its health turns false): every
// session hears of it once, naming it; registrations on it are refused and
// leave nothing on the first; the first device's registrations and peers
// go on.
TEST_P(CoreDevicesTest, ADeviceThatGoesDownLeavesTheOtherServing) {
  absl::StatusOr<core::CompletionSubscription> stream =
      core_->SubscribeCompletions(own_.session, [] {});
  ASSERT_TRUE(stream.ok()) << stream.status();
  EXPECT_EQ(core_->TakeDeviceHealthChanges().size(), 2u);  // the first look
  EXPECT_TRUE(core_->TakeDeviceHealthChanges().empty());
  absl::StatusOr<v1::RegisterMrResponse> first =
      Register(Request(0, page_, {"software"}));
  ASSERT_TRUE(first.ok()) << first.status();
  std::unique_ptr<peer::SoftPeer> peer = PeerOn("software");
  ASSERT_NE(peer, nullptr);

  devices_[1]->Shutdown();
  std::vector<core::DeviceState> changes = core_->TakeDeviceHealthChanges();
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0].name, "software1");
  EXPECT_FALSE(changes[0].healthy);
  EXPECT_TRUE(core_->TakeDeviceHealthChanges().empty());
  std::optional<v1::Completion> told = (*stream)->PopCompletion();
  while (told.has_value() &&
         told->kind() == v1::Completion::PEER_CONNECTED) {  // our peer's
    told = (*stream)->PopCompletion();
  }
  ASSERT_TRUE(told.has_value());
  EXPECT_EQ(told->kind(), v1::Completion::DEVICE_HEALTH);
  EXPECT_EQ(told->device(), "software1");
  EXPECT_EQ(told->status(), v1::STATUS_CONNECTION_INVALID);
  EXPECT_FALSE(told->message().empty());
  EXPECT_FALSE((*stream)->PopCompletion().has_value());

  absl::StatusOr<v1::RegisterMrResponse> both =
      Register(Request(page_, page_, {}, /*all=*/true));
  ASSERT_FALSE(both.ok());
  EXPECT_TRUE(absl::StrContains(both.status().message(), "software1"))
      << both.status();
  EXPECT_EQ(devices_[0]->CountResources().mrs, 1u);  // `first` alone
  absl::StatusOr<std::string> read =
      peer->Read(first->rkey(), first->base_address(), 32);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, own_.pattern.substr(0, 32));
  absl::StatusOr<v1::RegisterMrResponse> again =
      Register(Request(page_, page_, {"software"}));
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_OK(Deregister(again->registration()));
  ASSERT_OK(Deregister(first->registration()));
  core_->UnsubscribeCompletions(*stream);
}

TEST_P(CoreDevicesTest, TheSessionsDefaultDevicesApplyWhenACallNamesNone) {
  v1::SetDefaultDevicesRequest set;
  set.set_session(own_.session);
  set.mutable_devices()->set_all(true);
  v1::SessionInfo info;
  ASSERT_OK(core_->SetDefaultDevices(set, &info));
  EXPECT_TRUE(info.default_devices().all());
  absl::StatusOr<v1::RegisterMrResponse> r = Register(Request(0, page_, {}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens_size(), 2);
  // A call that names its devices still chooses.
  absl::StatusOr<v1::RegisterMrResponse> one =
      Register(Request(0, page_, {"software1"}));
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_EQ(one->tokens_size(), 1);
  EXPECT_EQ(one->tokens(0).device(), "software1");
  ASSERT_OK(Deregister(r->registration()));
  ASSERT_OK(Deregister(one->registration()));

  set.mutable_devices()->add_names("software1");  // and all: refused
  absl::Status both = core_->SetDefaultDevices(set, &info);
  EXPECT_EQ(GetErrorDetail(both).reason(), "BAD_DEVICE_SELECTION") << both;
  set.mutable_devices()->set_all(false);
  set.mutable_devices()->add_names("nope");
  EXPECT_EQ(GetErrorDetail(core_->SetDefaultDevices(set, &info)).reason(),
            "UNKNOWN_DEVICE");
  // Refused, the default stays what it was.
  v1::GetSessionRequest get;
  get.set_session(own_.session);
  ASSERT_OK(core_->GetSession(get, &info));
  EXPECT_TRUE(info.default_devices().all());
}

// `nearest`: the devices on the NUMA node of the registered memory, or
// every device when none is on it. The second device is placed on the
// memory's node here.
TEST_P(CoreDevicesTest, NearestChoosesTheDevicesOnTheMemorysNode) {
  absl::StatusOr<v1::RegisterMrResponse> anywhere =
      Register(Request(0, page_, {}, false, /*nearest=*/true));
  ASSERT_TRUE(anywhere.ok()) << anywhere.status();
  EXPECT_EQ(anywhere->tokens_size(), 2);  // neither device has a node
  ASSERT_OK(Deregister(anywhere->registration()));

  // A buffer whose first page the test places (writes) and then asks the
  // node of, through a mapping of its own.
  UniqueFd memfd = MakeSealedMemfd(4 * page_);
  ASSERT_TRUE(memfd.valid());
  void* page =
      mmap(nullptr, page_, PROT_READ | PROT_WRITE, MAP_SHARED, memfd.get(), 0);
  ASSERT_NE(page, MAP_FAILED);
  static_cast<char*>(page)[0] = 'n';
  int node = -1;
  const long got = ::syscall(SYS_get_mempolicy, &node, nullptr, 0, page,
                             3 /* MPOL_F_NODE | MPOL_F_ADDR */);
  munmap(page, page_);
  ASSERT_EQ(got, 0);
  device::SoftwareDeviceOptions options;
  options.name = "near";
  options.peer_listen_address = "127.0.0.1:0";
  options.numa_node = node;
  auto near = device::SoftwareDevice::Create(options);
  ASSERT_TRUE(near.ok()) << near.status();
  ASSERT_OK((*near)->Start());
  {
    core::Core core(
        std::vector<device::Device*>{devices_[0].get(), near->get()},
        RealClock::Get(), core::CoreOptions{});
    absl::StatusOr<std::string> session =
        core.OnConnect({getpid(), getuid(), getgid(), std::nullopt, ""});
    ASSERT_TRUE(session.ok()) << session.status();
    v1::ImportMemfd import;
    absl::StatusOr<v1::BufferInfo> buffer =
        core.OnImport(*session, UniqueFd(dup(memfd.get())), import);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    v1::RegisterMrRequest req = Request(0, page_, {}, false, true);
    req.set_session(*session);
    req.set_buffer(buffer->buffer());
    absl::StatusOr<v1::RegisterMrResponse> r = RegisterOn(core, req);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->tokens_size(), 1);
    EXPECT_EQ(r->tokens(0).device(), "near");
    core.Shutdown();
  }
  (*near)->Shutdown();
}

// An MR object and a LAM belong to one device (NDK's adapter): a fast
// registration is posted on a connection of that device, maps pages of that
// device's LAMs only, and its token works on that device's peer path.
// NDK's MR object is one adapter's: a registration through a normal MR
// object is made on the object's device, whatever the session's default
// devices; naming any other set is refused and registers nothing.
TEST_P(CoreDevicesTest, ARegistrationThroughAnMrObjectIsOnItsDevice) {
  v1::SetDefaultDevicesRequest defaults;
  defaults.set_session(own_.session);
  defaults.mutable_devices()->set_all(true);
  v1::SessionInfo info;
  ASSERT_OK(core_->SetDefaultDevices(defaults, &info));
  v1::CreateMrRequest create;
  create.set_session(own_.session);
  create.set_device("software1");
  v1::MrInfo mr;
  ASSERT_OK(core_->CreateMr(create, &mr));
  for (const std::vector<std::string>& names :
       std::vector<std::vector<std::string>>{{"software"},
                                             {"software", "software1"}}) {
    v1::RegisterMrRequest req = Request(0, page_, names);
    req.set_mr(mr.mr());
    absl::StatusOr<v1::RegisterMrResponse> r = Register(req);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(GetErrorDetail(r.status()).reason(), "MR_ON_ANOTHER_DEVICE")
        << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), "software1"));
  }
  ExpectEmpty(*devices_[0]);
  ExpectEmpty(*devices_[1]);
  v1::RegisterMrRequest req = Request(0, page_, {});
  req.set_mr(mr.mr());
  absl::StatusOr<v1::RegisterMrResponse> r = Register(req);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->tokens_size(), 1);
  EXPECT_EQ(r->tokens(0).device(), "software1");
  EXPECT_EQ(devices_[0]->CountResources().mrs, 0u);
  v1::CloseMrRequest close;
  close.set_session(own_.session);
  close.set_mr(mr.mr());
  // The object held the registration's only reference.
  ASSERT_OK(core_->CloseMr(close));
  ExpectEmpty(*devices_[1]);
}

TEST_P(CoreDevicesTest, FastRegistrationLivesOnTheDeviceOfItsMrAndLam) {
  absl::Mutex mu;
  bool woken = false;
  absl::StatusOr<core::CompletionSubscription> stream =
      core_->SubscribeCompletions(own_.session, [&] {
        absl::MutexLock lock(&mu);
        woken = true;
      });
  ASSERT_TRUE(stream.ok()) << stream.status();
  v1::CreateMrRequest create;
  create.set_session(own_.session);
  create.set_fast_register(true);
  create.set_allow_remote_access(true);
  create.set_device("software1");
  v1::MrInfo mr;
  ASSERT_OK(core_->CreateMr(create, &mr));
  EXPECT_EQ(mr.device(), "software1");
  v1::BuildLamRequest build;
  build.set_session(own_.session);
  build.set_buffer(own_.buffer.buffer());
  build.set_length(2 * page_);
  build.set_device("software1");
  v1::BuildLamResponse lam;
  ASSERT_OK(core_->BuildLam(build, &lam));
  EXPECT_EQ(lam.device(), "software1");
  build.clear_device();
  v1::BuildLamResponse first_lam;  // on the first device
  ASSERT_OK(core_->BuildLam(build, &first_lam));
  EXPECT_EQ(first_lam.device(), "software");
  std::unique_ptr<peer::SoftPeer> first = PeerOn("software");
  std::unique_ptr<peer::SoftPeer> second = PeerOn("software1");
  ASSERT_TRUE(first != nullptr && second != nullptr);
  // The id the peer learns says which device it is on.
  EXPECT_EQ(core::Session::DeviceOfConnection(second->connection_id()), 1u);
  EXPECT_NE(first->connection_id(), second->connection_id());

  constexpr uint64_t kFrBase = uint64_t{0x7000} << 32;
  v1::FastRegisterRequest fr;
  fr.set_session(own_.session);
  fr.set_mr(mr.mr());
  fr.mutable_pages()->CopyFrom(lam.pages());
  fr.set_fbo(lam.fbo());
  fr.set_length(lam.length());
  fr.set_base_address(kFrBase);
  fr.set_flags(kOpRemoteRead);
  fr.set_request_context(7);
  v1::FastRegisterResponse posted;
  fr.set_connection(first->connection_id());
  absl::Status wrong = core_->FastRegister(fr, &posted);
  EXPECT_EQ(GetErrorDetail(wrong).reason(), "MR_ON_ANOTHER_DEVICE") << wrong;
  fr.set_connection(second->connection_id());
  fr.mutable_pages()->CopyFrom(first_lam.pages());
  EXPECT_EQ(GetErrorDetail(core_->FastRegister(fr, &posted)).reason(),
            "UNKNOWN_LOGICAL_ADDRESS");
  fr.mutable_pages()->CopyFrom(lam.pages());
  ASSERT_OK(core_->FastRegister(fr, &posted));

  // Its completion, with the new token.
  std::optional<v1::Completion> done;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!done.has_value() && absl::Now() < deadline) {
    for (std::optional<v1::Completion> c = (*stream)->PopCompletion();
         c.has_value(); c = (*stream)->PopCompletion()) {
      if (c->kind() == v1::Completion::FAST_REGISTER) done = c;
    }
    if (done.has_value()) break;
    absl::MutexLock lock(&mu);
    mu.AwaitWithDeadline(absl::Condition(&woken), deadline);
    woken = false;
  }
  ASSERT_TRUE(done.has_value());
  ASSERT_EQ(done->status(), v1::STATUS_SUCCESS) << done->message();
  EXPECT_EQ(done->connection(), second->connection_id());
  EXPECT_EQ(done->mr(), mr.mr());
  absl::StatusOr<std::string> read = second->Read(done->rkey(), kFrBase, 64);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, own_.pattern.substr(0, 64));
  core_->UnsubscribeCompletions(*stream);
}

// A registration on two devices holds an MR and a key on each: it counts
// twice against the registration limits (the pinned bytes once).
TEST_P(CoreDevicesTest, ARegistrationCountsOncePerDeviceAgainstTheLimits) {
  core::CoreOptions options;
  options.max_session_registrations = 3;
  core::Core core(
      std::vector<device::Device*>{devices_[0].get(), devices_[1].get()},
      RealClock::Get(), options);
  absl::StatusOr<SessionWithBuffer> own =
      OpenSessionWithBuffer(core, 8 * page_);
  ASSERT_TRUE(own.ok()) << own.status();
  auto request = [&](uint64_t page, bool all) {
    v1::RegisterMrRequest req = Request(page * page_, page_, {}, all);
    req.set_session(own->session);
    req.set_buffer(own->buffer.buffer());
    return req;
  };
  absl::StatusOr<v1::RegisterMrResponse> both =
      RegisterOn(core, request(0, true));
  ASSERT_TRUE(both.ok()) << both.status();
  absl::StatusOr<v1::RegisterMrResponse> more =
      RegisterOn(core, request(1, true));
  ASSERT_FALSE(more.ok());
  EXPECT_EQ(GetErrorDetail(more.status()).reason(),
            "LIMIT_SESSION_REGISTRATIONS");
  EXPECT_EQ(devices_[0]->CountResources().mrs, 1u);
  EXPECT_EQ(devices_[1]->CountResources().mrs, 1u);
  absl::StatusOr<v1::RegisterMrResponse> one =
      RegisterOn(core, request(1, false));
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(core.Stats().accounted_pinned_bytes, 2 * page_);
  ASSERT_TRUE(DeregisterOn(core, own->session, both->registration()).ok());
  absl::StatusOr<v1::RegisterMrResponse> again =
      RegisterOn(core, request(2, true));
  ASSERT_TRUE(again.ok()) << again.status();
  core.Shutdown();
}

// A live handover's new process, as the core sees it: two devices like the
// fixture's (pins shared as theirs are) and a core on them, which adopts
// what the fixture's core exported.
struct Successor {
  device::FaultPoints faults[2];
  std::unique_ptr<device::SoftwareDevice> devices[2];
  std::unique_ptr<core::Core> core;

  static std::unique_ptr<Successor> Start(bool shared, size_t count = 2) {
    auto next = std::make_unique<Successor>();
    std::vector<device::Device*> devices;
    for (size_t i = 0; i < count; ++i) {
      device::SoftwareDeviceOptions options;
      options.name = i == 0 ? "software" : "software1";
      options.peer_listen_address = "127.0.0.1:0";
      options.fault_points = &next->faults[i];
      options.connection_id_base = uint64_t{i} << core::Session::kDeviceShift;
      if (i == 1 && shared) options.share_pins_with = next->devices[0].get();
      auto device = device::SoftwareDevice::Create(options);
      EXPECT_TRUE(device.ok()) << device.status();
      if (!device.ok()) return nullptr;
      next->devices[i] = std::move(*device);
      EXPECT_OK(next->devices[i]->Start());
      devices.push_back(next->devices[i].get());
    }
    next->core = std::make_unique<core::Core>(devices, RealClock::Get(),
                                              core::CoreOptions{});
    return next;
  }
  // Holds nothing; then stops.
  void Stop() {
    core->Shutdown();
    for (auto& device : devices) {
      if (device == nullptr) continue;
      const device::SoftwareDevice::ResourceCounts counts =
          device->CountResources();
      EXPECT_EQ(counts.mrs, 0u) << device->Attributes().name;
      EXPECT_EQ(counts.lams, 0u) << device->Attributes().name;
      EXPECT_EQ(counts.keys, 0u) << device->Attributes().name;
      EXPECT_EQ(device->PinnedBytes(), 0u) << device->Attributes().name;
      device->Shutdown();
    }
  }
};

// Copies of `fds` (an adoption takes the ones it uses).
std::vector<UniqueFd> Copies(const std::vector<UniqueFd>& fds) {
  std::vector<UniqueFd> copies;
  for (const UniqueFd& fd : fds) {
    copies.emplace_back(fcntl(fd.get(), F_DUPFD_CLOEXEC, 0));
  }
  return copies;
}

// (device, lkey, rkey) of each token of each registration the session
// lists, in order.
std::vector<std::tuple<std::string, uint32_t, uint32_t>> TokensOf(
    core::Core& core, const std::string& session) {
  v1::ListRegistrationsRequest req;
  req.set_session(session);
  v1::ListRegistrationsResponse list;
  EXPECT_OK(core.ListRegistrations(req, &list));
  std::vector<std::tuple<std::string, uint32_t, uint32_t>> tokens;
  for (const v1::RegistrationInfo& r : list.registrations()) {
    for (const v1::DeviceToken& t : r.tokens()) {
      tokens.emplace_back(t.device(), t.lkey(), t.rkey());
    }
  }
  return tokens;
}

// The state a handover of two devices moves: a registration on both, one
// on the second only, a LAM and a fast-register MR object of the second,
// a ticket on the second, and the session's default devices.
class CoreDevicesHandoverTest : public CoreDevicesTest {
 protected:
  void SetUp() override {
    CoreDevicesTest::SetUp();
    if (HasFatalFailure()) return;
    absl::StatusOr<v1::RegisterMrResponse> both =
        Register(Request(0, 2 * page_, {}, /*all=*/true));
    ASSERT_TRUE(both.ok()) << both.status();
    absl::StatusOr<v1::RegisterMrResponse> second =
        Register(Request(2 * page_, page_, {"software1"}));
    ASSERT_TRUE(second.ok()) << second.status();
    v1::BuildLamRequest lam;
    lam.set_session(own_.session);
    lam.set_buffer(own_.buffer.buffer());
    lam.set_offset(4 * page_);
    lam.set_length(2 * page_);
    lam.set_device("software1");
    v1::BuildLamResponse built;
    ASSERT_OK(core_->BuildLam(lam, &built));
    v1::CreateMrRequest mr;
    mr.set_session(own_.session);
    mr.set_fast_register(true);
    mr.set_allow_remote_access(true);
    mr.set_device("software1");
    v1::MrInfo made;
    ASSERT_OK(core_->CreateMr(mr, &made));
    v1::CreatePeerTicketRequest ticket_req;
    ticket_req.set_session(own_.session);
    ticket_req.set_device("software1");
    ASSERT_OK(core_->CreatePeerTicket(ticket_req, &ticket_));
    v1::SetDefaultDevicesRequest defaults;
    defaults.set_session(own_.session);
    defaults.mutable_devices()->set_all(true);
    v1::SessionInfo info;
    ASSERT_OK(core_->SetDefaultDevices(defaults, &info));
    ASSERT_OK(core_->ExportState(&snapshot_, &fds_));
    ASSERT_EQ(snapshot_.other_devices_size(), 1);
    EXPECT_EQ(snapshot_.other_devices(0).name(), "software1");
  }

  v1::PeerTicket ticket_;
  v1::HandoverSnapshot snapshot_;
  std::vector<UniqueFd> fds_;
};

TEST_P(CoreDevicesHandoverTest, EveryDevicesStateMovesWithItsKeys) {
  std::unique_ptr<Successor> next = Successor::Start(Shared());
  ASSERT_NE(next, nullptr);
  std::vector<UniqueFd> fds = Copies(fds_);
  ASSERT_OK(next->core->AdoptState(snapshot_, fds));
  EXPECT_EQ(TokensOf(*next->core, own_.session),
            TokensOf(*core_, own_.session));
  EXPECT_EQ(TokensOf(*next->core, own_.session).size(), 3u);
  for (int i = 0; i < 2; ++i) {
    const device::SoftwareDevice::ResourceCounts was =
        devices_[i]->CountResources();
    const device::SoftwareDevice::ResourceCounts is =
        next->devices[i]->CountResources();
    EXPECT_EQ(is.mrs, was.mrs) << i;
    EXPECT_EQ(is.lams, was.lams) << i;
    EXPECT_EQ(is.keys, was.keys) << i;
  }
  EXPECT_EQ(next->devices[1]->CountResources().lams, 1u);
  const core::CoreStats stats = next->core->Stats();
  EXPECT_EQ(stats.lams, 1u);
  EXPECT_EQ(stats.mrs, 1u);
  EXPECT_EQ(stats.accounted_pinned_bytes,
            core_->Stats().accounted_pinned_bytes);
  // The ticket of the second device is the one peers hold.
  v1::CreatePeerTicketRequest ticket_req;
  ticket_req.set_session(own_.session);
  ticket_req.set_device("software1");
  v1::PeerTicket ticket;
  ASSERT_OK(next->core->CreatePeerTicket(ticket_req, &ticket));
  EXPECT_EQ(ticket.ticket(), ticket_.ticket());
  v1::GetSessionRequest get;
  get.set_session(own_.session);
  v1::SessionInfo info;
  ASSERT_OK(next->core->GetSession(get, &info));
  EXPECT_TRUE(info.default_devices().all());
  // The defaults hold: a registration naming no device is on both.
  v1::RegisterMrRequest req = Request(6 * page_, page_, {});
  absl::StatusOr<v1::RegisterMrResponse> r = RegisterOn(*next->core, req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens_size(), 2);
  next->Stop();
}

// Every step of the second device's adoption fails once: the adoption
// fails, the new core and both its devices hold nothing, and the same
// snapshot is then adopted whole. A core of another device count refuses
// the snapshot by name.
TEST_P(CoreDevicesHandoverTest, AFailureOnTheSecondDeviceLeavesNothing) {
  std::unique_ptr<Successor> one = Successor::Start(Shared(), 1);
  ASSERT_NE(one, nullptr);
  std::vector<UniqueFd> fds = Copies(fds_);
  absl::Status refused = one->core->AdoptState(snapshot_, fds);
  EXPECT_EQ(GetErrorDetail(refused).reason(), "HANDOVER_DEVICE_MISMATCH")
      << refused;
  one->Stop();

  std::unique_ptr<Successor> next = Successor::Start(Shared());
  ASSERT_NE(next, nullptr);
  int failures = 0;
  for (int nth = 1;; ++nth) {
    ASSERT_LT(nth, 200) << "the adoption never got past its faults";
    next->faults[1].Arm(nth, absl::InternalError("fault"));
    fds = Copies(fds_);
    absl::Status s = next->core->AdoptState(snapshot_, fds);
    if (!next->faults[1].Fired()) {
      ASSERT_OK(s);
      break;
    }
    ++failures;
    EXPECT_FALSE(s.ok()) << next->faults[1].FiredStep();
    const core::CoreStats stats = next->core->Stats();
    EXPECT_EQ(stats.sessions, 0u) << next->faults[1].FiredStep();
    EXPECT_EQ(stats.registrations, 0u);
    EXPECT_EQ(stats.accounted_pinned_bytes, 0u);
    for (auto& device : next->devices) {
      EXPECT_EQ(device->CountResources().mrs, 0u)
          << device->Attributes().name << " " << next->faults[1].FiredStep();
      EXPECT_EQ(device->CountResources().keys, 0u);
      EXPECT_EQ(device->PinnedBytes(), 0u);
    }
  }
  EXPECT_GT(failures, 3);
  next->faults[1].Reset();
  EXPECT_EQ(TokensOf(*next->core, own_.session),
            TokensOf(*core_, own_.session));
  next->Stop();
}

std::string PinsName(
    const ::testing::TestParamInfo<std::tuple<bool, bool>>& info) {
  return absl::StrCat(std::get<0>(info.param) ? "Shared" : "OwnPins",
                      std::get<1>(info.param) ? "SideBySide" : "InTurn");
}

INSTANTIATE_TEST_SUITE_P(Pins, CoreDevicesTest,
                         ::testing::Combine(::testing::Bool(),
                                            ::testing::Bool()),
                         PinsName);
INSTANTIATE_TEST_SUITE_P(Pins, CoreDevicesHandoverTest,
                         ::testing::Combine(::testing::Bool(),
                                            ::testing::Values(false)),
                         PinsName);

}  // namespace
}  // namespace mrd::core_test
