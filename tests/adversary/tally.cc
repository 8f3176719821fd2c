#include "tests/adversary/tally.h"

#include <dirent.h>

#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "mrd/status.h"

namespace mrd::adversary {
namespace {

constexpr size_t kMaxSamples = 8;

std::string OneLine(absl::string_view text) {
  std::string out(text.substr(0, 300));
  for (char& c : out) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return out;
}

}  // namespace

std::string OutcomeOf(const absl::Status& status) {
  if (status.ok()) return "OK";
  std::string reason = GetErrorDetail(status).reason();
  if (!reason.empty()) return reason;
  return absl::StrCat("CODE_", absl::StatusCodeToString(status.code()));
}

bool IsFailureOfMrd(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return false;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kDataLoss:
      return true;
    default:
      return GetErrorDetail(status).reason().empty();
  }
}

Tally::Tally(const Tally& other) { *this = other; }

Tally& Tally::operator=(const Tally& other) {
  if (this == &other) return *this;
  absl::MutexLock other_lock(&other.mu_);
  absl::MutexLock lock(&mu_);
  attempts_ = other.attempts_;
  outcomes_ = other.outcomes_;
  unexpected_ = other.unexpected_;
  samples_ = other.samples_;
  return *this;
}

void Tally::Add(const absl::Status& status) {
  AddNamed(OutcomeOf(status), IsFailureOfMrd(status), status.ToString());
}

void Tally::AddNamed(absl::string_view outcome, bool unexpected,
                     absl::string_view detail) {
  absl::MutexLock lock(&mu_);
  ++attempts_;
  ++outcomes_[std::string(outcome)];
  if (unexpected) {
    ++unexpected_[std::string(outcome)];
    if (samples_.size() < kMaxSamples) {
      samples_.push_back(OneLine(absl::StrCat(outcome, ": ", detail)));
    }
  }
}

uint64_t Tally::attempts() const {
  absl::MutexLock lock(&mu_);
  return attempts_;
}

std::map<std::string, uint64_t> Tally::outcomes() const {
  absl::MutexLock lock(&mu_);
  return outcomes_;
}

std::map<std::string, uint64_t> Tally::unexpected() const {
  absl::MutexLock lock(&mu_);
  return unexpected_;
}

std::vector<std::string> Tally::samples() const {
  absl::MutexLock lock(&mu_);
  return samples_;
}

std::string Tally::Serialize() const {
  absl::MutexLock lock(&mu_);
  std::string out = absl::StrCat("attempts ", attempts_, "\n");
  for (const auto& [key, n] : outcomes_) {
    absl::StrAppend(&out, "outcome ", key, " ", n, "\n");
  }
  for (const auto& [key, n] : unexpected_) {
    absl::StrAppend(&out, "unexpected ", key, " ", n, "\n");
  }
  for (const std::string& s : samples_)
    absl::StrAppend(&out, "sample ", s, "\n");
  return out;
}

Tally Tally::Parse(absl::string_view text) {
  Tally t;
  absl::MutexLock lock(&t.mu_);
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::ConsumePrefix(&line, "sample ")) {
      t.samples_.emplace_back(line);
      continue;
    }
    std::vector<absl::string_view> f = absl::StrSplit(line, ' ');
    uint64_t n = 0;
    if (f.size() == 2 && f[0] == "attempts" && absl::SimpleAtoi(f[1], &n)) {
      t.attempts_ = n;
    } else if (f.size() == 3 && absl::SimpleAtoi(f[2], &n)) {
      if (f[0] == "outcome") t.outcomes_[std::string(f[1])] = n;
      if (f[0] == "unexpected") t.unexpected_[std::string(f[1])] = n;
    }
  }
  return t;
}

ProcStats ReadProcStats(int pid) {
  ProcStats s;
  const std::string dir = absl::StrCat("/proc/", pid);
  std::ifstream status(dir + "/status");
  if (!status) return s;
  std::string line;
  bool zombie = false;
  while (std::getline(status, line)) {
    absl::string_view v(line);
    auto kb = [&](absl::string_view key, uint64_t* out) {
      absl::string_view rest = v;
      if (!absl::ConsumePrefix(&rest, key)) return;
      rest = absl::StripAsciiWhitespace(rest);
      rest = absl::StripSuffix(rest, " kB");
      uint64_t n = 0;
      if (absl::SimpleAtoi(rest, &n)) *out = n;
    };
    if (absl::StartsWith(v, "State:")) {
      zombie = absl::StrContains(v, "Z") || absl::StrContains(v, "X");
    }
    kb("Threads:", &s.threads);
    kb("VmRSS:", &s.rss_kb);
    kb("RssAnon:", &s.rss_anon_kb);
    kb("VmLck:", &s.vm_lck_kb);
    kb("VmPin:", &s.vm_pin_kb);
  }
  s.alive = !zombie && s.threads > 0;
  if (DIR* d = opendir((dir + "/fd").c_str())) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') ++s.fds;
    }
    closedir(d);
  }
  std::ifstream maps(dir + "/maps");
  while (std::getline(maps, line)) ++s.maps;
  return s;
}

}  // namespace mrd::adversary
