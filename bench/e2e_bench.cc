// One end-to-end benchmark (issue 9, part 6): the real mrd over its real
// sockets (software device; C++ client, gRPC over the Unix socket, memfds
// passed with SCM_RIGHTS) against a floor built in the same run: a minimal
// gRPC server (bench/floor_server.h) in a process of its own, as mrd is
// (this binary started again), on a Unix socket of its own, whose
// GetDeviceInfo, RegisterMr, DeregisterMr, RegisterMrBatch and
// DeregisterMrBatch answer at once with a plausible reply of the same shape
// and pin nothing. It runs twice: answering on gRPC's callback thread
// ("inline") and handing each call to one of two worker threads first
// ("hop"). The floor is what gRPC over a Unix socket costs for the same
// messages through the same client library. Figure f has a floor of its
// own: one thread's mlock of the same memory.
//
// a. Latency against size: RegisterMr + DeregisterMr of a whole memfd
//    (Buffer::Create, every page written once) of 4 KiB ... 256 MiB (1 GiB
//    too with --big), a new registration each time (it pins); the same
//    request pair to the floors. p50 of each round, median of `--rounds`.
// b. Throughput against clients: 1, 2, 4, 8 threads, each with its own fd
//    session and 64 KiB memfd, doing RegisterMr + DeregisterMr pairs for
//    `--seconds`; pairs/s, median of the rounds.
// c. Throughput against batch size: `--count` 4 KiB registrations
//    registered and deregistered in RegisterMrBatch / DeregisterMrBatch calls
//    of 1, 8, 64, 512, 4096 items, against mrd's single calls and against
//    the floors' batch calls of the same size; registrations/s.
// d. Memory against live registrations: mrd's RssAnon and VmRSS
//    (/proc/<pid>/status) at 0 ... `--max_live` live 4 KiB registrations
//    (a fresh mrd; RegisterMrBatch of 4,096); bytes per live registration.
// e. Cache hits: RegisterMr that hits the cache + its DeregisterMr against
//    the same pair to the inline floor, p50 / p99.
// f. Big memory (big_bench's measurement, bench/big_memory.h): `--big_gib`
//    GiB (default 8) in four memfds of 4 KiB pages, every page written by
//    this process. The floor: one thread mlocks all four through the
//    mappings it wrote through, then munlocks them. mrd: a fresh mrd
//    (default flags) registers fresh imports of the four (new mappings in
//    mrd), one RegisterMr per memfd, all at once from four threads; GB/s,
//    median of `--big_rounds`. Then, when this process can raise
//    vm.nr_hugepages (root; put back afterwards), the same memory in 2 MiB
//    pages (MFD_HUGETLB) through mrd against the same 4 KiB floor;
//    otherwise it says why it skipped that case. Issue 9's goals: 4 KiB
//    pages at >= 1.6x the floor's GB/s, 2 MiB pages at >= 10x.
// g. Pipelining: `--pipeline_count` (4,096) RegisterMr of distinct 4 KiB
//    pages of one written memfd, each a new registration, sent on one
//    channel one synchronous call after the other, and with
//    `--pipeline_depth` (32) asynchronous calls outstanding (gRPC's callback
//    API, Client::RegisterMrAsync); requests/s of the RegisterMr calls
//    alone, median of the rounds. mrd's registrations are given back with
//    DeregisterMrBatch after each timed run, untimed. The floors get the
//    same requests; the ratio pipelined / synchronous for each server.
//
// Ratios are mrd's cost over the floor's (time per operation): 1 is the
// floor, 2 is twice as slow. Rows in unit "×" are speed-ups in their own
// right (f's and g's), with no ratio.
//
//   build/bench/e2e_bench [--out=bench-out] [--rounds=3] [--samples=200]
//                         [--seconds=2] [--count=8192] [--max_live=250000]
//                         [--pairs=5000] [--big] [--big_gib=8]
//                         [--big_rounds=3] [--pipeline_count=4096]
//                         [--pipeline_depth=32]
//
// Figure f needs about `--big_gib` GiB of free memory and the right to mlock
// it (root or a large RLIMIT_MEMLOCK); --big_gib=0 leaves it out.
//
// Prints the ratio table (markdown) and writes one CSV per figure into
// --out; exits non-zero if anything failed. `make bench` runs it and plots
// the CSVs (bench/plot_bench.py).

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <initializer_list>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "bench/bench_util.h"
#include "bench/big_memory.h"
#include "bench/floor_server.h"
#include "client/lib/mrd_client.h"
#include "grpcpp/grpcpp.h"
#include "mrd/v1/mrd.grpc.pb.h"
#include "tests/integration/mrd_process.h"
#include "tests/support/kernel_pins.h"

