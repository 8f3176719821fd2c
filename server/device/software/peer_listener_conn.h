// The peer listener's connection record and the constants its parts share
// (peer_listener.cc: the reactor and the workers; peer_listener_admission.cc:
// accepting and shedding, the memory budget; peer_listener_framing.cc:
// reading and writing frames; peer_listener_handover.cc: a live handover's
// freeze, thaw and adoption). Private to those files.
#ifndef MRD_SERVER_DEVICE_SOFTWARE_PEER_LISTENER_CONN_H_
#define MRD_SERVER_DEVICE_SOFTWARE_PEER_LISTENER_CONN_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "mrd/peer_frame.h"
#include "mrd/unique_fd.h"
#include "server/device/software/peer_listener.h"

namespace mrd::device {
namespace peer_listener_internal {

// The reactor's tick: deadlines are checked, and a paused accept retried,
// this often.
inline constexpr int kTickMs = 100;

}  // namespace peer_listener_internal

struct PeerListener::Conn {
  enum class State { kReading, kParked, kBusy, kWriting };
  uint64_t id = 0;
  UniqueFd fd;
  std::string remote;
  std::shared_ptr<void> context;
  State state = State::kReading;
  bool registered = false;  // in the epoll set
  bool authenticated = false;
  bool doomed = false;  // close as soon as the worker returns
  bool keep_open = true;
  absl::Time accepted_at;
  absl::Time last_progress;
  // The frame being assembled.
  unsigned char header[peer::kFrameHeaderBytes] = {};
  size_t header_got = 0;  // 0 between frames
  uint64_t body_length = 0;
  std::string body;       // size() = bytes received
  uint64_t body_cap = 0;  // bytes reserved (and charged) for the body
  // Memory charged to buffer_bytes: body_cap while reading, then kept
  // while the frame is handled, then the unsent response.
  uint64_t charge = 0;
  std::string out;
  size_t out_off = 0;
};

}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_SOFTWARE_PEER_LISTENER_CONN_H_
