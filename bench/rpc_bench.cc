// mrd's RPC path against floors measured in the same run, through the real
// mrd over its real sockets (C++ client, gRPC over the Unix socket, a memfd
// passed with SCM_RIGHTS):
//
// 1. Calls answered on the gRPC thread ("inline") against the same call to
//    the floor (bench/floor_server.h: a minimal callback-API gRPC server on
//    a Unix socket that answers at once with a reply of the same shape),
//    each on its own channel, one call after the other: GetDeviceInfo,
//    GetSession, a RegisterMr that hits the cache and a DeregisterMr that
//    leaves a reference (the range is held once throughout). Each sample
//    times the four calls on mrd and then on the floor, so that both see
//    the same machine; p50 and p99 of `--pairs` samples, and the ratio
//    mrd ÷ floor (issue 25's goal: at most 1.1, p50 and p99).
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
//                         [--profile_batches=B] [--batch_then_singles=B]
//
// --profile_batches=B times only batches of B (a load to profile mrd
// under); --batch_then_singles=B registers in batches of B and times the
// single DeregisterMr calls that give them back (a batch's adjacent pages
// are pinned together: each such call releases a page of a shared pin).
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
#include "bench/floor_server.h"
#include "client/lib/mrd_client.h"
#include "tests/integration/mrd_process.h"

