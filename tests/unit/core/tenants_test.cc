#include "server/core/tenants.h"

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"
#include "server/core/core.h"

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

TEST(TenantTableTest, ATenantRunsAtMostItsLimitOfCallsInline) {
  auto table = TenantTable::Create(Options(100));
  ASSERT_TRUE(table.ok());
  std::shared_ptr<Tenant> t = (*table)->Resolve(User(5));
  std::shared_ptr<Tenant> other = (*table)->Resolve(User(6));
  EXPECT_TRUE(t->TryEnterInline(2));
  EXPECT_TRUE(t->TryEnterInline(2));
  EXPECT_FALSE(t->TryEnterInline(2));
  EXPECT_TRUE(other->TryEnterInline(2));
  t->LeaveInline();
  EXPECT_TRUE(t->TryEnterInline(2));
  t->LeaveInline();
  t->LeaveInline();
  other->LeaveInline();
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
      "tenant a pods=not-a-uid\n",
      ("tenant a pods=0f3e2d1c-4b5a-4c6d-8e7f-901a2b3c4d5e\n"
       "tenant b pods=0F3E2D1C-4B5A-4C6D-8E7F-901A2B3C4D5E\n"),
      "tenant pod:x pods=0f3e2d1c-4b5a-4c6d-8e7f-901a2b3c4d5e\n",
      "tenant container:x uids=1\n",
      "tenant a uids=1 weight=0\n",
      "tenant a uids=1 weight=1001\n",
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

Identity InPod(uint32_t uid, const std::string& pod) {
  Identity id = User(uid);
  id.tenant_key = "pod:" + pod;
  return id;
}

constexpr char kPodA[] = "0f3e2d1c-4b5a-4c6d-8e7f-901a2b3c4d5e";
constexpr char kPodB[] = "1a2b3c4d-5e6f-4a1b-9c2d-3e4f5a6b7c8d";

// Issue 24: pods of one uid are tenants of their own.
TEST(TenantTableTest, PodsOfOneUidAreDifferentTenants) {
  auto table = TenantTable::Create(Options(25));
  ASSERT_TRUE(table.ok());
  std::shared_ptr<Tenant> a = (*table)->Resolve(InPod(1000, kPodA));
  std::shared_ptr<Tenant> b = (*table)->Resolve(InPod(1000, kPodB));
  std::shared_ptr<Tenant> plain = (*table)->Resolve(User(1000));
  EXPECT_EQ(a->name(), absl::StrCat("pod:", kPodA));
  EXPECT_EQ(b->name(), absl::StrCat("pod:", kPodB));
  EXPECT_EQ(plain->name(), "uid:1000");
  EXPECT_NE(a, b);
  ASSERT_TRUE(a->Reserve(TenantResource::kPinnedBytes,
                         a->quota(TenantResource::kPinnedBytes))
                  .ok());
  EXPECT_FALSE(a->Reserve(TenantResource::kPinnedBytes, 4096).ok());
  EXPECT_TRUE(b->Reserve(TenantResource::kPinnedBytes, 4096).ok());
  EXPECT_TRUE(plain->Reserve(TenantResource::kPinnedBytes, 4096).ok());
  EXPECT_EQ(TenantKeyOf(User(7)), "uid:7");
  EXPECT_EQ(TenantKeyOf(InPod(7, kPodA)), absl::StrCat("pod:", kPodA));
}

TEST(TenantTableTest, TheFileNamesPodsAndWeights) {
  auto table = TenantTable::Create(Options(25),
                                   absl::StrCat("tenant infer pods=", kPodA,
                                                " weight=4 pinned_bytes=1G\n"
                                                "tenant batch uids=1000\n"));
  ASSERT_TRUE(table.ok()) << table.status();
  std::shared_ptr<Tenant> infer = (*table)->Resolve(InPod(1000, kPodA));
  EXPECT_EQ(infer->name(), "infer");
  EXPECT_EQ(infer->weight(), 4u);
  EXPECT_EQ(infer->quota(TenantResource::kPinnedBytes), uint64_t{1} << 30);
  // uids= names callers keyed by their uid, not those in a pod.
  EXPECT_EQ((*table)->Resolve(User(1000))->name(), "batch");
  EXPECT_EQ((*table)->Resolve(InPod(1000, kPodB))->name(),
            absl::StrCat("pod:", kPodB));
  EXPECT_EQ((*table)->Resolve(User(1000))->weight(), kDefaultTenantWeight);
}

TEST(TenantTableTest, SettingsApplyAtOnceAndClearRestoresTheBase) {
  auto table = TenantTable::Create(
      Options(25), absl::StrCat("tenant infer pods=", kPodA, " weight=4\n"));
  ASSERT_TRUE(table.ok());
  const std::string pod_b = absl::StrCat("pod:", kPodB);
  // Before anyone of pod B connected.
  TenantSettings settings;
  settings.quota[static_cast<int>(TenantResource::kPinnedBytes)] = 65536;
  settings.weight = 3;
  ASSERT_TRUE((*table)->Set(pod_b, settings).ok());
  EXPECT_TRUE((*table)->HasSettings(pod_b));
  std::shared_ptr<Tenant> b = (*table)->Resolve(InPod(1000, kPodB));
  EXPECT_EQ(b->quota(TenantResource::kPinnedBytes), 65536u);
  EXPECT_EQ(b->weight(), 3u);
  // Lowered below use: nothing taken away, new work refused.
  ASSERT_TRUE(b->Reserve(TenantResource::kPinnedBytes, 65536).ok());
  TenantSettings lower;
  lower.quota[static_cast<int>(TenantResource::kPinnedBytes)] = 4096;
  ASSERT_TRUE((*table)->Set(pod_b, lower).ok());
  EXPECT_EQ(b->Used(TenantResource::kPinnedBytes), 65536u);
  EXPECT_FALSE(b->Reserve(TenantResource::kPinnedBytes, 1).ok());
  EXPECT_EQ(b->weight(), 3u);  // unset in `lower`: kept
  // Cleared: the default share again.
  ASSERT_TRUE((*table)->Clear(pod_b).ok());
  EXPECT_FALSE((*table)->HasSettings(pod_b));
  EXPECT_EQ(b->quota(TenantResource::kPinnedBytes), uint64_t{4} << 30);
  EXPECT_EQ(b->weight(), kDefaultTenantWeight);
  EXPECT_EQ(GetErrorDetail((*table)->Clear(pod_b)).reason(),
            "NO_TENANT_SETTINGS");
  // A named tenant's file values come back too.
  TenantSettings heavy;
  heavy.weight = 9;
  ASSERT_TRUE((*table)->Set("infer", heavy).ok());
  EXPECT_EQ((*table)->Resolve(InPod(1, kPodA))->weight(), 9u);
  ASSERT_TRUE((*table)->Clear("infer").ok());
  EXPECT_EQ((*table)->Resolve(InPod(1, kPodA))->weight(), 4u);
}

TEST(TenantTableTest, BadSettingsAreRefused) {
  auto table = TenantTable::Create(Options(25));
  ASSERT_TRUE(table.ok());
  TenantSettings settings;
  settings.weight = 2;
  EXPECT_EQ(GetErrorDetail((*table)->Set("", settings)).reason(),
            "BAD_TENANT_NAME");
  EXPECT_EQ(GetErrorDetail((*table)->Set("a b", settings)).reason(),
            "BAD_TENANT_NAME");
  EXPECT_EQ(
      GetErrorDetail((*table)->Set(std::string(300, 'x'), settings)).reason(),
      "BAD_TENANT_NAME");
  settings.weight = 0;
  EXPECT_EQ(GetErrorDetail((*table)->Set("uid:1", settings)).reason(),
            "BAD_TENANT_WEIGHT");
  EXPECT_TRUE((*table)->Settings().empty());
}

TEST(TenantTableTest, TheFileNamesPodsByNamespaceAndName) {
  auto table = TenantTable::Create(
      Options(25), "tenant serving pods=prod/inference-0,prod/inference-1\n");
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_TRUE((*table)->names_pods_by_name());
  Identity named = InPod(1000, kPodA);
  named.pod_name = "prod/inference-1";
  EXPECT_EQ((*table)->Resolve(named)->name(), "serving");
  Identity other = InPod(1000, kPodB);
  other.pod_name = "prod/trainer-0";
  EXPECT_EQ((*table)->Resolve(other)->name(), absl::StrCat("pod:", kPodB));
  for (const char* bad : {"tenant a pods=Prod/x\n", "tenant a pods=/x\n",
                          "tenant a pods=a/\n", "tenant a pods=a_b/c\n"}) {
    EXPECT_FALSE(TenantTable::Create(Options(25), bad).ok()) << bad;
  }
}

// The administrative call's (and the handover's) quotas by resource name.
TEST(TenantTableTest, SettingsFromTheWireNameResources) {
  google::protobuf::RepeatedPtrField<v1::TenantQuotaValue> quotas;
  v1::TenantQuotaValue* q = quotas.Add();
  q->set_resource("memory_maps");
  q->set_amount(40);
  absl::StatusOr<TenantSettings> settings = TenantSettingsFromProto(quotas, 2);
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->quota[static_cast<int>(TenantResource::kMemoryMaps)],
            40u);
  EXPECT_EQ(settings->weight, 2u);
  EXPECT_FALSE(TenantSettingsFromProto(quotas, 0)->weight.has_value());
  quotas.Add()->set_resource("frobs");
  EXPECT_EQ(
      GetErrorDetail(TenantSettingsFromProto(quotas, 1).status()).reason(),
      "BAD_TENANT_RESOURCE");
}

// A handover carries the settings; the next table restores them before any
// session resolves its tenant.
TEST(TenantTableTest, SettingsMoveToAnotherTable) {
  auto old_table = TenantTable::Create(Options(25));
  ASSERT_TRUE(old_table.ok());
  TenantSettings settings;
  settings.quota[static_cast<int>(TenantResource::kSessions)] = 3;
  settings.weight = 7;
  const std::string pod_a = absl::StrCat("pod:", kPodA);
  ASSERT_TRUE((*old_table)->Set(pod_a, settings).ok());
  auto new_table = TenantTable::Create(Options(25));
  ASSERT_TRUE(new_table.ok());
  (*new_table)->Restore((*old_table)->Settings());
  std::shared_ptr<Tenant> a = (*new_table)->Resolve(InPod(5, kPodA));
  EXPECT_EQ(a->quota(TenantResource::kSessions), 3u);
  EXPECT_EQ(a->weight(), 7u);
  EXPECT_TRUE((*new_table)->HasSettings(pod_a));
}

}  // namespace
}  // namespace mrd::core
