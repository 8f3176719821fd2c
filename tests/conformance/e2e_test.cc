// End to end on the software device: the client library registers real
// memfds with the real mrd over its Unix sockets, and a peer moves data
// through the returned tokens on the peer path.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <future>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tests/integration/test_env.h"

namespace mrd::testing {
namespace {

using client::Buffer;
using client::CompletionStream;
using client::Lam;
using client::Mr;
using client::Registration;
using client::Session;

TEST_F(MrdTest, PeerReadsWhatTheClientWroteAndTheClientSeesThePeersWrite) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 8192, "hello, peer! ");
  Registration reg =
      Register(session, buffer, 0, 8192, kRemoteRead | kRemoteWrite);
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);

  auto read = peer->Read(reg.rkey(), reg.base_address(), 12);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "hello, peer!");

  ASSERT_TRUE(
      peer->Write(reg.rkey(), reg.base_address() + 4096, "written").ok());
  EXPECT_EQ(std::memcmp(static_cast<char*>(buffer.data()) + 4096, "written", 7),
            0);
}

TEST_F(MrdTest, DeregisterRevokesTheTokenBeforeItReturns) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 4096, "x");
  Registration reg = Register(session, buffer, 0, 4096, kRemoteRead);
  auto peer = ConnectPeer(session);
  ASSERT_TRUE(peer->Read(reg.rkey(), reg.base_address(), 1).ok());
  const uint32_t rkey = reg.rkey();
  const uint64_t base = reg.base_address();
  auto left = reg.Deregister();
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_EQ(*left, 0u);
  ExpectRemoteAccessError(peer->Read(rkey, base, 1).status());
}

TEST_F(MrdTest, SameRangeTwiceSharesOneDescriptorUntilTheLastDeregister) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 4096, "w5");
  Registration first = Register(session, buffer, 0, 4096, kRemoteRead);
  Registration second = Register(session, buffer, 0, 4096, kRemoteRead);
  EXPECT_EQ(first.id(), second.id());
  EXPECT_EQ(first.rkey(), second.rkey());
  EXPECT_EQ(first.descriptor(), second.descriptor());
  EXPECT_EQ(second.references(), 2u);
  EXPECT_TRUE(second.cache_hit());

  auto peer = ConnectPeer(session);
  auto left = first.Deregister();
  ASSERT_TRUE(left.ok());
  EXPECT_EQ(*left, 1u);
  EXPECT_TRUE(peer->Read(second.rkey(), second.base_address(), 2).ok());
  const uint32_t rkey = second.rkey();
  left = second.Deregister();
  ASSERT_TRUE(left.ok());
  EXPECT_EQ(*left, 0u);
  ExpectRemoteAccessError(peer->Read(rkey, second.base_address(), 2).status());
}

TEST_F(MrdTest, ReadOnlyIsNeverWritableAndWriteOnlyNeverReadable) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 8192, "r");
  Registration ro = Register(session, buffer, 0, 4096, kRemoteRead);
  Registration wo = Register(session, buffer, 4096, 4096, kRemoteWrite);
  {
    auto peer = ConnectPeer(session);
    ExpectRemoteAccessError(peer->Write(ro.rkey(), ro.base_address(), "no"));
  }
  {
    auto peer = ConnectPeer(session);
    ExpectRemoteAccessError(
        peer->Read(wo.rkey(), wo.base_address(), 1).status());
  }
  EXPECT_EQ(static_cast<char*>(buffer.data())[0], 'r');
}

TEST_F(MrdTest, AnotherSessionsPeerCannotUseTheToken) {
  Session owner = OpenFdSession();
  Session other = OpenFdSession();
  Buffer buffer = NewBuffer(owner, 4096, "secret");
  Registration reg = Register(owner, buffer, 0, 4096, kRemoteRead);
  auto stranger = ConnectPeer(other);
  ExpectRemoteAccessError(
      stranger->Read(reg.rkey(), reg.base_address(), 6).status());
  auto peer = ConnectPeer(owner);
  auto read = peer->Read(reg.rkey(), reg.base_address(), 6);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "secret");
}

