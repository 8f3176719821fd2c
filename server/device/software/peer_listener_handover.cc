// PeerListener, a live handover: accepting stops and resumes on the
// listening socket, which is duplicated for the new process; established
// connections freeze between frames, are held (socket and state) for the
// new process or thawed if the handover fails, and are adopted there.
#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "mrd/status.h"
#include "server/common/log.h"
#include "server/device/software/peer_listener.h"
#include "server/device/software/peer_listener_conn.h"

namespace mrd::device {
namespace {

absl::Status ListenerStopped(const std::string& address) {
  return MrdError(absl::StatusCode::kFailedPrecondition,
                  "PEER_LISTENER_STOPPED",
                  absl::StrCat("peer listener on ", address, " is stopped"));
}

}  // namespace

absl::StatusOr<UniqueFd> PeerListener::StopAccepting() {
  absl::MutexLock start_lock(&start_mu_);
  MRD_ASSIGN_OR_RETURN(UniqueFd copy, DuplicateSocketLocked());
  SetAcceptingLocked(false);
  return copy;
}

absl::StatusOr<UniqueFd> PeerListener::DuplicateSocket() {
  absl::MutexLock start_lock(&start_mu_);
  return DuplicateSocketLocked();
}

absl::StatusOr<UniqueFd> PeerListener::DuplicateSocketLocked() {
  if (stopped_) {
    return MrdError(absl::StatusCode::kFailedPrecondition,
                    "PEER_LISTENER_STOPPED",
                    absl::StrCat("peer listener on ", address_,
                                 " is stopped: no listening socket to hand "
                                 "over"));
  }
  // Not stopped: the reactor leaves listen_fd_ alone (it closes it only
  // once Stop began, which start_mu_ holds off).
  UniqueFd copy(fcntl(listen_fd_.get(), F_DUPFD_CLOEXEC, 0));
  if (!copy.valid()) {
    return ErrnoError(errno, "fcntl(F_DUPFD_CLOEXEC)",
                      "PEER_LISTENER_DUP_FAILED");
  }
  return copy;
}

void PeerListener::ResumeAccepting() {
  absl::MutexLock start_lock(&start_mu_);
  if (stopped_) return;
  SetAcceptingLocked(true);
}

void PeerListener::SetAcceptingLocked(bool accept) {
  {
    absl::MutexLock lock(&mu_);
    accept_wanted_ = accept;
  }
  if (!started_) return;  // the reactor reads accept_wanted_ when it starts
  // Returns once the reactor acts on it: after a stop, no accept runs in
  // this process any more.
  Wake();
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](PeerListener* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
        return self->accepting_ == self->accept_wanted_;
      },
      this));
}

absl::StatusOr<std::vector<PeerListener::HeldConnection>>
PeerListener::FreezeConnections(absl::Duration timeout) {
  absl::MutexLock start_lock(&start_mu_);
  {
    absl::MutexLock lock(&mu_);
    held_.reset();
  }
  if (!OnReactor([this] {
        freezing_ = true;
        frozen_ = false;  // frozen already: the connections as they are now
        TryCompleteFreeze();
      })) {
    return ListenerStopped(address_);
  }
  std::optional<absl::StatusOr<std::vector<HeldConnection>>> held;
  {
    absl::MutexLock lock(&mu_);
    (void)mu_.AwaitWithTimeout(
        absl::Condition(
            +[](PeerListener* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
              return self->held_.has_value();
            },
            this),
        timeout);
    held.swap(held_);
  }
  if (held.has_value() && held->ok()) return *std::move(held);
  (void)OnReactor([this] { Thaw(); });
  if (held.has_value()) return held->status();
  return MrdError(absl::StatusCode::kUnavailable, "HANDOVER_BUSY",
                  absl::StrCat("a peer frame was still being handled after ",
                               absl::FormatDuration(timeout)));
}

void PeerListener::ThawConnections() {
  absl::MutexLock start_lock(&start_mu_);
  (void)OnReactor([this] { Thaw(); });
}

void PeerListener::DropConnections() {
  absl::MutexLock start_lock(&start_mu_);
  (void)OnReactor([this] {
    std::vector<uint64_t> ids;
    ids.reserve(conns_.size());
    for (const auto& [id, conn] : conns_) ids.push_back(id);
    for (uint64_t id : ids) {
      // The open file lives on in the other process: out of this epoll set
      // first (closing this fd alone would not take it out).
      auto it = conns_.find(id);
      if (it != conns_.end() && it->second->registered) {
        epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, it->second->fd.get(),
                  nullptr);
        it->second->registered = false;
      }
      CloseConn(id, nullptr);
    }
    freezing_ = frozen_ = false;
    Publish();
  });
}

