// The directory entry's hand-written JSON (server/core/entry_json.h) is
// protobuf's own proto3 JSON of the entry, and reads back as the entry.
#include "server/core/entry_json.h"

#include <string>

#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace mrd::core {
namespace {

v1::PublishedEntry Full() {
  v1::PublishedEntry entry;
  entry.set_name("weights.0");
  entry.set_tenant("pod:0f6a8b2e-3c41-4d3f-9a57-1e2b3c4d5e6f");
  entry.set_cluster("prod");
  entry.set_node("node-a");
  entry.set_address(0xffffffffffffffffULL);
  entry.set_length(uint64_t{1} << 40);
  entry.set_flags(0x5);
  for (int i = 0; i < 2; ++i) {
    v1::PublishedToken* token = entry.add_tokens();
    token->set_device(i == 0 ? "software" : "rxe1");
    token->set_rkey(i == 0 ? 0xffffffffU : 0);
    token->set_peer_address(i == 0 ? "127.0.0.1:7471" : "");
  }
  entry.set_epoch(7);
  entry.set_published_unix_ms(1795000000123);
  return entry;
}

std::string Protobufs(const v1::PublishedEntry& entry) {
  std::string json;
  EXPECT_TRUE(google::protobuf::util::MessageToJsonString(entry, &json).ok());
  return json;
}

TEST(EntryJsonTest, IsWhatProtobufPrints) {
  v1::PublishedEntry entry = Full();
  EXPECT_EQ(PublishedEntryJson(entry), Protobufs(entry));
  // Fields at their defaults are left out, as protobuf leaves them out.
  v1::PublishedEntry sparse;
  EXPECT_EQ(PublishedEntryJson(sparse), Protobufs(sparse));
  sparse.set_epoch(1);
  sparse.add_tokens();
  EXPECT_EQ(PublishedEntryJson(sparse), Protobufs(sparse));
  sparse.set_name("n");
  sparse.set_published_unix_ms(-5);  // negative: still a string
  EXPECT_EQ(PublishedEntryJson(sparse), Protobufs(sparse));
}

TEST(EntryJsonTest, MrdsOwnFieldsStayOut) {
  v1::PublishedEntry entry = Full();
  const std::string stored = PublishedEntryJson(entry);
  entry.set_key("/mrd/v1/prod/tenants/t/names/weights.0");
  entry.set_state("published");
  entry.set_registration(9);
  entry.set_mooncake_key("mooncake/ram/weights.0");
  entry.set_mr(4);
  EXPECT_EQ(PublishedEntryJson(entry), stored);
}

TEST(EntryJsonTest, AnyTenantReadsBack) {
  v1::PublishedEntry entry = Full();
  entry.set_tenant("a\"b\\c\n\t\x01\x7f<>&=é");
  v1::PublishedEntry read;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(
                  PublishedEntryJson(entry), &read)
                  .ok())
      << PublishedEntryJson(entry);
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(read, entry));
}

}  // namespace
}  // namespace mrd::core
