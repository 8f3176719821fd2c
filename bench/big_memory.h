// Big registrations against one thread's mlock of the same memory (issue 9,
// part 3), shared by big_bench and e2e_bench's figure f:
//
// - the client's memfds (4 KiB pages, or 2 MiB pages on hugetlbfs), every
//   4 KiB of them written by this process;
// - the floor: one thread of this process mlocks all of them through the
//   mappings it wrote through, then munlocks them;
// - mrd: a fresh mrd on the software device; the memfds imported anew each
//   round (so mrd's mappings of them are new, as on a buffer's first
//   registration) and each import registered whole, all at once from one
//   thread per memfd; then deregistered and released.
//
// Needs the memory (the memfds; pins do not copy) and the right to mlock it
// (root or a large RLIMIT_MEMLOCK); the 2 MiB pages need root to raise
// vm.nr_hugepages (RaiseHugePages).
#ifndef MRD_BENCH_BIG_MEMORY_H_
#define MRD_BENCH_BIG_MEMORY_H_

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "client/lib/mrd_client.h"
#include "tests/integration/mrd_process.h"
#include "tests/support/huge_pages.h"

namespace mrd::bench {

// `count` memfds of `size` bytes each (MappedMemfd: sealed, mapped here), in
// 2 MiB pages with `huge_pages`; one byte of every 4 KiB written, so that
// all their pages exist before anything pins them.
inline absl::StatusOr<std::vector<client::MappedMemfd>> WrittenMemfds(
    uint64_t count, uint64_t size, bool huge_pages) {
  std::vector<client::MappedMemfd> memfds;
  for (uint64_t i = 0; i < count; ++i) {
    auto m = client::MappedMemfd::Create(size, "big-memory", huge_pages);
    if (!m.ok()) return m.status();
    char* data = static_cast<char*>(m->data());
    for (uint64_t at = 0; at < size; at += kPage) data[at] = 1;
    memfds.push_back(*std::move(m));
  }
  return memfds;
}

// The floor: one thread mlocks every memfd through this process's mapping,
// then munlocks them all; the seconds of the mlocks.
inline absl::StatusOr<double> MlockSeconds(
    const std::vector<client::MappedMemfd>& memfds) {
  const Clock::time_point start = Clock::now();
  for (const client::MappedMemfd& m : memfds) {
    if (mlock(m.data(), m.size()) != 0) {
      const int error = errno;
      for (const client::MappedMemfd& l : memfds) munlock(l.data(), l.size());
      return absl::PermissionDeniedError(
          absl::StrCat("mlock (needs root or a large RLIMIT_MEMLOCK): ",
                       std::strerror(error)));
    }
  }
  const double seconds = Seconds(start);
  for (const client::MappedMemfd& m : memfds) munlock(m.data(), m.size());
  return seconds;
}

// Imports every memfd anew in `session` and registers each whole import at
// once, one thread per memfd (local write, remote read and write); then
// deregisters them and releases the imports. The seconds of the
// registrations (from before the first starts to after the last returns).
inline absl::StatusOr<double> RegisterFreshImports(
    const client::Session& session,
    const std::vector<client::MappedMemfd>& memfds) {
  std::vector<client::Buffer> imports;
  for (const client::MappedMemfd& m : memfds) {
    auto imported = session.ImportMemfd(m.fd(), true, m.size());
    if (!imported.ok()) return imported.status();
    imports.push_back(*std::move(imported));
  }
  std::vector<absl::StatusOr<client::Registration>> results(imports.size());
  const Clock::time_point start = Clock::now();
  std::vector<std::thread> threads;
  for (size_t i = 0; i < imports.size(); ++i) {
    threads.emplace_back([&session, &imports, &results, i] {
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
    if (!r.ok()) return r.status();
    auto left = r->Deregister();
    if (!left.ok()) return left.status();
  }
  for (client::Buffer& b : imports) {
    auto released = b.Release();
    if (!released.ok()) return released.status();
  }
  return seconds;
}

// Starts an mrd that may pin four times `total` bytes (the kernel lets go
// of a deregistered buffer's pins a little later), with no warm pins and
// `extra_flags`; runs `rounds` RegisterFreshImports of `memfds` in one fd
// session; stops it. The median seconds.
inline absl::StatusOr<double> MedianRegisterSeconds(
    const std::vector<client::MappedMemfd>& memfds, uint64_t total,
    uint64_t rounds, const std::vector<std::string>& extra_flags) {
  std::vector<std::string> flags = GenerousFlags(4 * total, 1024);
  flags.push_back("--max_buffer_size=" + std::to_string(4 * total));
  flags.insert(flags.end(), extra_flags.begin(), extra_flags.end());
  testing::MrdProcessOptions options;
  options.extra_flags = std::move(flags);
  auto mrd = testing::MrdProcess::Start(options);
  if (!mrd.ok()) return mrd.status();
  auto client = ConnectTo(**mrd);
  if (!client.ok()) return client.status();
  auto session = client::Session::OpenFd(*client);
  if (!session.ok()) return session.status();
  std::vector<double> times;
  for (uint64_t r = 0; r < rounds; ++r) {
    auto t = RegisterFreshImports(*session, memfds);
    if (!t.ok()) return t.status();
    times.push_back(*t);
  }
  absl::Status closed = session->Close();
  if (!closed.ok()) return closed;
  absl::Status stopped = (*mrd)->Stop();
  if (!stopped.ok()) return stopped;
  return Percentile(std::move(times), 0.5);
}

// vm.nr_hugepages raised so that `pages` more 2 MiB pages are free, put
// back when the result is destroyed; null, with the reason in `why_not`,
// when this process cannot (not root, or the kernel found too little free
// memory for them).
inline std::unique_ptr<test_support::HugePagePool> RaiseHugePages(
    uint64_t pages, std::string* why_not) {
  constexpr const char* kPath = "/proc/sys/vm/nr_hugepages";
  if (access(kPath, W_OK) != 0) {
    const int error = errno;
    *why_not = absl::StrCat("cannot write ", kPath, " (", std::strerror(error),
                            "; run as root)");
    return nullptr;
  }
  const uint64_t free_before = test_support::HugePages("Free");
  auto pool = std::make_unique<test_support::HugePagePool>(pages);
  if (pool->ok()) return pool;
  const uint64_t free_after = test_support::HugePages("Free");
  *why_not = absl::StrCat(
      "asked the kernel for ", pages, " more free 2 MiB pages, it made ",
      free_after > free_before ? free_after - free_before : 0,
      " (too little free, unfragmented memory)");
  return nullptr;
}

// What MeasureBigMemory measured.
struct BigMemory {
  uint64_t total_bytes = 0;
  double floor_seconds = 0;  // one thread mlocks the 4 KiB-page memfds
  // mrd on the 4 KiB-page memfds, one per entry of the flag sets given.
  std::vector<double> small_page_seconds;
  double huge_page_seconds = -1;   // mrd on 2 MiB pages; < 0: not measured
  std::string huge_pages_skipped;  // why not, when not measured
};

// The whole measurement: `count` memfds of `size` bytes in 4 KiB pages, the
// mlock floor and, per entry of `small_page_flags`, a fresh mrd with those
// flags (medians of `rounds`); then, with the 4 KiB memfds gone and when the
// huge page pool can be raised for it, the same memory in 2 MiB pages
// through a fresh mrd with `huge_page_flags`. The pool is put back before
// this returns.
inline absl::StatusOr<BigMemory> MeasureBigMemory(
    uint64_t count, uint64_t size, uint64_t rounds,
    const std::vector<std::vector<std::string>>& small_page_flags,
    const std::vector<std::string>& huge_page_flags) {
  BigMemory result;
  result.total_bytes = count * size;
  {
    auto memfds = WrittenMemfds(count, size, false);
    if (!memfds.ok()) return memfds.status();
    std::vector<double> floor;
    for (uint64_t r = 0; r < rounds; ++r) {
      auto t = MlockSeconds(*memfds);
      if (!t.ok()) return t.status();
      floor.push_back(*t);
    }
    result.floor_seconds = Percentile(std::move(floor), 0.5);
    for (const std::vector<std::string>& flags : small_page_flags) {
      auto t =
          MedianRegisterSeconds(*memfds, result.total_bytes, rounds, flags);
      if (!t.ok()) return t.status();
      result.small_page_seconds.push_back(*t);
    }
  }
  std::unique_ptr<test_support::HugePagePool> pool = RaiseHugePages(
      result.total_bytes / client::kHugePageSize, &result.huge_pages_skipped);
  if (pool == nullptr) return result;
  auto memfds = WrittenMemfds(count, size, true);
  if (!memfds.ok()) return memfds.status();
  auto t = MedianRegisterSeconds(*memfds, result.total_bytes, rounds,
                                 huge_page_flags);
  if (!t.ok()) return t.status();
  result.huge_page_seconds = *t;
  return result;
}

}  // namespace mrd::bench

#endif  // MRD_BENCH_BIG_MEMORY_H_
