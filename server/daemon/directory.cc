#include "server/daemon/directory.h"

#include <limits.h>
#include <unistd.h>

#include <string>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "mrd/status.h"
#include "server/common/log.h"
#include "server/daemon/config.h"
#include "server/daemon/flags.h"

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

}  // namespace

absl::Status StartDirectory(core::Core* core,
                            std::unique_ptr<directory::Publisher>* publisher) {
  const std::vector<std::string> endpoints =
      absl::GetFlag(FLAGS_etcd_endpoints);
  if (endpoints.empty()) return absl::OkStatus();
  core::DirectoryOptions options;
  options.root = absl::GetFlag(FLAGS_directory_root);
  if (options.root.empty() || options.root.front() != '/' ||
      options.root.back() == '/') {
    return Fail(absl::StrCat("--directory_root='", options.root,
                             "' must start with '/' and not end with one"));
  }
  options.cluster = absl::GetFlag(FLAGS_directory_cluster);
  MRD_RETURN_IF_ERROR(CheckSegment("directory_cluster", options.cluster));
  options.node = absl::GetFlag(FLAGS_node_name);
  if (options.node.empty()) options.node = HostName();
  MRD_RETURN_IF_ERROR(CheckSegment("node_name", options.node));
  options.unpublish_wait = absl::GetFlag(FLAGS_directory_unpublish_wait);

  directory::PublisherOptions publisher_options;
  publisher_options.etcd.endpoints = endpoints;
  publisher_options.lease_ttl = absl::GetFlag(FLAGS_directory_lease_ttl);
  publisher_options.max_keys = absl::GetFlag(FLAGS_directory_max_entries);
  absl::StatusOr<std::unique_ptr<directory::Publisher>> started =
      directory::Publisher::Start(publisher_options);
  if (!started.ok()) {
    return Fail(absl::StrCat("directory (--etcd_endpoints=",
                             absl::StrJoin(endpoints, ","),
                             "): ", started.status().ToString()));
  }
  *publisher = std::move(*started);
  LogInfo("directory: etcd ", absl::StrJoin(endpoints, ","), ", cluster ",
          options.cluster, ", node ", options.node, ", lease TTL ",
          absl::FormatDuration(publisher_options.lease_ttl));
  core->SetDirectory(publisher->get(), std::move(options));
  return absl::OkStatus();
}

}  // namespace mrd::daemon
