// The core when the device fails at any one of its calls: for each RPC flow,
// one clean run lists the device calls it makes (and the posted work it
// waits for), then the flow is run again once per call with exactly that
// call failing (FaultPoints in a device wrapper; FakeDevice::FailNextWork
// for the work), each time in a session of its own. After every failure:
//   * the RPC fails with an error that carries the device's failure, or
//     succeeds where the core may do without that call (a warm pin it could
//     not make);
//   * what the core accounts matches what the device holds: pinned bytes,
//     registrations, LAMs (its own and warm pins), MR objects, PDs;
//   * after a failure nothing is held that was not held before the request;
//   * the same request then succeeds;
//   * the session's end leaves nothing on the device and nothing accounted.
// Each sweep prints its calls ("[ CALLS    ]") and checks them by name.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "mrd/status_proto.h"
#include "server/device/fault_points.h"
#include "tests/unit/core/core_test_util.h"

namespace mrd::core_test {
namespace {

using ::testing::ElementsAre;

// Forwards every call to the fake device, with a fault point (named after
// the method) in front of each call that changes anything.
class FaultyDevice final : public device::Device {
 public:
  FaultyDevice(device::Device* inner, device::FaultPoints* faults)
      : inner_(inner), faults_(faults) {}

  const device::DeviceAttributes& Attributes() const override {
    return inner_->Attributes();
  }
  device::DeviceHealth Health() const override { return inner_->Health(); }
  uint64_t PinnedBytes() const override { return inner_->PinnedBytes(); }
  absl::Status Start() override { return inner_->Start(); }
  void Shutdown() override { inner_->Shutdown(); }

  absl::StatusOr<device::PdId> AllocatePd(device::PdEventSink* sink) override {
    MRD_RETURN_IF_ERROR(faults_->Hit("AllocatePd"));
    return inner_->AllocatePd(sink);
  }
  absl::Status DeallocatePd(device::PdId pd) override {
    MRD_RETURN_IF_ERROR(faults_->Hit("DeallocatePd"));
    return inner_->DeallocatePd(pd);
  }
  absl::StatusOr<device::MrKeys> RegisterMr(device::PdId pd,
                                            const device::MemorySpan& span,
                                            uint64_t base_address,
                                            uint32_t access) override {
    MRD_RETURN_IF_ERROR(faults_->Hit("RegisterMr"));
    return inner_->RegisterMr(pd, span, base_address, access);
  }
  absl::Status DeregisterMr(device::MrId mr) override {
    MRD_RETURN_IF_ERROR(faults_->Hit("DeregisterMr"));
    return inner_->DeregisterMr(mr);
  }
  absl::StatusOr<device::LogicalMapping> BuildLam(
      device::PdId pd, const device::MemorySpan& span) override {
    MRD_RETURN_IF_ERROR(faults_->Hit("BuildLam"));
    return inner_->BuildLam(pd, span);
  }
  absl::Status ReleaseLam(device::LamId lam) override {
    MRD_RETURN_IF_ERROR(faults_->Hit("ReleaseLam"));
    return inner_->ReleaseLam(lam);
  }
  absl::StatusOr<device::MrKeys> AllocateFastRegisterMr(
      device::PdId pd, bool allow_remote, uint32_t max_pages) override {
    MRD_RETURN_IF_ERROR(faults_->Hit("AllocateFastRegisterMr"));
    return inner_->AllocateFastRegisterMr(pd, allow_remote, max_pages);
  }
  absl::Status FreeFastRegisterMr(device::MrId mr) override {
    MRD_RETURN_IF_ERROR(faults_->Hit("FreeFastRegisterMr"));
    return inner_->FreeFastRegisterMr(mr);
  }
  absl::StatusOr<device::MrKeys> QueryMr(device::MrId mr) const override {
    return inner_->QueryMr(mr);
  }
  absl::StatusOr<std::string> CreatePeerTicket(device::PdId pd) override {
    MRD_RETURN_IF_ERROR(faults_->Hit("CreatePeerTicket"));
    return inner_->CreatePeerTicket(pd);
  }
  absl::StatusOr<uint64_t> PostFastRegister(
      device::ConnectionId connection,
      const device::FastRegisterWork& work) override {
    MRD_RETURN_IF_ERROR(faults_->Hit("PostFastRegister"));
    return inner_->PostFastRegister(connection, work);
  }
  absl::StatusOr<uint64_t> PostInvalidate(
      device::ConnectionId connection,
      const device::InvalidateWork& work) override {
    MRD_RETURN_IF_ERROR(faults_->Hit("PostInvalidate"));
    return inner_->PostInvalidate(connection, work);
  }