namespace mrd::bench {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr uint64_t kBatchMax = 4096;

// ---------------------------------------------------------------------------
// The calls measured.

// RegisterMr + DeregisterMr of `o` through mrd; false on failure or when the
// registration was not a new one.
bool MrdPair(const client::Session& session, const client::RegisterOptions& o) {
  auto r = client::Registration::Register(session, o);
  if (!r.ok()) {
    std::fprintf(stderr, "RegisterMr: %s\n", r.status().ToString().c_str());
    return false;
  }
  if (r->cache_hit()) {
    std::fprintf(stderr, "RegisterMr hit the cache\n");
    return false;
  }
  auto left = r->Deregister();
  return left.ok() && *left == 0;
}

// The same request pair to a floor.
bool FloorPair(const Floor& floor, const client::Session& session,
               const client::RegisterOptions& o) {
  auto r = floor.client().RegisterMr(client::ToRequest(session.token(), o));
  if (!r.ok()) return false;
  v1::DeregisterMrRequest d;
  d.set_session(session.token());
  d.set_registration(r->registration());
  return floor.client().DeregisterMr(d).ok();
}

// Pages 0..count-1 of `buffer` registered and deregistered at a floor in
// batch calls of `batch`; seconds, or < 0.
double FloorBatches(const Floor& floor, const client::Session& session,
                    uint64_t buffer, uint64_t count, uint64_t batch) {
  const Clock::time_point start = Clock::now();
  std::vector<uint64_t> ids;
  ids.reserve(count);
  for (uint64_t first = 0; first < count; first += batch) {
    v1::RegisterMrBatchRequest request;
    request.set_session(session.token());
    for (uint64_t i = first; i < std::min(count, first + batch); ++i) {
      *request.add_items() =
          client::ToRequest(session.token(), PageOf(buffer, i));
    }
    auto reply = floor.client().RegisterMrBatch(request);
    if (!reply.ok()) return -1;
    for (const auto& item : reply->items()) {
      ids.push_back(item.registration().registration());
    }
  }
  for (uint64_t first = 0; first < count; first += batch) {
    v1::DeregisterMrBatchRequest request;
    request.set_session(session.token());
    for (uint64_t i = first; i < std::min(count, first + batch); ++i) {
      v1::DeregisterMrRequest* item = request.add_items();
      item->set_session(session.token());
      item->set_registration(ids[i]);
    }
    if (!floor.client().DeregisterMrBatch(request).ok()) return -1;
  }
  return Seconds(start);
}

double Median(std::vector<double> v) { return Percentile(std::move(v), 0.5); }

// ---------------------------------------------------------------------------
// Output.

struct Row {
  std::string figure;
  std::string what;
  std::string unit;
  double mrd = 0;
  double floor = 0;  // 0: none
  double hop = 0;    // 0: none
  bool higher_is_better = false;
  // The columns are figures of their own (speed-ups), not costs to compare:
  // no ratio.
  bool no_ratio = false;
  bool skipped = false;  // not measured; `what` says why
};

std::string Number(double v) {
  char text[64];
  if (v >= 100) {
    std::snprintf(text, sizeof(text), "%.0f", v);
  } else if (v >= 10) {
    std::snprintf(text, sizeof(text), "%.1f", v);
  } else {
    std::snprintf(text, sizeof(text), "%.2f", v);
  }
  return text;
}

// mrd's cost over the floor's, or "–".
std::string Ratio(const Row& r, double floor) {
  if (floor <= 0 || r.mrd <= 0 || r.no_ratio || r.skipped) return "–";
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f",
                r.higher_is_better ? floor / r.mrd : r.mrd / floor);
  return text;
}

void PrintTable(const std::vector<Row>& rows) {
  std::printf(
      "| figure | case | unit | mrd | floor (inline) | mrd ÷ floor | "
      "floor (hop) | mrd ÷ hop floor |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    std::printf(
        "| %s | %s | %s | %s | %s | %s | %s | %s |\n", r.figure.c_str(),
        r.what.c_str(), r.unit.c_str(), r.skipped ? "–" : Number(r.mrd).c_str(),
        r.floor > 0 ? Number(r.floor).c_str() : "–", Ratio(r, r.floor).c_str(),
        r.hop > 0 ? Number(r.hop).c_str() : "–", Ratio(r, r.hop).c_str());
  }
  std::fflush(stdout);
}

// Writes `header` and `lines` to <out>/<name>; false on failure.
bool WriteCsv(const std::string& out, const std::string& name,
              const std::string& header,
              const std::vector<std::string>& lines) {
  const std::string path = out + "/" + name;
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::perror(path.c_str());
    return false;
  }
  std::fprintf(f, "%s\n", header.c_str());
  for (const std::string& line : lines) std::fprintf(f, "%s\n", line.c_str());
  return std::fclose(f) == 0;
}

std::string Csv(std::initializer_list<double> values) {
  std::string line;
  for (double v : values) {
    char text[64];
    std::snprintf(text, sizeof(text), "%.10g", v);
    if (!line.empty()) line += ",";
    line += text;
  }
  return line;
}

std::string SizeName(uint64_t bytes) {
  if (bytes >= kGiB) return std::to_string(bytes / kGiB) + " GiB";
  if (bytes >= kMiB) return std::to_string(bytes / kMiB) + " MiB";
  return std::to_string(bytes / 1024) + " KiB";
}