TEST_F(MrdTest, FastRegisterOntoAnMrGivesATokenThatInvalidateKills) {
  Session session = OpenFdSession();
  CompletionStream completions = CompletionStream::Open(session);
  Buffer buffer = NewBuffer(session, 3 * 4096, "fast-register ");
  client::BuildLamOptions lam_options;
  lam_options.buffer = buffer.id();
  lam_options.offset = 100;
  lam_options.length = 2 * 4096;
  auto lam = Lam::Build(session, lam_options);
  ASSERT_TRUE(lam.ok()) << lam.status();
  EXPECT_EQ(lam->fbo(), 100u);
  ASSERT_EQ(lam->pages().size(), 3u);

  auto mr = Mr::Create(session, /*fast_register=*/true,
                       /*allow_remote_access=*/true);
  ASSERT_TRUE(mr.ok()) << mr.status();
  auto peer = ConnectPeer(session);
  v1::Completion connected =
      NextOfKind(completions, v1::Completion::PEER_CONNECTED);
  EXPECT_EQ(connected.connection(), peer->connection_id());

  client::FastRegisterOptions fr = client::FastRegisterOptions::FromLam(*lam);
  fr.connection = peer->connection_id();
  fr.request_context = 42;
  fr.base_address = 0x10000000 + fr.fbo;
  fr.length = 2 * 4096;
  fr.flags = kOpRemoteRead | kOpRemoteWrite;
  ASSERT_TRUE(mr->FastRegister(fr).ok());
  v1::Completion done = NextOfKind(completions, v1::Completion::FAST_REGISTER);
  EXPECT_EQ(done.status(), ::mrd::STATUS_SUCCESS) << done.message();
  EXPECT_EQ(done.request_context(), 42u);
  const uint32_t rkey = done.rkey();
  ASSERT_NE(rkey, 0u);

  auto read = peer->Read(rkey, fr.base_address, 13);
  ASSERT_TRUE(read.ok()) << read.status();
  // Offset 100 into a buffer filled with the 14-byte pattern.
  std::string pattern = "fast-register ";
  std::string expect;
  for (int i = 0; i < 13; ++i) expect += pattern[(100 + i) % pattern.size()];
  EXPECT_EQ(*read, expect);
  ASSERT_TRUE(peer->Write(rkey, fr.base_address + 4096, "FR").ok());
  EXPECT_EQ(
      std::memcmp(static_cast<char*>(buffer.data()) + 100 + 4096, "FR", 2), 0);

  ASSERT_TRUE(mr->Invalidate(peer->connection_id(), 43).ok());
  v1::Completion inval = NextOfKind(completions, v1::Completion::INVALIDATE);
  EXPECT_EQ(inval.status(), ::mrd::STATUS_SUCCESS) << inval.message();
  EXPECT_EQ(inval.request_context(), 43u);
  ExpectRemoteAccessError(peer->Read(rkey, fr.base_address, 1).status());

  // The refused read moved the old connection to the error state; a new one
  // fast-registers the same MR again and gets a different key.
  auto peer2 = ConnectPeer(session);
  NextOfKind(completions, v1::Completion::PEER_CONNECTED);
  fr.connection = peer2->connection_id();
  fr.request_context = 44;
  ASSERT_TRUE(mr->FastRegister(fr).ok());
  v1::Completion again = NextOfKind(completions, v1::Completion::FAST_REGISTER);
  EXPECT_EQ(again.status(), ::mrd::STATUS_SUCCESS) << again.message();
  EXPECT_NE(again.rkey(), rkey);
  EXPECT_TRUE(peer2->Read(again.rkey(), fr.base_address, 1).ok());
  ASSERT_TRUE(mr->Invalidate(peer2->connection_id(), 45).ok());
  NextOfKind(completions, v1::Completion::INVALIDATE);
}

