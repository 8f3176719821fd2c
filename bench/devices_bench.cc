// One registration on several devices (issue 26), through the real mrd with
// two software devices (--software_devices=2) or, with `--verbs`, two verbs
// devices, against the same registration on one device in the same run:
//
// - big: a fresh 1 GiB memfd (`--gib`), every page written by the client,
//   imported and registered whole (RegisterMr), on the first device and on
//   both; the time of the RegisterMr alone, then it is deregistered and the
//   buffer released;
// - batches: 10,000 4 KiB pages (`--pages`) registered in RegisterMrBatch
//   calls of 1,000 (`--batch`) and deregistered in DeregisterMrBatch calls,
//   on the first device and on both; the time of the whole round.
//
// The two cases alternate, `--rounds` times (default 5); the medians and
// both ÷ one are reported, then every round's times (issue 26's goals: at
// most 1.3 for the 1 GiB registration, 1.5 for the batches).
//
//   build/bench/devices_bench [--gib=1] [--pages=10000] [--batch=1000]
//                             [--rounds=5] [--verbs]
//
// `--verbs`: the same on two verbs devices instead of the software ones,
// inside the Soft-RoCE VM (tests/vm/run.sh), where MRD_VERBS_DEVICE (rxe0,
// on MRD_VERBS_ADDRESS) and MRD_VERBS_DEVICE2 (rxe1) name them: mrd runs
// with --device=verbs on the first and --verbs_devices=<the second>. For
// example, from the checkout (one line):
//
//   tests/vm/run.sh --rw "$PWD" --cwd "$PWD" --mem 6144 --timeout 1500
//     -- build/bench/devices_bench --verbs
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench_util.h"

namespace mrd::bench {
namespace {

// Registers the whole of a fresh, written buffer of `bytes` on one device or
// on all; the seconds of the RegisterMr, or < 0 on failure.
double BigRegistration(const client::Session& session, uint64_t bytes,
                       bool all) {
  absl::StatusOr<client::Buffer> buffer =
      client::Buffer::Create(session, bytes);
  if (!buffer.ok()) {
    std::fprintf(stderr, "buffer: %s\n", buffer.status().ToString().c_str());
    return -1;
  }
  TouchPages(*buffer);
  client::RegisterOptions o;
  o.buffer = buffer->id();
  o.length = bytes;
  o.flags = 0x2;  // remote read
  o.all_devices = all;
  const Clock::time_point start = Clock::now();
  absl::StatusOr<client::Registration> r =
      client::Registration::Register(session, o);
  const double seconds = Seconds(start);
  if (!r.ok()) {
    std::fprintf(stderr, "RegisterMr: %s\n", r.status().ToString().c_str());
    return -1;
  }
  if (r->tokens().size() != (all ? 2 : 1)) return -1;
  if (!r->Deregister().ok()) return -1;
  return seconds;
}

double Median(std::vector<double> v) { return Percentile(std::move(v), 0.5); }

// Whether `--<name>` (no value) is among the arguments.
bool Switch(int argc, char** argv, const char* name) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return true;
  }
  return false;
}

std::string Env(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? "" : value;
}

// mrd's device flags for the run: two software devices, or (`verbs`) the
// VM's two verbs devices; false, having said why on stderr, when the verbs
// devices are not named. `what` describes them for the report.
bool DeviceFlags(bool verbs, std::vector<std::string>* flags,
                 std::string* what) {
  if (!verbs) {
    flags->push_back("--software_devices=2");
    *what = "two software devices";
    return true;
  }
  const std::string first = Env("MRD_VERBS_DEVICE");
  const std::string address = Env("MRD_VERBS_ADDRESS");
  const std::string second = Env("MRD_VERBS_DEVICE2");
  if (first.empty() || address.empty() || second.empty()) {
    std::fprintf(stderr,
                 "devices_bench --verbs: MRD_VERBS_DEVICE, MRD_VERBS_ADDRESS "
                 "and MRD_VERBS_DEVICE2 must be set (run it inside the "
                 "Soft-RoCE VM: tests/vm/run.sh)\n");
    return false;
  }
  // Later flags win over the software device StartMrd gives mrd by default.
  flags->push_back("--device=verbs");
  flags->push_back("--verbs_device=" + first);
  flags->push_back("--peer_address=" + address + ":0");
  flags->push_back("--verbs_devices=" + second);
  *what = "two verbs devices (" + first + ", " + second + ")";
  return true;
}

