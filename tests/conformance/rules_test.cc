// Device-visible seed rules that e2e_test.cc does not already prove, against
// the real mrd on whichever device the run selects (MRD_TEST_DEVICE): the
// software device here, the verbs device on Soft-RoCE inside the VM. Each
// test names its rules; docs/CONFORMANCE.md maps every rule to its test.

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "mrd/v1/mrd.grpc.pb.h"
#include "tests/integration/test_env.h"

namespace mrd::testing {
namespace {

using client::Buffer;
using client::CompletionStream;
using client::Lam;
using client::Mr;
using client::Registration;
using client::Session;

constexpr uint32_t kMrReadSink = 0x8;           // NDK_MR_FLAG_RDMA_READ_SINK
constexpr uint32_t kOpReadFence = 0x2;          // NDK_OP_FLAG_READ_FENCE
constexpr uint32_t kOpReadSink = 0x40;          // NDK_OP_FLAG_RDMA_READ_SINK
constexpr uint32_t kOpDefer = 0x200;            // NDK_OP_FLAG_DEFER
constexpr uint32_t kReadSinkNotRequired = 0x2;  // adapter flag

class RulesTest : public MrdTest {
 protected:
  // A LAM over the whole of `buffer`.
  Lam BuildLam(const Session& session, const Buffer& buffer, uint64_t length) {
    client::BuildLamOptions o;
    o.buffer = buffer.id();
    o.length = length;
    auto lam = Lam::Build(session, o);
    EXPECT_TRUE(lam.ok()) << lam.status();
    return std::move(*lam);
  }

  client::FastRegisterOptions Fr(const Lam& lam, uint64_t connection,
                                 uint64_t base, uint64_t context,
                                 uint32_t flags) {
    client::FastRegisterOptions fr = client::FastRegisterOptions::FromLam(lam);
    fr.connection = connection;
    fr.base_address = base + fr.fbo;
    fr.request_context = context;
    fr.flags = flags;
    return fr;
  }

  // Expects that no completion arrives within `wait`.
  void ExpectNoCompletion(CompletionStream& stream, absl::Duration wait) {
    auto c = stream.Next(wait);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded)
        << (c.ok() ? c->DebugString() : c.status().ToString());
  }
};

// R9, F3 (READ_SINK): the device says sinks need no special access, the flag
// is accepted on registrations and fast registrations, never refused because
// of it, and memory registered without it still takes remote writes (the
// sink of an RDMA READ is written the same way).
TEST_F(RulesTest, ReadSinkIsAcceptedAndNotRequired) {
  auto info = client_->GetDeviceInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_NE(info->adapter_flags() & kReadSinkNotRequired, 0u)
      << "device " << info->kind()
      << " must report RDMA_READ_SINK_NOT_REQUIRED";

  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 2 * 4096, "sink");
  Registration with_sink = Register(session, buffer, 0, 4096,
                                    kRemoteWrite | kRemoteRead | kMrReadSink);
  Registration without =
      Register(session, buffer, 4096, 4096, kRemoteWrite | kRemoteRead);
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  ASSERT_TRUE(
      peer->Write(with_sink.rkey(), with_sink.base_address(), "A").ok());
  ASSERT_TRUE(peer->Write(without.rkey(), without.base_address(), "B").ok());
  EXPECT_EQ(static_cast<char*>(buffer.data())[0], 'A');
  EXPECT_EQ(static_cast<char*>(buffer.data())[4096], 'B');

  CompletionStream completions = CompletionStream::Open(session);
  Buffer fr_buffer = NewBuffer(session, 4096, "fr-sink");
  Lam lam = BuildLam(session, fr_buffer, 4096);
  auto mr = Mr::Create(session, /*fast_register=*/true, /*remote=*/true);
  ASSERT_TRUE(mr.ok()) << mr.status();
  auto fr_peer = ConnectPeer(session);
  NextOfKind(completions, v1::Completion::PEER_CONNECTED);
  NextOfKind(completions, v1::Completion::PEER_CONNECTED);
  ASSERT_TRUE(mr->FastRegister(Fr(lam, fr_peer->connection_id(), 0x30000000, 7,
                                  kOpRemoteWrite | kOpReadSink))
                  .ok());
  v1::Completion done = NextOfKind(completions, v1::Completion::FAST_REGISTER);
  ASSERT_EQ(done.status(), ::mrd::STATUS_SUCCESS) << done.message();
  ASSERT_TRUE(fr_peer->Write(done.rkey(), 0x30000000, "S").ok());
  EXPECT_EQ(static_cast<char*>(fr_buffer.data())[0], 'S');
  ASSERT_TRUE(mr->Invalidate(fr_peer->connection_id(), 8).ok());
  NextOfKind(completions, v1::Completion::INVALIDATE);
}

