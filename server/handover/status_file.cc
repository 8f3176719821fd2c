#include "server/handover/status_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "mrd/unique_fd.h"
#include "server/common/log.h"

namespace mrd::handover {

void StatusFile::Write(absl::string_view state) {
  if (path_.empty()) return;
  absl::MutexLock lock(&mu_);
  if (state_ == state) return;
  state_ = std::string(state);
  const std::string temporary = absl::StrCat(path_, ".tmp");
  const std::string text = absl::StrCat(state, "\n");
  UniqueFd fd(::open(temporary.c_str(),
                     O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW,
                     0644));
  const bool written = fd.valid() &&
                       ::write(fd.get(), text.data(), text.size()) ==
                           static_cast<ssize_t>(text.size()) &&
                       ::rename(temporary.c_str(), path_.c_str()) == 0;
  if (!written) {
    LogWarning("--handover_status_file=", path_, ": cannot write '", state,
               "': ", std::strerror(errno));
  }
}

}  // namespace mrd::handover