 private:
  device::Device* const inner_;
  device::FaultPoints* const faults_;
};

// The step name of the posted work's execution, after the device calls.
constexpr char kWork[] = "work";

// One run of an RPC flow in a session of its own: the constructor prepares
// (nothing armed), Run is the RPC, the destructor ends the session.
class Flow {
 public:
  virtual ~Flow() = default;
  virtual absl::Status Run() = 0;
  // After a successful Run: what it made works (keys valid, state right).
  virtual void CheckDone() {}
};

class CoreFaultSweepTest : public CoreTest {
 protected:
  void Configure(core::CoreOptions& options,
                 fake::FakeDeviceOptions&) override {
    // Warm pins on, so that the flows that use them are swept too.
    options.warm_pin_bytes_per_session = 8 * page_;
    options.warm_pin_bytes_total = 16 * page_;
  }

  // CoreTest::SetUp, with the core on the fault-injecting wrapper.
  void SetUp() override {
    Configure(options_, device_options_);
    fake_ = std::make_unique<fake::FakeDevice>(device_options_);
    ASSERT_OK(fake_->Start());
    faulty_ = std::make_unique<FaultyDevice>(fake_.get(), &faults_);
    core_ = std::make_unique<core::Core>(faulty_.get(), &clock_, options_);
  }

 public:  // for the flows, classes of their own
  using CoreTest::BuildLam;
  using CoreTest::Connect;
  using CoreTest::ConnectPeer;
  using CoreTest::core_;
  using CoreTest::CreateMr;
  using CoreTest::Deregister;
  using CoreTest::Drain;
  using CoreTest::fake_;
  using CoreTest::FastRegister;
  using CoreTest::FastRegisterRequest;
  using CoreTest::Import;
  using CoreTest::Invalidate;
  using CoreTest::MrState;
  using CoreTest::page_;
  using CoreTest::Register;
  using CoreTest::ReleaseLam;
  using CoreTest::TryImport;

  // What the core accounts and what the device holds, by name.
  using State = std::vector<std::pair<std::string, uint64_t>>;
  State Now() {
    const core::CoreStats s = core_->Stats();
    return {{"core.sessions", s.sessions},
            {"core.accounted", s.accounted_pinned_bytes},
            {"core.registrations", s.registrations},
            {"core.cache_entries", s.cache.entries},
            {"core.lams", s.lams},
            {"core.warm_pins", s.warm.pins},
            {"core.mrs", s.mrs},
            {"device.pds", fake_->LivePdCount()},
            {"device.pinned", fake_->PinnedBytes()},
            {"device.mrs", fake_->LiveRegisteredMrCount()},
            {"device.fr_mrs", fake_->LiveFastRegisterMrCount()},
            {"device.lams", fake_->LiveLamCount()},
            {"device.pending_work", fake_->PendingWorkCount()}};
  }
  static std::string Describe(const State& state) {
    std::vector<std::string> parts;
    for (const auto& [name, value] : state) {
      parts.push_back(absl::StrCat(name, "=", value));
    }
    return absl::StrJoin(parts, " ");
  }
  std::string DescribeNow() { return Describe(Now()); }
  // Nothing is held now that was not held at `before` (a failed request may
  // let go of more, as a warm pin it took).
  void ExpectNoMoreThan(const State& before) {
    const State now = Now();
    for (size_t i = 0; i < now.size(); ++i) {
      EXPECT_LE(now[i].second, before[i].second)
          << now[i].first << " grew: " << Describe(before) << " -> "
          << Describe(now);
    }
  }

  // The core's books match the device's, object for object.
  void ExpectConsistent() {
    const core::CoreStats s = core_->Stats();
    EXPECT_EQ(s.accounted_pinned_bytes, fake_->PinnedBytes()) << DescribeNow();
    EXPECT_EQ(s.cache.entries, fake_->LiveRegisteredMrCount()) << DescribeNow();
    EXPECT_EQ(s.lams + s.warm.pins, fake_->LiveLamCount()) << DescribeNow();
    EXPECT_EQ(s.mrs, fake_->LiveFastRegisterMrCount()) << DescribeNow();
    EXPECT_EQ(s.sessions, fake_->LivePdCount()) << DescribeNow();
    EXPECT_OK(fake_->CheckLiveMemory());
  }

