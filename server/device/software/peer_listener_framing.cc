// PeerListener, framing: reading a frame's header and body from a
// connection without blocking (a body's buffer grows as its bytes arrive),
// handing the frame to a worker, and writing the response back.
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "mrd/peer_frame.h"
#include "mrd/status.h"
#include "server/common/log.h"
#include "server/device/software/peer_listener.h"
#include "server/device/software/peer_listener_conn.h"

namespace mrd::device {
namespace {

// One recv reads at most this much, so at most this much of the buffer is
// zero-filled ahead of the data.
constexpr uint64_t kRecvBytes = 256 << 10;
// Fairness: bytes read from one connection per readiness event.
constexpr uint64_t kReadRoundBytes = 1 << 20;

}  // namespace

PeerListener::Step PeerListener::AfterRecv(Conn& conn, ssize_t n,
                                           const char* end_why) {
  if (n == 0) {
    CloseConn(conn.id, end_why);
    return Step::kStop;
  }
  const int err = errno;
  if (err == EINTR) return Step::kMore;
  if (err == EAGAIN || err == EWOULDBLOCK) {
    Arm(conn, EPOLLIN);
  } else {
    CloseConn(conn.id, std::strerror(err));
  }
  return Step::kStop;
}

PeerListener::Step PeerListener::ReadHeader(Conn& conn) {
  ssize_t n = ::recv(conn.fd.get(), conn.header + conn.header_got,
                     peer::kFrameHeaderBytes - conn.header_got, 0);
  if (n <= 0) {
    return AfterRecv(conn, n,
                     conn.header_got == 0 ? nullptr : "end in a frame");
  }
  conn.header_got += static_cast<size_t>(n);
  conn.last_progress = absl::Now();
  if (conn.header_got < peer::kFrameHeaderBytes) return Step::kMore;
  uint32_t length = 0;
  for (size_t i = 0; i < peer::kFrameHeaderBytes; ++i) {
    length |= static_cast<uint32_t>(conn.header[i]) << (8 * i);
  }
  const uint32_t limit = conn.authenticated ? options_.max_frame_bytes
                                            : options_.hello_frame_bytes;
  if (length > limit) {
    Dispatch(conn,
             MrdError(absl::StatusCode::kInvalidArgument, "FRAME_TOO_LARGE",
                      absl::StrCat("peer frame of ", length,
                                   " bytes exceeds the limit of ", limit)));
    return Step::kStop;
  }
  conn.body_length = length;
  if (length == 0) {
    Dispatch(conn, std::string());
    return Step::kStop;
  }
  return Step::kMore;
}

bool PeerListener::GrowBody(Conn& conn) {
  // Memory follows the bytes that arrived, never the header's promise; the
  // budget is charged first.
  const uint64_t want = NextCap(conn);
  const uint64_t delta = want - conn.body_cap;
  if (!CanGrow(conn, delta)) {
    conn.state = Conn::State::kParked;
    parked_.push_back(conn.id);
    ++local_.memory_waits;
    return false;  // not armed: nothing is read until memory frees
  }
  std::string bigger;
  bigger.reserve(want);  // from empty: exactly `want`
  bigger.append(conn.body);
  conn.body.swap(bigger);
  charged_ += delta;
  conn.charge += delta;
  conn.body_cap = want;
  return true;
}

void PeerListener::ReadSome(Conn& conn) {
  uint64_t round = 0;
  while (true) {
    if (conn.header_got < peer::kFrameHeaderBytes) {
      if (ReadHeader(conn) == Step::kStop) return;
      continue;
    }
    if (conn.body.size() == conn.body_cap && !GrowBody(conn)) return;
    const size_t old = conn.body.size();
    const size_t room = std::min<uint64_t>(conn.body_cap - old, kRecvBytes);
    conn.body.resize(old + room);
    ssize_t n = ::recv(conn.fd.get(), conn.body.data() + old, room, 0);
    conn.body.resize(old + (n > 0 ? static_cast<size_t>(n) : 0));
    if (n <= 0) {
      if (AfterRecv(conn, n, "end in a frame") == Step::kStop) return;
      continue;
    }
    conn.last_progress = absl::Now();
    if (conn.body.size() == conn.body_length) {
      std::string body;
      body.swap(conn.body);
      conn.body_cap = 0;  // the charge stays until the frame is handled
      Dispatch(conn, std::move(body));
      return;
    }
    round += static_cast<uint64_t>(n);
    if (round >= kReadRoundBytes) {
      Arm(conn, EPOLLIN);  // one-shot: fires again at once if data is left
      return;
    }
  }
}

void PeerListener::Dispatch(Conn& conn, absl::StatusOr<std::string> body) {
  conn.state = Conn::State::kBusy;
  conn.header_got = 0;
  conn.body_length = 0;
  Job job;
  job.id = conn.id;
  job.fd = conn.fd.get();
  job.context = conn.context;
  job.body = std::move(body);
  absl::MutexLock lock(&mu_);
  jobs_.push_back(std::move(job));
}

void PeerListener::Finish(Done done) {
  auto it = conns_.find(done.id);
  if (it == conns_.end()) return;  // cannot happen: busy ones stay
  Conn& conn = *it->second;
  conn.state = Conn::State::kReading;
  charged_ -= conn.charge;  // the frame is gone
  conn.charge = 0;
  if (done.verdict.authenticated && !conn.authenticated) {
    conn.authenticated = true;
    unauthenticated_.erase(conn.id);
  }
  if (conn.doomed || done.broken) {
    CloseConn(conn.id, done.broken ? "send failed" : nullptr);
    return;
  }
  conn.keep_open = done.verdict.keep_open;
  if (!done.unsent.empty()) {
    conn.out = std::move(done.unsent);
    conn.out_off = 0;
    // Already allocated: charged even past the budget, which then holds
    // back reading until it drains.
    conn.charge = conn.out.size();
    charged_ += conn.charge;
    conn.state = Conn::State::kWriting;
    conn.last_progress = absl::Now();
    if (!freezing_) Arm(conn, EPOLLOUT);  // else Thaw writes it
    return;
  }
  if (!conn.keep_open) {
    CloseConn(conn.id, nullptr);
    return;
  }
  // The next request may be waiting already (frozen: Thaw reads it).
  if (!freezing_) ReadSome(conn);
}

void PeerListener::WriteSome(Conn& conn) {
  while (conn.out_off < conn.out.size()) {
    ssize_t n = ::send(conn.fd.get(), conn.out.data() + conn.out_off,
                       conn.out.size() - conn.out_off, MSG_NOSIGNAL);
    if (n < 0) {
      int err = errno;
      if (err == EINTR) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) {
        Arm(conn, EPOLLOUT);
      } else {
        CloseConn(conn.id, std::strerror(err));
      }
      return;
    }
    conn.out_off += static_cast<size_t>(n);
    conn.last_progress = absl::Now();
  }
  charged_ -= conn.charge;
  conn.charge = 0;
  std::string().swap(conn.out);
  conn.out_off = 0;
  if (!conn.keep_open) {
    CloseConn(conn.id, nullptr);
    return;
  }
  conn.state = Conn::State::kReading;
  ReadSome(conn);
}

}  // namespace mrd::device