// F3 (DEFER): a deferred fast registration is held, with no completion and
// no usable token, until the next non-deferred request on the same
// connection; then both run in order.
TEST_F(RulesTest, DeferredFastRegisterWaitsForTheNextNonDeferredRequest) {
  Session session = OpenFdSession();
  CompletionStream completions = CompletionStream::Open(session);
  Buffer buffer = NewBuffer(session, 2 * 4096, "deferred");
  Lam lam = BuildLam(session, buffer, 2 * 4096);
  auto first = Mr::Create(session, true, true);
  auto second = Mr::Create(session, true, true);
  ASSERT_TRUE(first.ok() && second.ok());
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  NextOfKind(completions, v1::Completion::PEER_CONNECTED);

  ASSERT_TRUE(first
                  ->FastRegister(Fr(lam, peer->connection_id(), 0x40000000, 1,
                                    kOpRemoteRead | kOpDefer))
                  .ok());
  ExpectNoCompletion(completions, absl::Milliseconds(500));

  ASSERT_TRUE(second
                  ->FastRegister(Fr(lam, peer->connection_id(), 0x50000000, 2,
                                    kOpRemoteRead))
                  .ok());
  v1::Completion a = NextOfKind(completions, v1::Completion::FAST_REGISTER);
  v1::Completion b = NextOfKind(completions, v1::Completion::FAST_REGISTER);
  EXPECT_EQ(a.request_context(), 1u);
  EXPECT_EQ(b.request_context(), 2u);
  ASSERT_EQ(a.status(), ::mrd::STATUS_SUCCESS) << a.message();
  ASSERT_EQ(b.status(), ::mrd::STATUS_SUCCESS) << b.message();
  auto ra = peer->Read(a.rkey(), 0x40000000, 8);
  ASSERT_TRUE(ra.ok()) << ra.status();
  EXPECT_EQ(*ra, "deferred");
  auto rb = peer->Read(b.rkey(), 0x50000000, 8);
  ASSERT_TRUE(rb.ok()) << rb.status();
  EXPECT_EQ(*rb, "deferred");
  ASSERT_TRUE(first->Invalidate(peer->connection_id(), 3).ok());
  ASSERT_TRUE(second->Invalidate(peer->connection_id(), 4).ok());
  EXPECT_EQ(
      NextOfKind(completions, v1::Completion::INVALIDATE).request_context(),
      3u);
  EXPECT_EQ(
      NextOfKind(completions, v1::Completion::INVALIDATE).request_context(),
      4u);
}

// F3 (READ_FENCE) and in-order work: an invalidation and a fenced
// re-registration of the same MR posted back to back complete in order; the
// new token works and the old one is dead.
TEST_F(RulesTest, FencedReRegistrationAfterInvalidateRunsInOrder) {
  Session session = OpenFdSession();
  CompletionStream completions = CompletionStream::Open(session);
  Buffer buffer = NewBuffer(session, 4096, "fence");
  Lam lam = BuildLam(session, buffer, 4096);
  auto mr = Mr::Create(session, true, true);
  ASSERT_TRUE(mr.ok());
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  NextOfKind(completions, v1::Completion::PEER_CONNECTED);
  ASSERT_TRUE(mr->FastRegister(Fr(lam, peer->connection_id(), 0x60000000, 1,
                                  kOpRemoteRead))
                  .ok());
  v1::Completion first = NextOfKind(completions, v1::Completion::FAST_REGISTER);
  ASSERT_EQ(first.status(), ::mrd::STATUS_SUCCESS) << first.message();

  ASSERT_TRUE(mr->Invalidate(peer->connection_id(), 2).ok());
  ASSERT_TRUE(mr->FastRegister(Fr(lam, peer->connection_id(), 0x60000000, 3,
                                  kOpRemoteRead | kOpReadFence))
                  .ok());
  v1::Completion inval = NextOfKind(completions, v1::Completion::INVALIDATE);
  v1::Completion again = NextOfKind(completions, v1::Completion::FAST_REGISTER);
  EXPECT_EQ(inval.request_context(), 2u);
  EXPECT_EQ(inval.status(), ::mrd::STATUS_SUCCESS) << inval.message();
  EXPECT_EQ(again.request_context(), 3u);
  ASSERT_EQ(again.status(), ::mrd::STATUS_SUCCESS) << again.message();
  EXPECT_NE(again.rkey(), first.rkey());
  auto read = peer->Read(again.rkey(), 0x60000000, 5);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "fence");
  ExpectRemoteAccessError(peer->Read(first.rkey(), 0x60000000, 1).status());
}

