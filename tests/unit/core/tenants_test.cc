#include "server/core/tenants.h"

#include <gtest/gtest.h>

#include "mrd/status.h"

namespace mrd::core {
namespace {

TenantTableOptions Options(uint32_t percent) {
  TenantTableOptions o;
  o.default_percent = percent;
  o.totals = {1024, 32768, 1 << 20, uint64_t{16} << 30, 262144, 262144, 4096};
  return o;
}

Identity User(uint32_t uid) {
  Identity id;
  id.verified = true;
  id.uid = uid;
  id.gid = uid;
  return id;
}

TEST(TenantTableTest, DefaultQuotaIsAShareOfEachTotal) {
  auto table = TenantTable::Create(Options(25));
  ASSERT_TRUE(table.ok()) << table.status();
  std::shared_ptr<Tenant> t = (*table)->Resolve(User(1000));
  EXPECT_EQ(t->name(), "uid:1000");
  EXPECT_EQ(t->quota(TenantResource::kSessions), 256u);
  EXPECT_EQ(t->quota(TenantResource::kPinnedBytes), uint64_t{4} << 30);
  EXPECT_EQ(t->quota(TenantResource::kPeerConnections), 1024u);
  // Rounded up, never zero.
  TenantTableOptions tiny = Options(25);
  tiny.totals[static_cast<int>(TenantResource::kSessions)] = 2;
  auto small = TenantTable::Create(tiny);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ((*small)->Resolve(User(1))->quota(TenantResource::kSessions), 1u);
}

TEST(TenantTableTest, SameUidSameTenantAnonymousIsOne) {
  auto table = TenantTable::Create(Options(50));
  ASSERT_TRUE(table.ok());
  EXPECT_EQ((*table)->Resolve(User(7)), (*table)->Resolve(User(7)));
  EXPECT_NE((*table)->Resolve(User(7)), (*table)->Resolve(User(8)));
  Identity anonymous;
  std::shared_ptr<Tenant> a = (*table)->Resolve(anonymous);
  EXPECT_EQ(a->name(), "anonymous");
  anonymous.uid = 7;  // an unverified uid is no identity at all
  EXPECT_EQ((*table)->Resolve(anonymous), a);
  EXPECT_EQ((*table)->All().size(), 3u);
}

TEST(TenantTableTest, ReserveRefusesPastQuotaNamingTenantAndLimit) {
  auto table = TenantTable::Create(Options(25));
  ASSERT_TRUE(table.ok());
  std::shared_ptr<Tenant> t = (*table)->Resolve(User(1000));
  for (int i = 0; i < 256; ++i) {
    ASSERT_TRUE(t->Reserve(TenantResource::kSessions, 1).ok()) << i;
  }
  absl::Status refused = t->Reserve(TenantResource::kSessions, 1);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetErrorDetail(refused).reason(), "LIMIT_TENANT_SESSIONS");
  EXPECT_NE(refused.message().find("tenant uid:1000"), std::string::npos);
  EXPECT_NE(refused.message().find("quota of 256"), std::string::npos);
  EXPECT_EQ(t->Refused(TenantResource::kSessions), 1u);
  // Another tenant is untouched.
  EXPECT_TRUE((*table)
                  ->Resolve(User(1001))
                  ->Reserve(TenantResource::kSessions, 1)
                  .ok());
  t->Release(TenantResource::kSessions, 1);
  EXPECT_TRUE(t->Reserve(TenantResource::kSessions, 1).ok());
  // Huge amounts do not wrap.
  EXPECT_FALSE(t->Reserve(TenantResource::kPinnedBytes, ~uint64_t{0}).ok());
  EXPECT_EQ(t->Used(TenantResource::kPinnedBytes), 0u);
}

TEST(TenantTableTest, ChargeGivesBackUnlessCommitted) {
  auto table = TenantTable::Create(Options(100));
  ASSERT_TRUE(table.ok());
  std::shared_ptr<Tenant> t = (*table)->Resolve(User(5));
  ASSERT_TRUE(t->Reserve(TenantResource::kLams, 2).ok());
  { TenantCharge charge(t, TenantResource::kLams, 1); }
  EXPECT_EQ(t->Used(TenantResource::kLams), 1u);
  {
    TenantCharge charge(t, TenantResource::kLams, 1);
    charge.Commit();
  }
  EXPECT_EQ(t->Used(TenantResource::kLams), 1u);
}

TEST(TenantTableTest, FileNamesTenantsAndQuotas) {
  auto table = TenantTable::Create(Options(25),
                                   "# comment\n"
                                   "\n"
                                   "tenant train uids=1000,1001 sessions=8 "
                                   "pinned_bytes=64G  # big\n"
                                   "tenant infer uids=2000 registrations=10\n");
  ASSERT_TRUE(table.ok()) << table.status();
  std::shared_ptr<Tenant> train = (*table)->Resolve(User(1001));
  EXPECT_EQ(train->name(), "train");
  EXPECT_EQ((*table)->Resolve(User(1000)), train);
  EXPECT_EQ(train->quota(TenantResource::kSessions), 8u);
  EXPECT_EQ(train->quota(TenantResource::kPinnedBytes), uint64_t{64} << 30);
  EXPECT_EQ(train->quota(TenantResource::kLams), 65536u);  // default share
  EXPECT_EQ(
      (*table)->Resolve(User(2000))->quota(TenantResource::kRegistrations),
      10u);
  EXPECT_EQ((*table)->All().size(), 2u);  // named ones exist from the start
}

TEST(TenantTableTest, BadFilesNameTheLine) {
  const char* bad[] = {
      "tenant a\n",
      "tenant a uids=x\n",
      "tenant a uids=1\ntenant b uids=1\n",
      "tenant a uids=1\ntenant a uids=2\n",
      "tenant anonymous uids=1\n",
      "tenant uid:5 uids=5\n",
      "tenant a uids=1 frobs=3\n",
      "tenant a uids=1 sessions=lots\n",
      "tenant a uids=1 pinned_bytes=99999999999999T\n",
      "group a uids=1\n",
      "tenant a sessions=1\n",
  };
  for (const char* text : bad) {
    auto table = TenantTable::Create(Options(25), text);
    EXPECT_FALSE(table.ok()) << text;
    if (!table.ok()) {
      EXPECT_NE(table.status().message().find("line"), std::string::npos)
          << table.status();
    }
  }
  TenantTableOptions zero = Options(0);
  EXPECT_FALSE(TenantTable::Create(zero).ok());
}

}  // namespace
}  // namespace mrd::core
