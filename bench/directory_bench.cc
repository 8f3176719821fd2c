// The directory on etcd (issue 27, docs/DIRECTORY.md) through the real mrd
// (--etcd_endpoints) against a real three-member etcd cluster on loopback
// that this benchmark starts itself (tests/unit/directory/etcd_cluster.h),
// every case against a floor measured in the same run:
//
// 1. RegisterMr + DeregisterMr of 4 KiB, a fresh range each (a cache miss
//    every time), remote read, with publish_name set against without, in
//    alternating blocks of `--block` samples (the order flipped every other
//    pair of blocks) so that drift hits both alike; p50 and p99 of each
//    call and of the pair, and the ratio published ÷ plain (goal for
//    RegisterMr: at most 1.2, the etcd write being asynchronous).
//    `--samples` per case, after `--warmup` unrecorded.
//
// 2. An mrd holding `--kill_entries` published entries is killed with
//    SIGKILL: the time from the kill to the last of its entries gone from
//    etcd, seen by an etcd watch on its prefix, with --directory_lease_ttl
//    of 2 s and of 5 s, `--kill_repeats` times each (goal: at most the TTL
//    + 1 s).
//
// 3. `--count` registrations in RegisterMrBatch calls of `--batch` items,
//    each item with publish_name, against the same batches without: the
//    calls' wall time, the time from the first call until every entry is
//    on etcd (watch), and the DeregisterMrBatch calls' wall time with and
//    without published entries (each call waits, up to
//    --directory_unpublish_wait, for etcd to confirm its deletes), plus the
//    time until the watch saw the last delete. `--rounds` rounds, plain and
//    published alternating; medians.
//
//   build/bench/directory_bench [--samples=3000] [--block=100] [--warmup=200]
//       [--kill_entries=100] [--kill_repeats=3] [--count=10000] [--batch=500]
//       [--rounds=1] [--parts=123] [--settle_us=0] [--etcd_down=0]
//
// --parts picks the parts to run; --settle_us pauses before every sample of
// part 1 (both cases alike); --etcd_down=1 kills every etcd member once mrd
// is up and runs part 1 alone: the publisher then only queues its writes,
// and part 1 shows mrd's own synchronous cost of publish_name without the
// etcd write running beside the call. A quick run:
//   build/bench/directory_bench --samples=300 --kill_repeats=1 --count=1000
//
// Prints one table per part and exits non-zero if anything failed.

#include <sched.h>
#include <signal.h>
#include <sys/types.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "bench/bench_util.h"
#include "client/lib/mrd_client.h"
#include "server/directory/etcd_client.h"
#include "tests/integration/mrd_process.h"
#include "tests/unit/directory/etcd_cluster.h"

namespace mrd::bench {
namespace {

using directory::EtcdWatchEvent;

// Counts the distinct keys a watch saw put and deleted among those that
// contain `filter`, and the time the count of each reached its target.
class Counter {
 public:
  explicit Counter(std::string filter) : filter_(std::move(filter)) {}

  directory::EtcdWatchCallback Callback() {
    return [this](absl::StatusOr<std::vector<EtcdWatchEvent>> events) {
      const Clock::time_point now = Clock::now();
      absl::MutexLock lock(&mu_);
      if (!events.ok()) {
        ended_ = true;
        return;
      }
      for (const EtcdWatchEvent& e : *events) {
        if (!absl::StrContains(e.key, filter_)) continue;
        if (e.type == EtcdWatchEvent::Type::kPut) {
          if (puts_.insert(e.key).second && puts_.size() == put_target_) {
            puts_reached_ = now;
          }
        } else if (deletes_.insert(e.key).second &&
                   deletes_.size() == delete_target_) {
          deletes_reached_ = now;
        }
      }
    };
  }

  // Forgets what was seen; the next targets are `puts` and `deletes`.
  void Reset(size_t puts, size_t deletes) {
    absl::MutexLock lock(&mu_);
    puts_.clear();
    deletes_.clear();
    put_target_ = puts;
    delete_target_ = deletes;
    puts_reached_.reset();
    deletes_reached_.reset();
  }
  // When the puts (or deletes) reached their target; nullopt if they did
  // not within `timeout`.
  std::optional<Clock::time_point> WaitPuts(absl::Duration timeout) {
    return Wait(&puts_reached_, timeout);
  }
  std::optional<Clock::time_point> WaitDeletes(absl::Duration timeout) {
    return Wait(&deletes_reached_, timeout);
  }
  size_t puts() {
    absl::MutexLock lock(&mu_);
    return puts_.size();
  }
  size_t deletes() {
    absl::MutexLock lock(&mu_);
    return deletes_.size();
  }