// W11: releasing a buffer while registered invalidates what was made from
// it; its tokens die on the wire, the registration's and the fast
// registration's alike, while another buffer's token lives on.
TEST_F(RulesTest, ReleasingABufferKillsItsTokensOnTheWire) {
  Session session = OpenFdSession();
  CompletionStream completions = CompletionStream::Open(session);
  Buffer doomed = NewBuffer(session, 2 * 4096, "doomed");
  Buffer kept = NewBuffer(session, 4096, "kept");
  Registration reg = Register(session, doomed, 0, 4096, kRemoteRead);
  Registration kept_reg = Register(session, kept, 0, 4096, kRemoteRead);
  client::BuildLamOptions lo;
  lo.buffer = doomed.id();
  lo.offset = 4096;
  lo.length = 4096;
  auto lam = Lam::Build(session, lo);
  ASSERT_TRUE(lam.ok()) << lam.status();
  auto mr = Mr::Create(session, true, true);
  ASSERT_TRUE(mr.ok());
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  NextOfKind(completions, v1::Completion::PEER_CONNECTED);
  ASSERT_TRUE(mr->FastRegister(Fr(*lam, peer->connection_id(), 0x70000000, 1,
                                  kOpRemoteRead))
                  .ok());
  v1::Completion fr = NextOfKind(completions, v1::Completion::FAST_REGISTER);
  ASSERT_EQ(fr.status(), ::mrd::STATUS_SUCCESS) << fr.message();
  ASSERT_TRUE(peer->Read(reg.rkey(), reg.base_address(), 6).ok());
  ASSERT_TRUE(peer->Read(fr.rkey(), 0x70000000, 6).ok());

  const uint32_t reg_rkey = reg.rkey();
  const uint64_t reg_base = reg.base_address();
  auto released = doomed.Release();
  ASSERT_TRUE(released.ok()) << released.status();

  ExpectRemoteAccessError(peer->Read(reg_rkey, reg_base, 1).status());
  auto second = ConnectPeer(session);
  ASSERT_NE(second, nullptr);
  ExpectRemoteAccessError(second->Read(fr.rkey(), 0x70000000, 1).status());
  auto third = ConnectPeer(session);
  ASSERT_NE(third, nullptr);
  auto alive = third->Read(kept_reg.rkey(), kept_reg.base_address(), 4);
  ASSERT_TRUE(alive.ok()) << alive.status();
  EXPECT_EQ(*alive, "kept");
}

// W5 with retries: a RegisterMr retried with the same request id returns the
// same registration without a second reference, so one DeregisterMr kills
// the token on the wire.
TEST_F(RulesTest, RetriedRegisterTakesOneReference) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 4096, "retry");
  client::RegisterOptions o;
  o.buffer = buffer.id();
  o.length = 4096;
  o.flags = kRemoteRead;
  o.request_id = "retry-1";
  auto first = Registration::Register(session, o);
  ASSERT_TRUE(first.ok()) << first.status();
  auto retry = Registration::Register(session, o);
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_EQ(retry->id(), first->id());
  EXPECT_EQ(retry->rkey(), first->rkey());
  EXPECT_EQ(retry->references(), 1u);
  retry->Detach();  // the same reference as `first`: release it once
  auto peer = ConnectPeer(session);
  ASSERT_TRUE(peer->Read(first->rkey(), first->base_address(), 5).ok());
  const uint32_t rkey = first->rkey();
  const uint64_t base = first->base_address();
  auto left = first->Deregister();
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(*left, 0u);
  ExpectRemoteAccessError(peer->Read(rkey, base, 1).status());
}