bool HasFlag(int argc, char** argv, const char* name) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return true;
  }
  return false;
}

// ---------------------------------------------------------------------------
// The figures.

struct Settings {
  uint64_t rounds = 3;
  uint64_t samples = 200;
  double seconds = 2;
  uint64_t count = 8192;
  uint64_t max_live = 250000;
  uint64_t pairs = 5000;
  bool big = false;
  uint64_t big_gib = 8;  // 0: no figure f
  uint64_t big_rounds = 3;
  uint64_t pipeline_count = 4096;
  uint64_t pipeline_depth = 32;
  std::string out;
};

struct Bench {
  Settings settings;
  std::unique_ptr<testing::MrdProcess> mrd;
  std::unique_ptr<client::Client> client;
  std::unique_ptr<Floor> inline_floor;
  std::unique_ptr<Floor> hop_floor;
  std::vector<Row> rows;
};

struct Tenant {
  std::unique_ptr<client::Session> session;
  std::unique_ptr<client::Buffer> buffer;
};

// A new fd session with a written memfd of `bytes`; false on failure.
bool NewTenant(const client::Client& client, uint64_t bytes, Tenant* t) {
  auto s = client::Session::OpenFd(client);
  if (!s.ok()) {
    std::fprintf(stderr, "OpenFd: %s\n", s.status().ToString().c_str());
    return false;
  }
  t->session = std::make_unique<client::Session>(*std::move(s));
  auto b = client::Buffer::Create(*t->session, bytes, "e2e-bench");
  if (!b.ok()) {
    std::fprintf(stderr, "buffer: %s\n", b.status().ToString().c_str());
    return false;
  }
  t->buffer = std::make_unique<client::Buffer>(*std::move(b));
  TouchPages(*t->buffer);
  return true;
}

// Releases `t`'s buffer and closes its session; false on failure.
bool Drop(Tenant& t) {
  return t.buffer->Release().ok() && t.session->Close().ok();
}

client::RegisterOptions Whole(const client::Buffer& b) {
  client::RegisterOptions o;
  o.buffer = b.id();
  o.length = b.size();
  o.flags = 0x2;  // remote read
  return o;
}

// a. Latency against size.
bool LatencyAgainstSize(Bench& b, std::vector<std::string>* csv) {
  std::vector<uint64_t> sizes = {4 * 1024, 64 * 1024, kMiB, 16 * kMiB,
                                 256 * kMiB};
  if (b.settings.big) sizes.push_back(kGiB);
  for (uint64_t size : sizes) {
    Tenant t;
    if (!NewTenant(*b.client, size, &t)) return false;
    const client::RegisterOptions o = Whole(*t.buffer);
    // Fewer samples of the big sizes: about 2 GiB pinned per round at most.
    const uint64_t n =
        std::clamp<uint64_t>(2 * kGiB / size, 5, b.settings.samples);
    if (!MrdPair(*t.session, o)) return false;  // warm the paths
    std::vector<double> mrd50, mrd99, floor50, hop50;
    for (uint64_t r = 0; r < b.settings.rounds; ++r) {
      std::vector<double> mrd_us, floor_us, hop_us;
      for (uint64_t i = 0; i < n; ++i) {
        Clock::time_point start = Clock::now();
        if (!MrdPair(*t.session, o)) return false;
        mrd_us.push_back(Seconds(start) * 1e6);
        start = Clock::now();
        if (!FloorPair(*b.inline_floor, *t.session, o)) return false;
        floor_us.push_back(Seconds(start) * 1e6);
        start = Clock::now();
        if (!FloorPair(*b.hop_floor, *t.session, o)) return false;
        hop_us.push_back(Seconds(start) * 1e6);
      }
      mrd50.push_back(Percentile(mrd_us, 0.5));
      mrd99.push_back(Percentile(mrd_us, 0.99));
      floor50.push_back(Percentile(floor_us, 0.5));
      hop50.push_back(Percentile(hop_us, 0.5));
    }
    const Row row{"a. latency",
                  SizeName(size) + " register+deregister p50",
                  "µs",
                  Median(mrd50),
                  Median(floor50),
                  Median(hop50)};
    b.rows.push_back(row);
    csv->push_back(Csv({static_cast<double>(size), row.mrd, Median(mrd99),
                        row.floor, row.hop}));
    if (!Drop(t)) return false;
  }
  return true;
}

