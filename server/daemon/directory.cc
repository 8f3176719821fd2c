#include "server/daemon/directory.h"

#include <limits.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "mrd/status.h"
#include "server/common/log.h"
#include "server/daemon/config.h"
#include "server/daemon/flags.h"
#include "server/directory/etcd_client.h"

namespace mrd::daemon {
namespace {

// The directory's path segments (root's, cluster's, node's): no '/' inside
// one, and printable.
absl::Status CheckSegment(absl::string_view flag, absl::string_view value) {
  if (value.empty() || value.size() > 128) {
    return Fail(absl::StrCat("--", flag, " must have 1 to 128 characters"));
  }
  for (char c : value) {
    if (c == '/' || c <= ' ' || c == 0x7f) {
      return Fail(absl::StrCat("--", flag, "='", value,
                               "' may hold no '/', space or control "
                               "character"));
    }
  }
  return absl::OkStatus();
}

std::string HostName() {
  char name[HOST_NAME_MAX + 1] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') {
    return "localhost";
  }
  return name;
}

// The flags of TLS and etcd's authentication: pairs that go together, and
// files that can be read and hold what they should (an EtcdClient made and
// dropped: it reads them and connects to nothing), so that a mistake stops
// the start rather than the first write. Errors name flags and files only.
absl::Status SetCredentials(directory::EtcdClientOptions* etcd) {
  etcd->ca_file = absl::GetFlag(FLAGS_etcd_ca_file);
  etcd->cert_file = absl::GetFlag(FLAGS_etcd_cert_file);
  etcd->key_file = absl::GetFlag(FLAGS_etcd_key_file);
  etcd->user = absl::GetFlag(FLAGS_etcd_user);
  etcd->password_file = absl::GetFlag(FLAGS_etcd_password_file);
  if (etcd->cert_file.empty() != etcd->key_file.empty()) {
    return Fail(etcd->cert_file.empty()
                    ? "--etcd_key_file needs --etcd_cert_file (the "
                      "certificate of that key)"
                    : "--etcd_cert_file needs --etcd_key_file (the "
                      "certificate's key)");
  }
  if (etcd->user.empty() != etcd->password_file.empty()) {
    return Fail(etcd->user.empty()
                    ? "--etcd_password_file needs --etcd_user (whose "
                      "password it is)"
                    : "--etcd_user needs --etcd_password_file (the file "
                      "holding the user's password)");
  }
  if (etcd->endpoints.empty()) return absl::OkStatus();
  absl::StatusOr<std::unique_ptr<directory::EtcdClient>> client =
      directory::EtcdClient::Create(*etcd);
  if (!client.ok()) {
    return Fail(absl::StrCat("directory: ", client.status().message(), " (",
                             GetErrorDetail(client.status()).reason(), ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status DirectoryParticipant::Start(core::Core* core, bool taking_over) {
  core_ = core;
  const std::vector<std::string> endpoints =
      absl::GetFlag(FLAGS_etcd_endpoints);
  publisher_options_.etcd.endpoints = endpoints;
  MRD_RETURN_IF_ERROR(SetCredentials(&publisher_options_.etcd));
  if (endpoints.empty()) {
    if (!publisher_options_.etcd.ca_file.empty() ||
        !publisher_options_.etcd.cert_file.empty() ||
        !publisher_options_.etcd.user.empty()) {
      LogInfo(
          "directory: off (no --etcd_endpoints); its TLS and user flags are "
          "not used");
    }
    return absl::OkStatus();
  }
  options_.root = absl::GetFlag(FLAGS_directory_root);
  if (options_.root.empty() || options_.root.front() != '/' ||
      options_.root.back() == '/') {
    return Fail(absl::StrCat("--directory_root='", options_.root,
                             "' must start with '/' and not end with one"));
  }
  options_.cluster = absl::GetFlag(FLAGS_directory_cluster);
  MRD_RETURN_IF_ERROR(CheckSegment("directory_cluster", options_.cluster));
  options_.node = absl::GetFlag(FLAGS_node_name);
  if (options_.node.empty()) options_.node = HostName();
  MRD_RETURN_IF_ERROR(CheckSegment("node_name", options_.node));
  options_.mooncake_prefix = absl::GetFlag(FLAGS_directory_mooncake_prefix);
  if (!options_.mooncake_prefix.empty()) {
    const std::string& prefix = options_.mooncake_prefix;
    bool printable = true;
    for (char c : prefix) printable = printable && c > ' ' && c != 0x7f;
    if (prefix.size() > 256 || prefix.back() != '/' || !printable) {
      return Fail(absl::StrCat("--directory_mooncake_prefix='", prefix,
                               "' must end with '/' and hold no space or "
                               "control character (e.g. mooncake/)"));
    }
  }
  options_.unpublish_wait = absl::GetFlag(FLAGS_directory_unpublish_wait);
  options_.max_watches = absl::GetFlag(FLAGS_directory_max_watches);
  publisher_options_.lease_ttl = absl::GetFlag(FLAGS_directory_lease_ttl);
  publisher_options_.max_keys = absl::GetFlag(FLAGS_directory_max_entries);
  enabled_ = true;
  const directory::EtcdClientOptions& etcd = publisher_options_.etcd;
  LogInfo("directory: etcd ", absl::StrJoin(endpoints, ","),
          etcd.ca_file.empty() && etcd.cert_file.empty()
              ? " (plain text)"
              : absl::StrCat(
                    " (TLS",
                    etcd.cert_file.empty() ? "" : ", client certificate", ")"),
          etcd.user.empty() ? "" : absl::StrCat(", user ", etcd.user),
          ", cluster ", options_.cluster, ", node ", options_.node,
          ", lease TTL ", absl::FormatDuration(publisher_options_.lease_ttl));
  if (taking_over) return absl::OkStatus();  // Commit starts it
  return StartPublisher(/*lease=*/0, /*republish=*/false);
}

absl::Status DirectoryParticipant::StartPublisher(int64_t lease,
                                                  bool republish) {
  directory::PublisherOptions options = publisher_options_;
  options.adopt_lease = lease;
  absl::StatusOr<std::unique_ptr<directory::Publisher>> started =
      directory::Publisher::Start(options);
  if (!started.ok()) {
    return Fail(
        absl::StrCat("directory (--etcd_endpoints=",
                     absl::StrJoin(publisher_options_.etcd.endpoints, ","),
                     "): ", started.status().ToString()));
  }
  // The core moves to the new publisher before the old one (if any) goes.
  std::unique_ptr<directory::Publisher> old = std::move(publisher_);
  publisher_ = std::move(*started);
  core_->SetDirectory(publisher_.get(), options_);
  if (republish) core_->RepublishDirectory();
  {
    absl::MutexLock lock(&health_mu_);
    watched_ = publisher_.get();
  }
  old.reset();
  return absl::OkStatus();
}

std::optional<bool> DirectoryParticipant::TakeServingChange() {
  absl::MutexLock lock(&health_mu_);
  if (watched_ == nullptr) return std::nullopt;
  const directory::DirectoryState state = watched_->State();
  const bool serving = state == directory::DirectoryState::kServing;
  if (last_serving_ == serving) return std::nullopt;
  const bool first = !last_serving_.has_value();
  last_serving_ = serving;
  if (!first && serving) {
    LogInfo("directory: serving (etcd reached, names written)");
  } else if (!first) {
    LogWarning("directory: ", directory::DirectoryStateName(state),
               " (etcd not reached: names are queued and retried; "
               "registrations go on)");
  }
  return serving;
}

void DirectoryParticipant::Stop(bool handed_over) {
  {
    absl::MutexLock lock(&health_mu_);
    watched_ = nullptr;
  }
  if (publisher_ == nullptr || handed_over) return;
  if (absl::Status s = publisher_->Stop(); !s.ok()) {
    LogWarning("directory: ", s.ToString(),
               "; the entries go when the lease's TTL runs out");
  }
}

absl::Status DirectoryParticipant::Export(v1::HandoverSnapshot* snapshot,
                                          std::vector<UniqueFd>* /*fds*/) {
  if (publisher_ == nullptr) return absl::OkStatus();
  exported_lease_ = publisher_->Stats().lease;
  snapshot->set_directory_lease(exported_lease_);
  snapshot->set_directory_epoch(options_.epoch);
  return absl::OkStatus();
}

absl::Status DirectoryParticipant::Release() {
  if (publisher_ == nullptr) return absl::OkStatus();
  {
    absl::MutexLock lock(&health_mu_);
    watched_ = nullptr;
  }
  // Stops writing; the keeper renews the lease until this process exits.
  const int64_t lease = publisher_->Handover();
  released_ = true;
  if (lease != exported_lease_) {
    return MrdError(
        absl::StatusCode::kUnavailable, "HANDOVER_DIRECTORY",
        absl::StrCat("the directory's lease changed (", lease, " instead of ",
                     exported_lease_, ") while handing over; try again"));
  }
  return absl::OkStatus();
}

void DirectoryParticipant::Thaw() {
  if (!released_) return;
  released_ = false;
  // Serving on: writing again, on the same lease (the old publisher kept
  // it alive; a lost one is replaced by the new publisher).
  if (absl::Status s = StartPublisher(exported_lease_, /*republish=*/true);
      !s.ok()) {
    LogError("directory after a failed handover: ", s.ToString());
  }
}

absl::Status DirectoryParticipant::Adopt(const v1::HandoverSnapshot& snapshot,
                                         std::vector<UniqueFd>& /*fds*/) {
  adopted_lease_ = snapshot.directory_lease();
  adopted_epoch_ = snapshot.directory_epoch();
  return absl::OkStatus();
}

void DirectoryParticipant::Commit() {
  if (!enabled_) return;
  options_.epoch = adopted_epoch_ + 1;
  if (absl::Status s = StartPublisher(adopted_lease_, /*republish=*/true);
      !s.ok()) {
    LogError("directory after the takeover: ", s.ToString());
  }
}

void DirectoryParticipant::Abandon() {
  adopted_lease_ = 0;
  adopted_epoch_ = 0;
}

}  // namespace mrd::daemon
