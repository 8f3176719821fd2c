// The Mooncake layout's keys and segment JSON (server/core/
// mooncake_layout.h), read back by the rules of Mooncake's own decoder
// (tests/unit/core/mooncake_reader.h).
#include "server/core/mooncake_layout.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/core/mooncake_reader.h"

namespace mrd::core {
namespace {

using ::mrd::testing::MooncakeSegmentRead;
using ::mrd::testing::ReadMooncakeSegment;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::PublishedEntry Entry() {
  v1::PublishedEntry entry;
  entry.set_name("10.0.0.7:17001");
  entry.set_tenant("pod:4f1c\"quoted\\\n");
  entry.set_cluster("c1");
  entry.set_node("node-a");
  // Past 2^53: a JSON number a double would round.
  entry.set_address(0x7f3a12345678abcdULL);
  entry.set_length(1 << 20);
  entry.set_flags(0x5);
  entry.set_epoch(3);
  v1::PublishedToken* token = entry.add_tokens();
  token->set_device("rxe0");
  token->set_rkey(0xfeedbeefU);
  token->set_peer_address("10.0.0.7:7471");
  return entry;
}

TEST(MooncakeLayoutTest, TheKeyIsWhereItsReadersLookASegmentUp) {
  EXPECT_EQ(MooncakeSegmentKey("mooncake/", "10.0.0.7:17001"),
            "mooncake/ram/10.0.0.7:17001");
  EXPECT_EQ(MooncakeSegmentKey("mooncake/prod/", "seg"),
            "mooncake/prod/ram/seg");
}

TEST(MooncakeLayoutTest, ASegmentItsReadersAccept) {
  const std::string gid = "fe80:0000:0000:0000:0211:22ff:fe33:4455";
  const std::string json = MooncakeSegmentJson(
      Entry(), {MooncakeDevice{"rxe0", gid, 7}}, absl::FromUnixSeconds(0));
  MooncakeSegmentRead read;
  ASSERT_TRUE(ReadMooncakeSegment(json, &read).ok())
      << ReadMooncakeSegment(json, &read) << "\n"
      << json;
  EXPECT_EQ(read.name, "10.0.0.7:17001");
  EXPECT_THAT(read.devices, ElementsAre("rxe0"));
  EXPECT_THAT(read.gids, ElementsAre(gid));
  EXPECT_EQ(read.buffer_location, "cpu:0");
  EXPECT_EQ(read.length, 1 << 20);
  EXPECT_THAT(read.rkeys, ElementsAre(double{0xfeedbeefU}));
  // 64-bit numbers are exact JSON integers, not proto3 JSON's strings.
  EXPECT_THAT(json, HasSubstr("\"addr\":9167660007464414157,"));
  EXPECT_THAT(json, HasSubstr("\"lid\":7,"));
  EXPECT_THAT(json, HasSubstr("\"timestamp\":\"1970-01-01 00:00:00"));
  // mrd's own fields, escaped.
  EXPECT_THAT(json, HasSubstr("\"tenant\":\"pod:4f1c\\\"quoted\\\\\\u000a\""));
  EXPECT_THAT(json, HasSubstr("\"peer_address\":\"10.0.0.7:7471\""));
  EXPECT_THAT(json, HasSubstr("\"epoch\":3,"));
}

TEST(MooncakeLayoutTest, TheSoftwareDeviceHasTheNullGid) {
  v1::PublishedEntry entry = Entry();
  entry.mutable_tokens(0)->set_device("software");
  const std::string json = MooncakeSegmentJson(
      entry, {MooncakeDevice{"software", "", 0}}, absl::Now());
  MooncakeSegmentRead read;
  ASSERT_TRUE(ReadMooncakeSegment(json, &read).ok()) << json;
  EXPECT_THAT(read.gids,
              ElementsAre("00:00:00:00:00:00:00:00:00:00:00:00:00:00:00:00"));
}

TEST(MooncakeLayoutTest, TheReaderRulesRefuseWhatItsReadersWould) {
  // The checker itself refuses a segment its readers would take as
  // corrupted: no rkey, and a zero address.
  v1::PublishedEntry entry = Entry();
  entry.clear_tokens();
  MooncakeSegmentRead read;
  EXPECT_FALSE(
      ReadMooncakeSegment(MooncakeSegmentJson(entry, {}, absl::Now()), &read)
          .ok());
  entry = Entry();
  entry.set_address(0);
  EXPECT_FALSE(
      ReadMooncakeSegment(
          MooncakeSegmentJson(entry, {{"rxe0", "g", 1}}, absl::Now()), &read)
          .ok());
}

}  // namespace
}  // namespace mrd::core