// `threads` threads, tenant i on thread i, each repeating `pair` for
// `seconds`; pairs per second, or < 0 on failure.
template <typename Pair>
double PairsPerSecond(const std::vector<Tenant>& tenants, size_t threads,
                      double seconds, Pair pair) {
  std::atomic<bool> go{false};
  std::atomic<bool> failed{false};
  std::atomic<uint64_t> done{0};
  std::vector<std::thread> workers;
  Clock::time_point start;
  for (size_t i = 0; i < threads; ++i) {
    workers.emplace_back([&, i] {
      const Tenant& t = tenants[i];
      const client::RegisterOptions o = Whole(*t.buffer);
      while (!go.load()) std::this_thread::yield();
      uint64_t n = 0;
      while (Seconds(start) < seconds) {
        if (!pair(*t.session, o)) {
          failed = true;
          break;
        }
        ++n;
      }
      done += n;
    });
  }
  start = Clock::now();
  go = true;
  for (std::thread& w : workers) w.join();
  const double elapsed = Seconds(start);
  if (failed) return -1;
  return static_cast<double>(done.load()) / elapsed;
}

// b. Throughput against clients.
bool ThroughputAgainstClients(Bench& b, std::vector<std::string>* csv) {
  const std::vector<size_t> counts = {1, 2, 4, 8};
  std::vector<Tenant> tenants(counts.back());
  for (Tenant& t : tenants) {
    if (!NewTenant(*b.client, 64 * 1024, &t)) return false;
  }
  for (size_t clients : counts) {
    std::vector<double> mrd, floor, hop;
    for (uint64_t r = 0; r < b.settings.rounds; ++r) {
      mrd.push_back(
          PairsPerSecond(tenants, clients, b.settings.seconds, MrdPair));
      floor.push_back(PairsPerSecond(
          tenants, clients, b.settings.seconds,
          [&](const client::Session& s, const client::RegisterOptions& o) {
            return FloorPair(*b.inline_floor, s, o);
          }));
      hop.push_back(PairsPerSecond(
          tenants, clients, b.settings.seconds,
          [&](const client::Session& s, const client::RegisterOptions& o) {
            return FloorPair(*b.hop_floor, s, o);
          }));
    }
    for (const auto* v : {&mrd, &floor, &hop}) {
      if (*std::min_element(v->begin(), v->end()) < 0) return false;
    }
    Row row{"b. clients",  std::to_string(clients) + " client(s), 64 KiB pairs",
            "pairs/s",     Median(mrd),
            Median(floor), Median(hop)};
    row.higher_is_better = true;
    b.rows.push_back(row);
    csv->push_back(
        Csv({static_cast<double>(clients), row.mrd, row.floor, row.hop}));
  }
  for (Tenant& t : tenants) {
    if (!Drop(t)) return false;
  }
  return true;
}

// Registrations per second of a timing function's seconds, median of the
// rounds; < 0 on failure.
template <typename Run>
double Rate(uint64_t rounds, uint64_t count, Run run) {
  std::vector<double> times;
  for (uint64_t r = 0; r < rounds; ++r) {
    const double t = run();
    if (t < 0) return -1;
    times.push_back(t);
  }
  return static_cast<double>(count) / Median(times);
}

// c. Throughput against batch size.
bool ThroughputAgainstBatch(Bench& b, std::vector<std::string>* csv) {
  const uint64_t count = b.settings.count;
  const uint64_t rounds = b.settings.rounds;
  Tenant t;
  if (!NewTenant(*b.client, count * kPage, &t)) return false;
  const client::Session& s = *t.session;
  const uint64_t buffer = t.buffer->id();
  const double single =
      Rate(rounds, count, [&] { return Singles(s, buffer, count); });
  if (single < 0) return false;
  Row row{"c. batches", "single RegisterMr calls, 4 KiB", "registrations/s",
          single};
  row.higher_is_better = true;
  b.rows.push_back(row);
  for (uint64_t batch : {1, 8, 64, 512, 4096}) {
    const double mrd =
        Rate(rounds, count, [&] { return Batches(s, buffer, count, batch); });
    const double floor = Rate(rounds, count, [&] {
      return FloorBatches(*b.inline_floor, s, buffer, count, batch);
    });
    const double hop = Rate(rounds, count, [&] {
      return FloorBatches(*b.hop_floor, s, buffer, count, batch);
    });
    if (mrd < 0 || floor < 0 || hop < 0) return false;
    Row vs_floor{"c. batches",
                 "batches of " + std::to_string(batch),
                 "registrations/s",
                 mrd,
                 floor,
                 hop};
    vs_floor.higher_is_better = true;
    b.rows.push_back(vs_floor);
    Row vs_single{
        "c. batches",
        "batches of " + std::to_string(batch) + " (floor: mrd's single calls)",
        "registrations/s", mrd, single};
    vs_single.higher_is_better = true;
    b.rows.push_back(vs_single);
    csv->push_back(Csv({static_cast<double>(batch), mrd, floor, hop, single}));
  }
  if (!Drop(t)) return false;
  return true;
}