absl::Status PeerListener::AdoptConnection(HeldConnection held,
                                           std::shared_ptr<void> context) {
  auto bad = [](const std::string& why) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_PEER_CONNECTION",
                    absl::StrCat("adopted peer connection: ", why));
  };
  if (!held.fd.valid()) return bad("no socket");
  const int flags = fcntl(held.fd.get(), F_GETFL);
  if (flags < 0 || fcntl(held.fd.get(), F_SETFL, flags | O_NONBLOCK) != 0) {
    return bad(absl::StrCat("fcntl(O_NONBLOCK): ", std::strerror(errno)));
  }
  auto conn = std::make_unique<Conn>();
  conn->fd = std::move(held.fd);
  conn->remote = std::move(held.remote);
  conn->context = std::move(context);
  conn->authenticated = held.authenticated;
  conn->accepted_at = conn->last_progress = absl::Now();
  // The frame read in part, as if those bytes had just arrived.
  const size_t header = std::min(held.received.size(), peer::kFrameHeaderBytes);
  std::memcpy(conn->header, held.received.data(), header);
  conn->header_got = header;
  if (header == peer::kFrameHeaderBytes) {
    uint32_t length = 0;
    for (size_t i = 0; i < peer::kFrameHeaderBytes; ++i) {
      length |= static_cast<uint32_t>(conn->header[i]) << (8 * i);
    }
    const uint32_t limit = conn->authenticated ? options_.max_frame_bytes
                                               : options_.hello_frame_bytes;
    const uint64_t got = held.received.size() - header;
    if (length == 0 || length > limit || got >= length) {
      return bad(absl::StrCat("a frame of ", length, " bytes (limit ", limit,
                              ") with ", got,
                              " bytes received is not one "
                              "being read"));
    }
    conn->body_length = length;
    conn->body.assign(held.received, header, std::string::npos);
    conn->body_cap = got;  // charged below
  }
  if (!held.unsent.empty()) {
    if (header != 0) return bad("a frame both being read and answered");
    conn->out = std::move(held.unsent);
    conn->state = Conn::State::kWriting;
  }
  absl::MutexLock start_lock(&start_mu_);
  absl::Status status;
  if (!OnReactor([this, &conn, &status] {
        if (!freezing_) {
          status = MrdError(absl::StatusCode::kFailedPrecondition,
                            "PEER_LISTENER_NOT_FROZEN",
                            absl::StrCat("peer listener on ", address_,
                                         " adopts connections only while "
                                         "frozen"));
          return;
        }
        conn->id = next_id_++;
        conn->charge = conn->body_cap + conn->out.size();
        charged_ += conn->charge;  // allocated already: even past the budget
        if (!conn->authenticated) unauthenticated_.insert(conn->id);
        const uint64_t id = conn->id;
        conns_.emplace(id, std::move(conn));
        Publish();
      })) {
    return ListenerStopped(address_);
  }
  return status;
}

PeerListener::HeldConnection PeerListener::Hold(const Conn& conn) const {
  HeldConnection held;
  held.fd = UniqueFd(fcntl(conn.fd.get(), F_DUPFD_CLOEXEC, 0));
  held.remote = conn.remote;
  held.context = conn.context;
  held.authenticated = conn.authenticated;
  held.received.assign(reinterpret_cast<const char*>(conn.header),
                       conn.header_got);
  if (conn.header_got == peer::kFrameHeaderBytes) {
    held.received.append(conn.body);
  }
  if (conn.state == Conn::State::kWriting) {
    held.unsent.assign(conn.out, conn.out_off, std::string::npos);
  }
  return held;
}

void PeerListener::TryCompleteFreeze() {
  if (!freezing_ || frozen_) return;
  for (const auto& [id, conn] : conns_) {
    if (conn->state == Conn::State::kBusy) return;  // its Finish comes
  }
  frozen_ = true;
  absl::Status failed;
  std::vector<HeldConnection> held;
  held.reserve(conns_.size());
  for (const auto& [id, conn] : conns_) {
    // One that closes after its last response is not handed over: it ends
    // here (ThawConnections or DropConnections).
    if (!conn->keep_open || conn->doomed) continue;
    held.push_back(Hold(*conn));
    if (!held.back().fd.valid()) {
      failed = ErrnoError(errno, "fcntl(F_DUPFD_CLOEXEC)",
                          "PEER_LISTENER_DUP_FAILED");
      break;
    }
  }
  absl::MutexLock lock(&mu_);
  if (failed.ok()) {
    held_ = std::move(held);
  } else {
    held_ = std::move(failed);
  }
}

void PeerListener::Thaw() {
  {
    absl::MutexLock lock(&mu_);
    held_.reset();  // a freeze that completed after its caller gave up
  }
  if (!freezing_) return;
  freezing_ = frozen_ = false;
  std::vector<uint64_t> ids;
  ids.reserve(conns_.size());
  for (const auto& [id, conn] : conns_) ids.push_back(id);
  const absl::Time now = absl::Now();
  for (uint64_t id : ids) {
    auto it = conns_.find(id);
    if (it == conns_.end()) continue;  // closed by an earlier one's step
    Conn& conn = *it->second;
    conn.last_progress = now;
    if (conn.state == Conn::State::kReading) {
      ReadSome(conn);
    } else if (conn.state == Conn::State::kWriting) {
      WriteSome(conn);
    }
  }
  if (!parked_.empty()) ResumeParked();
  Publish();
}

}  // namespace mrd::device
