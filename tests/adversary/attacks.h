// The attacks of the adversary test (issue 8, section 4). Each runs in its
// own child process (so that it can be another uid, another tenant, and so
// that whatever it does to itself cannot hide what it does to mrd), repeats
// until its deadline, and counts every outcome in a Tally.
//
//   lease_flood         anonymous OpenLeaseSession with 24 h TTLs until
//                       refused, then CloseSession them all; again.
//   session_flood       fd sessions until refused; close them; again.
//   buffer_flood        one fd session imports the same 4 KiB memfd until
//                       refused (buffers, or fds); end the session; again.
//   registration_flood  one fd session registers every other page of a
//                       large memfd from 4 threads until refused; again.
//   peer_idle           hundreds of TCP connections to the peer port that
//                       never say hello; each must be closed by mrd.
//   peer_bigframe       connections that announce a 16 MiB frame, then
//                       fall silent; each must be closed by mrd.
//   peer_garbage        connections sending random bytes; closed by mrd.
//   peer_bad_ticket     hello with unknown tickets (short and 64 KiB).
//   import_secret       (uid 65534, not allowed on the fd socket) fd
//                       session, then an anonymous lease importing a root
//                       0600 file, a 0644 file writable, and paths out of
//                       --shm_dir.
//   churn               fd sessions closed while RegisterMr calls are in
//                       flight; gRPC calls with garbage tokens and handles;
//                       garbage datagrams on the fd socket.
//   grpc_spam           many gRPC channels, completion-stream subscription
//                       spam, RegisterMr with 1 MiB request ids.
#ifndef MRD_TESTS_ADVERSARY_ATTACKS_H_
#define MRD_TESTS_ADVERSARY_ATTACKS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "tests/adversary/tally.h"

namespace mrd::adversary {

// The page the attacks and the test work in, and the access bit of a
// remote read (the NDK flag value on the wire).
inline constexpr uint64_t kPage = 4096;
inline constexpr uint32_t kRemoteRead = 0x2;

struct AttackContext {
  std::string grpc_socket;
  std::string fd_socket;
  std::string peer_address;  // host:port
  absl::Time deadline;
};

std::vector<std::string> AttackNames();

// Runs attack `name` until ctx.deadline. False for an unknown name.
bool RunAttack(const std::string& name, const AttackContext& ctx, Tally& tally);

}  // namespace mrd::adversary

#endif  // MRD_TESTS_ADVERSARY_ATTACKS_H_
