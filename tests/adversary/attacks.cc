#include "tests/adversary/attacks.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "client/lib/mrd_client.h"
#include "client/peer/soft_peer.h"
#include "mrd/peer_frame.h"
#include "mrd/v1/peer.pb.h"

namespace mrd::adversary {
namespace {

// A connection to the peer port that mrd still holds after this long has
// escaped every deadline (hello: 5 s by default).
constexpr absl::Duration kTooLongOpen = absl::Seconds(15);

bool Before(const AttackContext& ctx) { return absl::Now() < ctx.deadline; }

absl::StatusOr<client::Client> Connect(const AttackContext& ctx) {
  client::ClientOptions o;
  o.socket_path = ctx.grpc_socket;
  o.fd_socket_path = ctx.fd_socket;
  o.rpc_timeout = absl::Seconds(20);
  return client::Client::Connect(o);
}

std::string RandomBytes(std::mt19937_64& rng, size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

std::string RandomHex(std::mt19937_64& rng, size_t n) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s(n, '0');
  for (char& c : s) c = kHex[rng() % 16];
  return s;
}

// --- gRPC and fd-socket floods ------------------------------------------

void LeaseFlood(const AttackContext& ctx, Tally& tally) {
  auto c = Connect(ctx);
  if (!c.ok()) return tally.Add(c.status());
  while (Before(ctx)) {
    std::vector<std::string> tokens;
    while (Before(ctx) && tokens.size() < 5000) {
      v1::OpenLeaseSessionRequest r;
      r.set_ttl_seconds(24 * 3600);
      auto s = c->OpenLeaseSession(r);
      tally.Add(s.status());
      if (!s.ok()) break;
      tokens.push_back(s->session());
    }
    for (const std::string& t : tokens) {
      v1::CloseSessionRequest r;
      r.set_session(t);
      tally.Add(c->CloseSession(r).status());
    }
  }
}

void SessionFlood(const AttackContext& ctx, Tally& tally) {
  auto c = Connect(ctx);
  if (!c.ok()) return tally.Add(c.status());
  while (Before(ctx)) {
    std::vector<client::Session> sessions;
    while (Before(ctx) && sessions.size() < 5000) {
      auto s = client::Session::OpenFd(*c);
      tally.Add(s.status());
      if (!s.ok()) break;
      sessions.push_back(std::move(*s));
    }
  }
}

void BufferFlood(const AttackContext& ctx, Tally& tally) {
  auto c = Connect(ctx);
  if (!c.ok()) return tally.Add(c.status());
  auto memfd = client::MappedMemfd::Create(kPage, "adversary-flood");
  if (!memfd.ok()) return tally.Add(memfd.status());
  while (Before(ctx)) {
    auto s = client::Session::OpenFd(*c);
    tally.Add(s.status());
    if (!s.ok()) continue;
    for (int i = 0; i < 100000 && Before(ctx); ++i) {
      auto b = s->ImportMemfd(memfd->fd(), true, kPage);
      tally.Add(b.status());
      if (!b.ok()) break;
      b->Detach();  // stays in the session until it ends
    }
    (void)s->Close();
  }
}

void RegistrationFlood(const AttackContext& ctx, Tally& tally) {
  auto c = Connect(ctx);
  if (!c.ok()) return tally.Add(c.status());
  constexpr uint64_t kPages = 2 * 8192 + 2;  // every other page: 8193
  constexpr int kThreads = 4;
  while (Before(ctx)) {
    auto s = client::Session::OpenFd(*c);
    tally.Add(s.status());
    if (!s.ok()) continue;
    auto b = client::Buffer::Create(*s, kPages * kPage, "adversary-regs");
    tally.Add(b.status());
    if (!b.ok()) continue;
    std::atomic<bool> refused{false};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (uint64_t page = 2 * t; page < kPages && !refused && Before(ctx);
             page += 2 * kThreads) {
          client::RegisterOptions o;
          o.buffer = b->id();
          o.offset = page * kPage;
          o.length = kPage;
          o.flags = kRemoteRead;
          auto r = client::Registration::Register(*s, o);
          tally.Add(r.status());
          if (!r.ok()) {
            refused = true;
            break;
          }
          r->Detach();  // held until the session ends
        }
      });
    }
    for (auto& t : threads) t.join();
    b->Detach();
    (void)s->Close();
  }
}

// --- the peer port ----------------------------------------------------------