int Main(int argc, char** argv) {
  const uint64_t gib = Flag(argc, argv, "--gib", 1, 1);
  const uint64_t pages = Flag(argc, argv, "--pages", 10000, 1);
  const uint64_t batch = Flag(argc, argv, "--batch", 1000, 1);
  const uint64_t rounds = Flag(argc, argv, "--rounds", 5, 1);
  const bool verbs = Switch(argc, argv, "--verbs");
  const uint64_t bytes = gib << 30;
  std::vector<std::string> flags =
      GenerousFlags(2 * bytes + pages * kPage, 2 * pages);
  std::string devices;
  if (!DeviceFlags(verbs, &flags, &devices)) return 1;
  flags.push_back("--max_batch_items=" + std::to_string(batch));
  std::unique_ptr<testing::MrdProcess> mrd = StartMrd(flags);
  if (mrd == nullptr) return 1;
  absl::StatusOr<client::Client> client = ConnectTo(*mrd);
  if (!client.ok()) return 1;
  absl::StatusOr<client::Session> session = client::Session::OpenFd(*client);
  if (!session.ok()) return 1;
  absl::StatusOr<client::Buffer> small =
      client::Buffer::Create(*session, pages * kPage);
  if (!small.ok()) return 1;
  TouchPages(*small);

  std::vector<double> big[2], batches[2];
  for (uint64_t round = 0; round < rounds; ++round) {
    // Alternate which goes first, so that neither always follows the other.
    for (int k = 0; k < 2; ++k) {
      const bool all = (round + k) % 2 == 1;
      const double b = BigRegistration(*session, bytes, all);
      const double s = Batches(*session, small->id(), pages, batch, all);
      if (b < 0 || s < 0) {
        std::fprintf(stderr, "devices_bench: a round failed\n%s",
                     mrd->Log().c_str());
        return 1;
      }
      big[all ? 1 : 0].push_back(b);
      batches[all ? 1 : 0].push_back(s);
    }
  }
  std::printf("%s, median of %llu rounds\n", devices.c_str(),
              static_cast<unsigned long long>(rounds));
  std::printf("%-52s %10s %10s %8s\n", "case", "one (s)", "both (s)",
              "both/one");
  const double big_one = Median(big[0]), big_both = Median(big[1]);
  const double batch_one = Median(batches[0]), batch_both = Median(batches[1]);
  std::printf("%-52s %10.4f %10.4f %8.2f\n",
              (std::to_string(gib) + " GiB registration, fresh import").c_str(),
              big_one, big_both, big_both / big_one);
  std::printf("%-52s %10.4f %10.4f %8.2f\n",
              (std::to_string(pages) + " x 4 KiB in batches of " +
               std::to_string(batch) + ", reg + dereg")
                  .c_str(),
              batch_one, batch_both, batch_both / batch_one);
  // Every round's figures, in order: on a loaded machine (or under the VM's
  // emulation) one slow round shows here, not only as a shifted median.
  const char* names[] = {"big one", "big both", "batches one", "batches both"};
  const std::vector<double>* series[] = {&big[0], &big[1], &batches[0],
                                         &batches[1]};
  for (int i = 0; i < 4; ++i) {
    std::printf("%-13s", names[i]);
    for (double v : *series[i]) std::printf(" %.4f", v);
    std::printf("\n");
  }
  // Everything the client holds goes before mrd does.
  small = absl::InternalError("released");
  session = absl::InternalError("closed");
  return mrd->Stop().ok() ? 0 : 1;
}

}  // namespace
}  // namespace mrd::bench

int main(int argc, char** argv) { return mrd::bench::Main(argc, argv); }