// e. Cache hits against the same request pair to the inline floor.
bool CacheHits(Bench& b, std::vector<std::string>* csv) {
  Tenant t;
  if (!NewTenant(*b.client, kPage, &t)) return false;
  std::vector<double> hit_us, floor_us;
  if (!HitPairs(*t.session, PageOf(t.buffer->id(), 0), b.settings.pairs,
                b.inline_floor->client(), &hit_us, &floor_us)) {
    std::fprintf(stderr, "hit pairs failed\n");
    return false;
  }
  b.rows.push_back(Row{"e. cache hit",
                       "hit RegisterMr + DeregisterMr p50 (floor: the same "
                       "pair to the inline floor)",
                       "µs", Percentile(hit_us, 0.5),
                       Percentile(floor_us, 0.5)});
  b.rows.push_back(Row{"e. cache hit",
                       "hit RegisterMr + DeregisterMr p99 (floor: the same "
                       "pair to the inline floor)",
                       "µs", Percentile(hit_us, 0.99),
                       Percentile(floor_us, 0.99)});
  if (!Drop(t)) return false;
  csv->push_back("hit_pair," +
                 Csv({Percentile(hit_us, 0.5), Percentile(hit_us, 0.99)}));
  csv->push_back("floor_pair," +
                 Csv({Percentile(floor_us, 0.5), Percentile(floor_us, 0.99)}));
  return true;
}

// Registers pages [first, last) of `t`'s buffer for good in batches; false
// on failure.
bool Fill(const Tenant& t, uint64_t first, uint64_t last) {
  for (uint64_t page = first; page < last; page += kBatchMax) {
    std::vector<client::RegisterOptions> options;
    for (uint64_t i = page; i < std::min(last, page + kBatchMax); ++i) {
      options.push_back(PageOf(t.buffer->id(), i));
    }
    std::vector<client::Registration> regs;
    if (!RegisterBatchInto(*t.session, options, &regs)) return false;
    for (client::Registration& r : regs) {
      r.Detach();  // mrd keeps it; the session's end releases it
    }
  }
  return true;
}

// d. Memory against live registrations, in an mrd of its own.
bool MemoryAgainstRegistrations(Bench& b, std::vector<std::string>* csv) {
  const uint64_t max_live = b.settings.max_live;
  std::vector<std::string> flags =
      GenerousFlags(2 * (max_live + 1) * kPage, max_live + 1);
  flags.push_back("--max_batch_items=" + std::to_string(kBatchMax));
  std::unique_ptr<testing::MrdProcess> mrd = StartMrd(std::move(flags));
  if (mrd == nullptr) return false;
  auto c = ConnectTo(*mrd);
  if (!c.ok()) return false;
  Tenant t;
  if (!NewTenant(*c, (max_live + 1) * kPage, &t)) return false;
  // Warm the paths (one registration made and dropped) before the baseline.
  if (!MrdPair(*t.session, PageOf(t.buffer->id(), max_live))) return false;
  const std::string pid = std::to_string(mrd->pid());
  auto status = [&pid](const char* field) {
    return static_cast<double>(test_support::ProcStatusBytes(field, pid));
  };
  const double anon0 = status("RssAnon");
  const double rss0 = status("VmRSS");
  csv->push_back(Csv({0, anon0, rss0, 0}));
  std::vector<uint64_t> steps;
  for (uint64_t s : {10000, 25000, 50000, 100000, 150000, 200000, 250000}) {
    if (s < max_live) steps.push_back(s);
  }
  steps.push_back(max_live);
  uint64_t live = 0;
  for (uint64_t step : steps) {
    const Clock::time_point start = Clock::now();
    if (!Fill(t, live, step)) return false;
    const double fill = Seconds(start);
    live = step;
    const double anon = status("RssAnon");
    const double rss = status("VmRSS");
    csv->push_back(Csv({static_cast<double>(live), anon, rss, fill}));
    if (live == 10000 || live == 100000 || live == max_live) {
      b.rows.push_back(Row{
          "d. memory",
          std::to_string(live) + " live 4 KiB: RssAnon growth per registration",
          "bytes", (anon - anon0) / static_cast<double>(live)});
      b.rows.push_back(Row{
          "d. memory",
          std::to_string(live) + " live 4 KiB: VmRSS growth per registration",
          "bytes", (rss - rss0) / static_cast<double>(live)});
    }
  }
  t.buffer.reset();
  if (!t.session->Close().ok()) return false;
  // mrd releases what the session held when it sees the socket close.
  for (int i = 0; i < 600 && test_support::KernelPinnedBytes(pid) != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const absl::Status stopped = mrd->Stop();
  if (!stopped.ok()) {
    std::fprintf(stderr, "mrd: %s\n", stopped.ToString().c_str());
    return false;
  }
  return true;
}

// ---------------------------------------------------------------------------
// g. Pipelining.

// At most `limit` calls in flight, and the first failure among them. Shared
// with the calls' callbacks, which may run after the caller stopped waiting
// for them.
class Window {
 public:
  explicit Window(uint64_t limit) : limit_(limit) {}

  // Waits for room for one more call; false (and no room taken) once a call
  // failed.
  bool Enter() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &Window::HasRoom));
    if (!status_.ok()) return false;
    ++in_flight_;
    return true;
  }
  // One call ended with `status`.
  void Leave(const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    status_.Update(status);
    --in_flight_;
  }
  // Waits until no call is in flight; the first failure.
  absl::Status Drain() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &Window::Idle));
    return status_;
  }

 private:
  bool HasRoom() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return in_flight_ < limit_ || !status_.ok();
  }
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return in_flight_ == 0;
  }

  const uint64_t limit_;
  absl::Mutex mu_;
  uint64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// `requests` through `channel`, one synchronous RegisterMr after the other;