  // The sweep (see the top of the file). `tolerated` names the calls whose
  // failure the RPC may survive. Returns the steps.
  std::vector<std::string> Sweep(
      absl::string_view rpc, const std::function<std::unique_ptr<Flow>()>& make,
      std::vector<std::string> tolerated = {}) {
    const std::string start = DescribeNow();
    std::vector<std::string> steps;
    {
      std::unique_ptr<Flow> flow = make();
      faults_.Reset();
      const uint64_t work_before = work_runs_;
      absl::Status status = flow->Run();
      steps = faults_.Steps();
      if (work_runs_ > work_before) steps.push_back(kWork);
      EXPECT_TRUE(status.ok()) << rpc << " without faults: " << status;
      if (!status.ok()) return steps;
      flow->CheckDone();
      ExpectConsistent();
    }
    EXPECT_EQ(DescribeNow(), start);
    for (size_t k = 1; k <= steps.size(); ++k) {
      const std::string& step = steps[k - 1];
      SCOPED_TRACE(
          absl::StrCat(rpc, " with device call ", k, " (", step, ") failing"));
      std::unique_ptr<Flow> flow = make();
      const State before = Now();
      const absl::Status injected =
          SeedError(::mrd::STATUS_INSUFFICIENT_RESOURCES, "INJECTED_FAULT",
                    absl::StrCat(rpc, ": ", step, " failed (injected)"));
      if (step == kWork) {
        faults_.Reset();
        fake_->FailNextWork(injected);
      } else {
        faults_.Arm(static_cast<int>(k), injected);
      }
      absl::Status status = flow->Run();
      if (step != kWork) {
        EXPECT_TRUE(faults_.Fired());
        EXPECT_EQ(faults_.FiredStep(), step);
      }
      ExpectConsistent();
      const bool may_survive = std::find(tolerated.begin(), tolerated.end(),
                                         step) != tolerated.end();
      if (status.ok()) {
        EXPECT_TRUE(may_survive) << "the RPC hid the failure of " << step;
        flow->CheckDone();
      } else {
        // The error carries the device's failure (the work's completion
        // carries its outcome and message).
        EXPECT_THAT(std::string(status.message()),
                    ::testing::HasSubstr(std::string(injected.message())));
        if (step == kWork) {
          EXPECT_EQ(GetErrorDetail(status).seed_status(),
                    ::mrd::STATUS_INSUFFICIENT_RESOURCES);
        }
        // Nothing of the failed request is left, and it can be made again.
        ExpectNoMoreThan(before);
        faults_.Reset();
        absl::Status retry = flow->Run();
        EXPECT_TRUE(retry.ok()) << "retry: " << retry;
        if (retry.ok()) flow->CheckDone();
        ExpectConsistent();
      }
      flow.reset();
      EXPECT_EQ(DescribeNow(), start) << "the session's end left something";
    }
    std::cout << "[ CALLS    ] " << rpc << " (" << steps.size()
              << "): " << absl::StrJoin(steps, ", ") << std::endl;
    return steps;
  }

  // Runs the fake's posted work; returns the one completion it produced, as
  // a status (OK for STATUS_SUCCESS, else the seed status and message).
  absl::Status RunWork(const std::string& session) {
    ++work_runs_;
    std::vector<v1::Completion> completions = RunWorkAndDrain(session);
    if (completions.size() != 1) {
      return absl::InternalError(
          absl::StrCat(completions.size(), " completions, expected 1"));
    }
    const v1::Completion& c = completions[0];
    if (c.status() == v1::STATUS_SUCCESS) return absl::OkStatus();
    return SeedError(::mrd::SeedStatusFromProto(c.status()),
                     "WORK_COMPLETED_WITH_ERROR", c.message());
  }

  device::FaultPoints faults_;
  std::unique_ptr<FaultyDevice> faulty_;
  uint64_t work_runs_ = 0;
};

// A session with a 16-page buffer; ended by the destructor.
class SessionFlow : public Flow {
 public:
  explicit SessionFlow(CoreFaultSweepTest& t) : t_(t) {
    session_ = t_.Connect();
    buffer_ = t_.Import(session_, 16 * t_.page_);
  }
  ~SessionFlow() override { t_.core_->OnDisconnect(session_); }