bool ParseHostPort(const std::string& host_port, sockaddr_in* addr) {
  std::pair<std::string, std::string> hp =
      absl::StrSplit(host_port, absl::MaxSplits(':', 1));
  int port = 0;
  if (!absl::SimpleAtoi(hp.second, &port)) return false;
  std::memset(addr, 0, sizeof(*addr));
  addr->sin_family = AF_INET;
  addr->sin_port = htons(static_cast<uint16_t>(port));
  return inet_pton(AF_INET, hp.first.c_str(), &addr->sin_addr) == 1;
}

// A non-blocking TCP connection, or -1 with `error` set.
int ConnectTcp(const std::string& host_port, std::string* error) {
  sockaddr_in addr;
  if (!ParseHostPort(host_port, &addr)) {
    *error = "bad address " + host_port;
    return -1;
  }
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *error = absl::StrCat("socket: ", std::strerror(errno));
    return -1;
  }
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 &&
      errno != EINPROGRESS) {
    *error = absl::StrCat("connect: ", std::strerror(errno));
    ::close(fd);
    return -1;
  }
  pollfd p{fd, POLLOUT, 0};
  if (::poll(&p, 1, 3000) != 1) {
    *error = "connect: no answer in 3 s";
    ::close(fd);
    return -1;
  }
  int err = 0;
  socklen_t len = sizeof(err);
  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) {
    *error = absl::StrCat("connect: ", std::strerror(err));
    ::close(fd);
    return -1;
  }
  return fd;
}

void SendAll(int fd, const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::send(fd, bytes.data() + done, bytes.size() - done,
                       MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n <= 0) return;  // the other end is gone or the window is full
    done += static_cast<size_t>(n);
  }
}

// Keeps `count` connections open to the peer port (making at most
// `max_connections` in all), each first given to `opening(fd, rng)` (false:
// drop it), and counts each one mrd closes ("closed_by_server"). A
// connection mrd still holds after `too_long` is a failure ("still_open").
template <typename Opening>
void HoldConnections(const AttackContext& ctx, size_t count,
                     uint64_t max_connections, absl::Duration too_long,
                     Opening opening, Tally& tally) {
  std::mt19937_64 rng(::getpid());
  struct Conn {
    int fd;
    absl::Time opened;
  };
  std::vector<Conn> conns;
  uint64_t made = 0;
  while (Before(ctx)) {
    while (conns.size() < count && made < max_connections && Before(ctx)) {
      std::string error;
      int fd = ConnectTcp(ctx.peer_address, &error);
      ++made;
      if (fd < 0) {
        tally.AddNamed("connect_failed", true, error);
        break;
      }
      if (!opening(fd, rng)) {
        ::close(fd);
        break;
      }
      conns.push_back({fd, absl::Now()});
    }
    std::vector<pollfd> polls;
    for (const Conn& c : conns) polls.push_back({c.fd, POLLIN | POLLRDHUP, 0});
    ::poll(polls.data(), polls.size(), 200);
    std::vector<Conn> still;
    for (size_t i = 0; i < conns.size(); ++i) {
      bool closed = false;
      if (polls[i].revents != 0) {
        char buf[4096];
        ssize_t n = ::recv(conns[i].fd, buf, sizeof(buf), MSG_DONTWAIT);
        closed = n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR) ||
                 (polls[i].revents & (POLLHUP | POLLERR | POLLRDHUP)) != 0;
      }
      if (closed) {
        ::close(conns[i].fd);
        tally.AddNamed("closed_by_server");
      } else if (absl::Now() - conns[i].opened > too_long) {
        ::close(conns[i].fd);
        tally.AddNamed("still_open", true,
                       absl::StrCat("mrd held a connection for ",
                                    absl::FormatDuration(too_long)));
      } else {
        still.push_back(conns[i]);
      }
    }
    conns = std::move(still);
  }
  for (const Conn& c : conns) {
    ::close(c.fd);
    tally.AddNamed("open_at_deadline");
  }
}

void PeerIdle(const AttackContext& ctx, Tally& tally) {
  HoldConnections(
      ctx, 300, 3000, kTooLongOpen, [](int, std::mt19937_64&) { return true; },
      tally);
}

