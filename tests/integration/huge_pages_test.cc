// Huge pages end to end (issue 9, part 3), against the real mrd: hugetlbfs
// memfds (2 MiB pages) made by the client library, imported, registered,
// read and written by a peer and unpinned, and clear refusals when they
// cannot be made. The tests change vm.nr_hugepages (root only) and put it
// back; ctest runs them alone (RESOURCE_LOCK huge_pages).
#include "tests/support/huge_pages.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "client/lib/mrd_client.h"
#include "mrd/status.h"
#include "tests/integration/test_env.h"

namespace mrd::testing {
namespace {

using client::Buffer;
using client::Registration;
using client::Session;

using HugePagesTest = MrdTest;

// Huge pages end to end (issue 9, part 3): a hugetlbfs memfd (2 MiB pages)
// is imported, registered whole and in part, read and written by a peer,
// and unpinned. Needs free 2 MiB pages: the test raises vm.nr_hugepages for
// itself when it runs as root.
TEST_F(HugePagesTest, HugePageBufferIsRegisteredAndSharedWithPeers) {
  test_support::HugePagePool pool(2);
  if (!pool.ok()) GTEST_SKIP() << "cannot raise vm.nr_hugepages (not root)";
  Session session = OpenFdSession();
  absl::StatusOr<Buffer> buffer = Buffer::Create(
      session, 2 * client::kHugePageSize, "huge", true, /*huge_pages=*/true);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  char* data = static_cast<char*>(buffer->data());
  std::memcpy(data + client::kHugePageSize + 4096, "huge bytes", 10);
  absl::StatusOr<Registration> whole = Registration::Register(
      session,
      Range(*buffer, 0, 2 * client::kHugePageSize, kRemoteRead | kRemoteWrite));
  ASSERT_TRUE(whole.ok()) << whole.status();
  // A 4 KiB range inside the second huge page.
  absl::StatusOr<Registration> part = Registration::Register(
      session, Range(*buffer, client::kHugePageSize + 4096, 4096, kRemoteRead));
  ASSERT_TRUE(part.ok()) << part.status();
  EXPECT_EQ(PinnedBytes(), 2 * client::kHugePageSize);
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  absl::StatusOr<std::string> read =
      peer->Read(part->rkey(), part->base_address(), 10);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "huge bytes");
  ASSERT_TRUE(peer->Write(whole->rkey(), whole->base_address() + 1, "w").ok());
  EXPECT_EQ(data[1], 'w');
  ASSERT_TRUE(part->Deregister().ok());
  ASSERT_TRUE(whole->Deregister().ok());
  EXPECT_EQ(PinnedBytes(), 0u);
}

TEST_F(HugePagesTest, HugePageBuffersAreRefusedClearlyWhenTheyCannotBeMade) {
  Session session = OpenFdSession();
  // Not a multiple of 2 MiB: refused before anything is made.
  absl::StatusOr<Buffer> odd = Buffer::Create(
      session, client::kHugePageSize + 4096, "odd", true, /*huge_pages=*/true);
  ASSERT_EQ(odd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GetErrorDetail(odd.status()).reason(), "HUGE_PAGE_MULTIPLE");
  // No free page in the pool: a refusal that says so.
  test_support::HugePagePool none(0, /*exactly_none=*/true);
  if (!none.ok()) GTEST_SKIP() << "cannot change vm.nr_hugepages (not root)";
  absl::StatusOr<Buffer> starved = Buffer::Create(
      session, client::kHugePageSize, "starved", true, /*huge_pages=*/true);
  ASSERT_EQ(starved.status().code(), absl::StatusCode::kResourceExhausted)
      << starved.status();
  EXPECT_EQ(GetErrorDetail(starved.status()).reason(), "NO_HUGE_PAGES");
  // The session carries on.
  EXPECT_TRUE(Buffer::Create(session, 4096, "small").ok());
}

}  // namespace
}  // namespace mrd::testing
