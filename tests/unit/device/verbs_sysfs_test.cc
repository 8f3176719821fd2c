// What the verbs device reads from sysfs about an RDMA device (its NUMA
// node, PCI address and port IPv4 address), against sysfs-shaped trees the
// test writes: runs on any host, no RDMA device needed.
#include "server/device/verbs/verbs_sysfs.h"

#include <gtest/gtest.h>
#include <infiniband/verbs.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "mrd/status.h"

namespace mrd::device {
namespace {

namespace fs = std::filesystem;

class VerbsSysfsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string dir = (fs::temp_directory_path() / "verbs_sysfs_XXXXXX");
    ASSERT_NE(mkdtemp(dir.data()), nullptr);
    root_ = dir;
    sysfs_ = root_ + "/class/infiniband";
    fs::create_directories(sysfs_);
  }
  void TearDown() override { fs::remove_all(root_); }

  void Write(const std::string& path, const std::string& text) {
    fs::create_directories(fs::path(path).parent_path());
    std::ofstream(path) << text;
  }
  // Device `name` whose device link points at `parent` (under root_).
  void LinkParent(const std::string& name, const std::string& parent) {
    fs::create_directories(root_ + "/" + parent);
    fs::create_directories(sysfs_ + "/" + name);
    fs::create_directory_symlink(root_ + "/" + parent,
                                 sysfs_ + "/" + name + "/device");
  }
  void Gid(const std::string& name, int index, const std::string& gid) {
    Write(sysfs_ + "/" + name + "/ports/1/gids/" + std::to_string(index),
          gid + "\n");
  }

  std::string root_;
  std::string sysfs_;
};

constexpr char kZeroGid[] = "0000:0000:0000:0000:0000:0000:0000:0000";
constexpr char kLinkLocalGid[] = "fe80:0000:0000:0000:5054:00ff:fe12:3456";

TEST_F(VerbsSysfsTest, ThePciFunctionAndNumaNodeOfTheAdapter) {
  LinkParent("mlx5_0", "devices/pci0000:3a/0000:3a:00.0/0000:3b:00.1");
  Write(sysfs_ + "/mlx5_0/device/numa_node", "1\n");
  EXPECT_EQ(VerbsDevicePciAddress("mlx5_0", sysfs_), "0000:3b:00.1");
  EXPECT_EQ(VerbsDeviceNumaNode("mlx5_0", sysfs_), 1);
}

TEST_F(VerbsSysfsTest, ADeviceWithoutAPciParentHasNeither) {
  // Soft-RoCE on a virtual netdev: no parent at all.
  fs::create_directories(sysfs_ + "/rxe0");
  EXPECT_EQ(VerbsDevicePciAddress("rxe0", sysfs_), "");
  EXPECT_EQ(VerbsDeviceNumaNode("rxe0", sysfs_), -1);
  // A parent that is not a PCI function, with the kernel's "no node".
  LinkParent("rxe1", "devices/virtual/net/mrd1");
  Write(sysfs_ + "/rxe1/device/numa_node", "-1\n");
  EXPECT_EQ(VerbsDevicePciAddress("rxe1", sysfs_), "");
  EXPECT_EQ(VerbsDeviceNumaNode("rxe1", sysfs_), -1);
  EXPECT_EQ(VerbsDevicePciAddress("nothere", sysfs_), "");
}

TEST_F(VerbsSysfsTest, TheIpv4AddressIsTheLowestIpv4MappedGid) {
  Gid("rxe0", 0, kLinkLocalGid);
  Gid("rxe0", 1, kZeroGid);
  Gid("rxe0", 2, "0000:0000:0000:0000:0000:ffff:0a4d:0001");
  Gid("rxe0", 3, "0000:0000:0000:0000:0000:ffff:0a4d:0001");
  // Index 10 sorts after 2 as a number, not before it as text.
  Gid("rxe0", 10, "0000:0000:0000:0000:0000:ffff:c0a8:01fe");
  absl::StatusOr<std::string> address =
      VerbsDeviceIpv4Address("rxe0", 1, sysfs_);
  ASSERT_TRUE(address.ok()) << address.status();
  EXPECT_EQ(*address, "10.77.0.1");
}

TEST_F(VerbsSysfsTest, ADeviceWithoutAnIpv4GidIsRefusedByName) {
  Gid("rxe1", 0, kLinkLocalGid);
  Gid("rxe1", 1, kZeroGid);
  // Not IPv4-mapped: ::ffff:0:0 (0.0.0.0) and an IPv6 address.
  Gid("rxe1", 2, "0000:0000:0000:0000:0000:ffff:0000:0000");
  Gid("rxe1", 3, "fd00:0000:0000:0000:0000:ffff:0a4d:0001");
  for (const char* name : {"rxe1", "nothere"}) {
    absl::StatusOr<std::string> address =
        VerbsDeviceIpv4Address(name, 1, sysfs_);
    ASSERT_FALSE(address.ok()) << name << ": " << *address;
    EXPECT_EQ(address.status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(GetErrorDetail(address.status()).reason(), "NO_DEVICE_ADDRESS");
    EXPECT_NE(address.status().message().find(name), std::string::npos)
        << address.status();
  }
}

TEST(LinkLayerNameTest, NamesWhatVerbsDefines) {
  EXPECT_EQ(LinkLayerName(IBV_LINK_LAYER_ETHERNET), "Ethernet");
  EXPECT_EQ(LinkLayerName(IBV_LINK_LAYER_INFINIBAND), "InfiniBand");
  EXPECT_EQ(LinkLayerName(IBV_LINK_LAYER_UNSPECIFIED), "InfiniBand");
  EXPECT_EQ(LinkLayerName(200), "");
}

}  // namespace
}  // namespace mrd::device
