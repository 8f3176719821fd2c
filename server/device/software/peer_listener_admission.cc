// PeerListener, accepting and shedding: connections come in batches while
// the connection and memory limits allow; past them the oldest idle or
// unauthenticated one is shed to make room, and a frame's buffer grows only
// within the memory budget (connections wait, parked, until it has room).
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "mrd/net.h"
#include "server/common/log.h"
#include "server/device/software/peer_listener.h"
#include "server/device/software/peer_listener_conn.h"

namespace mrd::device {
namespace {

using peer_listener_internal::kTickMs;

constexpr int kAcceptBatch = 32;
// A frame buffer grows by at least this much (and at least doubles), and
// only when the bytes already received fill it.
constexpr uint64_t kGrowBytes = 64 << 10;

}  // namespace

void PeerListener::LogShed(const char* what, const std::string& remote) {
  ++shed_since_log_;
  absl::Time now = absl::Now();
  if (now - last_shed_log_ < absl::Seconds(1)) return;
  LogWarning("peer listener ", address_, ": ", what, " ", remote, " (",
             shed_since_log_, " connections shed or refused since the last ",
             "report; open ", conns_.size(), "/", options_.max_connections,
             ", before hello ", unauthenticated_.size(), "/",
             options_.max_unauthenticated, ")");
  last_shed_log_ = now;
  shed_since_log_ = 0;
}

void PeerListener::CloseConn(uint64_t id, const char* why) {
  auto it = conns_.find(id);
  if (it == conns_.end()) return;
  Conn& conn = *it->second;
  if (conn.state == Conn::State::kBusy) {
    conn.doomed = true;  // the worker holds its fd; Finish closes it
    return;
  }
  if (why != nullptr) {
    LogDebug("peer listener ", address_, ": closing ", conn.remote, ": ", why);
  }
  if (handler_.close) handler_.close(conn.context);  // none before Start
  charged_ -= conn.charge;
  unauthenticated_.erase(id);
  conns_.erase(it);  // closes the fd, which leaves the epoll set
}

bool PeerListener::MakeRoom(bool for_total) {
  // Silent strangers go first: a connection that has sent nothing, not even
  // bytes still waiting in the socket, oldest first. Only when every
  // connection before hello is talking is the oldest of those shed: a peer
  // whose hello is on its way is never shed while a silent one remains.
  bool (*silent)(const Conn&) = [](const Conn& conn) {
    if (conn.header_got != 0 || !conn.body.empty()) return false;
    char byte;
    return ::recv(conn.fd.get(), &byte, 1, MSG_PEEK | MSG_DONTWAIT) < 0 &&
           (errno == EAGAIN || errno == EWOULDBLOCK);
  };
  for (int pass = 0; pass < 2; ++pass) {
    if (ShedOne(for_total, pass == 0 ? silent : nullptr)) return true;
  }
  return false;
}

bool PeerListener::ShedOne(bool for_total, bool (*eligible)(const Conn& conn)) {
  for (uint64_t id : unauthenticated_) {
    auto found = conns_.find(id);
    if (found == conns_.end()) continue;
    Conn& conn = *found->second;
    if (conn.state == Conn::State::kBusy) continue;  // its hello is running
    if (eligible != nullptr && !eligible(conn)) continue;
    std::string remote = conn.remote;
    CloseConn(id, "shed");
    ++local_.shed;
    LogShed(for_total ? "max connections reached: shed the oldest "
                        "connection before hello,"
                      : "max connections before hello reached: shed the "
                        "oldest,",
            remote);
    return true;
  }
  return false;
}

void PeerListener::AcceptBatch() {
  for (int i = 0; i < kAcceptBatch; ++i) {
    int fd = ::accept4(listen_fd_.get(), nullptr, nullptr,
                       SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      if (err == EINTR || err == ECONNABORTED) continue;
      if ((err == EMFILE || err == ENFILE) && MakeRoom(false)) continue;
      // Out of descriptors (or worse) with nobody to shed: the connection
      // stays pending, so stop watching the listener for a tick instead of
      // spinning on it.
      LogWarning("peer listener ", address_, ": accept: ", std::strerror(err),
                 "; pausing accepts");
      epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, listen_fd_.get(), nullptr);
      listen_armed_ = false;
      accept_paused_until_ = absl::Now() + absl::Milliseconds(kTickMs);
      return;
    }
    UniqueFd socket(fd);
    absl::StatusOr<std::string> remote_or = peer::RemoteAddress(fd);
    std::string remote = remote_or.ok() ? *remote_or : "unknown";
    if (conns_.size() >= options_.max_connections && !MakeRoom(true)) {
      ++local_.refused;
      LogShed("max connections reached, all past hello: refused", remote);
      continue;
    }
    if (unauthenticated_.size() >= options_.max_unauthenticated &&
        !MakeRoom(false)) {
      ++local_.refused;
      LogShed("max connections before hello reached, all busy: refused",
              remote);
      continue;
    }
    peer::SetNoDelay(fd);
    std::shared_ptr<void> context = handler_.open(fd, remote);
    if (context == nullptr) continue;  // closes the socket
    ++local_.accepted;
    auto conn = std::make_unique<Conn>();
    conn->id = next_id_++;
    conn->fd = std::move(socket);
    conn->remote = std::move(remote);
    conn->context = std::move(context);
    conn->accepted_at = conn->last_progress = absl::Now();
    Conn& ref = *conn;
    conns_.emplace(ref.id, std::move(conn));
    unauthenticated_.insert(ref.id);
    // A hello that came with the connection is handled at once (frozen:
    // at the thaw; it is not one of the connections handed over).
    if (!freezing_) ReadSome(ref);
  }
}

