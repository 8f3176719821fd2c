#include "client/lib/session.h"

#include <poll.h>

#include <cstdio>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/lib/buffer.h"
#include "client/lib/client_core.h"
#include "client/lib/session_core.h"
#include "client/lib/status.h"
#include "mrd/status.h"

namespace mrd::client {
namespace {

// What the library cannot return (a release from a destructor that
// failed) goes to stderr, one line.
void Warn(const std::string& line) {
  std::fprintf(stderr, "%s\n", line.c_str());
}

}  // namespace

namespace internal {

void LogReleaseError(absl::string_view what, uint64_t id,
                     const absl::Status& status) {
  Warn(absl::StrCat("mrd client: releasing ", what, " ", id,
                    " failed: ", FormatStatus(status)));
}

}  // namespace internal

namespace {

absl::Status MovedFrom() {
  return absl::FailedPreconditionError("use of a moved-from Session");
}

}  // namespace

absl::StatusOr<Session> Session::OpenFd(const Client& client,
                                        absl::string_view fd_socket_path) {
  std::string path = fd_socket_path.empty() ? FdSocketPathFor(client.options())
                                            : std::string(fd_socket_path);
  MRD_ASSIGN_OR_RETURN(std::unique_ptr<FdChannel> channel,
                       FdChannel::Connect(path, client.options().rpc_timeout));
  auto core = std::make_shared<internal::SessionCore>(
      client, channel->welcome().session(), internal::SessionKind::kFd);
  core->fd_channel = std::move(channel);
  return Session(std::move(core));
}

absl::StatusOr<Session> Session::OpenLease(const Client& client,
                                           absl::Duration ttl) {
  v1::OpenLeaseSessionRequest request;
  if (ttl > absl::ZeroDuration()) {
    int64_t seconds = absl::ToInt64Seconds(ttl);
    if (ttl == absl::InfiniteDuration() || seconds > UINT32_MAX) {
      return absl::InvalidArgumentError("lease ttl too large");
    }
    request.set_ttl_seconds(static_cast<uint32_t>(seconds < 1 ? 1 : seconds));
  }
  // Vouched for by an fd session when the fd socket lets us in, so that the
  // lease carries our uid (and may import our own files); anonymous else.
  std::optional<Session> voucher;
  if (absl::StatusOr<Session> fd = OpenFd(client); fd.ok()) {
    voucher.emplace(std::move(*fd));
    request.set_vouching_session(voucher->token());
  }
  MRD_ASSIGN_OR_RETURN(v1::SessionInfo info, client.OpenLeaseSession(request));
  return Session(std::make_shared<internal::SessionCore>(
      client, info.session(), internal::SessionKind::kLease));
}

Session Session::Attach(const Client& client, std::string token) {
  return Session(std::make_shared<internal::SessionCore>(
      client, std::move(token), internal::SessionKind::kAttached));
}

Session::Session(Session&& other) noexcept : core_(std::move(other.core_)) {}

Session& Session::operator=(Session&& other) noexcept {
  if (this != &other) {
    EndOnDestruction();
    core_ = std::move(other.core_);
  }
  return *this;
}

namespace {

// Whether the other end of a connected socket is still open.
bool PeerStillThere(int fd) {
  if (fd < 0) return false;
  struct pollfd p = {};
  p.fd = fd;
  p.events = POLLIN | POLLRDHUP;
  if (::poll(&p, 1, 0) < 0) return false;
  return (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL)) == 0;
}

}  // namespace

Session::~Session() { EndOnDestruction(); }

void Session::EndOnDestruction() {
  if (core_ == nullptr) return;
  if (core_->kind != internal::SessionKind::kAttached) {
    absl::Status status = Close();
    if (!status.ok() && core_->kind == internal::SessionKind::kLease) {
      Warn(absl::StrCat("mrd client: closing lease session failed: ",
                        FormatStatus(status)));
    }
  }
  core_.reset();
}

const std::string& Session::token() const {
  static const std::string* const kEmpty = new std::string();
  return core_ == nullptr ? *kEmpty : core_->token;
}

Session::Kind Session::kind() const {
  switch (core_ == nullptr ? internal::SessionKind::kAttached : core_->kind) {
    case internal::SessionKind::kFd:
      return Kind::kFd;
    case internal::SessionKind::kLease:
      return Kind::kLease;
    case internal::SessionKind::kAttached:
      break;
  }
  return Kind::kAttached;
}

const Client& Session::client() const { return core_->client; }

uint32_t Session::peer_uid() const {
  if (core_ == nullptr || core_->fd_channel == nullptr) return 0;
  return core_->fd_channel->welcome().peer_uid();
}

uint32_t Session::peer_pid() const {
  if (core_ == nullptr || core_->fd_channel == nullptr) return 0;
  return core_->fd_channel->welcome().peer_pid();
}

absl::StatusOr<v1::SessionInfo> Session::Info() const {
  if (core_ == nullptr) return MovedFrom();
  v1::GetSessionRequest request;
  request.set_session(core_->token);
  return core_->client.GetSession(request);
}

absl::StatusOr<v1::ListRegistrationsResponse> Session::List() const {
  if (core_ == nullptr) return MovedFrom();
  v1::ListRegistrationsRequest request;
  request.set_session(core_->token);
  return core_->client.ListRegistrations(request);
}

absl::Status Session::Ping() const {
  if (core_ == nullptr) return MovedFrom();
  if (core_->fd_channel != nullptr) {
    return core_->fd_channel->Ping(core_->client.options().rpc_timeout);
  }
  return Info().status();
}

absl::StatusOr<Buffer> Session::ImportMemfd(int fd, bool writable,
                                            uint64_t expected_size) const {
  if (core_ == nullptr) return MovedFrom();
  if (core_->fd_channel == nullptr) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "NOT_AN_FD_SESSION",
                    "ImportMemfd needs a session opened on the fd socket "
                    "(Session::OpenFd)");
  }
  MRD_ASSIGN_OR_RETURN(
      v1::BufferInfo info,
      core_->fd_channel->ImportMemfd(fd, writable, expected_size,
                                     core_->client.options().rpc_timeout));
  return Buffer::Adopt(*this, info);
}

absl::Status Session::Close() {
  if (core_ == nullptr) return MovedFrom();
  if (core_->fd_channel != nullptr) {
    // mrd releases everything the session holds before it answers
    // CloseSession; the socket's hang-up alone would have it released
    // later, on mrd's workers. Not asked when mrd is gone (the socket hung
    // up) or cannot answer: the hang-up ends the session either way.
    if (!core_->ended.load(std::memory_order_acquire) &&
        PeerStillThere(core_->fd_channel->socket_fd())) {
      v1::CloseSessionRequest request;
      request.set_session(core_->token);
      (void)core_->client.CloseSession(request);
    }
    core_->fd_channel->Close();
    core_->ended.store(true, std::memory_order_release);
    return absl::OkStatus();
  }
  if (core_->ended.load(std::memory_order_acquire)) return absl::OkStatus();
  v1::CloseSessionRequest request;
  request.set_session(core_->token);
  absl::Status status = core_->client.CloseSession(request).status();
  // Whatever the answer, the session is no longer ours to use: either it is
  // closed now or mrd had already ended it (WSAENOTCONN).
  if (status.ok() || SeedStatusOf(status) == WSAENOTCONN) {
    core_->ended.store(true, std::memory_order_release);
  }
  return status;
}

int Session::fd_socket() const {
  if (core_ == nullptr || core_->fd_channel == nullptr) return -1;
  return core_->fd_channel->socket_fd();
}

}  // namespace mrd::client
