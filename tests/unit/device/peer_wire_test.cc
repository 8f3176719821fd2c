#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <thread>

#include "client/peer/soft_peer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mrd/net.h"
#include "mrd/peer_frame.h"
#include "mrd/unique_fd.h"
#include "mrd/v1/peer.pb.h"
#include "tests/unit/device/device_test_util.h"

namespace mrd::peer {
namespace {

using ::mrd::device::testing::IsMrdError;
using ::testing::Pair;

class FrameTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int fds[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    a_.Reset(fds[0]);
    b_.Reset(fds[1]);
  }
  void SendRaw(const std::string& bytes) {
    ASSERT_EQ(write(a_.get(), bytes.data(), bytes.size()),
              static_cast<ssize_t>(bytes.size()));
  }
  UniqueFd a_, b_;
};

TEST_F(FrameTest, RoundTripsAMessage) {
  v1::PeerRequest request;
  request.set_id(9);
  request.mutable_write()->set_rkey(0x1234);
  request.mutable_write()->set_data(std::string(100000, 'x'));
  ASSERT_TRUE(WriteFrame(a_.get(), request).ok());
  v1::PeerRequest received;
  ASSERT_TRUE(ReadFrame(b_.get(), 1 << 20, &received).ok());
  EXPECT_EQ(received.SerializeAsString(), request.SerializeAsString());
}

TEST_F(FrameTest, HeaderIsLittleEndianLength) {
  v1::PeerResponse response;
  response.set_id(1);  // serializes to 2 bytes: 08 01
  ASSERT_TRUE(WriteFrame(a_.get(), response).ok());
  char bytes[6];
  ASSERT_EQ(read(b_.get(), bytes, sizeof(bytes)), 6);
  EXPECT_EQ(std::string(bytes, 4), std::string("\x02\x00\x00\x00", 4));
}

TEST_F(FrameTest, EndOfStreamBetweenFramesIsClosed) {
  a_.Reset();
  v1::PeerRequest request;
  EXPECT_THAT(
      ReadFrame(b_.get(), 1024, &request),
      IsMrdError(absl::StatusCode::kUnavailable, "PEER_CONNECTION_CLOSED"));
}

TEST_F(FrameTest, EndOfStreamInsideAFrameIsBroken) {
  SendRaw(std::string("\x10\x00\x00\x00\x08", 5));  // 16 announced, 1 sent
  a_.Reset();
  v1::PeerRequest request;
  EXPECT_THAT(
      ReadFrame(b_.get(), 1024, &request),
      IsMrdError(absl::StatusCode::kUnavailable, "PEER_CONNECTION_BROKEN"));
}

TEST_F(FrameTest, OversizeFrameIsRefusedBeforeReadingIt) {
  SendRaw(std::string("\x01\x04\x00\x00", 4));  // 1025 bytes announced
  v1::PeerRequest request;
  EXPECT_THAT(
      ReadFrame(b_.get(), 1024, &request),
      IsMrdError(absl::StatusCode::kInvalidArgument, "FRAME_TOO_LARGE"));
}

TEST_F(FrameTest, GarbageBodyIsUnparsable) {
  SendRaw(std::string("\x02\x00\x00\x00\xff\xff", 6));
  v1::PeerRequest request;
  EXPECT_THAT(
      ReadFrame(b_.get(), 1024, &request),
      IsMrdError(absl::StatusCode::kInvalidArgument, "FRAME_UNPARSABLE"));
}

TEST_F(FrameTest, WritingToAClosedPeerIsUnavailableNotSigpipe) {
  b_.Reset();
  v1::PeerRequest request;
  request.set_id(1);
  EXPECT_THAT(
      WriteFrame(a_.get(), request),
      IsMrdError(absl::StatusCode::kUnavailable, "PEER_CONNECTION_BROKEN"));
}

TEST(NetTest, SplitHostPortAcceptsV4V6AndNames) {
  EXPECT_THAT(*SplitHostPort("127.0.0.1:0"), Pair("127.0.0.1", "0"));
  EXPECT_THAT(*SplitHostPort("[::1]:8080"), Pair("::1", "8080"));
  EXPECT_THAT(*SplitHostPort("localhost:7"), Pair("localhost", "7"));
  for (const char* bad :
       {"", "host", ":80", "::1:80", "[::1]80", "h:x", "h:123456", "[::1]:"}) {
    EXPECT_THAT(SplitHostPort(bad).status(),
                IsMrdError(absl::StatusCode::kInvalidArgument, "BAD_HOST_PORT"))
        << bad;
  }
}

TEST(NetTest, ListenReportsItsPortAndConnectReachesIt) {
  absl::StatusOr<UniqueFd> listener = ListenTcp("127.0.0.1:0", 4);
  ASSERT_TRUE(listener.ok()) << listener.status();
  absl::StatusOr<std::string> address = LocalAddress(listener->get());
  ASSERT_TRUE(address.ok());
  EXPECT_NE(*address, "127.0.0.1:0");
  absl::StatusOr<UniqueFd> client = ConnectTcp(*address);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ(*RemoteAddress(client->get()), *address);
}

TEST(NetTest, ConnectWithNobodyListeningIsUnavailable) {
  absl::StatusOr<UniqueFd> listener = ListenTcp("127.0.0.1:0", 4);
  ASSERT_TRUE(listener.ok());
  std::string address = *LocalAddress(listener->get());
  listener->Reset();
  EXPECT_THAT(
      ConnectTcp(address).status(),
      IsMrdError(absl::StatusCode::kUnavailable, "PEER_CONNECT_FAILED"));
}

// SoftPeer::Connect against a listener that closes its first connection
// unanswered, as mrd's peer listener sheds the oldest silent connection
// under a flood (a peer held up between its connect and its hello is
// one): it says hello again on a new connection. A listener that closes
// every connection fails it after the second.
TEST(SoftPeerConnectTest, AHelloClosedUnansweredIsTriedOnceMore) {
  absl::StatusOr<UniqueFd> listener = ListenTcp("127.0.0.1:0", 8);
  ASSERT_TRUE(listener.ok()) << listener.status();
  absl::StatusOr<std::string> address = LocalAddress(listener->get());
  ASSERT_TRUE(address.ok()) << address.status();
  for (bool answer_the_second : {true, false}) {
    int accepted = 0;
    UniqueFd held;  // the answered connection, open until the peer is done
    std::thread server([&] {
      for (int i = 0; i < 2; ++i) {
        // A peer that does not come back within 5 s is not waited for.
        pollfd ready = {listener->get(), POLLIN, 0};
        if (::poll(&ready, 1, 5000) != 1) return;
        UniqueFd conn(
            ::accept4(listener->get(), nullptr, nullptr, SOCK_CLOEXEC));
        if (!conn.valid()) return;
        ++accepted;
        if (i == 0 || !answer_the_second) continue;  // closed unanswered
        v1::PeerRequest hello;
        if (!ReadFrame(conn.get(), 4096, &hello).ok()) return;
        v1::PeerResponse answer;
        answer.set_id(hello.id());
        answer.set_status(v1::PEER_SUCCESS);
        answer.set_connection(5);
        answer.set_max_message_size(4096);
        if (!WriteFrame(conn.get(), answer).ok()) return;
        held = std::move(conn);
      }
    });
    absl::StatusOr<std::unique_ptr<SoftPeer>> peer =
        SoftPeer::Connect(*address, "ticket");
    server.join();
    EXPECT_EQ(accepted, 2);
    if (answer_the_second) {
      ASSERT_TRUE(peer.ok()) << peer.status();
      EXPECT_EQ((*peer)->connection_id(), 5u);
    } else {
      ASSERT_FALSE(peer.ok());
      EXPECT_EQ(peer.status().code(), absl::StatusCode::kUnavailable)
          << peer.status();
    }
  }
}

}  // namespace
}  // namespace mrd::peer