 protected:
  CoreFaultSweepTest& t_;
  std::string session_;
  v1::BufferInfo buffer_;
};

TEST_F(CoreFaultSweepTest, OnConnect) {
  class ConnectFlow final : public Flow {
   public:
    explicit ConnectFlow(CoreFaultSweepTest& t) : t_(t) {}
    ~ConnectFlow() override {
      if (!session_.empty()) t_.core_->OnDisconnect(session_);
    }
    absl::Status Run() override {
      fd_socket::PeerCredentials creds;
      creds.uid = 1000;
      creds.gid = 1000;
      creds.pid = 4242;
      absl::StatusOr<std::string> token = t_.core_->OnConnect(creds);
      if (token.ok()) session_ = *token;
      return token.status();
    }
    void CheckDone() override {
      EXPECT_TRUE(t_.TryImport(session_, t_.page_).ok());
    }

   private:
    CoreFaultSweepTest& t_;
    std::string session_;
  };
  EXPECT_THAT(
      Sweep("OnConnect", [&] { return std::make_unique<ConnectFlow>(*this); }),
      ElementsAre("AllocatePd"));
}

TEST_F(CoreFaultSweepTest, CreateMrForFastRegistration) {
  class CreateMrFlow final : public SessionFlow {
   public:
    using SessionFlow::SessionFlow;
    absl::Status Run() override {
      absl::StatusOr<v1::MrInfo> mr = t_.CreateMr(session_, true, true);
      if (mr.ok()) mr_ = *mr;
      return mr.status();
    }
    void CheckDone() override {
      EXPECT_EQ(t_.MrState(session_, mr_.mr()).state(), "free");
    }

   private:
    v1::MrInfo mr_;
  };
  EXPECT_THAT(Sweep("CreateMr(fast_register)",
                    [&] { return std::make_unique<CreateMrFlow>(*this); }),
              ElementsAre("AllocateFastRegisterMr"));
}

// RegisterMr, and RegisterMr on a range with a warm pin (the pin's LAM is
// released once the MR holds the pages).
class RegisterFlow final : public SessionFlow {
 public:
  RegisterFlow(CoreFaultSweepTest& t, bool warm) : SessionFlow(t) {
    if (!warm) return;
    absl::StatusOr<v1::RegisterMrResponse> r = Register();
    EXPECT_TRUE(r.ok()) << r.status();
    if (r.ok()) {
      EXPECT_EQ(t_.Deregister(session_, r->registration()).value_or(99), 0u);
    }
    EXPECT_EQ(t_.core_->Stats().warm.pins, 1u);
  }
  absl::Status Run() override {
    absl::StatusOr<v1::RegisterMrResponse> r = Register();
    if (r.ok()) reg_ = *r;
    return r.status();
  }
  void CheckDone() override {
    EXPECT_TRUE(t_.fake_->IsKeyValid(reg_.rkey()));
    EXPECT_OK(t_.fake_->PeerAccess(reg_.rkey(), reg_.base_address(),
                                   reg_.length(), false));
  }

 private:
  absl::StatusOr<v1::RegisterMrResponse> Register() {
    return t_.Register(session_, buffer_.buffer(), 100, 3 * t_.page_,
                       kMrRemoteRead);
  }
  v1::RegisterMrResponse reg_;
};

TEST_F(CoreFaultSweepTest, RegisterMr) {
  EXPECT_THAT(
      Sweep("RegisterMr",
            [&] { return std::make_unique<RegisterFlow>(*this, false); }),
      ElementsAre("RegisterMr"));
}

// A warm hit registers over the warm pin's pages, then releases the pin's
// LAM. If that release fails the registration still stands (it is done and
// its key works); the LAM stays a warm pin, accounted, for a later release:
// the books still match the device.
TEST_F(CoreFaultSweepTest, RegisterMrOnAWarmPin) {
  EXPECT_THAT(Sweep("RegisterMr(warm hit)",
                    [&] { return std::make_unique<RegisterFlow>(*this, true); },
                    {"ReleaseLam"}),
              ElementsAre("RegisterMr", "ReleaseLam"));
}

// The last DeregisterMr of a registration: the pages go to a warm pin (a
// LAM) before the MR is deregistered.
TEST_F(CoreFaultSweepTest, LastDeregisterMrKeepingAWarmPin) {
  class DeregisterFlow final : public SessionFlow {
   public:
    explicit DeregisterFlow(CoreFaultSweepTest& t) : SessionFlow(t) {
      absl::StatusOr<v1::RegisterMrResponse> r = t_.Register(
          session_, buffer_.buffer(), 100, 3 * t_.page_, kMrRemoteRead);
      EXPECT_TRUE(r.ok()) << r.status();
      if (r.ok()) reg_ = *r;
    }
    absl::Status Run() override {
      return t_.Deregister(session_, reg_.registration()).status();
    }
    void CheckDone() override {
      EXPECT_FALSE(t_.fake_->IsKeyValid(reg_.rkey()));
    }

   private:
    v1::RegisterMrResponse reg_;
  };
  // Without a warm pin the deregistration still happens.
  EXPECT_THAT(Sweep("DeregisterMr(last reference)",
                    [&] { return std::make_unique<DeregisterFlow>(*this); },
                    {"BuildLam"}),
              ElementsAre("BuildLam", "DeregisterMr"));
}

TEST_F(CoreFaultSweepTest, BuildLam) {
  class LamFlow final : public SessionFlow {
   public:
    using SessionFlow::SessionFlow;
    absl::Status Run() override {
      absl::StatusOr<v1::BuildLamResponse> lam =
          t_.BuildLam(session_, buffer_.buffer(), 100, 3 * t_.page_);
      if (lam.ok()) lam_ = *lam;
      return lam.status();
    }
    void CheckDone() override { EXPECT_EQ(lam_.pages_size(), 4); }

   private:
    v1::BuildLamResponse lam_;
  };
  EXPECT_THAT(
      Sweep("BuildLam", [&] { return std::make_unique<LamFlow>(*this); }),
      ElementsAre("BuildLam"));
}

// A session with a LAM, a fast-register MR object and a connected peer.
class FastRegisterFlow : public SessionFlow {
 public:
  explicit FastRegisterFlow(CoreFaultSweepTest& t) : SessionFlow(t) {
    absl::StatusOr<v1::BuildLamResponse> lam =
        t_.BuildLam(session_, buffer_.buffer(), 100, 2 * t_.page_);
    EXPECT_TRUE(lam.ok()) << lam.status();
    if (lam.ok()) lam_ = *lam;
    absl::StatusOr<v1::MrInfo> mr = t_.CreateMr(session_, true, true);
    EXPECT_TRUE(mr.ok()) << mr.status();
    if (mr.ok()) mr_ = *mr;
    connection_ = t_.ConnectPeer(session_);
    t_.Drain(session_);  // PEER_CONNECTED
  }
  absl::Status Run() override {
    absl::StatusOr<v1::FastRegisterResponse> posted =
        t_.FastRegister(t_.FastRegisterRequest(session_, connection_, mr_.mr(),
                                               lam_, kOpRemoteRead, 77));
    MRD_RETURN_IF_ERROR(posted.status());
    return t_.RunWork(session_);
  }
  void CheckDone() override {
    v1::MrInfo state = t_.MrState(session_, mr_.mr());
    EXPECT_EQ(state.state(), "fast_registered");
    EXPECT_TRUE(t_.fake_->IsKeyValid(state.rkey()));
  }