// reply i in (*replies)[i]. Seconds from the first request to the last
// reply.
absl::StatusOr<double> SendSynchronous(
    const client::Client& channel,
    const std::vector<v1::RegisterMrRequest>& requests,
    std::vector<v1::RegisterMrResponse>* replies) {
  replies->assign(requests.size(), v1::RegisterMrResponse());
  const Clock::time_point start = Clock::now();
  for (size_t i = 0; i < requests.size(); ++i) {
    auto reply = channel.RegisterMr(requests[i]);
    if (!reply.ok()) return reply.status();
    (*replies)[i] = *std::move(reply);
  }
  return Seconds(start);
}

// The same with `depth` asynchronous RegisterMr calls (gRPC's callback API,
// Client::RegisterMrAsync) outstanding on `channel`: a new one goes out as
// soon as one of them is answered.
absl::StatusOr<double> SendPipelined(
    const client::Client& channel,
    const std::vector<v1::RegisterMrRequest>& requests, uint64_t depth,
    std::vector<v1::RegisterMrResponse>* replies) {
  replies->assign(requests.size(), v1::RegisterMrResponse());
  auto window = std::make_shared<Window>(depth);
  const Clock::time_point start = Clock::now();
  for (size_t i = 0; i < requests.size() && window->Enter(); ++i) {
    channel.RegisterMrAsync(
        requests[i],
        [window, replies, i](absl::StatusOr<v1::RegisterMrResponse> reply) {
          absl::Status status = reply.status();
          if (reply.ok()) (*replies)[i] = *std::move(reply);
          window->Leave(status);
        });
  }
  const absl::Status status = window->Drain();
  const double seconds = Seconds(start);
  if (!status.ok()) return status;
  return seconds;
}

// Gives back the registrations `replies` made in `session` (DeregisterMrBatch
// of up to kBatchMax); false unless every one was new (no cache hit) and is
// gone now.
bool DeregisterReplies(const client::Session& session,
                       const std::vector<v1::RegisterMrResponse>& replies) {
  for (size_t first = 0; first < replies.size(); first += kBatchMax) {
    std::vector<client::Registration> chunk;
    for (size_t i = first; i < std::min(replies.size(), first + kBatchMax);
         ++i) {
      if (replies[i].cache_hit()) {
        std::fprintf(stderr, "RegisterMr hit the cache\n");
        return false;
      }
      chunk.push_back(client::Registration::Adopt(session, replies[i]));
    }
    auto left = client::Registration::DeregisterBatch(chunk);
    if (!left.ok()) {
      std::fprintf(stderr, "DeregisterMrBatch: %s\n",
                   left.status().ToString().c_str());
      return false;
    }
    for (const auto& l : *left) {
      if (!l.ok() || *l != 0) return false;
    }
  }
  return true;
}

// g. Pipelining: new 4 KiB registrations (distinct pages of one written
// memfd, registered for the first time in their round), synchronous and
// with `pipeline_depth` outstanding on one channel, at mrd and at each
// floor; mrd's are deregistered after each timed run.
bool Pipelining(Bench& b, std::vector<std::string>* csv) {
  const uint64_t count = b.settings.pipeline_count;
  const uint64_t depth = b.settings.pipeline_depth;
  Tenant t;
  if (!NewTenant(*b.client, count * kPage, &t)) return false;
  std::vector<v1::RegisterMrRequest> requests;
  for (uint64_t i = 0; i < count; ++i) {
    requests.push_back(
        client::ToRequest(t.session->token(), PageOf(t.buffer->id(), i)));
  }
  struct Server {
    const char* name;
    const client::Client* channel;
    bool registers;  // mrd: what it registered must be deregistered
    std::vector<double> synchronous;
    std::vector<double> pipelined;
  };
  Server servers[] = {
      {"mrd", &t.session->client(), true, {}, {}},
      {"floor_inline", &b.inline_floor->client(), false, {}, {}},
      {"floor_hop", &b.hop_floor->client(), false, {}, {}},
  };
  for (uint64_t r = 0; r < b.settings.rounds; ++r) {
    for (Server& server : servers) {
      for (bool pipelined : {false, true}) {
        std::vector<v1::RegisterMrResponse> replies;
        const absl::StatusOr<double> seconds =
            pipelined
                ? SendPipelined(*server.channel, requests, depth, &replies)
                : SendSynchronous(*server.channel, requests, &replies);
        if (!seconds.ok()) {
          std::fprintf(stderr, "%s: %s\n", server.name,
                       seconds.status().ToString().c_str());
          return false;
        }
        if (server.registers && !DeregisterReplies(*t.session, replies)) {
          return false;
        }
        (pipelined ? server.pipelined : server.synchronous)
            .push_back(static_cast<double>(count) / *seconds);
      }
    }
  }
  double synchronous[3];
  double pipelined[3];
  for (int i = 0; i < 3; ++i) {
    synchronous[i] = Median(servers[i].synchronous);
    pipelined[i] = Median(servers[i].pipelined);
    csv->push_back(std::string(servers[i].name) + "," +
                   Csv({static_cast<double>(depth), synchronous[i],
                        pipelined[i], pipelined[i] / synchronous[i]}));
  }
  const std::string what = ", new 4 KiB each, one channel";
  Row sync_row{"g. pipelining", "synchronous RegisterMr" + what,
               "requests/s",    synchronous[0],
               synchronous[1],  synchronous[2]};
  sync_row.higher_is_better = true;
  Row pipelined_row{
      "g. pipelining", std::to_string(depth) + " RegisterMr outstanding" + what,
      "requests/s",    pipelined[0],
      pipelined[1],    pipelined[2]};
  pipelined_row.higher_is_better = true;
  Row speedup{"g. pipelining",
              std::to_string(depth) + " outstanding ÷ synchronous, each server",
              "×",
              pipelined[0] / synchronous[0],
              pipelined[1] / synchronous[1],
              pipelined[2] / synchronous[2]};
  speedup.no_ratio = true;
  b.rows.push_back(sync_row);
  b.rows.push_back(pipelined_row);
  b.rows.push_back(speedup);
  return Drop(t);
}

