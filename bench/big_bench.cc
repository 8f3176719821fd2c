// Big registrations past the one-thread pinning floor (issue 9, part 3),
// through the real mrd on the software device over its real sockets:
//
// - `--buffers` memfds (default 4) of `--gib` GiB each (default 2), made and
//   written by the client, every page;
// - the floor: one thread of the client mlocks all of them (through the
//   mappings it wrote through) and munlocks them;
// - mrd: the client imports the memfds anew (so mrd's mappings of them are
//   fresh, as on a buffer's first registration) and registers each whole
//   buffer, all at once from one thread per buffer, then deregisters them
//   and releases the imports. Once with --prefault_threads=0 (the pin
//   faults mrd's mapping in by itself) and once with the default.
//
// Each case runs `--rounds` times (default 3); the median is reported, and
// the speed-up as floor time / case time (issue 9's goal: at least 1.6 for
// 8 GiB of 4 KiB pages on the 2-core machine).
//
//   build/bench/big_bench [--buffers=4] [--gib=2] [--rounds=3]
//
// Needs the memory (twice the total: the memfds and nothing else, as pins
// do not copy) and the right to mlock it (root or a large RLIMIT_MEMLOCK).

#include <sys/mman.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "client/lib/mrd_client.h"
#include "tests/integration/mrd_process.h"
#include "tests/support/huge_pages.h"

