#include "server/device/software/peer_listener.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "mrd/net.h"
#include "mrd/peer_frame.h"
#include "mrd/status.h"
#include "server/common/log.h"

namespace mrd::device {
namespace {

constexpr uint64_t kListenerId = 0;
constexpr uint64_t kWakeId = 1;
// A frame buffer grows by at least this much (and at least doubles), and
// only when the bytes already received fill it.
constexpr uint64_t kGrowBytes = 64 << 10;
// One recv reads at most this much, so at most this much of the buffer is
// zero-filled ahead of the data.
constexpr uint64_t kRecvBytes = 256 << 10;
// Fairness: bytes read from one connection per readiness event.
constexpr uint64_t kReadRoundBytes = 1 << 20;
constexpr int kAcceptBatch = 32;
constexpr int kTickMs = 100;
constexpr int kListenBacklog = 1024;

}  // namespace

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

absl::Status PeerListener::CheckOptions(const PeerListenerOptions& options) {
  auto bad = [](const std::string& message) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_OPTION", message);
  };
  if (options.max_connections == 0) return bad("max_connections must be > 0");
  if (options.max_unauthenticated == 0) {
    return bad("max_unauthenticated connections must be > 0");
  }
  if (options.workers == 0 || options.workers > 256) {
    return bad("peer workers must be in [1, 256]");
  }
  if (options.hello_timeout <= absl::ZeroDuration() ||
      options.stall_timeout <= absl::ZeroDuration()) {
    return bad("peer hello and stall timeouts must be > 0");
  }
  if (options.buffer_bytes <
      uint64_t{options.max_frame_bytes} + options.hello_frame_bytes) {
    return bad(absl::StrCat("peer buffer bytes (", options.buffer_bytes,
                            ") must hold at least one largest frame (",
                            options.max_frame_bytes, " bytes) and a hello"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PeerListener>> PeerListener::Bind(
    absl::string_view address, const PeerListenerOptions& options) {
  MRD_RETURN_IF_ERROR(CheckOptions(options));
  MRD_ASSIGN_OR_RETURN(UniqueFd listen_fd,
                       peer::ListenTcp(address, kListenBacklog));
  return Wrap(std::move(listen_fd), options);
}

absl::StatusOr<std::unique_ptr<PeerListener>> PeerListener::FromSocket(
    UniqueFd listen_fd, const PeerListenerOptions& options) {
  MRD_RETURN_IF_ERROR(CheckOptions(options));
  auto bad = [&](const std::string& what) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_PEER_LISTENER",
                    absl::StrCat("inherited peer listener fd ", listen_fd.get(),
                                 " ", what));
  };
  if (!listen_fd.valid()) return bad("is not a file descriptor");
  auto option = [&](int level, int name, int* value) {
    socklen_t length = sizeof(*value);
    return getsockopt(listen_fd.get(), level, name, value, &length) == 0;
  };
  int domain = 0;
  int type = 0;
  int listening = 0;
  if (!option(SOL_SOCKET, SO_DOMAIN, &domain) ||
      !option(SOL_SOCKET, SO_TYPE, &type) ||
      !option(SOL_SOCKET, SO_ACCEPTCONN, &listening)) {
    return bad(absl::StrCat("is not a socket: ", std::strerror(errno)));
  }
  if ((domain != AF_INET && domain != AF_INET6) || type != SOCK_STREAM) {
    return bad("is not a TCP socket");
  }
  if (listening == 0) return bad("is not listening");
  return Wrap(std::move(listen_fd), options);
}

absl::StatusOr<std::unique_ptr<PeerListener>> PeerListener::Wrap(
    UniqueFd listen_fd, const PeerListenerOptions& options) {
  // O_NONBLOCK belongs to the open file description, which a socket handed
  // over shares with the process that made it: harmless, that one sets it
  // too.
  int flags = fcntl(listen_fd.get(), F_GETFL);
  if (flags < 0 || fcntl(listen_fd.get(), F_SETFL, flags | O_NONBLOCK) != 0) {
    return ErrnoError(errno, "fcntl(O_NONBLOCK)", "PEER_LISTEN_FAILED");
  }
  UniqueFd epoll_fd(epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_fd.valid()) {
    return ErrnoError(errno, "epoll_create1", "PEER_LISTEN_FAILED");
  }
  UniqueFd wake_fd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd.valid()) {
    return ErrnoError(errno, "eventfd", "PEER_LISTEN_FAILED");
  }
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.u64 = kWakeId;
  if (epoll_ctl(epoll_fd.get(), EPOLL_CTL_ADD, wake_fd.get(), &event) != 0) {
    return ErrnoError(errno, "epoll_ctl", "PEER_LISTEN_FAILED");
  }
  MRD_ASSIGN_OR_RETURN(std::string bound, peer::LocalAddress(listen_fd.get()));
  return std::unique_ptr<PeerListener>(
      new PeerListener(std::move(listen_fd), std::move(epoll_fd),
                       std::move(wake_fd), std::move(bound), options));
}

PeerListener::PeerListener(UniqueFd listen_fd, UniqueFd epoll_fd,
                           UniqueFd wake_fd, std::string address,
                           const PeerListenerOptions& options)
    : options_(options),
      listen_fd_(std::move(listen_fd)),
      epoll_fd_(std::move(epoll_fd)),
      wake_fd_(std::move(wake_fd)),
      address_(std::move(address)) {
  local_.max_connections = options_.max_connections;
  local_.max_unauthenticated = options_.max_unauthenticated;
  local_.max_buffer_bytes = options_.buffer_bytes;
  absl::MutexLock lock(&mu_);
  stats_ = local_;
}

PeerListener::~PeerListener() { Stop(); }

absl::Status PeerListener::Start(Handler handler) {
  absl::MutexLock start_lock(&start_mu_);
  if (started_ || stopped_) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "ALREADY_STARTED",
                    absl::StrCat("peer listener on ", address_,
                                 " was started or stopped before"));
  }
  started_ = true;
  handler_ = std::move(handler);
  absl::Status status;
  for (uint32_t i = 0; i < options_.workers && status.ok(); ++i) {
    status = FaultPoint(options_.fault_points, "thread.create");
    if (!status.ok()) break;
    absl::StatusOr<Thread> worker =
        Thread::Start("mrd-peer-work", [this] { WorkerLoop(); });
    if (!worker.ok()) {
      status = worker.status();
      break;
    }
    workers_.push_back(std::move(*worker));
  }
  if (status.ok()) status = FaultPoint(options_.fault_points, "thread.create");
  if (status.ok()) {
    absl::StatusOr<Thread> reactor =
        Thread::Start("mrd-peer-io", [this] { ReactorLoop(); });
    if (reactor.ok()) {
      reactor_ = std::move(*reactor);
    } else {
      status = reactor.status();
    }
  }
  if (!status.ok()) {
    LogError("peer listener ", address_, ": cannot start: ", status.message());
    {
      absl::MutexLock lock(&mu_);
      workers_stop_ = true;
    }
    for (Thread& worker : workers_) worker.Join();
    workers_.clear();
    stopped_ = true;
    listen_fd_.Reset();
    return status;
  }
  {
    absl::MutexLock lock(&mu_);
    stats_.threads = local_.threads = workers_.size() + 1;
  }
  return absl::OkStatus();
}

