// A million live registrations in one mrd (issue 9, part 2), through the real
// mrd over its real sockets:
//
// - `--sessions` fd sessions (default 16), each with one memfd of
//   registrations/sessions + `--spare` 4 KiB pages, every page written once;
// - the sessions fill up to `--registrations` (default 1,000,000) distinct
//   live 4 KiB registrations with RegisterMrBatch (4,096 per call, the
//   sessions in turn), each registration's client handle given up (Detach),
//   so that only mrd holds them;
// - at 10,000 live and at the end, `--samples` single RegisterMr calls of a
//   spare page (each deregistered right after): p50 and p99 of the
//   RegisterMr, and the ratio of p50 at the end to p50 at 10,000 (goal: at
//   most 1.2);
// - mrd's anonymous memory (RssAnon of /proc/<pid>/status) before the first
//   registration, at every step, and after every session closed: bytes per
//   live registration (goal: at most 256) and what closing gave back.
//
//   build/bench/scale_bench [--registrations=1000000] [--sessions=16]
//                           [--samples=2000] [--spare=4096]
//
// Prints the table and exits non-zero if anything failed.

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "client/lib/mrd_client.h"
#include "tests/integration/mrd_process.h"
#include "tests/support/kernel_pins.h"

namespace mrd::bench {
namespace {

constexpr uint64_t kBatch = 4096;

uint64_t RssAnon(pid_t pid) {
  return test_support::ProcStatusBytes("RssAnon", std::to_string(pid));
}
// What mrd has pinned (mlock and io_uring's pins).
uint64_t Pinned(pid_t pid) {
  return test_support::KernelPinnedBytes(std::to_string(pid));
}

struct Tenant {
  std::unique_ptr<client::Session> session;
  std::unique_ptr<client::Buffer> buffer;
  uint64_t next_page = 0;  // the next page to register for good
  uint64_t pages = 0;      // pages for good; spare ones follow
};

client::RegisterOptions Page(const Tenant& t, uint64_t page) {
  return PageOf(t.buffer->id(), page);
}

// `samples` single RegisterMr calls of spare pages (deregistered at once);
// microseconds of each RegisterMr, or empty on failure.
std::vector<double> Sample(std::vector<Tenant>& tenants, uint64_t samples,
                           uint64_t spare) {
  std::vector<double> us;
  for (uint64_t i = 0; i < samples; ++i) {
    Tenant& t = tenants[i % tenants.size()];
    const uint64_t page = t.pages + (i / tenants.size()) % spare;
    const Clock::time_point start = Clock::now();
    auto r = client::Registration::Register(*t.session, Page(t, page));
    const double elapsed = Seconds(start) * 1e6;
    if (!r.ok()) {
      std::fprintf(stderr, "RegisterMr: %s\n", r.status().ToString().c_str());
      return {};
    }
    auto left = r->Deregister();
    if (!left.ok() || *left != 0) {
      std::fprintf(stderr, "DeregisterMr failed\n");
      return {};
    }
    us.push_back(elapsed);
  }
  return us;
}

// Registers `count` more pages for good, the tenants in turn, in batches;
// false on failure.
bool Fill(std::vector<Tenant>& tenants, uint64_t count, size_t* turn) {
  while (count > 0) {
    Tenant& t = tenants[(*turn)++ % tenants.size()];
    const uint64_t n = std::min({count, kBatch, t.pages - t.next_page});
    if (n == 0) continue;
    std::vector<client::RegisterOptions> options;
    options.reserve(n);
    for (uint64_t i = 0; i < n; ++i)
      options.push_back(Page(t, t.next_page + i));
    std::vector<client::Registration> regs;
    if (!RegisterBatchInto(*t.session, options, &regs)) return false;
    for (client::Registration& r : regs) {
      r.Detach();  // mrd keeps it; the client forgets it
    }
    t.next_page += n;
    count -= n;
  }
  return true;
}

int Main(int argc, char** argv) {
  const uint64_t total = Flag(argc, argv, "--registrations", 1000000);
  const uint64_t sessions = Flag(argc, argv, "--sessions", 16, 1);
  const uint64_t samples = Flag(argc, argv, "--samples", 2000, 1);
  const uint64_t spare = Flag(argc, argv, "--spare", 4096, 1);
  const uint64_t per_session = (total + sessions - 1) / sessions;
  const uint64_t first_sample = std::min<uint64_t>(10000, total);

  std::vector<std::string> flags = GenerousFlags(
      (per_session + spare) * sessions * kPage * 2, per_session + spare);
  flags.push_back("--max_batch_items=" + std::to_string(kBatch));
  std::unique_ptr<testing::MrdProcess> mrd = StartMrd(std::move(flags));
  if (mrd == nullptr) return 1;
  auto client = ConnectTo(*mrd);
  if (!client.ok()) return 1;
  std::vector<Tenant> tenants(sessions);
  for (Tenant& t : tenants) {
    auto s = client::Session::OpenFd(*client);
    if (!s.ok()) {
      std::fprintf(stderr, "OpenFd: %s\n", s.status().ToString().c_str());
      return 1;
    }
    t.session = std::make_unique<client::Session>(*std::move(s));
    t.pages = per_session;
    auto b = client::Buffer::Create(*t.session, (per_session + spare) * kPage,
                                    "scale-bench");
    if (!b.ok()) {
      std::fprintf(stderr, "buffer: %s\n", b.status().ToString().c_str());
      return 1;
    }
    t.buffer = std::make_unique<client::Buffer>(*std::move(b));
    TouchPages(*t.buffer);
  }
  const pid_t pid = mrd->pid();
  // Warm the paths (and the sample pages' first touch) before the baseline.
  if (Sample(tenants, std::min<uint64_t>(samples, 256), spare).empty()) {
    return 1;
  }
  const uint64_t base = RssAnon(pid);
  std::printf("%-28s %10s %12s %14s %10s\n", "live registrations", "fill s",
              "RssAnon MiB", "B/registration", "p50 us");
  std::printf("%-28s %10s %12.1f %14s %10s\n", "0 (baseline)", "",
              base / 1048576.0, "", "");
  size_t turn = 0;
  uint64_t live = 0;
  double p50_first = 0;
  double p50_last = 0;
  double p99_first = 0;
  double p99_last = 0;
  std::vector<uint64_t> steps = {first_sample};
  for (uint64_t s = 100000; s < total; s += 100000) steps.push_back(s);
  steps.push_back(total);
  for (uint64_t step : steps) {
    if (step <= live && live != 0) continue;
    const Clock::time_point start = Clock::now();
    if (!Fill(tenants, step - live, &turn)) return 1;
    const double fill = Seconds(start);
    live = step;
    const uint64_t rss = RssAnon(pid);
    std::string p50_text;
    if (step == first_sample || step == total) {
      std::vector<double> us = Sample(tenants, samples, spare);
      if (us.empty()) return 1;
      const double p50 = Percentile(us, 0.5);
      const double p99 = Percentile(us, 0.99);
      if (step == first_sample) {
        p50_first = p50;
        p99_first = p99;
      }
      p50_last = p50;
      p99_last = p99;
      p50_text = std::to_string(static_cast<int>(p50));
    }
    std::printf("%-28llu %10.2f %12.1f %14.1f %10s\n",
                static_cast<unsigned long long>(step), fill, rss / 1048576.0,
                (static_cast<double>(rss) - static_cast<double>(base)) /
                    static_cast<double>(step),
                p50_text.c_str());
    std::fflush(stdout);
  }
  const uint64_t full = RssAnon(pid);
  const Clock::time_point close_start = Clock::now();
  for (Tenant& t : tenants) {
    t.buffer.reset();
    if (!t.session->Close().ok()) return 1;
  }
  // The sessions end on mrd's side when it sees the sockets close: wait
  // until nothing is pinned any more, then for the anonymous memory to
  // settle.
  for (int i = 0; i < 600 && Pinned(pid) != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (Pinned(pid) != 0) {
    std::fprintf(stderr,
                 "mrd still pins %llu bytes after the sessions closed\n",
                 static_cast<unsigned long long>(Pinned(pid)));
    return 1;
  }
  uint64_t after = RssAnon(pid);
  for (int i = 0; i < 50; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const uint64_t now = RssAnon(pid);
    if (now == after) break;
    after = now;
  }
  const double close_s = Seconds(close_start);
  std::printf("%-28s %10.2f %12.1f\n", "all sessions closed", close_s,
              after / 1048576.0);
  std::printf("\nbytes per live registration: %.1f (goal <= 256)\n",
              (static_cast<double>(full) - static_cast<double>(base)) /
                  static_cast<double>(total));
  std::printf(
      "RegisterMr p50 at %llu / at %llu live: %.1f / %.1f us = %.3f "
      "(goal <= 1.2); p99 %.1f / %.1f us\n",
      static_cast<unsigned long long>(total),
      static_cast<unsigned long long>(first_sample), p50_last, p50_first,
      p50_last / p50_first, p99_last, p99_first);
  std::printf(
      "kept after close: %.1f MiB of %.1f MiB grown (%.1f%%)\n",
      (static_cast<double>(after) - static_cast<double>(base)) / 1048576.0,
      (static_cast<double>(full) - static_cast<double>(base)) / 1048576.0,
      100.0 * (static_cast<double>(after) - static_cast<double>(base)) /
          std::max(1.0, static_cast<double>(full) - static_cast<double>(base)));
  if (!mrd->Stop().ok()) return 1;
  return 0;
}

}  // namespace
}  // namespace mrd::bench

int main(int argc, char** argv) { return mrd::bench::Main(argc, argv); }