// Says hello with a valid ticket, then announces a 16 MiB frame (the
// largest a bound connection may send) and falls silent: memory for it must
// be committed only as bytes arrive. mrd may keep such a connection until
// its stall deadline (30 s), so only one held past 45 s is a failure.
void PeerBigFrame(const AttackContext& ctx, Tally& tally) {
  auto c = Connect(ctx);
  if (!c.ok()) return tally.Add(c.status());
  auto s = client::Session::OpenFd(*c);
  if (!s.ok()) return tally.Add(s.status());
  auto ticket = client::PeerTicket::Create(*s);
  if (!ticket.ok()) return tally.Add(ticket.status());
  HoldConnections(
      ctx, 48, 2000, absl::Seconds(45),
      [&](int fd, std::mt19937_64&) {
        v1::PeerRequest hello;
        hello.set_id(1);
        hello.mutable_hello()->set_ticket(ticket->ticket());
        pollfd p{fd, POLLIN, 0};
        v1::PeerResponse response;
        const int flags = ::fcntl(fd, F_GETFL);
        ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);  // hello: blocking
        absl::Status st = peer::WriteFrame(fd, hello);
        if (st.ok() && ::poll(&p, 1, 10000) != 1) {
          st = absl::DeadlineExceededError("no answer to hello in 10 s");
        }
        if (st.ok()) st = peer::ReadFrame(fd, 1 << 16, &response);
        if (st.ok() && response.status() != v1::PEER_SUCCESS) {
          st = absl::PermissionDeniedError(response.message());
        }
        if (!st.ok()) {
          tally.AddNamed("hello_failed", true, st.ToString());
          return false;
        }
        tally.AddNamed("hello_ok");
        ::fcntl(fd, F_SETFL, flags);
        SendAll(fd, std::string("\x00\x00\x00\x01", 4));  // 16 MiB
        return true;
      },
      tally);
}

void PeerGarbage(const AttackContext& ctx, Tally& tally) {
  HoldConnections(
      ctx, 16, 2000, kTooLongOpen,
      [](int fd, std::mt19937_64& rng) {
        SendAll(fd, RandomBytes(rng, 64));
        return true;
      },
      tally);
}

void PeerBadTicket(const AttackContext& ctx, Tally& tally) {
  std::mt19937_64 rng(::getpid());
  for (uint64_t i = 0; Before(ctx); ++i) {
    const bool huge = i % 16 == 15;
    std::string ticket = RandomHex(rng, huge ? 65536 : 32);
    auto peer = peer::SoftPeer::Connect(ctx.peer_address, ticket);
    if (peer.ok()) {
      tally.AddNamed("ACCEPTED_BAD_TICKET", true,
                     "hello with a made-up ticket");
      continue;
    }
    const std::string outcome = OutcomeOf(peer.status());
    // A stranger may be shed before its hello is answered (mrd closes the
    // oldest unauthenticated connection when too many wait, and a 64 KiB
    // hello is refused as a frame: mrd answers it without a request id,
    // which SoftPeer calls PEER_PROTOCOL_ERROR, and closes).
    if (outcome == "PEER_CONNECTION_CLOSED" ||
        outcome == "PEER_CONNECTION_BROKEN" ||
        (huge && outcome == "PEER_PROTOCOL_ERROR")) {
      tally.AddNamed(outcome);
    } else {
      tally.Add(peer.status());
    }
  }
}

// --- privilege crossing -------------------------------------------------

void ImportSecret(const AttackContext& ctx, Tally& tally) {
  auto c = Connect(ctx);
  if (!c.ok()) return tally.Add(c.status());
  while (Before(ctx)) {
    auto fd_session = client::Session::OpenFd(*c);
    if (fd_session.ok()) {
      tally.AddNamed("FD_SESSION_OPENED", true, "uid not in --allowed_uids");
    } else {
      tally.Add(fd_session.status());
    }
    v1::OpenLeaseSessionRequest open;
    open.set_ttl_seconds(60);
    open.set_vouching_session("not-a-session-of-mine");
    tally.Add(c->OpenLeaseSession(open).status());
    open.clear_vouching_session();
    auto lease = c->OpenLeaseSession(open);
    tally.Add(lease.status());
    if (!lease.ok()) continue;
    struct Try {
      const char* path;
      bool writable;
      bool may_succeed;
      const char* if_it_does;
    };
    for (const Try& t : {
             Try{"secret", false, false, "IMPORTED_ROOT_0600_FILE"},
             Try{"secret", true, false, "IMPORTED_ROOT_0600_FILE"},
             Try{"public", true, false, "IMPORTED_0644_FILE_WRITABLE"},
             Try{"public", false, true, ""},
             Try{"../../../etc/shadow", false, false, "ESCAPED_SHM_DIR"},
             Try{"/etc/shadow", false, false, "ESCAPED_SHM_DIR"},
             Try{"", false, false, "IMPORTED_THE_DIRECTORY"},
         }) {
      v1::ImportFileRequest r;
      r.set_session(lease->session());
      r.set_path(t.path);
      r.set_writable(t.writable);
      auto b = c->ImportFile(r);
      if (b.ok() && !t.may_succeed) {
        tally.AddNamed(t.if_it_does, true, t.path);
      } else {
        tally.Add(b.status());
      }
    }
    v1::CloseSessionRequest close;
    close.set_session(lease->session());
    tally.Add(c->CloseSession(close).status());
  }
}