void PeerListener::Stop() {
  absl::MutexLock start_lock(&start_mu_);
  if (stopped_) return;
  stopped_ = true;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  Wake();
  // The reactor closes the listener and every connection, waiting for the
  // frames in the workers, then returns.
  reactor_.Join();
  {
    absl::MutexLock lock(&mu_);
    workers_stop_ = true;
  }
  for (Thread& worker : workers_) worker.Join();
  workers_.clear();
  listen_fd_.Reset();  // never started: the reactor did not close it
}

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

bool PeerListener::OnReactor(absl::AnyInvocable<void()> call) {
  if (stopped_) return false;
  if (!started_) {  // no reactor yet: this thread is the only one
    std::move(call)();
    return true;
  }
  uint64_t ticket = 0;
  {
    absl::MutexLock lock(&mu_);
    if (reactor_gone_) return false;
    calls_.push_back(std::move(call));
    ticket = ++calls_queued_;
  }
  Wake();
  struct Wait {
    PeerListener* self;
    uint64_t ticket;
  } wait{this, ticket};
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](Wait* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {  // Await holds mu_
        return w->self->calls_run_ >= w->ticket || w->self->reactor_gone_;
      },
      &wait));
  return calls_run_ >= ticket;
}

void PeerListener::RunCalls() {
  std::vector<absl::AnyInvocable<void()>> calls;
  {
    absl::MutexLock lock(&mu_);
    if (calls_.empty()) return;
    calls.swap(calls_);
  }
  for (auto& call : calls) std::move(call)();
  absl::MutexLock lock(&mu_);
  calls_run_ += calls.size();
}