 protected:
  v1::BuildLamResponse lam_;
  v1::MrInfo mr_;
  device::ConnectionId connection_ = 0;
};

TEST_F(CoreFaultSweepTest, FastRegister) {
  EXPECT_THAT(Sweep("FastRegister",
                    [&] { return std::make_unique<FastRegisterFlow>(*this); }),
              ElementsAre("PostFastRegister", kWork));
}

TEST_F(CoreFaultSweepTest, InvalidateMr) {
  class InvalidateFlow final : public FastRegisterFlow {
   public:
    explicit InvalidateFlow(CoreFaultSweepTest& t) : FastRegisterFlow(t) {
      EXPECT_OK(FastRegisterFlow::Run());
      rkey_ = t_.MrState(session_, mr_.mr()).rkey();
    }
    absl::Status Run() override {
      absl::StatusOr<v1::InvalidateMrResponse> posted =
          t_.Invalidate(session_, connection_, mr_.mr(), 0, 78);
      MRD_RETURN_IF_ERROR(posted.status());
      return t_.RunWork(session_);
    }
    void CheckDone() override {
      EXPECT_EQ(t_.MrState(session_, mr_.mr()).state(), "free");
      EXPECT_FALSE(t_.fake_->IsKeyValid(rkey_));
      EXPECT_OK(t_.ReleaseLam(session_, lam_.lam()));
    }

   private:
    uint32_t rkey_ = 0;
  };
  EXPECT_THAT(Sweep("InvalidateMr",
                    [&] { return std::make_unique<InvalidateFlow>(*this); }),
              ElementsAre("PostInvalidate", kWork));
}

TEST_F(CoreFaultSweepTest, CreatePeerTicket) {
  class TicketFlow final : public SessionFlow {
   public:
    using SessionFlow::SessionFlow;
    absl::Status Run() override {
      v1::CreatePeerTicketRequest req;
      req.set_session(session_);
      return t_.core_->CreatePeerTicket(req, &ticket_);
    }
    void CheckDone() override {
      EXPECT_TRUE(t_.fake_->ConnectPeerWithTicket(ticket_.ticket()).ok());
    }

   private:
    v1::PeerTicket ticket_;
  };
  EXPECT_THAT(Sweep("CreatePeerTicket",
                    [&] { return std::make_unique<TicketFlow>(*this); }),
              ElementsAre("CreatePeerTicket"));
}

}  // namespace
}  // namespace mrd::core_test
