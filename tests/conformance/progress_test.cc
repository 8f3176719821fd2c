// Progress and cancellation of long registrations (issue 9, part 3), against
// the real mrd on either device (the device suite): a registration still
// pinning reports REGISTRATION_PROGRESS on its session's completion stream, and
// one cancelled midway (the client cancels the call) answers CANCELLED and
// leaves nothing pinned or registered. mrd runs with --progress_after=1ms and
// --progress_interval=2ms so that a 1 GiB registration, which pins for a tenth
// of a second or more, reports many times; one thread prefaults, so that
// pinning takes as long as it can.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/lib/mrd_client.h"
#include "mrd/v1/mrd.grpc.pb.h"
#include "tests/integration/test_env.h"

namespace mrd::testing {
namespace {

using client::Buffer;
using client::CompletionStream;
using client::Registration;
using client::Session;

constexpr uint64_t kBig = uint64_t{1} << 30;

class ProgressTest : public MrdTest {
 protected:
  MrdProcessOptions ServerOptions() override { return EagerProgressOptions(); }

  // Whether mrd's pinned bytes come down to 0 within 10 s.
  bool NothingPinnedSoon() {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (PinnedBytes() != 0) {
      if (absl::Now() >= deadline) return false;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return true;
  }

  // Starts an asynchronous call through `start` (on a channel of its own),
  // waits for the first REGISTRATION_PROGRESS report on `stream` (pinning is
  // under way then), cancels the call and returns its status.
  grpc::Status CancelAfterFirstReport(
      CompletionStream& stream, v1::Completion* first,
      const std::function<void(v1::MemoryRegistration::Stub&,
                               grpc::ClientContext*,
                               std::function<void(grpc::Status)>)>& start) {
    std::unique_ptr<v1::MemoryRegistration::Stub> stub =
        v1::MemoryRegistration::NewStub(grpc::CreateChannel(
            mrd_->grpc_target(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    std::mutex mu;
    std::condition_variable cv;
    std::optional<grpc::Status> answer;
    start(*stub, &ctx, [&](grpc::Status s) {
      std::lock_guard<std::mutex> lock(mu);
      answer = s;
      cv.notify_all();
    });
    while (true) {
      absl::StatusOr<v1::Completion> c = stream.Next(absl::Seconds(30));
      if (!c.ok()) {
        ADD_FAILURE() << "no progress report: " << c.status();
        break;
      }
      if (c->kind() == v1::Completion::REGISTRATION_PROGRESS) {
        *first = *std::move(c);
        break;
      }
    }
    ctx.TryCancel();
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, std::chrono::seconds(60),
                     [&] { return answer.has_value(); })) {
      ADD_FAILURE() << "the call never answered";
      return grpc::Status(grpc::StatusCode::UNKNOWN, "no answer");
    }
    return *answer;
  }

  // The REGISTRATION_PROGRESS completions on `stream` until none comes for
  // `quiet`.
  static std::vector<v1::Completion> DrainProgress(CompletionStream& stream,
                                                   absl::Duration quiet) {
    std::vector<v1::Completion> out;
    while (true) {
      absl::StatusOr<v1::Completion> c = stream.Next(quiet);
      if (!c.ok()) break;
      if (c->kind() == v1::Completion::REGISTRATION_PROGRESS) {
        out.push_back(*std::move(c));
      }
    }
    return out;
  }
};

// A 1 GiB registration reports its progress while it pins: every report
// names the call and counts up to at most the length; a small one reports
// nothing.
TEST_F(ProgressTest, LongRegistrationReportsProgressOnTheStream) {
  Session session = OpenFdSession();
  CompletionStream stream = CompletionStream::Open(session);
  absl::StatusOr<Buffer> buffer = Buffer::Create(session, kBig, "big");
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  client::RegisterOptions o = Range(*buffer, 0, kBig, kRemoteRead);
  o.request_id = "the-big-one";
  absl::StatusOr<Registration> reg = Registration::Register(session, o);
  ASSERT_TRUE(reg.ok()) << reg.status();

  std::vector<v1::Completion> reports =
      DrainProgress(stream, absl::Milliseconds(200));
  ASSERT_FALSE(reports.empty()) << "no progress reported";
  uint64_t pinned = 0;
  uint64_t populated = 0;
  uint64_t elapsed = 0;
  for (const v1::Completion& c : reports) {
    SCOPED_TRACE(c.DebugString());
    EXPECT_EQ(c.request_id(), "the-big-one");
    EXPECT_EQ(c.buffer(), buffer->id());
    EXPECT_EQ(c.offset(), 0u);
    EXPECT_EQ(c.length(), kBig);
    EXPECT_LE(c.bytes_pinned(), kBig);
    EXPECT_LE(c.bytes_populated(), kBig);
    EXPECT_GE(c.bytes_pinned(), pinned);  // never goes back
    EXPECT_GE(c.bytes_populated(), populated);
    EXPECT_GE(c.elapsed_ms(), elapsed);
    pinned = c.bytes_pinned();
    populated = c.bytes_populated();
    elapsed = c.elapsed_ms();
  }
  // The prefault ran first (one thread fills 1 GiB in steps): some report
  // saw it under way.
  EXPECT_GT(populated, 0u);

  // A 1 MiB registration: no report.
  absl::StatusOr<Buffer> small = Buffer::Create(session, 1 << 20, "small");
  ASSERT_TRUE(small.ok()) << small.status();
  ASSERT_TRUE(
      Registration::Register(session, Range(*small, 0, 1 << 20, kRemoteRead))
          .ok());
  EXPECT_TRUE(DrainProgress(stream, absl::Milliseconds(100)).empty());
  ASSERT_TRUE(reg->Deregister().ok());
}

// The client cancels a 1 GiB RegisterMr once its first progress report has
// arrived: CANCELLED, nothing pinned, nothing registered, and the same range
// registers afterwards.
TEST_F(ProgressTest, CancelledMidwayLeavesNothingPinned) {
  Session session = OpenFdSession();
  CompletionStream stream = CompletionStream::Open(session);
  absl::StatusOr<Buffer> buffer = Buffer::Create(session, kBig, "big");
  ASSERT_TRUE(buffer.ok()) << buffer.status();

  v1::RegisterMrRequest req = client::ToRequest(
      session.token(), Range(*buffer, 0, kBig, kRemoteRead | kRemoteWrite));
  req.set_request_id("cancel-me");
  v1::RegisterMrResponse resp;
  v1::Completion first;
  const grpc::Status answer = CancelAfterFirstReport(
      stream, &first,
      [&](v1::MemoryRegistration::Stub& stub, grpc::ClientContext* ctx,
          std::function<void(grpc::Status)> done) {
        stub.async()->RegisterMr(ctx, &req, &resp, std::move(done));
      });
  EXPECT_EQ(first.request_id(), "cancel-me");
  EXPECT_LT(first.bytes_pinned(), kBig);
  EXPECT_EQ(answer.error_code(), grpc::StatusCode::CANCELLED)
      << answer.error_message();
  // mrd stops at its next step and undoes what it pinned.
  EXPECT_TRUE(NothingPinnedSoon()) << PinnedBytes() << " bytes still pinned";
  // Reports sent after the first: the pin may even have finished before
  // mrd saw the cancel (the cancel crosses gRPC, which is slow in the TSan
  // build; the kernel's pinning is not), and then the registration made for
  // a caller who has gone is given back before the answer, as checked
  // above and below. Either way a report names this call and never counts
  // past its length.
  std::vector<v1::Completion> later =
      DrainProgress(stream, absl::Milliseconds(200));
  for (const v1::Completion& c : later) {
    EXPECT_EQ(c.request_id(), "cancel-me");
    EXPECT_LE(c.bytes_pinned(), kBig);
  }
  absl::StatusOr<v1::ListRegistrationsResponse> held = session.List();
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(held->registrations_size(), 0);

  // Nothing stale: the same range registers, and a peer reads it.
  static_cast<char*>(buffer->data())[4096] = 'z';
  client::RegisterOptions again = Range(*buffer, 0, kBig, kRemoteRead);
  again.request_id = "cancel-me";  // the cancelled call left no answer
  absl::StatusOr<Registration> reg = Registration::Register(session, again);
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_FALSE(reg->cache_hit());
  EXPECT_EQ(reg->references(), 1u);
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  absl::StatusOr<std::string> read =
      peer->Read(reg->rkey(), reg->base_address() + 4096, 1);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "z");
  ASSERT_TRUE(reg->Deregister().ok());
  EXPECT_TRUE(NothingPinnedSoon());
}

// BuildLam pins the same way: a 1 GiB LAM reports its progress, and
// cancelled midway it leaves nothing pinned or mapped (L7).
TEST_F(ProgressTest, LongBuildLamReportsProgressAndCancelledLeavesNothing) {
  Session session = OpenFdSession();
  CompletionStream stream = CompletionStream::Open(session);
  absl::StatusOr<Buffer> buffer = Buffer::Create(session, kBig, "big");
  ASSERT_TRUE(buffer.ok()) << buffer.status();

  v1::BuildLamRequest req;
  req.set_session(session.token());
  req.set_buffer(buffer->id());
  req.set_length(kBig);
  v1::BuildLamResponse resp;
  v1::Completion first;
  const grpc::Status answer = CancelAfterFirstReport(
      stream, &first,
      [&](v1::MemoryRegistration::Stub& stub, grpc::ClientContext* ctx,
          std::function<void(grpc::Status)> done) {
        stub.async()->BuildLam(ctx, &req, &resp, std::move(done));
      });
  EXPECT_EQ(first.buffer(), buffer->id());
  EXPECT_EQ(first.length(), kBig);
  EXPECT_EQ(answer.error_code(), grpc::StatusCode::CANCELLED)
      << answer.error_message();
  EXPECT_TRUE(NothingPinnedSoon()) << PinnedBytes() << " bytes still pinned";
  absl::StatusOr<v1::ListRegistrationsResponse> held = session.List();
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(held->lams_size(), 0);

  // Built to the end, it reported on the way.
  DrainProgress(stream, absl::Milliseconds(100));
  client::BuildLamOptions options;
  options.buffer = buffer->id();
  options.length = kBig;
  absl::StatusOr<client::Lam> lam = client::Lam::Build(session, options);
  ASSERT_TRUE(lam.ok()) << lam.status();
  std::vector<v1::Completion> reports =
      DrainProgress(stream, absl::Milliseconds(200));
  EXPECT_FALSE(reports.empty());
  for (const v1::Completion& c : reports) EXPECT_LE(c.bytes_pinned(), kBig);
}

}  // namespace
}  // namespace mrd::testing
