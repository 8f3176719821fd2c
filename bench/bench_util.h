// Small helpers the standalone benchmarks (rpc_bench, scale_bench,
// e2e_bench) share: a clock, percentiles, `--name=N` flags, one-page
// registrations, starting mrd with generous limits, and the register /
// deregister loops more than one of them times.
#ifndef MRD_BENCH_BENCH_UTIL_H_
#define MRD_BENCH_BENCH_UTIL_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "client/lib/mrd_client.h"
#include "tests/integration/mrd_process.h"

namespace mrd::bench {

constexpr uint64_t kPage = 4096;

// RegisterMr options for page `page` of buffer `buffer`, remote read.
inline client::RegisterOptions PageOf(uint64_t buffer, uint64_t page) {
  client::RegisterOptions o;
  o.buffer = buffer;
  o.offset = page * kPage;
  o.length = kPage;
  o.flags = 0x2;  // remote read
  return o;
}

using Clock = std::chrono::steady_clock;

inline double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// The p-quantile (0 <= p <= 1) of `v`, nearest rank below; `v` not empty.
inline double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1))];
}

// The value of `--<name>=N` among the arguments, or `fallback`; at least
// `minimum`.
inline uint64_t Flag(int argc, char** argv, const char* name, uint64_t fallback,
                     uint64_t minimum = 0) {
  const size_t n = std::strlen(name);
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], name, n) == 0 && argv[i][n] == '=') {
      return std::max<uint64_t>(minimum,
                                std::strtoull(argv[i] + n + 1, nullptr, 10));
    }
  }
  return std::max(minimum, fallback);
}

// The value of `--<name>=TEXT` among the arguments, or `fallback`.
inline std::string StringFlag(int argc, char** argv, const char* name,
                              const std::string& fallback) {
  const size_t n = std::strlen(name);
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], name, n) == 0 && argv[i][n] == '=') {
      return argv[i] + n + 1;
    }
  }
  return fallback;
}

// mrd's flags for a benchmark: `pinned_bytes` may be pinned per session and
// in all, `registrations` live per session, no warm pins kept after the last
// deregistration (so every new registration pins), one tenant may take it
// all.
inline std::vector<std::string> GenerousFlags(uint64_t pinned_bytes,
                                              uint64_t registrations) {
  const std::string bytes = std::to_string(pinned_bytes);
  return {
      "--max_session_pinned_bytes=" + bytes,
      "--max_total_pinned_bytes=" + bytes,
      "--max_session_registrations=" + std::to_string(registrations),
      "--warm_pin_bytes_total=0",
      "--tenant_default_percent=100",
  };
}

// The real mrd with `flags` (software device); null, having said why on
// stderr, when it does not start.
inline std::unique_ptr<testing::MrdProcess> StartMrd(
    std::vector<std::string> flags) {
  testing::MrdProcessOptions options;
  options.extra_flags = std::move(flags);
  auto p = testing::MrdProcess::Start(options);
  if (!p.ok()) {
    std::fprintf(stderr, "mrd: %s\n", p.status().ToString().c_str());
    return nullptr;
  }
  return *std::move(p);
}

// A client of `mrd`'s gRPC and fd sockets.
inline absl::StatusOr<client::Client> ConnectTo(
    const testing::MrdProcess& mrd) {
  client::ClientOptions options;
  options.socket_path = mrd.grpc_socket();
  options.fd_socket_path = mrd.fd_socket();
  return client::Client::Connect(options);
}

// Writes one byte of every page of `buffer` (made by Buffer::Create), so
// that its pages exist before mrd pins them.
inline void TouchPages(const client::Buffer& buffer) {
  for (uint64_t i = 0; i < buffer.size(); i += kPage) {
    static_cast<char*>(buffer.data())[i] = 1;
  }
}

// RegisterMrBatch of `options` in `session`, each registration appended to
// `out`; false, having said why on stderr, when the call or an item failed.
inline bool RegisterBatchInto(
    const client::Session& session,
    const std::vector<client::RegisterOptions>& options,
    std::vector<client::Registration>* out) {
  auto results = client::Registration::RegisterBatch(session, options);
  if (!results.ok()) {
    std::fprintf(stderr, "RegisterMrBatch: %s\n",
                 results.status().ToString().c_str());
    return false;
  }
  for (auto& r : *results) {
    if (!r.ok()) {
      std::fprintf(stderr, "item: %s\n", r.status().ToString().c_str());
      return false;
    }
    out->push_back(*std::move(r));
  }
  return true;
}

// Registers pages 0..count-1 of `buffer` in `session` one RegisterMr each,
// then deregisters them one DeregisterMr each; seconds, or < 0 on failure.
inline double Singles(const client::Session& session, uint64_t buffer,
                      uint64_t count) {
  std::vector<client::Registration> regs;
  regs.reserve(count);
  const Clock::time_point start = Clock::now();
  for (uint64_t i = 0; i < count; ++i) {
    auto r = client::Registration::Register(session, PageOf(buffer, i));
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

// The same in RegisterMrBatch / DeregisterMrBatch calls of `batch` pages;
// `all_devices`: each page registered on every device of mrd.
inline double Batches(const client::Session& session, uint64_t buffer,
                      uint64_t count, uint64_t batch,
                      bool all_devices = false) {
  std::vector<client::Registration> regs;
  regs.reserve(count);
  const Clock::time_point start = Clock::now();
  for (uint64_t first = 0; first < count; first += batch) {
    std::vector<client::RegisterOptions> options;
    for (uint64_t i = first; i < std::min(count, first + batch); ++i) {
      options.push_back(PageOf(buffer, i));
      options.back().all_devices = all_devices;
    }
    if (!RegisterBatchInto(session, options, &regs)) return -1;
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

// Cache hits against the same request pair to a floor server (floor_server.h,
// `floor`): with `range` held once, `pairs` times a RegisterMr of it that
// hits the cache plus the DeregisterMr that gives that reference back,
// interleaved with the same RegisterMr and DeregisterMr to the floor so that
// both see the same machine; the microseconds of each, false on any failure.
inline bool HitPairs(const client::Session& session,
                     const client::RegisterOptions& range, uint64_t pairs,
                     const client::Client& floor, std::vector<double>* hit_us,
                     std::vector<double>* floor_us) {
  auto held = client::Registration::Register(session, range);
  if (!held.ok()) return false;
  const v1::RegisterMrRequest request =
      client::ToRequest(session.token(), range);
  for (uint64_t i = 0; i < pairs; ++i) {
    Clock::time_point start = Clock::now();
    auto floor_reg = floor.RegisterMr(request);
    if (!floor_reg.ok()) return false;
    v1::DeregisterMrRequest floor_dereg;
    floor_dereg.set_session(session.token());
    floor_dereg.set_registration(floor_reg->registration());
    if (!floor.DeregisterMr(floor_dereg).ok()) return false;
    floor_us->push_back(Seconds(start) * 1e6);
    start = Clock::now();
    auto hit = client::Registration::Register(session, range);
    if (!hit.ok() || !hit->cache_hit()) return false;
    auto left = hit->Deregister();
    if (!left.ok() || *left != 1) return false;
    hit_us->push_back(Seconds(start) * 1e6);
  }
  return true;
}

}  // namespace mrd::bench

#endif  // MRD_BENCH_BENCH_UTIL_H_