uint64_t PeerListener::NextCap(const Conn& conn) {
  return std::min<uint64_t>(
      conn.body_length,
      std::max<uint64_t>(conn.body_cap * 2, conn.body.size() + kGrowBytes));
}

bool PeerListener::CanGrow(const Conn& conn, uint64_t delta) const {
  if (charged_ + delta > options_.buffer_bytes) return false;
  // Deadlock avoidance (a banker's rule): after this growth, some frame
  // being received must still be able to complete with the memory left plus
  // what frames being handled or written will give back. Otherwise every
  // frame could end up waiting for memory that only another waiting frame
  // holds.
  uint64_t reclaimable = 0;
  for (const auto& [id, other] : conns_) {
    if (other->state == Conn::State::kBusy ||
        other->state == Conn::State::kWriting) {
      reclaimable += other->charge;
    }
  }
  const uint64_t free_after =
      options_.buffer_bytes - charged_ - delta + reclaimable;
  if (conn.body_length - (conn.body_cap + delta) <= free_after) return true;
  for (const auto& [id, other] : conns_) {
    if (other.get() == &conn || other->body_cap == 0) continue;
    if (other->state != Conn::State::kReading &&
        other->state != Conn::State::kParked) {
      continue;
    }
    if (other->body_length - other->body_cap <= free_after) return true;
  }
  return false;
}

void PeerListener::ResumeParked() {
  // Any parked frame that may grow now goes on (not only the oldest: the
  // one that can complete must never wait behind one that cannot).
  size_t rounds = parked_.size();
  while (rounds-- > 0 && !parked_.empty()) {
    uint64_t id = parked_.front();
    parked_.pop_front();
    auto it = conns_.find(id);
    if (it == conns_.end() || it->second->state != Conn::State::kParked) {
      continue;
    }
    Conn& conn = *it->second;
    if (!CanGrow(conn, NextCap(conn) - conn.body_cap)) {
      parked_.push_back(id);
      continue;
    }
    conn.state = Conn::State::kReading;
    ReadSome(conn);
  }
}

}  // namespace mrd::device
