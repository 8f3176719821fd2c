// The handover state of this process in a file of one word (mrd
// --handover_status_file): taking-over, serving, handing-over,
// handed-over, stopping or stopped. Kubernetes probes and mrd
// --await_handover read it.
#ifndef MRD_SERVER_HANDOVER_STATUS_FILE_H_
#define MRD_SERVER_HANDOVER_STATUS_FILE_H_

#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace mrd::handover {

// Written by the main thread and the handover thread.
class StatusFile {
 public:
  // `path` empty: nothing is written.
  explicit StatusFile(std::string path) : path_(std::move(path)) {}
  // Writes `state` whole and renames it into place (a reader sees the old
  // state or the new one, never a part); a failure is logged.
  void Write(absl::string_view state) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const std::string path_;
  absl::Mutex mu_;
  std::string state_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mrd::handover

#endif  // MRD_SERVER_HANDOVER_STATUS_FILE_H_
