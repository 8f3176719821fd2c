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
#include "mrd/status.h"
#include "server/common/log.h"
#include "server/device/software/peer_listener_conn.h"

namespace mrd::device {
namespace {

using peer_listener_internal::kTickMs;

constexpr uint64_t kListenerId = 0;
constexpr uint64_t kWakeId = 1;
constexpr int kListenBacklog = 1024;

}  // namespace

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
