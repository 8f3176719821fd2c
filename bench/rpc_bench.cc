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
  testing::MrdProcessOptions options;
  const std::string bytes = std::to_string(2 * count * kPage);
  options.extra_flags = {
      "--max_session_pinned_bytes=" + bytes,
      "--max_total_pinned_bytes=" + bytes,
      "--max_session_registrations=" + std::to_string(2 * count),
      "--warm_pin_bytes_total=0",
      "--tenant_default_percent=100",
  };
  auto p = testing::MrdProcess::Start(options);
  if (!p.ok()) {
    std::fprintf(stderr, "mrd: %s\n", p.status().ToString().c_str());
    return false;
  }
  f->mrd = std::move(*p);
  client::ClientOptions client_options;
  client_options.socket_path = f->mrd->grpc_socket();
  client_options.fd_socket_path = f->mrd->fd_socket();
  auto c = client::Client::Connect(client_options);
  if (!c.ok()) return false;
  f->client = std::make_unique<client::Client>(std::move(*c));
  auto s = client::Session::OpenFd(*f->client);
  if (!s.ok()) return false;
  f->session = std::make_unique<client::Session>(std::move(*s));
  auto b = client::Buffer::Create(*f->session, count * kPage, "batch-bench");
  if (!b.ok()) return false;
  f->buffer = std::make_unique<client::Buffer>(std::move(*b));
  for (uint64_t i = 0; i < count * kPage; i += kPage) {
    static_cast<char*>(f->buffer->data())[i] = 1;
  }
  return true;
}

client::RegisterOptions Range(const Fixture& f, uint64_t i) {
  return PageOf(f.buffer->id(), i);
}

// Register and deregister `count` ranges one call each; seconds, or < 0.
double Singles(const Fixture& f, uint64_t count) {
  std::vector<client::Registration> regs;
  regs.reserve(count);
  const Clock::time_point start = Clock::now();
  for (uint64_t i = 0; i < count; ++i) {
    auto r = client::Registration::Register(*f.session, Range(f, i));
    if (!r.ok()) {
      std::fprintf(stderr, "RegisterMr: %s\n", r.status().ToString().c_str());
      return -1;
    }
    regs.push_back(*std::move(r));
  }
  for (client::Registration& r : regs) {
    auto left = r.Deregister();
    if (!left.ok() || *left != 0) return -1;
  }
  return Seconds(start);
}

// The same in batches of `batch` ranges.
double Batches(const Fixture& f, uint64_t count, uint64_t batch) {
  std::vector<client::Registration> regs;
  regs.reserve(count);
  const Clock::time_point start = Clock::now();
  for (uint64_t first = 0; first < count; first += batch) {
    std::vector<client::RegisterOptions> options;
    for (uint64_t i = first; i < std::min(count, first + batch); ++i) {
      options.push_back(Range(f, i));
    }
    auto results = client::Registration::RegisterBatch(*f.session, options);
    if (!results.ok()) {
      std::fprintf(stderr, "RegisterMrBatch: %s\n",
                   results.status().ToString().c_str());
      return -1;
    }
    for (auto& r : *results) {
      if (!r.ok()) {
        std::fprintf(stderr, "item: %s\n", r.status().ToString().c_str());
        return -1;
      }
      regs.push_back(*std::move(r));
    }
  }
  for (uint64_t first = 0; first < count; first += batch) {
    std::vector<client::Registration> chunk;
    for (uint64_t i = first; i < std::min(count, first + batch); ++i) {
      chunk.push_back(std::move(regs[i]));
    }
    auto left = client::Registration::DeregisterBatch(chunk);
    if (!left.ok()) return -1;
    for (const auto& l : *left) {
      if (!l.ok() || *l != 0) return -1;
    }
  }
  return Seconds(start);
}

// Section 1: microseconds of each hit pair and of each pair of empty calls,
// interleaved so that both see the same machine; false on any failure.
bool HitPairs(const Fixture& f, uint64_t pairs, std::vector<double>* hit_us,
              std::vector<double>* empty_us) {
  auto held = client::Registration::Register(*f.session, Range(f, 0));
  if (!held.ok()) return false;
  for (uint64_t i = 0; i < pairs; ++i) {
    Clock::time_point start = Clock::now();
    if (!f.client->GetDeviceInfo().ok() || !f.client->GetDeviceInfo().ok()) {
      return false;
    }
    empty_us->push_back(Seconds(start) * 1e6);
    start = Clock::now();
    auto hit = client::Registration::Register(*f.session, Range(f, 0));
    if (!hit.ok() || !hit->cache_hit()) return false;
    auto left = hit->Deregister();
    if (!left.ok() || *left != 1) return false;
    hit_us->push_back(Seconds(start) * 1e6);
  }
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
  if (!HitPairs(f, pairs, &hit_us, &empty_us)) {
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
  for (uint64_t r = 0; r < rounds; ++r) single.push_back(Singles(f, count));
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
      times.push_back(Batches(f, count, batch));
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
