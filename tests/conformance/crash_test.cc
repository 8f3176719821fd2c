// A client killed with SIGKILL while holding registrations: mrd releases
// everything its session held (nothing stays pinned), its peer connection is
// dropped and its tokens are refused, while another client's registrations
// keep working.

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "tests/integration/test_env.h"

namespace mrd::testing {
namespace {

using client::Buffer;
using client::Registration;
using client::Session;

TEST_F(MrdTest, KilledClientsRegistrationsAreReleasedAndItsTokensRefused) {
  // A bystander whose registration must survive.
  Session bystander = OpenFdSession();
  Buffer kept = NewBuffer(bystander, 4096, "kept");
  Registration kept_reg = Register(bystander, kept, 0, 4096, kRemoteRead);

  // The victim is a separate program (fork+exec: gRPC does not survive a
  // bare fork of a process that already uses it).
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    dup2(pipe_fds[1], STDOUT_FILENO);
    close(pipe_fds[0]);
    execl(MRD_CRASH_CLIENT, MRD_CRASH_CLIENT, mrd_->grpc_socket().c_str(),
          mrd_->fd_socket().c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(pipe_fds[1]);
  std::string line;
  char c;
  while (read(pipe_fds[0], &c, 1) == 1 && c != '\n') line += c;
  close(pipe_fds[0]);
  std::vector<std::string> parts = absl::StrSplit(line, ' ');
  ASSERT_EQ(parts.size(), 4u) << "child reported '" << line << "'";
  uint32_t rkey;
  uint64_t base;
  ASSERT_TRUE(absl::SimpleAtoi(parts[0], &rkey));
  ASSERT_TRUE(absl::SimpleAtoi(parts[1], &base));

  auto peer = TryConnectPeer(parts[3], parts[2]);
  ASSERT_TRUE(peer.ok()) << peer.status();
  auto read = (*peer)->Read(rkey, base, 10);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "child data");

  auto info = client_->GetDeviceInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_GE(info->pinned_bytes(), 16u * 4096);

  kill(child, SIGKILL);
  int status;
  waitpid(child, &status, 0);

  // The session ends when mrd sees the fd socket close; poll briefly.
  uint64_t pinned = 0;
  for (int i = 0; i < 200; ++i) {
    info = client_->GetDeviceInfo();
    ASSERT_TRUE(info.ok());
    pinned = info->pinned_bytes();
    if (pinned == 4096) break;  // only the bystander's page is left
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(pinned, 4096u);

  // The dead session's peer connection is gone with its protection domain:
  // the token is refused on it, and its ticket admits no new peer.
  auto after = (*peer)->Read(rkey, base, 10);
  EXPECT_FALSE(after.ok());
  auto again = TryConnectPeer(parts[3], parts[2]);
  EXPECT_FALSE(again.ok());
  // Nor does the token work from a live session's peer.
  auto bystander_peer = ConnectPeer(bystander);
  ExpectRemoteAccessError(bystander_peer->Read(rkey, base, 10).status());

  // The bystander is untouched.
  auto other = ConnectPeer(bystander);
  auto kept_read = other->Read(kept_reg.rkey(), kept_reg.base_address(), 4);
  ASSERT_TRUE(kept_read.ok()) << kept_read.status();
  EXPECT_EQ(*kept_read, "kept");
}

}  // namespace
}  // namespace mrd::testing