TEST_F(MrdTest, SilentSuccessSuppressesOnlySuccesses) {
  Session session = OpenFdSession();
  CompletionStream completions = CompletionStream::Open(session);
  Buffer buffer = NewBuffer(session, 4096, "s");
  client::BuildLamOptions lam_options;
  lam_options.buffer = buffer.id();
  lam_options.length = 4096;
  auto lam = Lam::Build(session, lam_options);
  ASSERT_TRUE(lam.ok());
  auto mr = Mr::Create(session, true, true);
  ASSERT_TRUE(mr.ok());
  auto peer = ConnectPeer(session);
  NextOfKind(completions, v1::Completion::PEER_CONNECTED);

  client::FastRegisterOptions fr = client::FastRegisterOptions::FromLam(*lam);
  fr.connection = peer->connection_id();
  fr.base_address = 0x20000000;
  fr.length = 4096;
  fr.flags = kOpRemoteRead | kOpSilentSuccess;
  fr.request_context = 1;
  ASSERT_TRUE(mr->FastRegister(fr).ok());
  // A second silent fast-register on the now-valid MR fails: its failure
  // must arrive even though it asked for silence.
  fr.request_context = 2;
  ASSERT_TRUE(mr->FastRegister(fr).ok());
  v1::Completion failed =
      NextOfKind(completions, v1::Completion::FAST_REGISTER);
  EXPECT_EQ(failed.request_context(), 2u);
  EXPECT_NE(failed.status(), ::mrd::STATUS_SUCCESS);
  ASSERT_TRUE(mr->Invalidate(peer->connection_id(), 3).ok());
  v1::Completion inval = NextOfKind(completions, v1::Completion::INVALIDATE);
  EXPECT_EQ(inval.request_context(), 3u);
}

TEST_F(MrdTest, FastRegisterWithoutAConnectedPeerIsConnectionInvalid) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 4096);
  client::BuildLamOptions lam_options;
  lam_options.buffer = buffer.id();
  lam_options.length = 4096;
  auto lam = Lam::Build(session, lam_options);
  ASSERT_TRUE(lam.ok());
  auto mr = Mr::Create(session, true, true);
  ASSERT_TRUE(mr.ok());
  client::FastRegisterOptions fr = client::FastRegisterOptions::FromLam(*lam);
  fr.connection = 999999;
  fr.base_address = 0x20000000;
  fr.length = 4096;
  ExpectError(mr->FastRegister(fr).status(),
              absl::StatusCode::kFailedPrecondition,
              ::mrd::STATUS_CONNECTION_INVALID, "NO_SUCH_CONNECTION");
}

TEST_F(MrdTest, BuildLamReportsTheSizeItNeeds) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 4 * 4096);
  client::BuildLamOptions lam_options;
  lam_options.buffer = buffer.id();
  lam_options.offset = 10;
  lam_options.length = 3 * 4096;
  lam_options.capacity = 16;
  auto lam = Lam::Build(session, lam_options);
  ExpectError(lam.status(), absl::StatusCode::kOutOfRange,
              ::mrd::STATUS_BUFFER_TOO_SMALL, "LAM_SPACE_TOO_SMALL");
  EXPECT_EQ(client::RequiredSizeOf(lam.status()), 8u + 8u * 4u);
  lam_options.capacity = 8 + 8 * 4;
  lam = Lam::Build(session, lam_options);
  ASSERT_TRUE(lam.ok()) << lam.status();
  EXPECT_EQ(lam->pages().size(), 4u);
}