namespace mrd::bench {
namespace {

double Median(std::vector<double> v) { return Percentile(std::move(v), 0.5); }

// One thread mlocks and munlocks every buffer; seconds of the mlocks, or < 0.
double Floor(const std::vector<client::Buffer>& buffers) {
  const Clock::time_point start = Clock::now();
  for (const client::Buffer& b : buffers) {
    if (mlock(b.data(), b.size()) != 0) {
      std::perror("mlock (needs root or RLIMIT_MEMLOCK)");
      return -1;
    }
  }
  const double seconds = Seconds(start);
  for (const client::Buffer& b : buffers) munlock(b.data(), b.size());
  return seconds;
}

// Imports every memfd anew and registers each whole import at once, one
// thread per buffer; seconds of the registrations, or < 0.
double Register(const client::Session& session,
                const std::vector<client::Buffer>& buffers) {
  std::vector<client::Buffer> imports;
  for (const client::Buffer& b : buffers) {
    auto imported = session.ImportMemfd(b.fd(), true, b.size());
    if (!imported.ok()) {
      std::fprintf(stderr, "import: %s\n",
                   imported.status().ToString().c_str());
      return -1;
    }
    imports.push_back(*std::move(imported));
  }
  std::vector<absl::StatusOr<client::Registration>> results(imports.size());
  const Clock::time_point start = Clock::now();
  std::vector<std::thread> threads;
  for (size_t i = 0; i < imports.size(); ++i) {
    threads.emplace_back([&, i] {
      client::RegisterOptions o;
      o.buffer = imports[i].id();
      o.length = imports[i].size();
      o.flags = 0x1 | 0x2 | 0x5;  // local write, remote read, remote write
      results[i] = client::Registration::Register(session, o);
    });
  }
  for (std::thread& t : threads) t.join();
  const double seconds = Seconds(start);
  for (auto& r : results) {
    if (!r.ok()) {
      std::fprintf(stderr, "RegisterMr: %s\n", r.status().ToString().c_str());
      return -1;
    }
    if (!r->Deregister().ok()) return -1;
  }
  for (client::Buffer& b : imports) {
    if (!b.Release().ok()) return -1;
  }
  return seconds;
}

// Starts mrd with `prefault_threads`, runs `rounds` registrations of all the
// buffers and returns their median, or < 0.
double Case(const std::string& prefault_threads, uint64_t total,
            uint64_t rounds, const std::vector<client::Buffer>& buffers) {
  testing::MrdProcessOptions options;
  const std::string bytes = std::to_string(4 * total);
  options.extra_flags = {
      "--max_session_pinned_bytes=" + bytes,
      "--max_total_pinned_bytes=" + bytes,
      "--max_buffer_size=" + bytes,
      "--warm_pin_bytes_total=0",
      "--tenant_default_percent=100",
      "--prefault_threads=" + prefault_threads,
  };
  auto mrd = testing::MrdProcess::Start(options);
  if (!mrd.ok()) {
    std::fprintf(stderr, "mrd: %s\n", mrd.status().ToString().c_str());
    return -1;
  }
  client::ClientOptions client_options;
  client_options.socket_path = (*mrd)->grpc_socket();
  client_options.fd_socket_path = (*mrd)->fd_socket();
  auto client = client::Client::Connect(client_options);
  if (!client.ok()) return -1;
  auto session = client::Session::OpenFd(*client);
  if (!session.ok()) return -1;
  std::vector<double> times;
  for (uint64_t r = 0; r < rounds; ++r) {
    const double t = Register(*session, buffers);
    if (t < 0) return -1;
    times.push_back(t);
  }
  if (!session->Close().ok() || !(*mrd)->Stop().ok()) return -1;
  return Median(times);
}

// The client's memfds (4 KiB or 2 MiB pages), made through `session` only
// for the library's Buffer (memfd + mapping); written every page. Empty on
// failure.
std::vector<client::Buffer> MakeBuffers(const client::Session& session,
                                        uint64_t count, uint64_t size,
                                        bool huge_pages) {
  std::vector<client::Buffer> buffers;
  for (uint64_t i = 0; i < count; ++i) {
    auto b =
        client::Buffer::Create(session, size, "big-bench", true, huge_pages);
    if (!b.ok()) {
      std::fprintf(stderr, "buffer: %s\n", b.status().ToString().c_str());
      return {};
    }
    char* data = static_cast<char*>(b->data());
    for (uint64_t at = 0; at < size; at += kPage) data[at] = 1;
    buffers.push_back(*std::move(b));
  }
  return buffers;
}

int Main(int argc, char** argv) {
  const uint64_t count = Flag(argc, argv, "--buffers", 4, 1);
  const uint64_t gib = Flag(argc, argv, "--gib", 2, 1);
  const uint64_t rounds = Flag(argc, argv, "--rounds", 3, 1);
  const uint64_t size = gib << 30;
  const uint64_t total = count * size;

  testing::MrdProcessOptions options;
  options.extra_flags = {"--max_buffer_size=" + std::to_string(size)};
  auto maker = testing::MrdProcess::Start(options);
  if (!maker.ok()) return 1;
  client::ClientOptions client_options;
  client_options.socket_path = (*maker)->grpc_socket();
  client_options.fd_socket_path = (*maker)->fd_socket();
  auto client = client::Client::Connect(client_options);
  if (!client.ok()) return 1;
  auto session = client::Session::OpenFd(*client);
  if (!session.ok()) return 1;

  double floor = 0;
  double off = 0;
  double on = 0;
  {
    std::vector<client::Buffer> buffers =
        MakeBuffers(*session, count, size, false);
    if (buffers.empty()) return 1;
    std::vector<double> floor_times;
    for (uint64_t r = 0; r < rounds; ++r) {
      const double t = Floor(buffers);
      if (t < 0) return 1;
      floor_times.push_back(t);
    }
    floor = Median(floor_times);
    off = Case("0", total, rounds, buffers);
    on = Case("8", total, rounds, buffers);
    if (off < 0 || on < 0) return 1;
  }
  // The same memory in 2 MiB pages, when the pool can be made big enough.
  double huge = -1;
  {
    test_support::HugePagePool pool(total / client::kHugePageSize);
    if (pool.ok()) {
      std::vector<client::Buffer> buffers =
          MakeBuffers(*session, count, size, true);
      if (buffers.empty()) return 1;
      huge = Case("8", total, rounds, buffers);
      if (huge < 0) return 1;
    } else {
      std::fprintf(stderr,
                   "no 2 MiB-page case: vm.nr_hugepages could not be raised "
                   "(run as root with the memory free)\n");
    }
  }
  const double gb = static_cast<double>(total) / 1e9;
  std::printf("%llu x %llu GiB of written memfds, median of %llu\n",
              static_cast<unsigned long long>(count),
              static_cast<unsigned long long>(gib),
              static_cast<unsigned long long>(rounds));
  std::printf("%-56s %9s %9s %10s\n", "case", "seconds", "GB/s", "x floor");
  std::printf("%-56s %9.3f %9.1f %10.2f\n",
              "floor: one thread mlocks the client's 4 KiB pages", floor,
              gb / floor, 1.0);
  std::printf("%-56s %9.3f %9.1f %10.2f\n",
              "mrd, 4 KiB pages, fresh imports, --prefault_threads=0", off,
              gb / off, floor / off);
  std::printf("%-56s %9.3f %9.1f %10.2f\n",
              "mrd, 4 KiB pages, fresh imports, --prefault_threads=8", on,
              gb / on, floor / on);
  if (huge > 0) {
    std::printf("%-56s %9.3f %9.1f %10.2f\n",
                "mrd, 2 MiB pages (hugetlbfs), fresh imports", huge, gb / huge,
                floor / huge);
  }
  return 0;
}

}  // namespace
}  // namespace mrd::bench

int main(int argc, char** argv) { return mrd::bench::Main(argc, argv); }
