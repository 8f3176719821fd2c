// HandoverChannel over a real socketpair: frames with any number of fds
// (more than one message carries), payloads larger than the socket buffer,
// and every way the other side can misbehave.

#include "server/handover/channel.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "mrd/status.h"

namespace mrd::handover {
namespace {

struct Pair {
  Pair() {
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    a = std::make_unique<HandoverChannel>(UniqueFd(sv[0]));
    b = std::make_unique<HandoverChannel>(UniqueFd(sv[1]));
  }
  std::unique_ptr<HandoverChannel> a;
  std::unique_ptr<HandoverChannel> b;
};

absl::Time Soon() { return absl::Now() + absl::Seconds(10); }

ino_t InodeOf(int fd) {
  struct stat st {};
  EXPECT_EQ(::fstat(fd, &st), 0);
  return st.st_ino;
}

TEST(HandoverChannelTest, AFrameWithMoreFdsThanOneMessageCarries) {
  Pair p;
  std::vector<UniqueFd> files;
  std::vector<int> fds;
  for (int i = 0; i < 600; ++i) {
    files.emplace_back(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(files.back().valid());
    fds.push_back(files.back().get());
  }
  v1::HandoverFrame frame;
  frame.mutable_hello()->set_mrd_version("test");
  std::thread sender([&] { ASSERT_TRUE(p.a->Send(frame, fds, Soon()).ok()); });
  absl::StatusOr<HandoverChannel::Received> got = p.b->Receive(Soon());
  sender.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->frame.hello().mrd_version(), "test");
  ASSERT_EQ(got->fds.size(), 600u);
  // In order: each received fd is the file sent at its index.
  for (size_t i = 0; i < fds.size(); ++i) {
    EXPECT_EQ(InodeOf(got->fds[i].get()), InodeOf(fds[i]));
    EXPECT_NE(::fcntl(got->fds[i].get(), F_GETFD) & FD_CLOEXEC, 0);
  }
}

TEST(HandoverChannelTest, APayloadLargerThanTheSocketBuffer) {
  Pair p;
  v1::HandoverFrame frame;
  v1::HandoverSnapshot* snapshot = frame.mutable_snapshot();
  for (int i = 0; i < 100000; ++i) {
    v1::HandedOverRegistration* r =
        snapshot->add_sessions()->add_registrations();
    r->set_id(uint64_t{1} << 40 | i);
    r->set_rkey(0x1000 + i);
  }
  std::thread sender([&] { ASSERT_TRUE(p.a->Send(frame, Soon()).ok()); });
  absl::StatusOr<HandoverChannel::Received> got = p.b->Receive(Soon());
  sender.join();
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->frame.snapshot().sessions_size(), 100000);
  EXPECT_EQ(got->frame.snapshot().sessions(99999).registrations(0).rkey(),
            0x1000u + 99999);
}

TEST(HandoverChannelTest, TheOtherSideGoneOrSilentOrSpeakingNonsense) {
  {
    Pair p;
    p.a.reset();
    absl::StatusOr<HandoverChannel::Received> got = p.b->Receive(Soon());
    EXPECT_EQ(GetErrorDetail(got.status()).reason(), "HANDOVER_PEER_GONE");
    v1::HandoverFrame frame;
    frame.mutable_commit();
    EXPECT_EQ(GetErrorDetail(p.b->Send(frame, Soon())).reason(),
              "HANDOVER_PEER_GONE");
  }
  {
    Pair p;
    absl::StatusOr<HandoverChannel::Received> got =
        p.b->Receive(absl::Now() + absl::Milliseconds(20));
    EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_EQ(GetErrorDetail(got.status()).reason(), "HANDOVER_TIMEOUT");
  }
  {
    Pair p;
    const char junk[12] = {'n', 'o', 'p', 'e'};
    ASSERT_EQ(::write(p.a->fd(), junk, sizeof(junk)), 12);
    absl::StatusOr<HandoverChannel::Received> got = p.b->Receive(Soon());
    EXPECT_EQ(GetErrorDetail(got.status()).reason(), "HANDOVER_BAD_FRAME");
  }
  {
    // A header announcing 4 GiB - 1 bytes: refused, nothing allocated.
    Pair p;
    const unsigned char header[12] = {'M',  'R',  'D', 'H', 0xff, 0xff,
                                      0xff, 0xff, 0,   0,   0,    0};
    ASSERT_EQ(::write(p.a->fd(), header, sizeof(header)), 12);
    absl::StatusOr<HandoverChannel::Received> got = p.b->Receive(Soon());
    EXPECT_EQ(GetErrorDetail(got.status()).reason(), "HANDOVER_BAD_FRAME");
  }
  {
    // A payload that does not parse.
    Pair p;
    const unsigned char frame[15] = {'M', 'R', 'D', 'H', 3,    0,    0,   0,
                                     0,   0,   0,   0,   0xff, 0xff, 0xff};
    ASSERT_EQ(::write(p.a->fd(), frame, sizeof(frame)), 15);
    absl::StatusOr<HandoverChannel::Received> got = p.b->Receive(Soon());
    EXPECT_EQ(GetErrorDetail(got.status()).reason(), "HANDOVER_BAD_FRAME");
  }
}

TEST(HandoverChannelTest, ConnectingWhereNobodyListens) {
  absl::StatusOr<UniqueFd> fd = ConnectUnix("/nonexistent/handover.sock");
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(GetErrorDetail(fd.status()).reason(), "HANDOVER_NOBODY");
}

}  // namespace
}  // namespace mrd::handover