// --- churn ----------------------------------------------------------------

// A garbage datagram (with fds attached) on a fresh fd-socket connection:
// mrd answers with an error or closes; it must not keep our fds.
void FdSocketGarbage(const AttackContext& ctx, std::mt19937_64& rng, int memfd,
                     Tally& tally) {
  int s = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, ctx.fd_socket.c_str(), sizeof(addr.sun_path) - 1);
  if (s < 0 ||
      ::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    tally.AddNamed("fd_socket_connect_failed", true, std::strerror(errno));
    if (s >= 0) ::close(s);
    return;
  }
  char buf[65536];
  pollfd p{s, POLLIN, 0};
  if (::poll(&p, 1, 5000) == 1)
    (void)::recv(s, buf, sizeof(buf), 0);  // welcome
  std::string junk = RandomBytes(rng, 1 + rng() % 512);
  iovec iov{junk.data(), junk.size()};
  constexpr int kFds = 8;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kFds)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* cm = CMSG_FIRSTHDR(&msg);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int) * kFds);
  for (int i = 0; i < kFds; ++i) {
    std::memcpy(CMSG_DATA(cm) + i * sizeof(int), &memfd, sizeof(int));
  }
  if (::sendmsg(s, &msg, MSG_NOSIGNAL) < 0) {
    tally.AddNamed("fd_garbage_closed");
    ::close(s);
    return;
  }
  if (::poll(&p, 1, 5000) != 1) {
    tally.AddNamed("fd_garbage_no_answer", true, "no reply or close in 5 s");
  } else {
    ssize_t n = ::recv(s, buf, sizeof(buf), 0);
    tally.AddNamed(n > 0 ? "fd_garbage_answered" : "fd_garbage_closed");
  }
  ::close(s);
}

void Churn(const AttackContext& ctx, Tally& tally) {
  auto c = Connect(ctx);
  if (!c.ok()) return tally.Add(c.status());
  std::mt19937_64 rng(::getpid());
  auto memfd = client::MappedMemfd::Create(kPage, "adversary-churn");
  if (!memfd.ok()) return tally.Add(memfd.status());
  while (Before(ctx)) {
    auto s = client::Session::OpenFd(*c);
    tally.Add(s.status());
    if (!s.ok()) continue;
    constexpr uint64_t kPages = 64;
    auto b = client::Buffer::Create(*s, kPages * kPage, "adversary-churn");
    tally.Add(b.status());
    if (!b.ok()) continue;
    // Garbage handles in a real session.
    v1::DeregisterMrRequest dereg;
    dereg.set_session(s->token());
    dereg.set_registration(rng() | 1);
    tally.Add(c->DeregisterMr(dereg).status());
    v1::ReleaseBufferRequest release;
    release.set_session(s->token());
    release.set_buffer(rng() | 1);
    tally.Add(c->ReleaseBuffer(release).status());
    v1::RegisterMrRequest bad = client::ToRequest(
        s->token(), {.buffer = b->id(), .offset = kPages * kPage, .length = 1});
    bad.set_flags(kRemoteRead);
    tally.Add(c->RegisterMr(bad).status());
    bad.set_buffer(rng() | 1);
    bad.set_offset(0);
    tally.Add(c->RegisterMr(bad).status());
    // Requests in flight when the session's socket closes.
    constexpr int kInFlight = 32;
    absl::Mutex mu;
    int answered = 0;
    for (int i = 0; i < kInFlight; ++i) {
      client::RegisterOptions o;
      o.buffer = b->id();
      o.offset = (i % kPages) * kPage;
      o.length = kPage * (1 + i % 4);
      if (o.offset + o.length > kPages * kPage) o.length = kPage;
      o.flags = kRemoteRead;
      client::Registration::RegisterAsync(
          *s, o, [&](absl::StatusOr<client::Registration> r) {
            tally.Add(r.status());
            if (r.ok()) r->Detach();
            absl::MutexLock lock(&mu);
            ++answered;
          });
    }
    b->Detach();
    (void)s->Close();  // abruptly, with requests in flight
    {
      absl::MutexLock lock(&mu);
      auto all = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
        return answered == kInFlight;
      };
      if (!mu.AwaitWithTimeout(absl::Condition(&all), absl::Seconds(30))) {
        tally.AddNamed("answer_lost", true, "RegisterMr never answered");
        // The callbacks still refer to this frame: wait for them for good.
        mu.Await(absl::Condition(&all));
      }
    }
    // Garbage tokens.
    v1::RegisterMrRequest r = client::ToRequest("garbage-" + RandomHex(rng, 16),
                                                {.buffer = 1, .length = kPage});
    tally.Add(c->RegisterMr(r).status());
    v1::GetSessionRequest get;
    get.set_session(std::string(65536, 'A'));
    tally.Add(c->GetSession(get).status());
    // Not even a valid message: a proto3 string that is not UTF-8. gRPC
    // refuses it before mrd's handler runs (Debian's gRPC answers
    // UNIMPLEMENTED, without a message): any refusal but one meaning mrd is
    // gone.
    v1::CloseSessionRequest close;
    close.set_session(RandomBytes(rng, 40));
    absl::Status undecodable = c->CloseSession(close).status();
    if (undecodable.ok() ||
        undecodable.code() == absl::StatusCode::kUnavailable ||
        undecodable.code() == absl::StatusCode::kDeadlineExceeded) {
      tally.Add(undecodable);
    } else {
      tally.AddNamed(
          absl::StrCat("undecodable_request:",
                       absl::StatusCodeToString(undecodable.code())));
    }
    FdSocketGarbage(ctx, rng, memfd->fd(), tally);
  }
}

