// mrd's RPC path against floors measured in the same run, through the real
// mrd over its real sockets (C++ client, gRPC over the Unix socket, a memfd
// passed with SCM_RIGHTS):
//
// 1. Cache hits: a RegisterMr that hits the cache plus the DeregisterMr that
//    gives its reference back (another reference stays), against two
//    GetDeviceInfo calls, mrd's cheapest RPC, on the same channel; p50 and
//    p99 of `--pairs` pairs (issue 9's goal: at most 1.1x).
//
// 2. Batch calls against single calls: N registrations of 4 KiB each
//    (distinct ranges of one memfd), registered and then deregistered
//   - one RegisterMr / DeregisterMr per range (the floor the batches are
//     measured against), and
//   - RegisterMrBatch / DeregisterMrBatch of B ranges per call, for several
//     batch sizes B.
// Each case runs `--rounds` times (default 3) and the median is reported;
// the ratio is batched time / single time of the same run (issue 9's goal:
// 10,000 registrations in batches at most 0.05x the single calls).
//
//   build/bench/rpc_bench [--pairs=5000] [--count=10000] [--rounds=3]
//
// Prints one table row per case and exits non-zero if anything failed.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "client/lib/mrd_client.h"
#include "tests/integration/mrd_process.h"

namespace mrd::bench {
namespace {

struct Fixture {
  std::unique_ptr<testing::MrdProcess> mrd;
  std::unique_ptr<client::Client> client;
  std::unique_ptr<client::Session> session;
  std::unique_ptr<client::Buffer> buffer;
};

bool Start(uint64_t count, Fixture* f) {
  f->mrd = StartMrd(GenerousFlags(2 * count * kPage, 2 * count));
  if (f->mrd == nullptr) return false;
  auto c = ConnectTo(*f->mrd);
  if (!c.ok()) return false;
  f->client = std::make_unique<client::Client>(std::move(*c));
  auto s = client::Session::OpenFd(*f->client);
  if (!s.ok()) return false;
  f->session = std::make_unique<client::Session>(std::move(*s));
  auto b = client::Buffer::Create(*f->session, count * kPage, "batch-bench");
  if (!b.ok()) return false;
  f->buffer = std::make_unique<client::Buffer>(std::move(*b));
  TouchPages(*f->buffer);
  return true;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Main(int argc, char** argv) {
  const uint64_t count = Flag(argc, argv, "--count", 10000);
  const uint64_t rounds = Flag(argc, argv, "--rounds", 3, 1);
  const uint64_t pairs = Flag(argc, argv, "--pairs", 5000, 1);
  Fixture f;
  if (!Start(count, &f)) return 1;
  std::vector<double> hit_us;
  std::vector<double> empty_us;
  if (!HitPairs(*f.session, PageOf(f.buffer->id(), 0), pairs, &hit_us,
                &empty_us)) {
    std::fprintf(stderr, "hit pairs failed\n");
    return 1;
  }
  std::printf("%-40s %10s %10s\n", "case (same channel, same run)", "p50 us",
              "p99 us");
  const double e50 = Percentile(empty_us, 0.5);
  const double e99 = Percentile(empty_us, 0.99);
  const double h50 = Percentile(hit_us, 0.5);
  const double h99 = Percentile(hit_us, 0.99);
  std::printf("%-40s %10.1f %10.1f\n", "two GetDeviceInfo (floor)", e50, e99);
  std::printf("%-40s %10.1f %10.1f\n", "cache-hit RegisterMr + DeregisterMr",
              h50, h99);
  std::printf("%-40s %10.3f %10.3f\n\n", "ratio", h50 / e50, h99 / e99);
  std::vector<double> single;
  for (uint64_t r = 0; r < rounds; ++r)
    single.push_back(Singles(*f.session, f.buffer->id(), count));
  if (*std::min_element(single.begin(), single.end()) < 0) return 1;
  const double floor = Median(single);
  std::printf("%-34s %10s %12s %8s\n", "case (4 KiB each, register+deregister)",
              "seconds", "per item us", "ratio");
  std::printf("%-34s %10.3f %12.1f %8.3f\n",
              (std::to_string(count) + " single calls (floor)").c_str(), floor,
              floor / count * 1e6, 1.0);
  for (uint64_t batch : {16, 256, 1024, 4096}) {
    std::vector<double> times;
    for (uint64_t r = 0; r < rounds; ++r) {
      times.push_back(Batches(*f.session, f.buffer->id(), count, batch));
    }
    if (*std::min_element(times.begin(), times.end()) < 0) return 1;
    const double t = Median(times);
    std::printf("%-34s %10.3f %12.1f %8.3f\n",
                ("batches of " + std::to_string(batch)).c_str(), t,
                t / count * 1e6, t / floor);
  }
  return 0;
}

}  // namespace
}  // namespace mrd::bench

int main(int argc, char** argv) { return mrd::bench::Main(argc, argv); }