// ---------------------------------------------------------------------------
// f. Big memory.

constexpr uint64_t kBigBuffers = 4;

// f. Big memory (big_bench's measurement, bench/big_memory.h): `big_gib`
// GiB in four memfds written by this process; one thread's mlock of them
// against mrd (default flags, a fresh mrd) registering fresh imports of all
// four at once; then the same in 2 MiB pages when the huge page pool can be
// raised.
bool BigMemoryFigure(Bench& b, std::vector<std::string>* csv) {
  if (b.settings.big_gib == 0) {
    std::fprintf(stderr, "e2e_bench: figure f skipped (--big_gib=0)\n");
    return true;
  }
  const uint64_t total = b.settings.big_gib * kGiB;
  const absl::StatusOr<BigMemory> big =
      MeasureBigMemory(kBigBuffers, total / kBigBuffers, b.settings.big_rounds,
                       {std::vector<std::string>()}, {});
  if (!big.ok()) {
    std::fprintf(stderr, "big memory: %s\n", big.status().ToString().c_str());
    return false;
  }
  const double gb = static_cast<double>(total) / 1e9;
  const double floor = gb / big->floor_seconds;
  const double mrd = gb / big->small_page_seconds[0];
  const std::string size = SizeName(total);
  auto line = [&](const char* name, uint64_t page, double seconds) {
    csv->push_back(std::string(name) + "," +
                   Csv({static_cast<double>(page), static_cast<double>(total),
                        seconds, gb / seconds, big->floor_seconds / seconds}));
  };
  line("floor_mlock", kPage, big->floor_seconds);
  line("mrd", kPage, big->small_page_seconds[0]);
  Row small{"f. big memory",
            size +
                " of 4 KiB pages, 4 fresh imports registered at once "
                "(floor: one thread's mlock)",
            "GB/s", mrd, floor};
  small.higher_is_better = true;
  Row small_speedup{"f. big memory",
                    "4 KiB pages: mrd's GB/s ÷ the floor's (goal ≥ 1.6)", "×",
                    mrd / floor};
  small_speedup.no_ratio = true;
  b.rows.push_back(small);
  b.rows.push_back(small_speedup);
  if (big->huge_page_seconds < 0) {
    std::fprintf(stderr, "e2e_bench: 2 MiB-page case skipped: %s\n",
                 big->huge_pages_skipped.c_str());
    Row skipped{"f. big memory",
                "2 MiB pages: skipped, " + big->huge_pages_skipped, "GB/s"};
    skipped.skipped = true;
    b.rows.push_back(skipped);
    return true;
  }
  line("mrd", client::kHugePageSize, big->huge_page_seconds);
  const double huge = gb / big->huge_page_seconds;
  Row huge_row{"f. big memory",
               size +
                   " of 2 MiB pages, 4 fresh imports registered at once "
                   "(floor: the 4 KiB mlock)",
               "GB/s", huge, floor};
  huge_row.higher_is_better = true;
  Row huge_speedup{"f. big memory",
                   "2 MiB pages: mrd's GB/s ÷ the 4 KiB floor's (goal ≥ 10)",
                   "×", huge / floor};
  huge_speedup.no_ratio = true;
  b.rows.push_back(huge_row);
  b.rows.push_back(huge_speedup);
  return true;
}