// --- gRPC surface -----------------------------------------------------------

void GrpcSpam(const AttackContext& ctx, Tally& tally) {
  constexpr int kChannels = 16;
  std::vector<client::Client> clients;
  for (int i = 0; i < kChannels; ++i) {
    client::ClientOptions o;
    o.socket_path = ctx.grpc_socket;
    o.fd_socket_path = ctx.fd_socket;
    auto c = client::Client::Connect(o);
    tally.Add(c.status());
    if (c.ok()) clients.push_back(std::move(*c));
  }
  if (clients.empty()) return;
  std::mt19937_64 rng(::getpid());
  while (Before(ctx)) {
    for (const client::Client& c : clients)
      tally.Add(c.GetDeviceInfo().status());
    auto s = client::Session::OpenFd(clients[0]);
    tally.Add(s.status());
    if (!s.ok()) continue;
    {
      std::vector<client::CompletionStream> streams;
      for (int i = 0; i < 64; ++i) {
        streams.push_back(client::CompletionStream::Open(*s));
      }
      for (auto& st : streams) st.Cancel();
    }
    auto b = client::Buffer::Create(*s, 16 * kPage, "adversary-spam");
    tally.Add(b.status());
    if (!b.ok()) continue;
    // Idempotency keys of 1 MiB each: mrd remembers up to 4,096 per session.
    for (int i = 0; i < 96 && Before(ctx); ++i) {
      client::RegisterOptions o;
      o.buffer = b->id();
      o.offset = (i % 16) * kPage;
      o.length = kPage;
      o.flags = kRemoteRead;
      o.request_id = RandomHex(rng, 32) + std::string(1 << 20, 'k');
      auto r = client::Registration::Register(*s, o);
      tally.Add(r.status());
      if (r.ok()) r->Detach();
    }
    b->Detach();
    (void)s->Close();
  }
}

}  // namespace

std::vector<std::string> AttackNames() {
  return {
      "lease_flood",   "session_flood", "buffer_flood", "registration_flood",
      "peer_idle",     "peer_bigframe", "peer_garbage", "peer_bad_ticket",
      "import_secret", "churn",         "grpc_spam"};
}

bool RunAttack(const std::string& name, const AttackContext& ctx,
               Tally& tally) {
  if (name == "lease_flood") {
    LeaseFlood(ctx, tally);
  } else if (name == "session_flood") {
    SessionFlood(ctx, tally);
  } else if (name == "buffer_flood") {
    BufferFlood(ctx, tally);
  } else if (name == "registration_flood") {
    RegistrationFlood(ctx, tally);
  } else if (name == "peer_idle") {
    PeerIdle(ctx, tally);
  } else if (name == "peer_bigframe") {
    PeerBigFrame(ctx, tally);
  } else if (name == "peer_garbage") {
    PeerGarbage(ctx, tally);
  } else if (name == "peer_bad_ticket") {
    PeerBadTicket(ctx, tally);
  } else if (name == "import_secret") {
    ImportSecret(ctx, tally);
  } else if (name == "churn") {
    Churn(ctx, tally);
  } else if (name == "grpc_spam") {
    GrpcSpam(ctx, tally);
  } else {
    return false;
  }
  return true;
}

}  // namespace mrd::adversary