// L9: a LAM comes with a privileged token for its logical addresses; it is
// local-only: a peer is refused with it at the logical addresses, and at the
// address where those pages are fast-registered for remote access.
TEST_F(RulesTest, PrivilegedTokenIsNeverUsableByAPeer) {
  Session session = OpenFdSession();
  CompletionStream completions = CompletionStream::Open(session);
  Buffer buffer = NewBuffer(session, 2 * 4096, "privileged");
  Lam lam = BuildLam(session, buffer, 2 * 4096);
  Lam other = BuildLam(session, buffer, 4096);
  ASSERT_NE(lam.privileged_token(), 0u);
  EXPECT_NE(lam.privileged_token(), other.privileged_token());

  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  NextOfKind(completions, v1::Completion::PEER_CONNECTED);
  ExpectRemoteAccessError(
      peer->Read(lam.privileged_token(), lam.pages()[0], 8).status());

  // The same pages fast-registered with remote access: the MR's token works
  // there, the privileged token still does not.
  auto mr = Mr::Create(session, true, true);
  ASSERT_TRUE(mr.ok());
  auto fresh = ConnectPeer(session);
  ASSERT_NE(fresh, nullptr);
  NextOfKind(completions, v1::Completion::PEER_CONNECTED);
  ASSERT_TRUE(mr->FastRegister(Fr(lam, fresh->connection_id(), 0x80000000, 1,
                                  kOpRemoteRead | kOpRemoteWrite))
                  .ok());
  v1::Completion done = NextOfKind(completions, v1::Completion::FAST_REGISTER);
  ASSERT_EQ(done.status(), ::mrd::STATUS_SUCCESS) << done.message();
  EXPECT_NE(done.rkey(), lam.privileged_token());
  auto read = fresh->Read(done.rkey(), 0x80000000, 10);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "privileged");
  ExpectRemoteAccessError(
      fresh->Write(lam.privileged_token(), 0x80000000, "X"));
  EXPECT_EQ(static_cast<char*>(buffer.data())[0], 'p');
  auto last = ConnectPeer(session);
  ASSERT_NE(last, nullptr);
  NextOfKind(completions, v1::Completion::PEER_CONNECTED);
  ASSERT_TRUE(mr->Invalidate(last->connection_id(), 2).ok());
  NextOfKind(completions, v1::Completion::INVALIDATE);
}

// W2 both ways, on the Winsock form of the call (MEM_* flags): too small a
// descriptor space is WSAEFAULT with the size needed; a buffer outside the
// caller's memory (another session's buffer, a range past the end) is
// WSAEFAULT with no size, so the caller's length stays as it gave it; and
// neither registers anything.
TEST_F(RulesTest, DescriptorSpaceAndForeignMemoryAreWsaefault) {
  constexpr uint32_t kMemRead = 0x1;
  Session session = OpenFdSession();
  Session other = OpenFdSession();
  Buffer mine = NewBuffer(session, 4096, "mine");
  Buffer theirs = NewBuffer(other, 4096, "theirs");

  client::RegisterOptions o;
  o.buffer = mine.id();
  o.length = 4096;
  o.mem_flags = kMemRead;
  o.descriptor_capacity = 8;
  auto small = Registration::Register(session, o);
  ExpectError(small.status(), absl::StatusCode::kOutOfRange, ::mrd::WSAEFAULT,
              "DESCRIPTOR_SPACE_TOO_SMALL");
  EXPECT_EQ(client::RequiredSizeOf(small.status()), 24u);

  o.descriptor_capacity = 64;
  o.buffer = theirs.id();
  auto foreign = Registration::Register(session, o);
  EXPECT_EQ(GetErrorDetail(foreign.status()).seed_status(), ::mrd::WSAEFAULT)
      << foreign.status();
  EXPECT_EQ(GetErrorDetail(foreign.status()).reason(),
            "BUFFER_OUTSIDE_CALLER_MEMORY");
  EXPECT_FALSE(client::RequiredSizeOf(foreign.status()).has_value());

  o.buffer = mine.id();
  o.offset = 4096;
  o.length = 1;
  auto past = Registration::Register(session, o);
  EXPECT_EQ(GetErrorDetail(past.status()).seed_status(), ::mrd::WSAEFAULT)
      << past.status();
  EXPECT_FALSE(client::RequiredSizeOf(past.status()).has_value());

  auto list = session.List();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->registrations_size(), 0);
  auto info = client_->GetDeviceInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->pinned_bytes(), 0u);

  // The NDK form keeps NDK codes for the same mistake (R2).
  client::RegisterOptions ndk;
  ndk.buffer = mine.id();
  ndk.offset = 4096;
  ndk.length = 1;
  ndk.flags = kRemoteRead;
  ExpectError(Registration::Register(session, ndk).status(),
              absl::StatusCode::kInvalidArgument,
              ::mrd::STATUS_INVALID_PARAMETER, "");
}

