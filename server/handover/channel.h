// HandoverChannel: frames of the handover protocol (mrd/v1/handover.proto)
// over a connected Unix stream socket, each with any number of fds.
//
// A frame is a 12-byte header — magic "MRDH", payload length, fd count
// (little-endian uint32s) — with its fds attached to the header by
// SCM_RIGHTS, then the payload (a serialized HandoverFrame). More fds than
// one message may carry (kMaxFdsPerMessage) go first in frames of fds only
// (payload length 0); Receive gathers them, in order, with the next frame's.
// A stream socket rather than SOCK_SEQPACKET: a snapshot of a million
// registrations is tens of MB, more than any datagram.
//
// Every call takes a deadline; the socket is non-blocking underneath. Not
// thread-safe: one side sends or receives at a time.
#ifndef MRD_SERVER_HANDOVER_CHANNEL_H_
#define MRD_SERVER_HANDOVER_CHANNEL_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "mrd/unique_fd.h"
#include "mrd/v1/handover.pb.h"

namespace mrd::handover {

class HandoverChannel {
 public:
  // Fds in one sendmsg (the kernel's SCM_MAX_FD is 253).
  static constexpr size_t kMaxFdsPerMessage = 250;
  // Largest payload accepted (a snapshot of 2^24 registrations fits).
  static constexpr uint32_t kMaxPayload = uint32_t{1} << 31;

  // `socket`: a connected AF_UNIX SOCK_STREAM socket (made non-blocking
  // here).
  explicit HandoverChannel(UniqueFd socket);

  // Sends `frame` with `fds` (borrowed: the kernel duplicates them).
  // Errors: DEADLINE_EXCEEDED "HANDOVER_TIMEOUT", UNAVAILABLE
  // "HANDOVER_PEER_GONE" (the other side closed), or sendmsg's errno.
  absl::Status Send(const v1::HandoverFrame& frame, const std::vector<int>& fds,
                    absl::Time deadline);
  absl::Status Send(const v1::HandoverFrame& frame, absl::Time deadline) {
    return Send(frame, {}, deadline);
  }

  struct Received {
    v1::HandoverFrame frame;
    std::vector<UniqueFd> fds;
  };
  // The next frame and every fd sent with it. Errors as Send, plus
  // INVALID_ARGUMENT "HANDOVER_BAD_FRAME" (bad magic, too long, unparsable
  // payload, truncated fds).
  absl::StatusOr<Received> Receive(absl::Time deadline);

  int fd() const { return socket_.get(); }

 private:
  absl::Status SendMessage(const char* header, size_t header_size,
                           const int* fds, size_t nfds, absl::Time deadline);
  absl::Status WriteAll(const char* data, size_t size, absl::Time deadline);
  absl::Status ReadAll(char* data, size_t size, absl::Time deadline);
  // Reads a header (12 bytes), collecting the fds that came with it.
  absl::Status ReadHeader(char* header, std::vector<UniqueFd>* fds,
                          absl::Time deadline);
  // Waits until the socket is readable (POLLIN) or writable (POLLOUT).
  absl::Status Wait(short events, absl::Time deadline);

  UniqueFd socket_;
};

// The socket of a path's listener, connected (a blocking connect to a
// Unix socket is immediate). NOT_FOUND "HANDOVER_NOBODY" when nothing
// listens there (no file, or refused).
absl::StatusOr<UniqueFd> ConnectUnix(const std::string& path);

}  // namespace mrd::handover

#endif  // MRD_SERVER_HANDOVER_CHANNEL_H_