TEST_F(MrdTest, ManyRegistrationsInFlightAtOnce) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 64 * 4096, "async");
  std::vector<std::future<absl::StatusOr<Registration>>> futures;
  for (int i = 0; i < 64; ++i) {
    client::RegisterOptions o;
    o.buffer = buffer.id();
    o.offset = static_cast<uint64_t>(i) * 4096;
    o.length = 4096;
    o.flags = kRemoteRead;
    futures.push_back(Registration::RegisterFuture(session, o));
  }
  std::vector<Registration> regs;
  for (auto& f : futures) {
    auto r = f.get();
    ASSERT_TRUE(r.ok()) << r.status();
    regs.push_back(std::move(*r));
  }
  auto list = session.List();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->registrations_size(), 64);
  auto peer = ConnectPeer(session);
  for (const auto& r : regs) {
    EXPECT_TRUE(peer->Read(r.rkey(), r.base_address(), 5).ok());
  }
}

TEST_F(MrdTest, LeaseSessionRegistersAFileUnderTheSharedMemoryDirectory) {
  ASSERT_TRUE(WriteShmFile(mrd_->shm_dir(), "leased", "lease!", 4096).ok());
  auto session = Session::OpenLease(*client_, absl::Seconds(60));
  ASSERT_TRUE(session.ok()) << session.status();
  auto buffer = Buffer::ImportFile(*session, "leased", /*writable=*/true);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  Registration reg =
      Register(*session, *buffer, 0, 4096, kRemoteRead | kRemoteWrite);
  auto peer = ConnectPeer(*session);
  auto read = peer->Read(reg.rkey(), reg.base_address(), 6);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "lease!");
  ASSERT_TRUE(peer->Write(reg.rkey(), reg.base_address(), "LEASE").ok());
  char head[5];
  FILE* f = fopen((mrd_->shm_dir() + "/leased").c_str(), "rb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(fread(head, 1, 5, f), 5u);
  fclose(f);
  EXPECT_EQ(std::string(head, 5), "LEASE");
}

// A file imported without --writable (the lease path) registers for remote
// read on every device and every kernel (kernels before 6.2 cannot pin a
// read-only mapping: the verbs device pins a writable view of the same pages
// that nothing writes through), and never for remote write: neither by
// registration nor by a peer's WRITE through the read token.
TEST_F(MrdTest, AReadOnlyImportIsReadableRemotelyAndNeverWritable) {
  ASSERT_TRUE(WriteShmFile(mrd_->shm_dir(), "ro", "read only", 8192).ok());
  auto session = Session::OpenLease(*client_, absl::Seconds(60));
  ASSERT_TRUE(session.ok()) << session.status();
  auto buffer = Buffer::ImportFile(*session, "ro", /*writable=*/false);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  Registration reg = Register(*session, *buffer, 0, 8192, kRemoteRead);
  auto peer = ConnectPeer(*session);
  ASSERT_NE(peer, nullptr);
  auto read = peer->Read(reg.rkey(), reg.base_address(), 9);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "read only");

  client::RegisterOptions write;
  write.buffer = buffer->id();
  write.length = 4096;
  write.flags = kRemoteWrite;
  auto refused = Registration::Register(*session, write);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(GetErrorDetail(refused.status()).reason(), "BUFFER_READ_ONLY")
      << refused.status();

  EXPECT_FALSE(peer->Write(reg.rkey(), reg.base_address(), "WRITE").ok());
  char head[9];
  FILE* f = fopen((mrd_->shm_dir() + "/ro").c_str(), "rb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(fread(head, 1, 9, f), 9u);
  fclose(f);
  EXPECT_EQ(std::string(head, 9), "read only");
}