// C2, R5, L3 (PENDING): requests complete asynchronously, many at once; a
// RegisterMr or BuildLam whose deadline expires or which is cancelled before
// it completes leaves nothing half-done: afterwards each registration or LAM
// that exists is the session's and works on the wire, and the pinned bytes
// are exactly what the session owns; closing the session gives all back.
class PendingTest : public RulesTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    // One worker: requests queue behind each other, so deadlines and
    // cancellations really do catch some of them before they run.
    o.extra_flags = {"--worker_threads=1"};
    return o;
  }
};

TEST_F(PendingTest, ExpiredOrCancelledRequestsLeaveAllOrNothing) {
  Session session = OpenFdSession();
  constexpr int kCount = 16;
  constexpr uint64_t kChunk = 64 * 4096;
  Buffer buffer = NewBuffer(session, kCount * kChunk, "pending!");
  auto stub = v1::MemoryRegistration::NewStub(grpc::CreateChannel(
      mrd_->grpc_target(), grpc::InsecureChannelCredentials()));

  struct Call {
    grpc::ClientContext ctx;
    v1::RegisterMrRequest reg;
    v1::RegisterMrResponse reg_out;
    v1::BuildLamRequest lam;
    v1::BuildLamResponse lam_out;
    grpc::Status status;
    absl::Notification done;
  };
  std::vector<std::unique_ptr<Call>> calls;
  for (int i = 0; i < kCount; ++i) {
    auto call = std::make_unique<Call>();
    const uint64_t offset = static_cast<uint64_t>(i) * kChunk;
    Call* c = call.get();
    auto on_done = [c](grpc::Status st) {
      c->status = std::move(st);
      c->done.Notify();
    };
    if (i % 4 < 2) {  // some with a deadline already tight
      c->ctx.set_deadline(std::chrono::system_clock::now() +
                          std::chrono::milliseconds(i % 2 == 0 ? 1 : 20));
    }
    if (i % 2 == 0) {
      c->reg.set_session(session.token());
      c->reg.set_buffer(buffer.id());
      c->reg.set_offset(offset);
      c->reg.set_length(kChunk);
      c->reg.set_flags(kRemoteRead);
      stub->async()->RegisterMr(&c->ctx, &c->reg, &c->reg_out, on_done);
    } else {
      c->lam.set_session(session.token());
      c->lam.set_buffer(buffer.id());
      c->lam.set_offset(offset);
      c->lam.set_length(kChunk);
      stub->async()->BuildLam(&c->ctx, &c->lam, &c->lam_out, on_done);
    }
    if (i % 4 >= 2 && i % 3 == 0) c->ctx.TryCancel();
    calls.push_back(std::move(call));
  }
  int completed = 0;
  for (auto& c : calls) {
    c->done.WaitForNotification();
    const auto code = c->status.error_code();
    EXPECT_TRUE(code == grpc::StatusCode::OK ||
                code == grpc::StatusCode::DEADLINE_EXCEEDED ||
                code == grpc::StatusCode::CANCELLED)
        << code << " " << c->status.error_message();
    if (code == grpc::StatusCode::OK) ++completed;
  }
  std::cerr << completed << " of " << kCount
            << " requests completed before their deadline or cancellation\n";
  // A barrier behind every queued request: the single worker has run them
  // all once this pool RPC returns.
  ASSERT_TRUE(Mr::Create(session, false).ok());

  auto list = session.List();
  ASSERT_TRUE(list.ok()) << list.status();
  uint64_t owned = 0;
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  for (const auto& r : list->registrations()) {
    EXPECT_EQ(r.references(), 1u);
    owned += r.length();
    auto read = peer->Read(r.rkey(), r.base_address(), 8);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(*read, "pending!");
  }
  for (const auto& l : list->lams()) owned += l.length();
  EXPECT_GE(static_cast<int>(list->registrations_size() + list->lams_size()),
            completed);
  EXPECT_EQ(list->session().pinned_bytes(), owned);
  auto info = client_->GetDeviceInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->pinned_bytes(), owned);

  ASSERT_TRUE(session.Close().ok());
  for (int i = 0; i < 200; ++i) {
    info = client_->GetDeviceInfo();
    ASSERT_TRUE(info.ok());
    if (info->pinned_bytes() == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(info->pinned_bytes(), 0u);
}

}  // namespace
}  // namespace mrd::testing