namespace {

absl::Status ListenerStopped(const std::string& address) {
  return MrdError(absl::StatusCode::kFailedPrecondition,
                  "PEER_LISTENER_STOPPED",
                  absl::StrCat("peer listener on ", address, " is stopped"));
}

}  // namespace

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

PeerListenerStats PeerListener::Stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void PeerListener::Wake() {
  uint64_t one = 1;
  // Only fails when the counter would overflow, which still wakes epoll.
  (void)!::write(wake_fd_.get(), &one, sizeof(one));
}

void PeerListener::Publish() {
  local_.connections = conns_.size();
  local_.unauthenticated = unauthenticated_.size();
  local_.buffered_bytes = charged_;
  absl::MutexLock lock(&mu_);
  uint64_t threads = stats_.threads;
  stats_ = local_;
  stats_.threads = threads;
}

// ---------------------------------------------------------------------------
// Workers.

bool PeerListener::WorkerHasJob() const {
  return workers_stop_ || !jobs_.empty();
}

void PeerListener::WorkerLoop() {
  while (true) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &PeerListener::WorkerHasJob));
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    Done done;
    done.id = job.id;
    std::string response;
    done.verdict = handler_.frame(job.context, std::move(job.body), &response);
    // Most responses fit the socket buffer: send them from here, and leave
    // only what the socket does not take to the reactor.
    size_t sent = 0;
    while (sent < response.size()) {
      ssize_t n = ::send(job.fd, response.data() + sent, response.size() - sent,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        int err = errno;
        if (err == EINTR) continue;
        if (err != EAGAIN && err != EWOULDBLOCK) done.broken = true;
        break;
      }
      sent += static_cast<size_t>(n);
    }
    if (!done.broken && sent < response.size()) {
      if (sent == 0) {
        done.unsent = std::move(response);
      } else {
        done.unsent.assign(response, sent, std::string::npos);
      }
    }
    {
      absl::MutexLock lock(&mu_);
      done_.push_back(std::move(done));
    }
    Wake();
  }
}

// ---------------------------------------------------------------------------
// Reactor.

void PeerListener::Arm(Conn& conn, uint32_t events) {
  epoll_event event{};
  event.events = events | EPOLLONESHOT;
  event.data.u64 = conn.id;
  int op = conn.registered ? EPOLL_CTL_MOD : EPOLL_CTL_ADD;
  if (epoll_ctl(epoll_fd_.get(), op, conn.fd.get(), &event) != 0) {
    int err = errno;
    LogWarning("peer listener ", address_, ": epoll_ctl for ", conn.remote,
               ": ", std::strerror(err), "; closing it");
    CloseConn(conn.id, nullptr);
    return;
  }
  conn.registered = true;
}

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

void PeerListener::CheckDeadlines(absl::Time now) {
  // Oldest first: the first one still within its deadline ends the scan.
  for (auto it = unauthenticated_.begin(); it != unauthenticated_.end();) {
    const uint64_t id = *it++;
    auto found = conns_.find(id);
    if (found == conns_.end()) continue;
    Conn& conn = *found->second;
    if (conn.accepted_at + options_.hello_timeout > now) break;
    if (conn.state == Conn::State::kBusy) continue;
    ++local_.hello_timeouts;
    CloseConn(id, "no hello in time");
  }
  std::vector<uint64_t> stalled;
  for (const auto& [id, conn] : conns_) {
    bool in_frame =
        (conn->state == Conn::State::kReading && conn->header_got > 0) ||
        conn->state == Conn::State::kParked ||
        conn->state == Conn::State::kWriting;
    if (in_frame && conn->last_progress + options_.stall_timeout <= now) {
      stalled.push_back(id);
    }
  }
  for (uint64_t id : stalled) {
    ++local_.stall_timeouts;
    CloseConn(id, "stalled inside a frame");
  }
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

bool PeerListener::ArmListener() {
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.u64 = kListenerId;
  if (epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, listen_fd_.get(), &event) !=
      0) {
    return false;
  }
  listen_armed_ = true;
  return true;
}