// The same through FastRegister: a LAM of a read-only import takes remote
// read (the verbs device maps a writable view for pinning), never remote
// write.
TEST_F(MrdTest, AReadOnlyImportFastRegistersForRemoteReadOnly) {
  ASSERT_TRUE(
      WriteShmFile(mrd_->shm_dir(), "rofr", "fast and read only", 8192).ok());
  auto session = Session::OpenLease(*client_, absl::Seconds(60));
  ASSERT_TRUE(session.ok()) << session.status();
  CompletionStream completions = CompletionStream::Open(*session);
  auto buffer = Buffer::ImportFile(*session, "rofr", /*writable=*/false);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  client::BuildLamOptions lam_options;
  lam_options.buffer = buffer->id();
  lam_options.length = 8192;
  auto lam = Lam::Build(*session, lam_options);
  ASSERT_TRUE(lam.ok()) << lam.status();
  auto mr = Mr::Create(*session, /*fast_register=*/true,
                       /*allow_remote_access=*/true);
  ASSERT_TRUE(mr.ok()) << mr.status();
  auto peer = ConnectPeer(*session);
  ASSERT_NE(peer, nullptr);
  NextOfKind(completions, v1::Completion::PEER_CONNECTED);

  client::FastRegisterOptions fr = client::FastRegisterOptions::FromLam(*lam);
  fr.connection = peer->connection_id();
  fr.base_address = 0x20000000;
  fr.length = 8192;
  fr.flags = kOpRemoteWrite;
  absl::StatusOr<uint64_t> write = mr->FastRegister(fr);
  if (write.ok()) {
    v1::Completion refused =
        NextOfKind(completions, v1::Completion::FAST_REGISTER);
    EXPECT_NE(refused.status(), ::mrd::STATUS_SUCCESS)
        << "remote write granted on a read-only import";
  }
  fr.flags = kOpRemoteRead;
  ASSERT_TRUE(mr->FastRegister(fr).ok());
  v1::Completion done = NextOfKind(completions, v1::Completion::FAST_REGISTER);
  ASSERT_EQ(done.status(), ::mrd::STATUS_SUCCESS) << done.message();
  auto read = peer->Read(done.rkey(), fr.base_address, 18);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "fast and read only");
  EXPECT_FALSE(peer->Write(done.rkey(), fr.base_address, "W").ok());
}

TEST_F(MrdTest, SymlinksAndEscapesOutOfTheSharedMemoryDirectoryAreRefused) {
  auto session = Session::OpenLease(*client_, absl::Seconds(60));
  ASSERT_TRUE(session.ok());
  ASSERT_EQ(symlink("/etc/passwd", (mrd_->shm_dir() + "/link").c_str()), 0);
  ExpectError(Buffer::ImportFile(*session, "link", false).status(),
              absl::StatusCode::kInvalidArgument,
              ::mrd::STATUS_INVALID_PARAMETER, "BAD_PATH");
  ExpectError(Buffer::ImportFile(*session, "../../etc/passwd", false).status(),
              absl::StatusCode::kInvalidArgument,
              ::mrd::STATUS_INVALID_PARAMETER, "BAD_PATH");
}

class MetricsTest : public MrdTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    o.metrics = true;
    return o;
  }
  std::string Scrape() {
    absl::StatusOr<std::string> text = ScrapeMetrics(mrd_->metrics_address());
    EXPECT_TRUE(text.ok()) << text.status();
    return text.ok() ? *text : "";
  }
};

TEST_F(MetricsTest, ExportsRegistrationsAndRpcCounts) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 4096);
  Registration reg = Register(session, buffer, 0, 4096, kRemoteRead);
  std::string text = Scrape();
  EXPECT_TRUE(absl::StrContains(text, "mrd_registrations 1")) << text;
  EXPECT_TRUE(absl::StrContains(text, "mrd_fd_sessions 1")) << text;
  EXPECT_TRUE(absl::StrContains(
      text,
      "grpc_server_handled_total{grpc_code=\"OK\",grpc_method=\"RegisterMr\","
      "grpc_service=\"mrd.v1.MemoryRegistration\",grpc_type=\"unary\"} 1"))
      << text;
  EXPECT_TRUE(absl::StrContains(text, "mrd_pinned_bytes 4096")) << text;
}

}  // namespace
}  // namespace mrd::testing
