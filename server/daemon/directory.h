// The directory on etcd (docs/DIRECTORY.md) as mrd's flags configure it:
// --etcd_endpoints turns it on; the Publisher that keeps mrd's lease and
// writes its entries, handed to the core.
#ifndef MRD_SERVER_DAEMON_DIRECTORY_H_
#define MRD_SERVER_DAEMON_DIRECTORY_H_

#include <memory>

#include "absl/status/status.h"
#include "server/core/core.h"
#include "server/directory/publisher.h"

namespace mrd::daemon {

// Without --etcd_endpoints: nothing (*publisher stays null; the core's
// directory calls answer DIRECTORY_OFF). Otherwise starts the Publisher
// (it does not wait for etcd) and configures the core with it. Errors:
// a bad flag (endpoint, TTL, name), the text to log.
absl::Status StartDirectory(core::Core* core,
                            std::unique_ptr<directory::Publisher>* publisher);

}  // namespace mrd::daemon

#endif  // MRD_SERVER_DAEMON_DIRECTORY_H_
