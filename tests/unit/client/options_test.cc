#include "client/lib/options.h"

#include "gtest/gtest.h"

namespace mrd::client {
namespace {

TEST(ResolveRuntimeDirTest, ExplicitEnvironmentWins) {
  EXPECT_EQ(ResolveRuntimeDir(0, "/x", "/run/user/0"), "/x");
  EXPECT_EQ(ResolveRuntimeDir(1000, "/x", "/run/user/1000"), "/x");
}

TEST(ResolveRuntimeDirTest, RootUsesRunMrd) {
  EXPECT_EQ(ResolveRuntimeDir(0, "", "/run/user/0"), "/run/mrd");
}

TEST(ResolveRuntimeDirTest, UserUsesXdgThenTmp) {
  EXPECT_EQ(ResolveRuntimeDir(1000, "", "/run/user/1000"),
            "/run/user/1000/mrd");
  EXPECT_EQ(ResolveRuntimeDir(1000, "", ""), "/tmp/mrd-1000");
}

TEST(TargetForTest, DefaultsToUnixSocket) {
  ClientOptions o;
  o.socket_path = "/s/mrd.sock";
  EXPECT_EQ(TargetFor(o), "unix:/s/mrd.sock");
  o.target = "dns:///h:1";
  EXPECT_EQ(TargetFor(o), "dns:///h:1");
  ClientOptions d;
  EXPECT_EQ(TargetFor(d), "unix:" + DefaultSocketPath());
  EXPECT_EQ(FdSocketPathFor(d), DefaultFdSocketPath());
}

TEST(UnixPathOfTargetTest, AcceptsAllUnixSpellings) {
  EXPECT_EQ(UnixPathOfTarget("unix:/a/b"), "/a/b");
  EXPECT_EQ(UnixPathOfTarget("unix:///a/b"), "/a/b");
  EXPECT_EQ(UnixPathOfTarget("unix:rel"), "rel");
  EXPECT_EQ(UnixPathOfTarget("localhost:5"), "");
}

}  // namespace
}  // namespace mrd::client