void PeerListener::HandleEvents(const epoll_event* events, int n, bool stopping,
                                bool accept) {
  for (int i = 0; i < n; ++i) {
    const uint64_t id = events[i].data.u64;
    if (id == kWakeId) {
      uint64_t count = 0;
      (void)!::read(wake_fd_.get(), &count, sizeof(count));
      continue;
    }
    if (id == kListenerId) {
      if (!stopping && accept) AcceptBatch();
      continue;
    }
    auto it = conns_.find(id);
    // Frozen: the event is dropped (one-shot: the connection stays quiet);
    // Thaw reads or writes each connection again.
    if (it == conns_.end() || stopping || freezing_) continue;
    Conn& conn = *it->second;
    if (conn.state == Conn::State::kReading) {
      ReadSome(conn);
    } else if (conn.state == Conn::State::kWriting) {
      WriteSome(conn);
    }
  }
}

void PeerListener::CloseEverything() {
  if (listen_fd_.valid()) {
    // Only this process's fd is closed, never shutdown(2): another process
    // may hold a duplicate (StopAccepting) and go on accepting on it. When
    // none does, closing it refuses later connection attempts.
    epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, listen_fd_.get(), nullptr);
    listen_fd_.Reset();
    listen_armed_ = true;  // nothing to re-arm
  }
  std::vector<uint64_t> ids;
  ids.reserve(conns_.size());
  for (const auto& [id, conn] : conns_) ids.push_back(id);
  for (uint64_t id : ids) CloseConn(id, nullptr);  // busy ones: doomed
  Publish();
}

bool PeerListener::ApplyAccepting(bool stopping) {
  bool accept = false;
  {
    absl::MutexLock lock(&mu_);
    accept = accept_wanted_;
    accepting_ = accept;  // StopAccepting / ResumeAccepting return now
  }
  if (!listen_fd_.valid() || stopping) return false;
  if (!accept && listen_armed_) {
    // The backlog now waits for whoever accepts next (another process
    // holding a duplicate, or ResumeAccepting).
    epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, listen_fd_.get(), nullptr);
    listen_armed_ = false;
  } else if (accept && !listen_armed_ && absl::Now() >= accept_paused_until_ &&
             !ArmListener()) {
    LogError("peer listener ", address_,
             ": epoll_ctl(listener): ", std::strerror(errno));
  }
  return accept;
}

void PeerListener::ReactorLoop() {
  bool stopping = false;
  bool accept = ApplyAccepting(stopping);
  absl::Time next_tick = absl::Now() + absl::Milliseconds(kTickMs);
  epoll_event events[128];
  while (true) {
    int timeout = -1;
    // Ticks drive deadlines and a paused listener's re-arming.
    if (!conns_.empty() || (accept && !listen_armed_)) timeout = kTickMs;
    int n = epoll_wait(epoll_fd_.get(), events, 128, timeout);
    if (n < 0) {
      int err = errno;
      if (err != EINTR) {
        LogError("peer listener ", address_,
                 ": epoll_wait: ", std::strerror(err));
        absl::SleepFor(absl::Milliseconds(kTickMs));
      }
      n = 0;
    }
    // Before the events: a stop asked for meanwhile drops a listener event
    // this round reported.
    accept = ApplyAccepting(stopping);
    HandleEvents(events, n, stopping, accept);
    std::vector<Done> done;
    {
      absl::MutexLock lock(&mu_);
      done.swap(done_);
      if (stopping_) stopping = true;
    }
    for (Done& d : done) Finish(std::move(d));
    if (!parked_.empty() && !freezing_) ResumeParked();
    RunCalls();
    TryCompleteFreeze();
    if (stopping) {
      CloseEverything();
      if (conns_.empty()) {
        absl::MutexLock lock(&mu_);
        reactor_gone_ = true;
        return;
      }
      continue;
    }
    absl::Time now = absl::Now();
    if (now >= next_tick) {
      next_tick = now + absl::Milliseconds(kTickMs);
      // Frozen connections make no progress by design.
      if (!freezing_) CheckDeadlines(now);
      if (accept && !listen_armed_ && now >= accept_paused_until_) {
        ArmListener();
      }
    }
    Publish();
  }
}

}  // namespace mrd::device
