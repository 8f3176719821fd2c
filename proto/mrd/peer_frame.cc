#include "mrd/peer_frame.h"

#include <sys/socket.h>
#include <sys/types.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"

namespace mrd::peer {
namespace {

absl::Status Broken(absl::string_view call, int err) {
  return MrdError(absl::StatusCode::kUnavailable, "PEER_CONNECTION_BROKEN",
                  absl::StrCat("peer socket ", call, ": ", std::strerror(err)));
}

absl::Status SendAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    // MSG_NOSIGNAL: a peer that went away must give EPIPE here, not kill
    // the process with SIGPIPE.
    ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL);
    if (n < 0) {
      int err = errno;
      if (err == EINTR) continue;
      return Broken("send", err);
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Reads exactly `size` bytes. An end of stream before the first byte is
// reported as PEER_CONNECTION_CLOSED (the other end finished cleanly between
// frames); anywhere later it is PEER_CONNECTION_BROKEN.
absl::Status RecvAll(int fd, char* data, size_t size) {
  size_t received = 0;
  while (received < size) {
    ssize_t n = ::recv(fd, data + received, size - received, 0);
    if (n < 0) {
      int err = errno;
      if (err == EINTR) continue;
      return Broken("recv", err);
    }
    if (n == 0) {
      if (received == 0) {
        return MrdError(absl::StatusCode::kUnavailable,
                        "PEER_CONNECTION_CLOSED", "peer closed the connection");
      }
      return MrdError(absl::StatusCode::kUnavailable, "PEER_CONNECTION_BROKEN",
                      absl::StrCat("peer closed the connection after ",
                                   received, " of ", size, " bytes"));
    }
    received += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AppendFrame(const google::protobuf::MessageLite& message,
                         std::string* out) {
  size_t body = message.ByteSizeLong();
  if (body > std::numeric_limits<uint32_t>::max()) {
    return MrdError(absl::StatusCode::kInvalidArgument, "FRAME_TOO_LARGE",
                    absl::StrCat("peer message of ", body,
                                 " bytes does not fit a 32-bit frame length"));
  }
  const size_t start = out->size();
  out->resize(start + kFrameHeaderBytes + body);
  uint32_t length = static_cast<uint32_t>(body);
  for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
    (*out)[start + i] = static_cast<char>((length >> (8 * i)) & 0xff);
  }
  if (!message.SerializeToArray(out->data() + start + kFrameHeaderBytes,
                                static_cast<int>(body))) {
    out->resize(start);
    return MrdError(absl::StatusCode::kInternal, "FRAME_SERIALIZE_FAILED",
                    "peer message could not be serialized");
  }
  return absl::OkStatus();
}

absl::Status WriteFrame(int fd, const google::protobuf::MessageLite& message) {
  size_t body = message.ByteSizeLong();
  if (body > std::numeric_limits<uint32_t>::max()) {
    return MrdError(absl::StatusCode::kInvalidArgument, "FRAME_TOO_LARGE",
                    absl::StrCat("peer message of ", body,
                                 " bytes does not fit a 32-bit frame length"));
  }
  // One buffer, one send loop: header and body leave together, which keeps
  // small frames in one TCP segment.
  std::string frame(kFrameHeaderBytes + body, '\0');
  uint32_t length = static_cast<uint32_t>(body);
  for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
    frame[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  }
  if (!message.SerializeToArray(frame.data() + kFrameHeaderBytes,
                                static_cast<int>(body))) {
    return MrdError(absl::StatusCode::kInternal, "FRAME_SERIALIZE_FAILED",
                    "peer message could not be serialized");
  }
  return SendAll(fd, frame.data(), frame.size());
}

absl::Status ReadFrame(int fd, uint32_t max_body_bytes,
                       google::protobuf::MessageLite* message) {
  unsigned char header[kFrameHeaderBytes];
  // Closed-before-header is an orderly end; RecvAll already says which.
  MRD_RETURN_IF_ERROR(
      RecvAll(fd, reinterpret_cast<char*>(header), sizeof(header)));
  uint32_t length = 0;
  for (size_t i = 0; i < kFrameHeaderBytes; ++i) {
    length |= static_cast<uint32_t>(header[i]) << (8 * i);
  }
  if (length > max_body_bytes) {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "FRAME_TOO_LARGE",
        absl::StrCat("peer frame of ", length, " bytes exceeds the limit of ",
                     max_body_bytes));
  }
  // Grown as the bytes arrive (doubling from 64 KiB), not sized from the
  // header: a header alone must not commit `length` bytes of memory.
  std::string body;
  size_t received = 0;
  while (received < length) {
    size_t chunk = std::min<size_t>(length - received,
                                    std::max<size_t>(received, 64 << 10));
    body.resize(received + chunk);
    absl::Status status = RecvAll(fd, body.data() + received, chunk);
    if (!status.ok()) {
      // The header arrived, so any end of stream here is inside the frame.
      return MrdError(absl::StatusCode::kUnavailable, "PEER_CONNECTION_BROKEN",
                      status.message());
    }
    received += chunk;
  }
  if (!message->ParseFromString(body)) {
    return MrdError(absl::StatusCode::kInvalidArgument, "FRAME_UNPARSABLE",
                    absl::StrCat("peer frame of ", length,
                                 " bytes is not a valid message"));
  }
  return absl::OkStatus();
}

}  // namespace mrd::peer
