#include "server/device/software/peer_listener.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/peer/net.h"
#include "server/common/log.h"
#include "server/common/status.h"

namespace mrd::device {

absl::StatusOr<std::unique_ptr<PeerListener>> PeerListener::Bind(
    absl::string_view address, uint32_t max_connections) {
  MRD_ASSIGN_OR_RETURN(UniqueFd listen_fd, peer::ListenTcp(address, 128));
  // Non-blocking, so that a connection reset between poll and accept makes
  // accept fail instead of hanging the acceptor.
  int flags = fcntl(listen_fd.get(), F_GETFL);
  if (flags < 0 || fcntl(listen_fd.get(), F_SETFL, flags | O_NONBLOCK) != 0) {
    return ErrnoError(errno, "fcntl(O_NONBLOCK)", "PEER_LISTEN_FAILED");
  }
  UniqueFd wake_fd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd.valid())
    return ErrnoError(errno, "eventfd", "PEER_LISTEN_FAILED");
  MRD_ASSIGN_OR_RETURN(std::string bound, peer::LocalAddress(listen_fd.get()));
  return std::unique_ptr<PeerListener>(
      new PeerListener(std::move(listen_fd), std::move(wake_fd),
                       std::move(bound), max_connections));
}

PeerListener::PeerListener(UniqueFd listen_fd, UniqueFd wake_fd,
                           std::string address, uint32_t max_connections)
    : listen_fd_(std::move(listen_fd)),
      wake_fd_(std::move(wake_fd)),
      address_(std::move(address)),
      max_connections_(max_connections) {}

PeerListener::~PeerListener() {
  StopAccepting();
  JoinConnections();
}

absl::Status PeerListener::Start(ServeFn serve) {
  absl::MutexLock lock(&mu_);
  if (started_ || stopping_) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "ALREADY_STARTED",
                    absl::StrCat("peer listener on ", address_,
                                 " was started or stopped before"));
  }
  started_ = true;
  serve_ = std::move(serve);
  acceptor_ = std::thread([this] { AcceptLoop(); });
  return absl::OkStatus();
}

void PeerListener::Wake() {
  uint64_t one = 1;
  // Only fails when the counter would overflow, which still wakes poll.
  (void)!::write(wake_fd_.get(), &one, sizeof(one));
}

void PeerListener::StopAccepting() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  Wake();
  // Only the owner calls this, never the acceptor itself.
  if (acceptor_.joinable()) acceptor_.join();
  // Safe without the lock: the acceptor, its only other user, has exited
  // (or never ran), and concurrent StopAccepting calls are the owner's to
  // avoid.
  listen_fd_.Reset();
}

void PeerListener::JoinConnections() {
  absl::flat_hash_map<uint64_t, std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    threads.swap(threads_);
    finished_.clear();
  }
  for (auto& [id, thread] : threads) thread.join();
}

void PeerListener::ReapFinished() {
  std::vector<std::thread> done;
  {
    absl::MutexLock lock(&mu_);
    for (uint64_t id : finished_) {
      auto it = threads_.find(id);
      if (it == threads_.end()) continue;
      done.push_back(std::move(it->second));
      threads_.erase(it);
    }
    finished_.clear();
  }
  for (std::thread& thread : done) thread.join();
}

void PeerListener::Spawn(UniqueFd socket) {
  peer::SetNoDelay(socket.get());
  absl::StatusOr<std::string> remote = peer::RemoteAddress(socket.get());
  std::string name = remote.ok() ? *remote : "unknown";
  absl::MutexLock lock(&mu_);
  if (stopping_) return;  // closes the socket
  if (live_ >= max_connections_) {
    LogWarning("peer listener ", address_, ": refusing ", name, ", already ",
               live_, " connections (max ", max_connections_, ")");
    return;
  }
  uint64_t id = next_thread_++;
  ++live_;
  threads_.emplace(id, std::thread([this, id, socket = std::move(socket),
                                    name = std::move(name)]() mutable {
                     serve_(std::move(socket), std::move(name));
                     {
                       absl::MutexLock done_lock(&mu_);
                       --live_;
                       finished_.push_back(id);
                     }
                     Wake();  // lets the acceptor join this thread
                   }));
}

void PeerListener::AcceptLoop() {
  while (true) {
    pollfd fds[2] = {{listen_fd_.get(), POLLIN, 0},
                     {wake_fd_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      int err = errno;
      if (err == EINTR) continue;
      LogError("peer listener ", address_, ": poll: ", std::strerror(err));
      absl::SleepFor(absl::Milliseconds(100));
      continue;
    }
    if (fds[1].revents != 0) {
      uint64_t count = 0;
      (void)!::read(wake_fd_.get(), &count, sizeof(count));
    }
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
    }
    ReapFinished();
    if ((fds[0].revents & POLLIN) == 0) continue;
    int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR ||
          err == ECONNABORTED) {
        continue;
      }
      LogWarning("peer listener ", address_, ": accept: ", std::strerror(err));
      // Out of descriptors leaves the connection pending, so poll would
      // report it again at once; back off instead of spinning.
      absl::SleepFor(absl::Milliseconds(50));
      continue;
    }
    Spawn(UniqueFd(fd));
  }
}

}  // namespace mrd::device
