// ProcessHandover's old side against a new process speaking the protocol
// (Takeover) over a real socket, with participants that record each step:
// the steps run in order, and a failure thaws exactly the participants that
// froze, in reverse order.

#include "server/handover/process_handover.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "mrd/status.h"
#include "server/handover/handover.h"
#include "server/handover/participant.h"
#include "server/handover/status_file.h"

namespace mrd::handover {
namespace {

// The steps every participant took, "<name>.<step>", in the order taken.
class Steps {
 public:
  void Add(const std::string& step) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    steps_.push_back(step);
  }
  std::string Joined() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return absl::StrJoin(steps_, " ");
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<std::string> steps_ ABSL_GUARDED_BY(mu_);
};

// Records each old-side step; fails the one named `fail`.
class Recorder final : public Participant {
 public:
  Recorder(std::string name, Steps* steps, std::string fail = "")
      : name_(std::move(name)), steps_(steps), fail_(std::move(fail)) {}

  absl::Status Check(const v1::HandoverHello&) override {
    return Step("check");
  }
  absl::Status Prepare(v1::HandoverSnapshot*, std::vector<UniqueFd>*) override {
    return Step("prepare");
  }
  absl::Status Freeze() override { return Step("freeze"); }
  absl::Status Export(v1::HandoverSnapshot*, std::vector<UniqueFd>*) override {
    return Step("export");
  }
  absl::Status Release() override { return Step("release"); }
  void Thaw() override { (void)Step("thaw"); }

 private:
  absl::Status Step(const std::string& step) {
    steps_->Add(absl::StrCat(name_, ".", step));
    if (step != fail_) return absl::OkStatus();
    return MrdError(absl::StatusCode::kUnavailable, "TEST_REFUSAL",
                    absl::StrCat(name_, " refuses to ", step));
  }

  const std::string name_;
  Steps* const steps_;
  const std::string fail_;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

class ProcessHandoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/process_handover_test.XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
  }
  void TearDown() override {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  // Runs one takeover against an old process made of `participants`, as
  // far as it goes with `fault` set there; returns the new process's error
  // (the old process's refusal).
  absl::Status TakeOver(std::vector<Participant*> participants,
                        const std::string& fault = "") {
    StatusFile status(dir_ + "/status");
    ProcessHandoverOptions options;
    options.socket = dir_ + "/handover.sock";
    options.mrd_version = "test";
    options.timeout = absl::Seconds(10);
    options.fault = fault;
    options.status = &status;
    options.pinned_bytes = [] { return uint64_t{0}; };
    ProcessHandover old(std::move(options), std::move(participants));
    old.Listen();
    EXPECT_TRUE(old.listening());
    TakeoverOptions takeover;
    takeover.path = dir_ + "/handover.sock";
    takeover.timeout = absl::Seconds(10);
    absl::Status result;
    {
      absl::StatusOr<std::unique_ptr<Takeover>> begun =
          Takeover::Begin(takeover, v1::HandoverHello());
      result = begun.ok() ? Rest(**begun) : begun.status();
    }  // the new process's socket closes: the old side stops waiting
    // Joins the handover thread: every step it takes has been taken.
    old.Shutdown();
    status_ = ReadFile(dir_ + "/status");
    return result;
  }

  // The new process's steps after hello, up to ready.
  static absl::Status Rest(Takeover& takeover) {
    MRD_RETURN_IF_ERROR(takeover.ReceivePrepare().status());
    MRD_RETURN_IF_ERROR(takeover.Prepared());
    MRD_RETURN_IF_ERROR(takeover.ReceiveSnapshot().status());
    // Not ready: the old process gives up at once (the socket closes).
    return MrdError(absl::StatusCode::kAborted, "NOT_READY", "test");
  }

  std::string dir_;
  std::string status_;  // the status file after the takeover
  Steps steps_;
};

TEST_F(ProcessHandoverTest, AFreezeThatFailsThawsTheFrozenOnesInReverse) {
  Recorder a("a", &steps_), b("b", &steps_), c("c", &steps_, "freeze");
  absl::Status s = TakeOver({&a, &b, &c});
  EXPECT_EQ(GetErrorDetail(s).reason(), "TEST_REFUSAL") << s;
  EXPECT_EQ(steps_.Joined(),
            "a.check b.check c.check a.prepare b.prepare c.prepare "
            "a.freeze b.freeze c.freeze b.thaw a.thaw");
  EXPECT_EQ(status_, "serving\n");
}

TEST_F(ProcessHandoverTest, TheFirstFreezeFailingThawsNothing) {
  Recorder a("a", &steps_, "freeze"), b("b", &steps_);
  absl::Status s = TakeOver({&a, &b});
  EXPECT_EQ(GetErrorDetail(s).reason(), "TEST_REFUSAL") << s;
  EXPECT_EQ(steps_.Joined(), "a.check b.check a.prepare b.prepare a.freeze");
  EXPECT_EQ(status_, "serving\n");
}

TEST_F(ProcessHandoverTest, AnExportThatFailsThawsEveryParticipant) {
  Recorder a("a", &steps_), b("b", &steps_, "export"), c("c", &steps_);
  absl::Status s = TakeOver({&a, &b, &c});
  EXPECT_EQ(GetErrorDetail(s).reason(), "TEST_REFUSAL") << s;
  EXPECT_EQ(steps_.Joined(),
            "a.check b.check c.check a.prepare b.prepare c.prepare "
            "a.freeze b.freeze c.freeze a.export b.export "
            "c.thaw b.thaw a.thaw");
  EXPECT_EQ(status_, "serving\n");
}

TEST_F(ProcessHandoverTest, NoReadyAfterTheSnapshotThawsEveryParticipant) {
  Recorder a("a", &steps_), b("b", &steps_);
  absl::Status s = TakeOver({&a, &b});
  EXPECT_EQ(GetErrorDetail(s).reason(), "NOT_READY") << s;
  EXPECT_EQ(steps_.Joined(),
            "a.check b.check a.prepare b.prepare a.freeze b.freeze "
            "a.export b.export b.thaw a.thaw");
  EXPECT_EQ(status_, "serving\n");
}

TEST_F(ProcessHandoverTest, TheFaultPointsFailTheirStepBeforeItRuns) {
  for (const char* fault : {"old.hello", "old.pause", "old.export"}) {
    Steps steps;
    Recorder a("a", &steps);
    absl::Status s = TakeOver({&a}, fault);
    EXPECT_EQ(GetErrorDetail(s).reason(), "HANDOVER_TEST_FAULT")
        << fault << ": " << s;
    const std::string want = std::string(fault) == "old.hello" ? ""
                             : std::string(fault) == "old.pause"
                                 ? "a.check a.prepare"
                                 : "a.check a.prepare a.freeze a.thaw";
    EXPECT_EQ(steps.Joined(), want) << fault;
  }
}

TEST_F(ProcessHandoverTest, ACheckThatRefusesEndsTheHandoverAtHello) {
  Recorder a("a", &steps_, "check"), b("b", &steps_);
  absl::Status s = TakeOver({&a, &b});
  EXPECT_EQ(GetErrorDetail(s).reason(), "TEST_REFUSAL") << s;
  EXPECT_EQ(steps_.Joined(), "a.check");
}

}  // namespace
}  // namespace mrd::handover