 private:
  std::optional<Clock::time_point> Wait(
      std::optional<Clock::time_point>* reached, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return reached->has_value() || ended_;
    };
    mu_.AwaitWithTimeout(absl::Condition(&done), timeout);
    return *reached;
  }

  const std::string filter_;
  absl::Mutex mu_;
  absl::flat_hash_set<std::string> puts_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> deletes_ ABSL_GUARDED_BY(mu_);
  size_t put_target_ ABSL_GUARDED_BY(mu_) = 0;
  size_t delete_target_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<Clock::time_point> puts_reached_ ABSL_GUARDED_BY(mu_);
  std::optional<Clock::time_point> deletes_reached_ ABSL_GUARDED_BY(mu_);
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
};

// One mrd on the directory, with a client, a session and a buffer of
// `pages` pages.
struct Node {
  std::unique_ptr<testing::MrdProcess> mrd;
  std::unique_ptr<client::Client> client;
  std::unique_ptr<client::Session> session;
  std::unique_ptr<client::Buffer> buffer;
};

bool StartNode(const testing::EtcdCluster& etcd, const std::string& cluster,
               absl::Duration lease_ttl, uint64_t pages, Node* node) {
  std::vector<std::string> flags = GenerousFlags(2 * pages * kPage, 2 * pages);
  flags.push_back(
      absl::StrCat("--etcd_endpoints=", absl::StrJoin(etcd.endpoints(), ",")));
  flags.push_back("--directory_cluster=" + cluster);
  flags.push_back("--node_name=bench-node");
  flags.push_back("--directory_lease_ttl=" + absl::FormatDuration(lease_ttl));
  node->mrd = StartMrd(flags);
  if (node->mrd == nullptr) return false;
  auto c = ConnectTo(*node->mrd);
  if (!c.ok()) return false;
  node->client = std::make_unique<client::Client>(std::move(*c));
  auto s = client::Session::OpenFd(*node->client);
  if (!s.ok()) return false;
  node->session = std::make_unique<client::Session>(std::move(*s));
  auto b = client::Buffer::Create(*node->session, pages * kPage, "dir-bench");
  if (!b.ok()) return false;
  node->buffer = std::make_unique<client::Buffer>(std::move(*b));
  TouchPages(*node->buffer);
  return true;
}

std::string Prefix(const std::string& cluster) {
  return absl::StrCat("/mrd/v1/", cluster, "/");
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// ---- Part 1 ----------------------------------------------------------------

struct LatencyCase {
  std::vector<double> reg_us, dereg_us, pair_us;
};

// One RegisterMr (a miss) and its DeregisterMr of page `page`, published as
// `name` when not empty, `hold` apart (not timed); recorded into `out` when
// not null.
bool OnePair(const Node& node, uint64_t page, const std::string& name,
             absl::Duration hold, LatencyCase* out) {
  v1::RegisterMrRequest req =
      client::ToRequest(node.session->token(), PageOf(node.buffer->id(), page));
  if (!name.empty()) req.set_publish_name(name);
  const Clock::time_point start = Clock::now();
  auto r = node.client->RegisterMr(req);
  const Clock::time_point registered = Clock::now();
  if (!r.ok() || r->cache_hit()) {
    std::fprintf(stderr, "RegisterMr: %s\n",
                 r.ok() ? "a cache hit" : r.status().ToString().c_str());
    return false;
  }
  if (hold > absl::ZeroDuration()) absl::SleepFor(hold);
  v1::DeregisterMrRequest d;
  d.set_session(node.session->token());
  d.set_registration(r->registration());
  const Clock::time_point deregistering = Clock::now();
  auto left = node.client->DeregisterMr(d);
  const Clock::time_point done = Clock::now();
  if (!left.ok() || left->references() != 0) {
    std::fprintf(
        stderr, "DeregisterMr: %s\n",
        left.ok() ? "references left" : left.status().ToString().c_str());
    return false;
  }
  if (out != nullptr) {
    out->reg_us.push_back(Between(start, registered) * 1e6);
    out->dereg_us.push_back(Between(deregistering, done) * 1e6);
    out->pair_us.push_back(
        (Between(start, registered) + Between(deregistering, done)) * 1e6);
  }
  return true;
}

bool Latency(const Node& node, uint64_t samples, uint64_t block,
             uint64_t warmup, absl::Duration settle, absl::Duration hold,
             LatencyCase* plain, LatencyCase* published) {
  uint64_t page = 0;
  uint64_t serial = 0;
  auto run = [&](bool publish, uint64_t n, LatencyCase* out) {
    for (uint64_t i = 0; i < n; ++i) {
      const std::string name =
          publish ? absl::StrCat("lat-", serial++) : std::string();
      if (settle > absl::ZeroDuration()) absl::SleepFor(settle);
      if (!OnePair(node, page, name, hold, out)) return false;
      page = (page + 1) % (node.buffer->size() / kPage);
    }
    return true;
  };
  if (!run(false, warmup, nullptr) || !run(true, warmup, nullptr)) {
    return false;
  }
  for (uint64_t done = 0, pair = 0; done < samples; done += block, ++pair) {
    const uint64_t n = std::min(block, samples - done);
    const bool published_first = pair % 2 == 1;
    if (!run(published_first, n, published_first ? published : plain) ||
        !run(!published_first, n, published_first ? plain : published)) {
      return false;
    }
  }
  return true;
}

// ---- Part 2 ----------------------------------------------------------------

// Seconds from SIGKILL of an mrd holding `entries` published entries to
// the last of them gone from etcd; < 0 on failure.
double KillOnce(const testing::EtcdCluster& etcd, directory::EtcdClient* client,
                absl::Duration ttl, uint64_t entries,
                const std::string& cluster) {
  Counter counter("/names/");
  counter.Reset(entries, entries);
  auto watch = client->Watch(Prefix(cluster), 0, counter.Callback());
  if (!watch.ok()) {
    std::fprintf(stderr, "watch: %s\n", watch.status().ToString().c_str());
    return -1;
  }
  Node node;
  if (!StartNode(etcd, cluster, ttl, entries, &node)) return -1;
  v1::RegisterMrBatchRequest batch;
  batch.set_session(node.session->token());
  for (uint64_t i = 0; i < entries; ++i) {
    v1::RegisterMrRequest* item = batch.add_items();
    *item = client::ToRequest("", PageOf(node.buffer->id(), i));
    item->clear_session();
    item->set_publish_name(absl::StrCat("doomed-", i));
  }
  auto made = node.client->RegisterMrBatch(batch);
  if (!made.ok()) {
    std::fprintf(stderr, "RegisterMrBatch: %s\n",
                 made.status().ToString().c_str());
    return -1;
  }
  for (const auto& item : made->items()) {
    if (item.status().code() != 0) {
      std::fprintf(stderr, "item: %s\n", item.status().message().c_str());
      return -1;
    }
  }
  if (!counter.WaitPuts(absl::Seconds(60)).has_value()) {
    std::fprintf(stderr, "only %zu of %lu entries reached etcd\n",
                 counter.puts(), static_cast<unsigned long>(entries));
    return -1;
  }
  const pid_t pid = node.mrd->pid();
  const Clock::time_point killed = Clock::now();
  if (::kill(pid, SIGKILL) != 0) return -1;
  const std::optional<Clock::time_point> gone =
      counter.WaitDeletes(ttl + absl::Seconds(30));
  node.mrd->WaitExited(absl::Seconds(10));
  if (!gone.has_value()) {
    std::fprintf(stderr, "only %zu of %lu entries left etcd\n",
                 counter.deletes(), static_cast<unsigned long>(entries));
    return -1;
  }
  // mrd is gone: the buffer, session and client let go without it.
  node.buffer.reset();
  node.session.reset();
  node.client.reset();
  node.mrd.reset();
  watch->reset();
  return Between(killed, *gone);
}

// ---- Part 3 ----------------------------------------------------------------

struct BulkRound {
  double register_s = 0;
  double on_etcd_s = 0;  // published only: first call to the last put seen
  double deregister_s = 0;
  double gone_s = 0;  // published only: first deregister to last delete seen
};

// `count` registrations in batches of `batch`, published as bulk-<round>-i
// when `publish`, then deregistered in batches of `batch`.
bool Bulk(const Node& node, Counter* counter, uint64_t count, uint64_t batch,
          bool publish, uint64_t round, BulkRound* out) {
  counter->Reset(publish ? count : 0, publish ? count : 0);
  std::vector<uint64_t> ids;
  ids.reserve(count);
  const Clock::time_point start = Clock::now();
  for (uint64_t first = 0; first < count; first += batch) {
    v1::RegisterMrBatchRequest req;
    req.set_session(node.session->token());
    for (uint64_t i = first; i < std::min(count, first + batch); ++i) {
      v1::RegisterMrRequest* item = req.add_items();
      *item = client::ToRequest("", PageOf(node.buffer->id(), i));
      item->clear_session();
      if (publish) item->set_publish_name(absl::StrCat("bulk-", round, "-", i));
    }
    auto made = node.client->RegisterMrBatch(req);
    if (!made.ok()) {
      std::fprintf(stderr, "RegisterMrBatch: %s\n",
                   made.status().ToString().c_str());
      return false;
    }
    for (const auto& item : made->items()) {
      if (item.status().code() != 0) {
        std::fprintf(stderr, "item: %s\n", item.status().message().c_str());
        return false;
      }
      ids.push_back(item.registration().registration());
    }
  }
  out->register_s = Seconds(start);
  if (publish) {
    const std::optional<Clock::time_point> all =
        counter->WaitPuts(absl::Seconds(600));
    if (!all.has_value()) {
      std::fprintf(stderr, "only %zu of %lu entries reached etcd\n",
                   counter->puts(), static_cast<unsigned long>(count));
      return false;
    }
    out->on_etcd_s = Between(start, *all);
  }
  const Clock::time_point dereg = Clock::now();
  for (uint64_t first = 0; first < count; first += batch) {
    v1::DeregisterMrBatchRequest req;
    req.set_session(node.session->token());
    for (uint64_t i = first; i < std::min(count, first + batch); ++i) {
      req.add_items()->set_registration(ids[i]);
    }
    auto left = node.client->DeregisterMrBatch(req);
    if (!left.ok()) {
      std::fprintf(stderr, "DeregisterMrBatch: %s\n",
                   left.status().ToString().c_str());
      return false;
    }
    for (const auto& item : left->items()) {
      if (item.status().code() != 0 || item.references() != 0) {
        std::fprintf(stderr, "deregister item: %s\n",
                     item.status().message().c_str());
        return false;
      }
    }
  }
  out->deregister_s = Seconds(dereg);
  if (publish) {
    const std::optional<Clock::time_point> all =
        counter->WaitDeletes(absl::Seconds(600));
    if (!all.has_value()) {
      std::fprintf(stderr, "only %zu of %lu entries left etcd\n",
                   counter->deletes(), static_cast<unsigned long>(count));
      return false;
    }
    out->gone_s = Between(dereg, *all);
  }
  return true;
}

void LatencyRow(const char* call, const std::vector<double>& plain,
                const std::vector<double>& published) {
  const double p50 = Percentile(plain, 0.5), p99 = Percentile(plain, 0.99);
  const double q50 = Percentile(published, 0.5);
  const double q99 = Percentile(published, 0.99);
  std::printf("%-24s %10.1f %10.1f %12.1f %12.1f %7.2f %7.2f\n", call, p50, p99,
              q50, q99, q50 / p50, q99 / p99);
}

int Main(int argc, char** argv) {
  const uint64_t samples = Flag(argc, argv, "--samples", 3000, 1);
  const uint64_t block = Flag(argc, argv, "--block", 100, 1);
  const uint64_t warmup = Flag(argc, argv, "--warmup", 200);
  const uint64_t kill_entries = Flag(argc, argv, "--kill_entries", 100, 1);
  const uint64_t kill_repeats = Flag(argc, argv, "--kill_repeats", 3, 1);
  const uint64_t count = Flag(argc, argv, "--count", 10000, 1);
  const uint64_t batch = Flag(argc, argv, "--batch", 500, 1);
  const uint64_t rounds = Flag(argc, argv, "--rounds", 1, 1);
  // A pause before every sample of part 1, both cases alike, so that etcd
  // and mrd's publisher are idle when the RegisterMr starts.
  const absl::Duration settle =
      absl::Microseconds(Flag(argc, argv, "--settle_us", 0));
  // A pause between each RegisterMr and its DeregisterMr in part 1, both
  // cases alike: longer than mrd's write delay (1 ms), the entry is written
  // to etcd before it is deleted, as a name that lives is.
  const absl::Duration hold =
      absl::Microseconds(Flag(argc, argv, "--hold_us", 0));
  // Which parts run: any of "1", "2", "3".
  const std::string parts = StringFlag(argc, argv, "--parts", "123");
  // --etcd_down=1: a diagnostic of part 1 only: every etcd member is killed
  // once mrd is up, so that the publisher queues its writes and retries
  // (backing off) and no etcd process runs meanwhile; what part 1 then
  // shows is mrd's own synchronous cost of publish_name.
  const bool etcd_down = Flag(argc, argv, "--etcd_down", 0) != 0;
  // --etcd_cpu=N (N >= 1): the etcd members run on CPU N only, this
  // benchmark and the mrd it starts on every other CPU, as if etcd ran on
  // other machines (as it does in a cluster): part 1 then shows what
  // publishing costs mrd itself, not etcd's use of the same cores.
  const uint64_t etcd_cpu = Flag(argc, argv, "--etcd_cpu", 0);
  // --etcd_idle=1: every thread of the etcd members runs under SCHED_IDLE:
  // etcd gets a core only when mrd and this benchmark leave one idle, as if
  // it ran on other machines, while mrd keeps both cores; part 1 then shows
  // what publishing costs mrd itself (its own etcd client included).
  const bool etcd_idle = Flag(argc, argv, "--etcd_idle", 0) != 0;

  auto etcd = testing::EtcdCluster::Start(3);
  if (!etcd.ok()) {
    std::fprintf(stderr, "etcd: %s\n", etcd.status().ToString().c_str());
    return 1;
  }
  if (etcd_cpu > 0) {
    cpu_set_t etcd_set;
    cpu_set_t rest;
    CPU_ZERO(&etcd_set);
    CPU_ZERO(&rest);
    if (sched_getaffinity(0, sizeof(rest), &rest) != 0 ||
        !CPU_ISSET(etcd_cpu, &rest) || CPU_COUNT(&rest) < 2) {
      std::fprintf(stderr, "--etcd_cpu=%lu: not one of 2+ CPUs of ours\n",
                   static_cast<unsigned long>(etcd_cpu));
      return 1;
    }
    CPU_SET(etcd_cpu, &etcd_set);
    CPU_CLR(etcd_cpu, &rest);
    for (int m = 0; m < (*etcd)->size(); ++m) {
      if (sched_setaffinity((*etcd)->pid(m), sizeof(etcd_set), &etcd_set) !=
          0) {
        std::perror("sched_setaffinity (etcd)");
        return 1;
      }
    }
    if (sched_setaffinity(0, sizeof(rest), &rest) != 0) {
      std::perror("sched_setaffinity");
      return 1;
    }
  }
  if (etcd_idle) {
    // Threads that etcd starts later inherit the policy from these.
    for (int m = 0; m < (*etcd)->size(); ++m) {
      std::error_code error;
      for (const auto& task : std::filesystem::directory_iterator(
               absl::StrCat("/proc/", (*etcd)->pid(m), "/task"), error)) {
        const sched_param param{};
        int tid = 0;
        if (!absl::SimpleAtoi(task.path().filename().string(), &tid) ||
            sched_setscheduler(tid, SCHED_IDLE, &param) != 0) {
          std::perror("sched_setscheduler (etcd, SCHED_IDLE)");
          return 1;
        }
      }
    }
  }
  directory::EtcdClientOptions options;
  options.endpoints = (*etcd)->endpoints();
  auto client = directory::EtcdClient::Create(options);
  if (!client.ok()) {
    std::fprintf(stderr, "etcd client: %s\n",
                 client.status().ToString().c_str());
    return 1;
  }
  std::printf("etcd: 3 members on loopback; mrd: software device\n\n");

  // Parts 1 and 3 on one mrd, lease TTL as mrd's default (10 s).
  const std::string cluster = "bench";
  Node node;
  if (!StartNode(**etcd, cluster, absl::Seconds(10),
                 std::max<uint64_t>(count, 4096), &node)) {
    return 1;
  }

  if (etcd_down) {
    for (int m = 0; m < (*etcd)->size(); ++m) (*etcd)->Kill(m);
  }
  LatencyCase plain, published;
  if (absl::StrContains(parts, "1") &&
      !Latency(node, samples, block, warmup, settle, hold, &plain,
               &published)) {
    return 1;
  }
  if (absl::StrContains(parts, "1")) {
    std::printf(
        "1. RegisterMr + DeregisterMr, 4 KiB, a miss each, %lu samples per "
        "case in alternating blocks of %lu\n",
        static_cast<unsigned long>(samples), static_cast<unsigned long>(block));
    std::printf("%-24s %10s %10s %12s %12s %7s %7s\n", "call", "plain p50",
                "plain p99", "publish p50", "publish p99", "p50 ×", "p99 ×");
    LatencyRow("RegisterMr (us)", plain.reg_us, published.reg_us);
    LatencyRow("DeregisterMr (us)", plain.dereg_us, published.dereg_us);
    LatencyRow("pair (us)", plain.pair_us, published.pair_us);
    std::printf("\n");
    std::fflush(stdout);
  }

  if (etcd_down) return 0;  // mrd is killed, not stopped: etcd is gone
  // Started after part 1: its events would cost this process CPU while
  // part 1 times calls.
  Counter bulk_counter("/names/bulk-");
  auto bulk_watch =
      (*client)->Watch(Prefix(cluster), 0, bulk_counter.Callback());
  if (!bulk_watch.ok()) return 1;
  if (absl::StrContains(parts, "3")) {
    std::vector<BulkRound> bulk_plain, bulk_published;
    for (uint64_t r = 0; r < rounds; ++r) {
      for (int publish = 0; publish < 2; ++publish) {
        BulkRound round;
        if (!Bulk(node, &bulk_counter, count, batch, publish == 1, r, &round)) {
          return 1;
        }
        (publish == 1 ? bulk_published : bulk_plain).push_back(round);
      }
    }
    auto median = [](const std::vector<BulkRound>& v,
                     double BulkRound::*field) {
      std::vector<double> x;
      for (const BulkRound& b : v) x.push_back(b.*field);
      return Median(x);
    };
    const double reg_plain = median(bulk_plain, &BulkRound::register_s);
    const double reg_pub = median(bulk_published, &BulkRound::register_s);
    const double dereg_plain = median(bulk_plain, &BulkRound::deregister_s);
    const double dereg_pub = median(bulk_published, &BulkRound::deregister_s);
    std::printf(
        "3. %lu registrations in RegisterMrBatch of %lu (median of %lu "
        "rounds)\n",
        static_cast<unsigned long>(count), static_cast<unsigned long>(batch),
        static_cast<unsigned long>(rounds));
    std::printf("%-44s %10s %10s %8s\n", "", "plain s", "publish s", "ratio");
    std::printf("%-44s %10.3f %10.3f %8.2f\n", "RegisterMrBatch calls",
                reg_plain, reg_pub, reg_pub / reg_plain);
    std::printf("%-44s %10s %10.3f %8s\n", "first call to all entries on etcd",
                "", median(bulk_published, &BulkRound::on_etcd_s), "");
    std::printf("%-44s %10.3f %10.3f %8.2f\n", "DeregisterMrBatch calls",
                dereg_plain, dereg_pub, dereg_pub / dereg_plain);
    std::printf("%-44s %10s %10.3f %8s\n",
                "first deregister to all entries gone", "",
                median(bulk_published, &BulkRound::gone_s), "");
    std::printf("\n");
    std::fflush(stdout);
  }
  bulk_watch->reset();
  node.buffer.reset();
  node.session.reset();
  node.client.reset();
  if (absl::Status s = node.mrd->Stop(); !s.ok()) {
    std::fprintf(stderr, "mrd stop: %s\n", s.ToString().c_str());
    return 1;
  }
  node = Node();
  if (!absl::StrContains(parts, "2")) return 0;

  std::printf(
      "2. SIGKILL of mrd to the last of its %lu entries gone from etcd "
      "(watch)\n",
      static_cast<unsigned long>(kill_entries));
  std::printf("%-10s %-30s %8s %8s %10s\n", "lease TTL", "seconds per run",
              "max s", "max-TTL", "goal ≤1s");
  for (int ttl_s : {2, 5}) {
    std::vector<double> took;
    for (uint64_t rep = 0; rep < kill_repeats; ++rep) {
      const double t =
          KillOnce(**etcd, client->get(), absl::Seconds(ttl_s), kill_entries,
                   absl::StrCat("kill-", ttl_s, "-", rep));
      if (t < 0) return 1;
      took.push_back(t);
    }
    std::string list;
    for (double t : took) {
      absl::StrAppend(&list, list.empty() ? "" : ", ",
                      absl::StrFormat("%.2f", t));
    }
    const double worst = *std::max_element(took.begin(), took.end());
    std::printf("%-10s %-30s %8.2f %8.2f %10s\n",
                absl::StrCat(ttl_s, " s").c_str(), list.c_str(), worst,
                worst - ttl_s, worst <= ttl_s + 1.0 ? "met" : "missed");
  }
  return 0;
}

}  // namespace
}  // namespace mrd::bench

int main(int argc, char** argv) { return mrd::bench::Main(argc, argv); }
