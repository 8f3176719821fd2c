// Framing of the software device's peer path (proto/mrd/v1/peer.proto): each
// frame is a 4-byte little-endian body length followed by that many bytes of
// one serialized message. This is the only implementation; the device's
// listener and the SoftPeer client both use it, so the two ends agree byte
// for byte.
//
// Thread safety: the functions keep no state. A socket must not be read (or
// written) by two threads at once.
#ifndef MRD_PROTO_MRD_PEER_FRAME_H_
#define MRD_PROTO_MRD_PEER_FRAME_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "google/protobuf/message_lite.h"

namespace mrd::peer {

inline constexpr size_t kFrameHeaderBytes = 4;

// Serializes `message` and sends header and body, retrying on EINTR and
// partial writes, never raising SIGPIPE. Errors: UNAVAILABLE
// "PEER_CONNECTION_BROKEN" (the socket failed or the other end is gone),
// INVALID_ARGUMENT "FRAME_TOO_LARGE" (the body does not fit 32 bits).
absl::Status WriteFrame(int fd, const google::protobuf::MessageLite& message);

// Appends header and serialized body of `message` to `out` (what WriteFrame
// sends). Errors: INVALID_ARGUMENT "FRAME_TOO_LARGE", INTERNAL
// "FRAME_SERIALIZE_FAILED".
absl::Status AppendFrame(const google::protobuf::MessageLite& message,
                         std::string* out);

// Receives one frame whose body is at most `max_body_bytes` and parses it
// into `message`. Errors: UNAVAILABLE "PEER_CONNECTION_CLOSED" (orderly end
// of stream at a frame boundary), UNAVAILABLE "PEER_CONNECTION_BROKEN" (end of
// stream inside a frame, reset, any other socket error), INVALID_ARGUMENT
// "FRAME_TOO_LARGE" (the header announces more than `max_body_bytes`; the
// body is left unread, so the stream is no longer usable), INVALID_ARGUMENT
// "FRAME_UNPARSABLE" (the body is not a valid message; the stream is still
// in sync). Memory follows the bytes received (the buffer at most doubles
// ahead of them), never the header's announcement alone.
absl::Status ReadFrame(int fd, uint32_t max_body_bytes,
                       google::protobuf::MessageLite* message);

}  // namespace mrd::peer

#endif  // MRD_PROTO_MRD_PEER_FRAME_H_
