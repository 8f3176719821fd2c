// Tally: what one attacker (or the bystander) tried and what it got back,
// counted by outcome. An outcome is "OK", the reason string of mrd's error
// (ErrorDetail.reason, e.g. "LIMIT_TENANT_SESSIONS"), "CODE_<name>" for an
// error without a reason, or a name the attacker gives to what it saw on a
// raw socket ("closed_by_server", ...). Outcomes that can only mean mrd
// failed (UNAVAILABLE, INTERNAL, UNKNOWN, DEADLINE_EXCEEDED, DATA_LOSS, or a
// refusal without a reason) are also kept as unexpected, with a sample of
// their messages.
//
// A child process writes its tally to stdout with Serialize(); the test
// reads it back with Parse().
//
// Thread-safe.
#ifndef MRD_TESTS_ADVERSARY_TALLY_H_
#define MRD_TESTS_ADVERSARY_TALLY_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace mrd::adversary {

// "OK", the reason, or "CODE_<name>".
std::string OutcomeOf(const absl::Status& status);
// True when `status` can only mean that mrd failed, not that it refused.
bool IsFailureOfMrd(const absl::Status& status);

class Tally {
 public:
  Tally() = default;
  Tally(const Tally& other);
  Tally& operator=(const Tally& other);

  // One attempt and its result.
  void Add(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);
  // One attempt ending in a named outcome; `unexpected` also records it as
  // a failure with `detail` as its sample.
  void AddNamed(absl::string_view outcome, bool unexpected = false,
                absl::string_view detail = "") ABSL_LOCKS_EXCLUDED(mu_);

  uint64_t attempts() const ABSL_LOCKS_EXCLUDED(mu_);
  std::map<std::string, uint64_t> outcomes() const ABSL_LOCKS_EXCLUDED(mu_);
  std::map<std::string, uint64_t> unexpected() const ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<std::string> samples() const ABSL_LOCKS_EXCLUDED(mu_);

  // Lines "attempts N", "outcome KEY N", "unexpected KEY N", "sample TEXT".
  std::string Serialize() const ABSL_LOCKS_EXCLUDED(mu_);
  static Tally Parse(absl::string_view text);

 private:
  mutable absl::Mutex mu_;
  uint64_t attempts_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, uint64_t> outcomes_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> unexpected_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> samples_ ABSL_GUARDED_BY(mu_);
};

// A snapshot of a process's resources, from /proc/<pid>.
struct ProcStats {
  bool alive = false;  // exists and is not a zombie
  uint64_t threads = 0;
  uint64_t fds = 0;
  uint64_t maps = 0;
  uint64_t rss_kb = 0;
  uint64_t rss_anon_kb = 0;
  uint64_t vm_lck_kb = 0;
  uint64_t vm_pin_kb = 0;
};
ProcStats ReadProcStats(int pid);

}  // namespace mrd::adversary

#endif  // MRD_TESTS_ADVERSARY_TALLY_H_