int Main(int argc, char** argv) {
  if (int code = 0; RunFloorChildIfAsked(argc, argv, &code)) return code;
  Bench b;
  b.settings.rounds = Flag(argc, argv, "--rounds", 3, 1);
  b.settings.samples = Flag(argc, argv, "--samples", 200, 5);
  b.settings.seconds = static_cast<double>(Flag(argc, argv, "--seconds", 2, 1));
  b.settings.count = Flag(argc, argv, "--count", 8192, 1);
  b.settings.max_live = Flag(argc, argv, "--max_live", 250000, 1);
  b.settings.pairs = Flag(argc, argv, "--pairs", 5000, 1);
  b.settings.big = HasFlag(argc, argv, "--big");
  b.settings.big_gib = Flag(argc, argv, "--big_gib", 8);
  b.settings.big_rounds = Flag(argc, argv, "--big_rounds", 3, 1);
  b.settings.pipeline_count = Flag(argc, argv, "--pipeline_count", 4096, 1);
  b.settings.pipeline_depth = Flag(argc, argv, "--pipeline_depth", 32, 1);
  b.settings.out = StringFlag(argc, argv, "--out", "bench-out");
  std::error_code error;
  std::filesystem::create_directories(b.settings.out, error);
  if (error) {
    std::fprintf(stderr, "%s: %s\n", b.settings.out.c_str(),
                 error.message().c_str());
    return 1;
  }
  const Clock::time_point start = Clock::now();

  const uint64_t largest = b.settings.big ? kGiB : 256 * kMiB;
  const uint64_t most_live =
      std::max(b.settings.count, b.settings.pipeline_count);
  std::vector<std::string> flags = GenerousFlags(
      std::max(4 * largest, 4 * most_live * kPage), 4 * (most_live + 64));
  flags.push_back("--max_batch_items=" + std::to_string(kBatchMax));
  b.mrd = StartMrd(std::move(flags));
  if (b.mrd == nullptr) return 1;
  auto c = ConnectTo(*b.mrd);
  if (!c.ok()) {
    std::fprintf(stderr, "connect: %s\n", c.status().ToString().c_str());
    return 1;
  }
  b.client = std::make_unique<client::Client>(*std::move(c));
  for (bool hop : {false, true}) {
    // In a process of its own, as mrd is (bench/floor_server.h: in the
    // client's process it would share the client's gRPC pollers).
    auto f = Floor::Start(hop, FloorPlace::kOwnProcess);
    if (!f.ok()) {
      std::fprintf(stderr, "floor: %s\n", f.status().ToString().c_str());
      return 1;
    }
    (hop ? b.hop_floor : b.inline_floor) = *std::move(f);
  }

  const struct {
    const char* name;
    bool (*run)(Bench&, std::vector<std::string>*);
    const char* csv;
    const char* header;
  } figures[] = {
      {"latency against size", LatencyAgainstSize, "latency_vs_size.csv",
       "size_bytes,mrd_p50_us,mrd_p99_us,floor_p50_us,floor_hop_p50_us"},
      {"throughput against clients", ThroughputAgainstClients,
       "throughput_vs_clients.csv",
       "clients,mrd_pairs_per_s,floor_pairs_per_s,floor_hop_pairs_per_s"},
      {"throughput against batch size", ThroughputAgainstBatch,
       "throughput_vs_batch.csv",
       "batch,mrd_regs_per_s,floor_regs_per_s,floor_hop_regs_per_s,"
       "mrd_single_regs_per_s"},
      {"cache hits", CacheHits, "cache_hit.csv", "case,p50_us,p99_us"},
      {"pipelining", Pipelining, "pipelining.csv",
       "server,outstanding,sync_requests_per_s,pipelined_requests_per_s,"
       "pipelined_over_sync"},
      {"memory against live registrations", MemoryAgainstRegistrations,
       "memory_vs_registrations.csv",
       "live,rss_anon_bytes,vm_rss_bytes,fill_seconds"},
      {"big memory", BigMemoryFigure, "big_memory.csv",
       "case,page_bytes,total_bytes,seconds,gb_per_s,x_floor"},
  };
  for (const auto& figure : figures) {
    std::fprintf(stderr, "e2e_bench: %s (%.0f s so far)\n", figure.name,
                 Seconds(start));
    std::vector<std::string> csv;
    if (!figure.run(b, &csv) ||
        !WriteCsv(b.settings.out, figure.csv, figure.header, csv)) {
      std::fprintf(stderr, "e2e_bench: %s failed\n", figure.name);
      return 1;
    }
  }
  const absl::Status stopped = b.mrd->Stop();
  if (!stopped.ok()) {
    std::fprintf(stderr, "mrd: %s\n", stopped.ToString().c_str());
    return 1;
  }
  std::stable_sort(
      b.rows.begin(), b.rows.end(),
      [](const Row& x, const Row& y) { return x.figure < y.figure; });
  PrintTable(b.rows);
  std::printf("\n%.0f s in all; CSVs in %s\n", Seconds(start),
              b.settings.out.c_str());
  return 0;
}

}  // namespace
}  // namespace mrd::bench

int main(int argc, char** argv) { return mrd::bench::Main(argc, argv); }