namespace mrd::bench {
namespace {

// Registers pages 0..count-1 of `buffer` in RegisterMrBatch calls of
// `batch`, then deregisters them one DeregisterMr each; the seconds of the
// deregistrations, or < 0 on failure.
double BatchThenSingles(const client::Session& session, uint64_t buffer,
                        uint64_t count, uint64_t batch) {
  std::vector<client::Registration> regs;
  regs.reserve(count);
  for (uint64_t first = 0; first < count; first += batch) {
    std::vector<client::RegisterOptions> options;
    for (uint64_t i = first; i < std::min(count, first + batch); ++i) {
      options.push_back(PageOf(buffer, i));
    }
    if (!RegisterBatchInto(session, options, &regs)) return -1;
  }
  const Clock::time_point start = Clock::now();
  for (client::Registration& r : regs) {
    auto left = r.Deregister();
    if (!left.ok() || *left != 0) return -1;
  }
  return Seconds(start);
}

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

// The four inline calls' samples, in µs, on one server (mrd or a floor).
struct Server {
  const char* name;
  const client::Client* client;
  bool is_mrd;
  std::vector<double> us[4];
};
constexpr const char* kInlineCalls[4] = {"GetDeviceInfo", "GetSession",
                                         "RegisterMr, a cache hit",
                                         "DeregisterMr, not the last"};

// Times `call` once; false if it failed.
template <typename F>
bool Time(std::vector<double>* us, F call) {
  const Clock::time_point start = Clock::now();
  if (!call()) return false;
  us->push_back(Seconds(start) * 1e6);
  return true;
}

// One round of the four inline calls on `server`; false on a failure.
bool InlineRound(const client::Session& session,
                 const v1::RegisterMrRequest& reg, Server* server) {
  const client::Client& c = *server->client;
  v1::GetSessionRequest get_session;
  get_session.set_session(session.token());
  uint64_t id = 0;
  return Time(&server->us[0], [&] { return c.GetDeviceInfo().ok(); }) &&
         Time(&server->us[1], [&] { return c.GetSession(get_session).ok(); }) &&
         Time(&server->us[2],
              [&] {
                auto r = c.RegisterMr(reg);
                if (!r.ok() || (server->is_mrd && !r->cache_hit())) {
                  return false;
                }
                id = r->registration();
                return true;
              }) &&
         Time(&server->us[3], [&] {
           v1::DeregisterMrRequest d;
           d.set_session(session.token());
           d.set_registration(id);
           auto r = c.DeregisterMr(d);
           return r.ok() && (!server->is_mrd || r->references() == 1);
         });
}

// Case 1: `samples` rounds of the four inline calls on each server in
// turn (mrd first); false on any failure.
bool InlineCalls(const client::Session& session,
                 const client::RegisterOptions& range, uint64_t samples,
                 std::vector<Server>* servers) {
  auto held = client::Registration::Register(session, range);
  if (!held.ok()) return false;
  const v1::RegisterMrRequest reg = client::ToRequest(session.token(), range);
  for (uint64_t i = 0; i < samples; ++i) {
    for (Server& server : *servers) {
      if (!InlineRound(session, reg, &server)) return false;
    }
  }
  return true;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Main(int argc, char** argv) {
  if (int code = 0; RunFloorChildIfAsked(argc, argv, &code)) return code;
  const uint64_t count = Flag(argc, argv, "--count", 10000);
  const uint64_t rounds = Flag(argc, argv, "--rounds", 3, 1);
  const uint64_t pairs = Flag(argc, argv, "--pairs", 5000, 1);
  // --profile_batches=B: only batches of B, `--rounds` times, nothing
  // printed but the rate (a load to profile mrd under).
  const uint64_t profile_batch = Flag(argc, argv, "--profile_batches", 0);
  const uint64_t then_singles = Flag(argc, argv, "--batch_then_singles", 0);
  Fixture f;
  if (!Start(count, &f)) return 1;
  // The seconds of `rounds` runs of `run` in all; < 0 if one failed.
  auto total = [rounds](auto run) {
    double seconds = 0;
    for (uint64_t r = 0; r < rounds; ++r) {
      const double t = run();
      if (t < 0) return t;
      seconds += t;
    }
    return seconds;
  };
  if (then_singles != 0) {
    const double seconds = total([&] {
      return BatchThenSingles(*f.session, f.buffer->id(), count, then_singles);
    });
    if (seconds < 0) return 1;
    std::printf("single DeregisterMr after batches of %lu: %.1f us each\n",
                static_cast<unsigned long>(then_singles),
                seconds / static_cast<double>(count * rounds) * 1e6);
    return 0;
  }
  if (profile_batch != 0) {
    const double seconds = total([&] {
      return Batches(*f.session, f.buffer->id(), count, profile_batch);
    });
    if (seconds < 0) return 1;
    std::printf("batches of %lu: %.0f registrations/s\n",
                static_cast<unsigned long>(profile_batch),
                static_cast<double>(count * rounds) / seconds);
    return 0;
  }
  // The floor twice: in this process, beside its client, and in a process
  // of its own, as mrd is.
  auto beside = Floor::Start(/*hop=*/false, FloorPlace::kInProcess);
  auto apart = Floor::Start(/*hop=*/false, FloorPlace::kOwnProcess);
  if (!beside.ok() || !apart.ok()) {
    std::fprintf(stderr, "floor: %s %s\n", beside.status().ToString().c_str(),
                 apart.status().ToString().c_str());
    return 1;
  }
  std::vector<Server> servers = {
      {"mrd", &f.session->client(), true, {}},
      {"floor, own process", &(*apart)->client(), false, {}},
      {"floor, in the client's process", &(*beside)->client(), false, {}}};
  if (!InlineCalls(*f.session, PageOf(f.buffer->id(), 0), pairs, &servers)) {
    std::fprintf(stderr, "inline calls failed\n");
    return 1;
  }
  std::printf("%-28s %-31s %8s %8s %7s %7s\n", "inline call", "server",
              "p50 us", "p99 us", "p50 ×", "p99 ×");
  for (int c = 0; c < 4; ++c) {
    const double m50 = Percentile(servers[0].us[c], 0.5);
    const double m99 = Percentile(servers[0].us[c], 0.99);
    for (const Server& server : servers) {
      const double p50 = Percentile(server.us[c], 0.5);
      const double p99 = Percentile(server.us[c], 0.99);
      if (server.is_mrd) {
        std::printf("%-28s %-31s %8.1f %8.1f %7s %7s\n", kInlineCalls[c],
                    server.name, p50, p99, "", "");
      } else {
        std::printf("%-28s %-31s %8.1f %8.1f %7.3f %7.3f\n", "",
                    ("  mrd ÷ " + std::string(server.name)).c_str(), p50, p99,
                    m50 / p50, m99 / p99);
      }
    }
  }
  std::printf("\n");
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
