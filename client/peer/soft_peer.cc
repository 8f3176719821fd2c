#include "client/peer/soft_peer.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "mrd/net.h"
#include "mrd/peer_frame.h"
#include "mrd/status.h"

namespace mrd::peer {
namespace {

// Room for the response's fields other than the data (id, status, message).
constexpr uint64_t kResponseOverheadBytes = 64 * 1024;
// Bound on the hello response, which carries no data.
constexpr uint32_t kHelloResponseMaxBytes = 64 * 1024;

absl::Status StatusFromResponse(const v1::PeerResponse& response) {
  switch (response.status()) {
    case v1::PEER_SUCCESS:
      return absl::OkStatus();
    case v1::PEER_REMOTE_ACCESS_ERROR:
      return MrdError(absl::StatusCode::kPermissionDenied,
                      "REMOTE_ACCESS_ERROR", response.message());
    case v1::PEER_REMOTE_INVALID_REQUEST:
      return MrdError(absl::StatusCode::kInvalidArgument,
                      "REMOTE_INVALID_REQUEST", response.message());
    case v1::PEER_BAD_TICKET:
      return MrdError(absl::StatusCode::kUnauthenticated, "BAD_TICKET",
                      response.message());
    case v1::PEER_RESOURCE_EXHAUSTED:
      return MrdError(absl::StatusCode::kResourceExhausted,
                      "LIMIT_PEER_CONNECTIONS", response.message());
    default:
      return MrdError(absl::StatusCode::kInternal, "PEER_PROTOCOL_ERROR",
                      absl::StrCat("device answered with peer status ",
                                   static_cast<int>(response.status()), ": ",
                                   response.message()));
  }
}

uint32_t ResponseLimit(uint64_t max_message_size) {
  uint64_t limit = max_message_size + kResponseOverheadBytes;
  return limit > UINT32_MAX ? UINT32_MAX : static_cast<uint32_t>(limit);
}

}  // namespace

absl::StatusOr<v1::PeerResponse> SoftPeer::Exchange(
    int fd, uint64_t max_response_bytes, const v1::PeerRequest& request) {
  MRD_RETURN_IF_ERROR(WriteFrame(fd, request));
  v1::PeerResponse response;
  absl::Status status =
      ReadFrame(fd, static_cast<uint32_t>(max_response_bytes), &response);
  if (!status.ok()) {
    if (status.code() == absl::StatusCode::kUnavailable) return status;
    return MrdError(absl::StatusCode::kInternal, "PEER_PROTOCOL_ERROR",
                    status.message());
  }
  if (response.id() != request.id()) {
    return MrdError(absl::StatusCode::kInternal, "PEER_PROTOCOL_ERROR",
                    absl::StrCat("response id ", response.id(),
                                 " does not answer request id ", request.id()));
  }
  MRD_RETURN_IF_ERROR(StatusFromResponse(response));
  return response;
}

absl::StatusOr<v1::PeerResponse> SoftPeer::Call(v1::PeerRequest& request) {
  absl::MutexLock lock(&mu_);
  if (broken_) {
    return MrdError(absl::StatusCode::kUnavailable, "PEER_CONNECTION_BROKEN",
                    absl::StrCat("connection ", connection_id_,
                                 " failed earlier and is no longer usable"));
  }
  request.set_id(next_id_++);
  absl::StatusOr<v1::PeerResponse> response =
      Exchange(fd_.get(), ResponseLimit(max_message_size_), request);
  if (!response.ok() &&
      (response.status().code() == absl::StatusCode::kUnavailable ||
       response.status().code() == absl::StatusCode::kInternal)) {
    broken_ = true;
  }
  return response;
}

absl::StatusOr<std::unique_ptr<SoftPeer>> SoftPeer::Connect(
    absl::string_view host_port, absl::string_view ticket) {
  v1::PeerRequest hello;
  hello.set_id(1);
  hello.mutable_hello()->set_ticket(std::string(ticket));
  UniqueFd fd;
  absl::StatusOr<v1::PeerResponse> answered;
  // A listener under a flood of connections sheds the oldest one that has
  // said nothing yet: this one, if this thread was held up between its
  // connect and its hello. Closed (or reset) before the hello was
  // answered, it tries once more on a new connection (a hello changes
  // nothing until it is answered).
  for (int attempt = 0; attempt < 2; ++attempt) {
    MRD_ASSIGN_OR_RETURN(fd, ConnectTcp(host_port));
    answered = Exchange(fd.get(), kHelloResponseMaxBytes, hello);
    if (answered.ok()) break;
    const std::string reason = GetErrorDetail(answered.status()).reason();
    if (reason != "PEER_CONNECTION_CLOSED" &&
        reason != "PEER_CONNECTION_BROKEN") {
      break;
    }
  }
  MRD_ASSIGN_OR_RETURN(v1::PeerResponse response, std::move(answered));
  if (response.connection() == 0 || response.max_message_size() == 0) {
    return MrdError(absl::StatusCode::kInternal, "PEER_PROTOCOL_ERROR",
                    "hello response lacks the connection id or message size");
  }
  return std::unique_ptr<SoftPeer>(new SoftPeer(
      std::move(fd), response.connection(), response.max_message_size()));
}

absl::StatusOr<std::string> SoftPeer::Read(uint32_t rkey, uint64_t address,
                                           uint64_t length) {
  v1::PeerRequest request;
  v1::PeerRead* read = request.mutable_read();
  read->set_rkey(rkey);
  read->set_address(address);
  read->set_length(length);
  MRD_ASSIGN_OR_RETURN(v1::PeerResponse response, Call(request));
  if (response.data().size() != length) {
    return MrdError(absl::StatusCode::kInternal, "PEER_PROTOCOL_ERROR",
                    absl::StrCat("READ of ", length, " bytes returned ",
                                 response.data().size()));
  }
  return std::move(*response.mutable_data());
}

absl::Status SoftPeer::Write(uint32_t rkey, uint64_t address,
                             absl::string_view data) {
  if (data.size() > max_message_size_) {
    return MrdError(absl::StatusCode::kInvalidArgument,
                    "REMOTE_INVALID_REQUEST",
                    absl::StrCat("WRITE of ", data.size(),
                                 " bytes exceeds the device's max message "
                                 "size of ",
                                 max_message_size_));
  }
  v1::PeerRequest request;
  v1::PeerWrite* write = request.mutable_write();
  write->set_rkey(rkey);
  write->set_address(address);
  write->set_data(std::string(data));
  return Call(request).status();
}

}  // namespace mrd::peer
