// Bad input against the real mrd: every malformed, foreign, out-of-range or
// over-the-limit request gets exactly its documented error (gRPC code, seed
// outcome in mrd-seed-status, stable reason), and nothing else is lost.
//
// Every test runs next to a *bystander*: a session opened in SetUp with its
// own buffer, a REMOTE_READ registration and a connected peer. TearDown
// proves that the bystander still reads its bytes through its token on the
// same peer connection, still holds exactly what it held, and that the server
// still answers GetDeviceInfo. Where the bad input came from a session, the
// test itself proves that this session still works afterwards.

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <linux/magic.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "mrd/v1/fd.pb.h"
#include "mrd/v1/mrd.grpc.pb.h"
#include "tests/integration/test_env.h"

namespace mrd::testing {
namespace {

using client::Buffer;
using client::CompletionStream;
using client::Lam;
using client::Mr;
using client::Registration;
using client::Session;

constexpr uint64_t kUnknownId = 0x7ffffff00000ULL;  // no handle ever has it
constexpr uint64_t kMax64 = std::numeric_limits<uint64_t>::max();
constexpr char kBystanderFill[] = "bystander-bytes:";
constexpr char kStillWorksFill[] = "still-works";
constexpr char kFrFill[] = "fast-register ";
constexpr uint64_t kFrBase = 0x40000000;  // fast-register base, before FBO
constexpr uint64_t kLamOffset = 100;      // so the LAM's FBO is 100

uint64_t HostPageSize() { return static_cast<uint64_t>(sysconf(_SC_PAGESIZE)); }

// Polls `done` every 10 ms until it holds or `limit` passed (bounded).
template <typename Fn>
bool Eventually(Fn done, absl::Duration limit = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + limit;
  while (true) {
    if (done()) return true;
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
}

// What the `fd` entries of process `pid` point at.
std::vector<std::string> FdTargets(pid_t pid) {
  std::vector<std::string> out;
  std::error_code ec;
  std::filesystem::directory_iterator it(absl::StrCat("/proc/", pid, "/fd"),
                                         ec);
  for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    char target[PATH_MAX];
    ssize_t n = readlink(it->path().c_str(), target, sizeof(target));
    out.push_back(n > 0 ? std::string(target, static_cast<size_t>(n)) : "?");
  }
  return out;
}

// The fds mrd holds, without the ones its own periodic scans open for a
// moment (the fd budget's and the gRPC acceptor's reads of /proc/self/fd,
// once a second) and without entries that closed while being listed ("?"):
// a snapshot taken during a scan would otherwise hold one or two more.
std::vector<std::string> HeldFds(pid_t pid) {
  std::vector<std::string> held;
  for (std::string& target : FdTargets(pid)) {
    if (target != "?" && !absl::StartsWith(target, "/proc/")) {
      held.push_back(std::move(target));
    }
  }
  std::sort(held.begin(), held.end());
  return held;
}

// What mrd holds now against a snapshot, as sorted lists of fd targets:
// the fds opened since (`Added`) and those closed since (`Removed`). A leak
// shows up in Added. One of mrd's own fds that closes meanwhile (a gRPC or
// peer connection ending, a poller's eventfd) shows up only in Removed, so
// a snapshot taken at a busy moment cannot fail a check by itself.
class FdsSince {
 public:
  explicit FdsSince(pid_t pid) : pid_(pid), before_(HeldFds(pid)) {}

  std::vector<std::string> Added() const {
    return Difference(HeldFds(pid_), before_);
  }
  std::vector<std::string> Removed() const {
    return Difference(before_, HeldFds(pid_));
  }
  // Removed entries that are sockets: connections mrd closed since.
  size_t SocketsRemoved() const {
    size_t n = 0;
    for (const std::string& target : Removed()) {
      if (absl::StartsWith(target, "socket:")) ++n;
    }
    return n;
  }
  std::string Describe() const {
    return absl::StrCat("opened since: [", absl::StrJoin(Added(), ", "),
                        "], closed since: [", absl::StrJoin(Removed(), ", "),
                        "]");
  }

 private:
  static std::vector<std::string> Difference(
      const std::vector<std::string>& a, const std::vector<std::string>& b) {
    std::vector<std::string> out;
    std::set_difference(a.begin(), a.end(), b.begin(), b.end(),
                        std::back_inserter(out));
    return out;
  }

  pid_t pid_;
  std::vector<std::string> before_;
};

std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Whether mrd holds an fd or a mapping of a memfd whose name contains `name`.
bool HoldsMemfd(pid_t pid, const std::string& name) {
  const std::string needle = "memfd:" + name;
  for (const std::string& t : FdTargets(pid)) {
    if (absl::StrContains(t, needle)) return true;
  }
  return absl::StrContains(ReadWholeFile(absl::StrCat("/proc/", pid, "/maps")),
                           needle);
}

// A memfd of `size` bytes filled with `fill`, sealed against shrinking and
// growing unless `seal` is false.
UniqueFd MakeMemfd(const std::string& name, uint64_t size, bool seal = true,
                   const std::string& fill = "") {
  UniqueFd fd(memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  EXPECT_TRUE(fd.valid()) << std::strerror(errno);
  EXPECT_EQ(ftruncate(fd.get(), static_cast<off_t>(size)), 0);
  if (!fill.empty()) {
    std::string data;
    while (data.size() < size) data += fill;
    data.resize(size);
    EXPECT_EQ(pwrite(fd.get(), data.data(), data.size(), 0),
              static_cast<ssize_t>(size));
  }
  if (seal) {
    EXPECT_EQ(fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  }
  return fd;
}

std::string ImportRequestBytes(uint64_t sequence, bool writable,
                               uint64_t expected_size) {
  v1::FdRequest request;
  request.set_sequence(sequence);
  request.mutable_import_memfd()->set_writable(writable);
  request.mutable_import_memfd()->set_expected_size(expected_size);
  return request.SerializeAsString();
}

// The fd socket spoken by hand, so that the test can send what the client
// library never would.
class RawFdSocket {
 public:
  explicit RawFdSocket(const std::string& path) {
    sock_.Reset(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    connected_ = sock_.valid() &&
                 connect(sock_.get(), reinterpret_cast<sockaddr*>(&addr),
                         sizeof(addr)) == 0;
  }

  bool connected() const { return connected_; }

  // One datagram, with `fds` (if any) in one SCM_RIGHTS control message.
  bool Send(const std::string& bytes, const std::vector<int>& fds = {}) {
    iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
    if (!fds.empty()) {
      msg.msg_control = control.data();
      msg.msg_controllen = control.size();
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    return sendmsg(sock_.get(), &msg, MSG_NOSIGNAL) ==
           static_cast<ssize_t>(bytes.size());
  }

  // The next reply; nullopt (with a test failure) on timeout, EOF or junk.
  std::optional<v1::FdReply> Receive(
      absl::Duration timeout = absl::Seconds(10)) {
    pollfd p{sock_.get(), POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) !=
        1) {
      ADD_FAILURE() << "no reply on the fd socket";
      return std::nullopt;
    }
    std::vector<char> data(65536);
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)];
    iovec iov{data.data(), data.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t n = recvmsg(sock_.get(), &msg, MSG_CMSG_CLOEXEC);
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr;
         c = CMSG_NXTHDR(&msg, c)) {
      ADD_FAILURE() << "mrd sent a control message";
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); ++i) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          close(fd);
        }
      }
    }
    if (n <= 0) {
      ADD_FAILURE() << "the fd socket closed (" << n << ")";
      return std::nullopt;
    }
    v1::FdReply reply;
    if (!reply.ParseFromArray(data.data(), static_cast<int>(n))) {
      ADD_FAILURE() << "unparseable FdReply";
      return std::nullopt;
    }
    return reply;
  }

  void Close() { sock_.Reset(); }

 private:
  UniqueFd sock_;
  bool connected_ = false;
};

// Expects an FdReply error with this sequence and reason (all protocol
// errors are INVALID_ARGUMENT with no seed outcome).
void ExpectFdError(const std::optional<v1::FdReply>& reply, uint64_t sequence,
                   absl::StatusCode code, ::mrd::SeedStatus seed,
                   const std::string& reason) {
  ASSERT_TRUE(reply.has_value());
  ASSERT_TRUE(reply->has_error()) << reply->DebugString();
  EXPECT_EQ(reply->sequence(), sequence);
  ExpectError(client::StatusFromFdError(reply->error()), code, seed, reason);
}

// Expects `foreign` (a request naming another session's handle) to be
// answered exactly as `unknown` (the same request naming a handle that never
// existed): same code, same detail, same message up to the id.
void ExpectSameAsUnknown(const absl::Status& foreign, uint64_t foreign_id,
                         const absl::Status& unknown, uint64_t unknown_id,
                         const std::string& reason) {
  ExpectError(unknown, absl::StatusCode::kNotFound,
              ::mrd::SEED_STATUS_UNSPECIFIED, reason);
  EXPECT_EQ(foreign.code(), unknown.code()) << foreign;
  EXPECT_EQ(GetErrorDetail(foreign).DebugString(),
            GetErrorDetail(unknown).DebugString())
      << foreign;
  EXPECT_EQ(absl::StrReplaceAll(foreign.message(),
                                {{absl::StrCat(foreign_id), "<id>"}}),
            absl::StrReplaceAll(unknown.message(),
                                {{absl::StrCat(unknown_id), "<id>"}}));
}

// A session ready for fast registration: its completion stream, a 3-page
// buffer filled with kFrFill, a LAM over [100, 100 + 2 pages) (3 pages, FBO
// 100), a fast-register MR and a connected peer. Members are destroyed in
// reverse order: peer, MR, LAM, buffer, stream.
struct FastRegisterRig {
  std::optional<CompletionStream> completions;
  std::optional<Buffer> buffer;
  std::optional<Lam> lam;
  std::optional<Mr> mr;
  std::unique_ptr<peer::Peer> peer;

  // A request that must succeed: every field valid.
  client::FastRegisterOptions Valid(uint64_t context) const {
    client::FastRegisterOptions fr = client::FastRegisterOptions::FromLam(*lam);
    fr.connection = peer->connection_id();
    fr.request_context = context;
    fr.base_address = kFrBase + fr.fbo;
    fr.flags = kOpRemoteRead;
    return fr;
  }
};

std::string FrBytesAt(uint64_t offset, size_t n) {
  const std::string pattern = kFrFill;
  std::string out;
  for (size_t i = 0; i < n; ++i) out += pattern[(offset + i) % pattern.size()];
  return out;
}

class BadInputTest : public MrdTest {
 protected:
  void SetUp() override {
    MrdTest::SetUp();
    if (HasFatalFailure()) return;
    page_ = HostPageSize();
    auto info = client_->GetDeviceInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_EQ(info->page_size(), page_);
    ASSERT_EQ(info->pinned_bytes(), 0u);

    auto session = Session::OpenFd(*client_);
    ASSERT_TRUE(session.ok()) << session.status();
    bystander_.emplace(std::move(*session));
    auto buffer = Buffer::Create(*bystander_, page_);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    bystander_buffer_.emplace(std::move(*buffer));
    std::string fill;
    while (fill.size() < page_) fill += kBystanderFill;
    std::memcpy(bystander_buffer_->data(), fill.data(), page_);
    auto reg = Reg(*bystander_, *bystander_buffer_, 0, page_, kRemoteRead);
    ASSERT_TRUE(reg.ok()) << reg.status();
    bystander_reg_.emplace(std::move(*reg));
    bystander_peer_ = ConnectPeer(*bystander_);
    ASSERT_NE(bystander_peer_, nullptr);
    ASSERT_NO_FATAL_FAILURE(ExpectBystanderReads());
    info = client_->GetDeviceInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    baseline_pinned_ = info->pinned_bytes();
    ASSERT_EQ(baseline_pinned_, page_);
  }

  void TearDown() override {
    if (bystander_peer_ != nullptr && mrd_ != nullptr) {
      SCOPED_TRACE("nothing was lost: the bystander and the server");
      ExpectBystanderReads();
      auto list = bystander_->List();
      EXPECT_TRUE(list.ok()) << list.status();
      if (list.ok()) {
        EXPECT_EQ(list->buffers_size(), 1);
        ASSERT_EQ(list->registrations_size(), 1);
        EXPECT_EQ(list->registrations(0).registration(), bystander_reg_->id());
        EXPECT_EQ(list->registrations(0).references(), 1u);
      }
      auto info = client_->GetDeviceInfo();
      EXPECT_TRUE(info.ok()) << info.status();
      if (info.ok()) {
        EXPECT_TRUE(info->healthy());
        EXPECT_GE(info->pinned_bytes(), page_);
      }
    }
    bystander_peer_.reset();
    bystander_reg_.reset();
    bystander_buffer_.reset();
    bystander_.reset();
    MrdTest::TearDown();
  }

  void ExpectBystanderReads() {
    const std::string want = kBystanderFill;
    auto read = bystander_peer_->Read(
        bystander_reg_->rkey(), bystander_reg_->base_address(), want.size());
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(*read, want);
  }

  absl::StatusOr<Registration> Reg(const Session& session, const Buffer& buffer,
                                   uint64_t offset, uint64_t length,
                                   uint32_t flags) {
    client::RegisterOptions o;
    o.buffer = buffer.id();
    o.offset = offset;
    o.length = length;
    o.flags = flags;
    return Registration::Register(session, o);
  }

  v1::RegisterMrRequest RegisterRequest(const Session& session, uint64_t buffer,
                                        uint64_t offset, uint64_t length,
                                        uint32_t flags) {
    v1::RegisterMrRequest r;
    r.set_session(session.token());
    r.set_buffer(buffer);
    r.set_offset(offset);
    r.set_length(length);
    r.set_flags(flags);
    return r;
  }

  v1::BuildLamRequest BuildLamRequest(const Session& session, uint64_t buffer,
                                      uint64_t offset, uint64_t length) {
    v1::BuildLamRequest r;
    r.set_session(session.token());
    r.set_buffer(buffer);
    r.set_offset(offset);
    r.set_length(length);
    return r;
  }

  uint64_t DevicePinned() {
    auto info = client_->GetDeviceInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->pinned_bytes() : 0;
  }

  // The session is alive and usable: it imports a buffer, registers it and
  // a peer of it reads the bytes through the token.
  void ExpectSessionStillWorks(const Session& session) {
    SCOPED_TRACE("the session still works");
    auto buffer = Buffer::Create(session, page_);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    std::memcpy(buffer->data(), kStillWorksFill, sizeof(kStillWorksFill) - 1);
    auto reg = Reg(session, *buffer, 0, page_, kRemoteRead);
    ASSERT_TRUE(reg.ok()) << reg.status();
    auto peer = ConnectPeer(session);
    ASSERT_NE(peer, nullptr);
    auto read = peer->Read(reg->rkey(), reg->base_address(),
                           sizeof(kStillWorksFill) - 1);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(*read, kStillWorksFill);
  }

  void MakeRig(const Session& session, FastRegisterRig* rig,
               bool allow_remote = true, bool writable = true) {
    rig->completions.emplace(CompletionStream::Open(session));
    auto buffer = Buffer::Create(session, 3 * page_, "rig", writable);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    std::string fill;
    while (fill.size() < 3 * page_) fill += kFrFill;
    std::memcpy(buffer->data(), fill.data(), 3 * page_);
    rig->buffer.emplace(std::move(*buffer));
    client::BuildLamOptions o;
    o.buffer = rig->buffer->id();
    o.offset = kLamOffset;
    o.length = 2 * page_;
    auto lam = Lam::Build(session, o);
    ASSERT_TRUE(lam.ok()) << lam.status();
    rig->lam.emplace(std::move(*lam));
    ASSERT_EQ(rig->lam->pages().size(), 3u);
    ASSERT_EQ(rig->lam->fbo(), kLamOffset);
    auto mr = Mr::Create(session, /*fast_register=*/true, allow_remote);
    ASSERT_TRUE(mr.ok()) << mr.status();
    rig->mr.emplace(std::move(*mr));
    rig->peer = ConnectPeer(session);
    ASSERT_NE(rig->peer, nullptr);
    WaitConnected(*rig->completions, rig->peer->connection_id());
  }

  // Reads completions until the PEER_CONNECTED event of `connection` (the
  // session learns of its peers' connections asynchronously).
  void WaitConnected(CompletionStream& completions, uint64_t connection) {
    for (int i = 0; i < 64; ++i) {
      auto c = completions.Next(absl::Seconds(10));
      ASSERT_TRUE(c.ok()) << c.status();
      if (c->kind() == v1::Completion::PEER_CONNECTED &&
          c->connection() == connection) {
        return;
      }
    }
    ADD_FAILURE() << "no PEER_CONNECTED for connection " << connection;
  }

  // A valid fast registration now succeeds, its completion is the next one
  // (so nothing refused earlier was posted), the peer reads through the new
  // token, and the invalidation completes.
  void ExpectFastRegisterWorks(FastRegisterRig& rig, uint64_t context) {
    SCOPED_TRACE("a valid fast registration still works");
    client::FastRegisterOptions fr = rig.Valid(context);
    auto posted = rig.mr->FastRegister(fr);
    ASSERT_TRUE(posted.ok()) << posted.status();
    v1::Completion done =
        NextOfKind(*rig.completions, v1::Completion::FAST_REGISTER);
    EXPECT_EQ(done.request_context(), context);
    ASSERT_EQ(done.status(), ::mrd::STATUS_SUCCESS) << done.message();
    auto read = rig.peer->Read(done.rkey(), fr.base_address, 13);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(*read, FrBytesAt(kLamOffset, 13));
    ASSERT_TRUE(
        rig.mr->Invalidate(rig.peer->connection_id(), context + 1).ok());
    v1::Completion inval =
        NextOfKind(*rig.completions, v1::Completion::INVALIDATE);
    EXPECT_EQ(inval.request_context(), context + 1);
    EXPECT_EQ(inval.status(), ::mrd::STATUS_SUCCESS) << inval.message();
  }

  // The MR of a rig is not fast-registered (a refused request mapped
  // nothing).
  void ExpectMrFree(const Session& session, uint64_t mr) {
    auto list = session.List();
    ASSERT_TRUE(list.ok()) << list.status();
    bool found = false;
    for (const auto& m : list->mrs()) {
      if (m.mr() != mr) continue;
      found = true;
      EXPECT_EQ(m.state(), "free");
    }
    EXPECT_TRUE(found);
  }

  void ExpectRefused(const absl::Status& status, const std::string& reason) {
    ExpectError(status, absl::StatusCode::kInvalidArgument,
                ::mrd::STATUS_INVALID_PARAMETER, reason);
  }

  uint64_t page_ = 0;
  uint64_t baseline_pinned_ = 0;
  std::optional<Session> bystander_;
  std::optional<Buffer> bystander_buffer_;
  std::optional<Registration> bystander_reg_;
  std::unique_ptr<peer::Peer> bystander_peer_;
};

// --- unknown and foreign handles -------------------------------------------

TEST_F(BadInputTest, UnknownBufferIsNotFound) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, page_);
  for (uint64_t id : {kUnknownId, uint64_t{0}, kMax64}) {
    SCOPED_TRACE(id);
    ExpectError(
        client_->RegisterMr(RegisterRequest(session, id, 0, page_, kRemoteRead))
            .status(),
        absl::StatusCode::kNotFound, ::mrd::SEED_STATUS_UNSPECIFIED,
        "UNKNOWN_BUFFER");
    ExpectError(
        client_->BuildLam(BuildLamRequest(session, id, 0, page_)).status(),
        absl::StatusCode::kNotFound, ::mrd::SEED_STATUS_UNSPECIFIED,
        "UNKNOWN_BUFFER");
    v1::ReleaseBufferRequest release;
    release.set_session(session.token());
    release.set_buffer(id);
    ExpectError(client_->ReleaseBuffer(release).status(),
                absl::StatusCode::kNotFound, ::mrd::SEED_STATUS_UNSPECIFIED,
                "UNKNOWN_BUFFER");
  }
  auto list = session.List();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->buffers_size(), 1);
  EXPECT_EQ(list->registrations_size(), 0);
  EXPECT_EQ(list->lams_size(), 0);
  EXPECT_EQ(DevicePinned(), baseline_pinned_);
  ExpectSessionStillWorks(session);
}

TEST_F(BadInputTest, UnknownRegistrationIsNotFound) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 2 * page_);
  auto kept = Reg(session, buffer, 0, page_, kRemoteRead);
  ASSERT_TRUE(kept.ok()) << kept.status();
  auto gone = Reg(session, buffer, page_, page_, kRemoteRead);
  ASSERT_TRUE(gone.ok()) << gone.status();
  const uint64_t stale = gone->id();
  ASSERT_TRUE(gone->Deregister().ok());
  for (uint64_t id : {kUnknownId, uint64_t{0}, stale}) {
    SCOPED_TRACE(id);
    v1::DeregisterMrRequest req;
    req.set_session(session.token());
    req.set_registration(id);
    ExpectError(client_->DeregisterMr(req).status(),
                absl::StatusCode::kNotFound, ::mrd::SEED_STATUS_UNSPECIFIED,
                "UNKNOWN_REGISTRATION");
  }
  // No reference was taken from the live registration.
  auto list = session.List();
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->registrations_size(), 1);
  EXPECT_EQ(list->registrations(0).registration(), kept->id());
  EXPECT_EQ(list->registrations(0).references(), 1u);
  auto peer = ConnectPeer(session);
  EXPECT_TRUE(peer->Read(kept->rkey(), kept->base_address(), 1).ok());
  ExpectSessionStillWorks(session);
}

TEST_F(BadInputTest, UnknownMrIsNotFound) {
  Session session = OpenFdSession();
  FastRegisterRig rig;
  ASSERT_NO_FATAL_FAILURE(MakeRig(session, &rig));
  for (uint64_t id : {kUnknownId, uint64_t{0}}) {
    SCOPED_TRACE(id);
    const std::string reason = "UNKNOWN_MR";
    v1::CloseMrRequest close;
    close.set_session(session.token());
    close.set_mr(id);
    ExpectError(client_->CloseMr(close).status(), absl::StatusCode::kNotFound,
                ::mrd::SEED_STATUS_UNSPECIFIED, reason);
    v1::DeregisterMrRequest dereg;
    dereg.set_session(session.token());
    dereg.set_mr(id);
    ExpectError(client_->DeregisterMr(dereg).status(),
                absl::StatusCode::kNotFound, ::mrd::SEED_STATUS_UNSPECIFIED,
                reason);
    if (id != 0) {  // mr 0 in RegisterMr means "an implicit MR object"
      v1::RegisterMrRequest reg =
          RegisterRequest(session, rig.buffer->id(), 0, page_, kRemoteRead);
      reg.set_mr(id);
      ExpectError(client_->RegisterMr(reg).status(),
                  absl::StatusCode::kNotFound, ::mrd::SEED_STATUS_UNSPECIFIED,
                  reason);
    }
    v1::FastRegisterRequest fr;
    fr.set_session(session.token());
    fr.set_connection(rig.peer->connection_id());
    fr.set_mr(id);
    for (uint64_t p : rig.lam->pages()) fr.add_pages(p);
    fr.set_fbo(rig.lam->fbo());
    fr.set_length(2 * page_);
    fr.set_base_address(kFrBase + rig.lam->fbo());
    fr.set_flags(kOpRemoteRead);
    ExpectError(client_->FastRegister(fr).status(), absl::StatusCode::kNotFound,
                ::mrd::SEED_STATUS_UNSPECIFIED, reason);
    v1::InvalidateMrRequest inval;
    inval.set_session(session.token());
    inval.set_connection(rig.peer->connection_id());
    inval.set_mr(id);
    ExpectError(client_->InvalidateMr(inval).status(),
                absl::StatusCode::kNotFound, ::mrd::SEED_STATUS_UNSPECIFIED,
                reason);
  }
  auto list = session.List();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->registrations_size(), 0);
  ExpectFastRegisterWorks(rig, 10);
  ExpectSessionStillWorks(session);
}

TEST_F(BadInputTest, UnknownLamIsNotFound) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 2 * page_);
  client::BuildLamOptions o;
  o.buffer = buffer.id();
  o.length = page_;
  auto kept = Lam::Build(session, o);
  ASSERT_TRUE(kept.ok()) << kept.status();
  o.offset = page_;
  auto gone = Lam::Build(session, o);
  ASSERT_TRUE(gone.ok()) << gone.status();
  const uint64_t stale = gone->id();
  ASSERT_TRUE(gone->Release().ok());
  for (uint64_t id : {kUnknownId, uint64_t{0}, stale}) {
    SCOPED_TRACE(id);
    v1::ReleaseLamRequest req;
    req.set_session(session.token());
    req.set_lam(id);
    ExpectError(client_->ReleaseLam(req).status(), absl::StatusCode::kNotFound,
                ::mrd::SEED_STATUS_UNSPECIFIED, "UNKNOWN_LAM");
  }
  auto list = session.List();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->lams_size(), 1);
  EXPECT_EQ(list->lams(0).lam(), kept->id());
  EXPECT_EQ(DevicePinned(), baseline_pinned_ + page_);
  ExpectSessionStillWorks(session);
}

// The proto's contract for FastRegister/InvalidateMr: a connection that is
// not a connected peer of the session is STATUS_CONNECTION_INVALID (F4),
// FAILED_PRECONDITION.
TEST_F(BadInputTest, UnknownConnectionIsConnectionInvalid) {
  Session session = OpenFdSession();
  FastRegisterRig rig;
  ASSERT_NO_FATAL_FAILURE(MakeRig(session, &rig));
  // A connection that was this session's and is gone.
  uint64_t closed;
  {
    auto old_peer = ConnectPeer(session);
    ASSERT_NE(old_peer, nullptr);
    closed = old_peer->connection_id();
    WaitConnected(*rig.completions, closed);
  }
  v1::Completion bye =
      NextOfKind(*rig.completions, v1::Completion::PEER_DISCONNECTED);
  EXPECT_EQ(bye.connection(), closed);
  for (uint64_t id : {kUnknownId, uint64_t{0}, closed}) {
    SCOPED_TRACE(id);
    client::FastRegisterOptions fr = rig.Valid(1);
    fr.connection = id;
    ExpectError(rig.mr->FastRegister(fr).status(),
                absl::StatusCode::kFailedPrecondition,
                ::mrd::STATUS_CONNECTION_INVALID, "NO_SUCH_CONNECTION");
    ExpectError(rig.mr->Invalidate(id, 2).status(),
                absl::StatusCode::kFailedPrecondition,
                ::mrd::STATUS_CONNECTION_INVALID, "NO_SUCH_CONNECTION");
  }
  ExpectMrFree(session, rig.mr->id());
  ExpectFastRegisterWorks(rig, 10);
  ExpectSessionStillWorks(session);
}

TEST_F(BadInputTest, AnotherSessionsHandlesAreNotFoundExactlyAsUnknownOnes) {
  // The owner holds one of everything.
  Session owner = OpenFdSession();
  FastRegisterRig owned;
  ASSERT_NO_FATAL_FAILURE(MakeRig(owner, &owned));
  Buffer owner_buffer = NewBuffer(owner, page_, "owner's");
  auto owner_reg = Reg(owner, owner_buffer, 0, page_, kRemoteRead);
  ASSERT_TRUE(owner_reg.ok()) << owner_reg.status();
  auto owner_normal_mr = Mr::Create(owner, /*fast_register=*/false);
  ASSERT_TRUE(owner_normal_mr.ok());
  client::RegisterOptions via_mr;
  via_mr.buffer = owner_buffer.id();
  via_mr.length = page_;
  via_mr.flags = kRemoteRead | kLocalWrite;
  auto owner_mr_reg = owner_normal_mr->Register(via_mr);
  ASSERT_TRUE(owner_mr_reg.ok()) << owner_mr_reg.status();

  // The intruder has its own working rig and names the owner's handles.
  Session intruder = OpenFdSession();
  FastRegisterRig rig;
  ASSERT_NO_FATAL_FAILURE(MakeRig(intruder, &rig));
  const std::string token = intruder.token();

  auto register_on = [&](uint64_t buffer) {
    return client_
        ->RegisterMr(RegisterRequest(intruder, buffer, 0, page_, kRemoteRead))
        .status();
  };
  ExpectSameAsUnknown(register_on(owner_buffer.id()), owner_buffer.id(),
                      register_on(kUnknownId), kUnknownId, "UNKNOWN_BUFFER");
  auto lam_on = [&](uint64_t buffer) {
    return client_->BuildLam(BuildLamRequest(intruder, buffer, 0, page_))
        .status();
  };
  ExpectSameAsUnknown(lam_on(owner_buffer.id()), owner_buffer.id(),
                      lam_on(kUnknownId), kUnknownId, "UNKNOWN_BUFFER");
  auto release_buffer = [&](uint64_t buffer) {
    v1::ReleaseBufferRequest r;
    r.set_session(token);
    r.set_buffer(buffer);
    return client_->ReleaseBuffer(r).status();
  };
  ExpectSameAsUnknown(release_buffer(owner_buffer.id()), owner_buffer.id(),
                      release_buffer(kUnknownId), kUnknownId, "UNKNOWN_BUFFER");
  auto deregister = [&](uint64_t registration) {
    v1::DeregisterMrRequest r;
    r.set_session(token);
    r.set_registration(registration);
    return client_->DeregisterMr(r).status();
  };
  ExpectSameAsUnknown(deregister(owner_reg->id()), owner_reg->id(),
                      deregister(kUnknownId), kUnknownId,
                      "UNKNOWN_REGISTRATION");
  auto deregister_mr = [&](uint64_t mr) {
    v1::DeregisterMrRequest r;
    r.set_session(token);
    r.set_mr(mr);
    return client_->DeregisterMr(r).status();
  };
  ExpectSameAsUnknown(deregister_mr(owner_normal_mr->id()),
                      owner_normal_mr->id(), deregister_mr(kUnknownId),
                      kUnknownId, "UNKNOWN_MR");
  auto close_mr = [&](uint64_t mr) {
    v1::CloseMrRequest r;
    r.set_session(token);
    r.set_mr(mr);
    return client_->CloseMr(r).status();
  };
  ExpectSameAsUnknown(close_mr(owned.mr->id()), owned.mr->id(),
                      close_mr(kUnknownId), kUnknownId, "UNKNOWN_MR");
  auto register_via = [&](uint64_t mr) {
    v1::RegisterMrRequest r =
        RegisterRequest(intruder, rig.buffer->id(), 0, page_, kRemoteRead);
    r.set_mr(mr);
    return client_->RegisterMr(r).status();
  };
  ExpectSameAsUnknown(register_via(owner_normal_mr->id()),
                      owner_normal_mr->id(), register_via(kUnknownId),
                      kUnknownId, "UNKNOWN_MR");
  auto fast_register = [&](uint64_t mr) {
    v1::FastRegisterRequest r;
    r.set_session(token);
    r.set_connection(rig.peer->connection_id());
    r.set_mr(mr);
    for (uint64_t p : rig.lam->pages()) r.add_pages(p);
    r.set_fbo(rig.lam->fbo());
    r.set_length(2 * page_);
    r.set_base_address(kFrBase + rig.lam->fbo());
    r.set_flags(kOpRemoteRead);
    return client_->FastRegister(r).status();
  };
  ExpectSameAsUnknown(fast_register(owned.mr->id()), owned.mr->id(),
                      fast_register(kUnknownId), kUnknownId, "UNKNOWN_MR");
  auto invalidate = [&](uint64_t mr) {
    v1::InvalidateMrRequest r;
    r.set_session(token);
    r.set_connection(rig.peer->connection_id());
    r.set_mr(mr);
    return client_->InvalidateMr(r).status();
  };
  ExpectSameAsUnknown(invalidate(owned.mr->id()), owned.mr->id(),
                      invalidate(kUnknownId), kUnknownId, "UNKNOWN_MR");
  auto release_lam = [&](uint64_t lam) {
    v1::ReleaseLamRequest r;
    r.set_session(token);
    r.set_lam(lam);
    return client_->ReleaseLam(r).status();
  };
  ExpectSameAsUnknown(release_lam(owned.lam->id()), owned.lam->id(),
                      release_lam(kUnknownId), kUnknownId, "UNKNOWN_LAM");
  // The owner's connection is no queue pair of the intruder's, exactly as an
  // unknown one (STATUS_CONNECTION_INVALID, see UnknownConnection...).
  auto on_connection = [&](uint64_t connection) {
    client::FastRegisterOptions fr = rig.Valid(1);
    fr.connection = connection;
    return rig.mr->FastRegister(fr).status();
  };
  absl::Status foreign_conn = on_connection(owned.peer->connection_id());
  absl::Status unknown_conn = on_connection(kUnknownId);
  ExpectError(unknown_conn, absl::StatusCode::kFailedPrecondition,
              ::mrd::STATUS_CONNECTION_INVALID, "NO_SUCH_CONNECTION");
  EXPECT_EQ(foreign_conn.code(), unknown_conn.code()) << foreign_conn;
  EXPECT_EQ(GetErrorDetail(foreign_conn).DebugString(),
            GetErrorDetail(unknown_conn).DebugString());

  // The owner lost nothing: its buffers, registrations (one reference each),
  // LAM and MRs are there and its tokens work.
  auto list = owner.List();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->buffers_size(), 2);
  ASSERT_EQ(list->registrations_size(), 2);
  for (const auto& r : list->registrations()) EXPECT_EQ(r.references(), 1u);
  EXPECT_EQ(list->lams_size(), 1);
  EXPECT_EQ(list->mrs_size(), 2);
  auto owner_peer = ConnectPeer(owner);
  auto read = owner_peer->Read(owner_reg->rkey(), owner_reg->base_address(), 7);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "owner's");
  EXPECT_TRUE(
      owner_peer->Read(owner_mr_reg->rkey(), owner_mr_reg->base_address(), 1)
          .ok());
  ExpectMrFree(intruder, rig.mr->id());
  ExpectFastRegisterWorks(owned, 20);
  ExpectFastRegisterWorks(rig, 30);
  ExpectSessionStillWorks(intruder);
}

// --- ranges
// -------------------------------------------------------------------

TEST_F(BadInputTest, ZeroLengthIsInvalidParameter) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, page_);
  for (uint64_t offset : {uint64_t{0}, uint64_t{10}}) {
    SCOPED_TRACE(offset);
    ExpectRefused(client_
                      ->RegisterMr(RegisterRequest(session, buffer.id(), offset,
                                                   0, kRemoteRead))
                      .status(),
                  "ZERO_LENGTH");
    ExpectRefused(
        client_->BuildLam(BuildLamRequest(session, buffer.id(), offset, 0))
            .status(),
        "ZERO_LENGTH");
  }
  EXPECT_EQ(DevicePinned(), baseline_pinned_);
  ExpectSessionStillWorks(session);
}

TEST_F(BadInputTest, LengthPastTheBufferIsInvalidParameter) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 2 * page_);
  const std::pair<uint64_t, uint64_t> ranges[] = {{0, 2 * page_ + 1},
                                                  {page_, page_ + 1},
                                                  {2 * page_ - 1, 2},
                                                  {10, 2 * page_}};
  for (const auto& [offset, length] : ranges) {
    SCOPED_TRACE(absl::StrCat(offset, "+", length));
    ExpectRefused(client_
                      ->RegisterMr(RegisterRequest(session, buffer.id(), offset,
                                                   length, kRemoteRead))
                      .status(),
                  "LENGTH_PAST_BUFFER");
    ExpectRefused(
        client_->BuildLam(BuildLamRequest(session, buffer.id(), offset, length))
            .status(),
        "LENGTH_PAST_BUFFER");
  }
  EXPECT_EQ(DevicePinned(), baseline_pinned_);
  // The whole buffer, exactly, is fine.
  auto whole = Reg(session, buffer, 0, 2 * page_, kRemoteRead);
  EXPECT_TRUE(whole.ok()) << whole.status();
  ExpectSessionStillWorks(session);
}

TEST_F(BadInputTest, OffsetPastTheEndIsInvalidParameter) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, page_);
  for (uint64_t offset : {page_, page_ + 1, 1000 * page_, kMax64}) {
    SCOPED_TRACE(offset);
    ExpectRefused(client_
                      ->RegisterMr(RegisterRequest(session, buffer.id(), offset,
                                                   1, kRemoteRead))
                      .status(),
                  "OFFSET_PAST_END");
    ExpectRefused(
        client_->BuildLam(BuildLamRequest(session, buffer.id(), offset, 1))
            .status(),
        "OFFSET_PAST_END");
  }
  EXPECT_EQ(DevicePinned(), baseline_pinned_);
  ExpectSessionStillWorks(session);
}

TEST_F(BadInputTest, OffsetPlusLengthOverflowIsInvalidParameter) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, page_);
  const std::pair<uint64_t, uint64_t> ranges[] = {
      {1, kMax64}, {page_ - 1, kMax64 - page_ + 2}, {100, kMax64 - 99}};
  for (const auto& [offset, length] : ranges) {
    SCOPED_TRACE(absl::StrCat(offset, "+", length));
    ExpectRefused(client_
                      ->RegisterMr(RegisterRequest(session, buffer.id(), offset,
                                                   length, kRemoteRead))
                      .status(),
                  "LENGTH_OVERFLOW");
    ExpectRefused(
        client_->BuildLam(BuildLamRequest(session, buffer.id(), offset, length))
            .status(),
        "LENGTH_OVERFLOW");
  }
  // An explicit base address whose region would wrap around.
  v1::RegisterMrRequest wrap =
      RegisterRequest(session, buffer.id(), 0, page_, kRemoteRead);
  wrap.set_base_address(kMax64 - 10);
  ExpectRefused(client_->RegisterMr(wrap).status(), "BASE_ADDRESS_OVERFLOW");
  EXPECT_EQ(DevicePinned(), baseline_pinned_);
  ExpectSessionStillWorks(session);
}

// --- flags ------------------------------------------------------------------

// mrd.proto, RegisterMr: "INVALID_ARGUMENT (...; WSAEINVAL: unknown flag bits
// or both flag forms; ...)", and docs/CLI.md: unknown bits reach the server,
// "which answers WSAEINVAL".
// NDK_MR_FLAG_* belong to NdkRegisterMr, whose seed outcome for a bad
// parameter is STATUS_INVALID_PARAMETER (R3, R5); WSAEINVAL is the outcome of
// the MEM_* form (W3), tested below.
TEST_F(BadInputTest, UnknownNdkFlagBitsAreInvalidParameter) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, page_);
  for (uint32_t flags : {0x10u, 0x40u, 0x4u, 0x4u | kRemoteRead,
                         kRemoteRead | 0x10u, 0x80000000u}) {
    SCOPED_TRACE(absl::StrCat("flags 0x", absl::Hex(flags)));
    absl::Status s =
        client_
            ->RegisterMr(RegisterRequest(session, buffer.id(), 0, page_, flags))
            .status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(GetErrorDetail(s).reason(), "UNKNOWN_FLAGS") << s;
    EXPECT_EQ(::mrd::SeedStatusName(GetErrorDetail(s).seed_status()),
              "STATUS_INVALID_PARAMETER")
        << s;
  }
  auto list = session.List();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->registrations_size(), 0);
  EXPECT_EQ(DevicePinned(), baseline_pinned_);
  ExpectSessionStillWorks(session);
}

TEST_F(BadInputTest, BadMemFlagsAndBothFlagFormsAreWsaeinval) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, page_, "mem-flags");
  for (uint32_t mem : {0x4u, 0x8u, 0xffu, 0x80000000u}) {
    SCOPED_TRACE(absl::StrCat("mem_flags 0x", absl::Hex(mem)));
    v1::RegisterMrRequest req =
        RegisterRequest(session, buffer.id(), 0, page_, 0);
    req.set_mem_flags(mem);
    ExpectError(client_->RegisterMr(req).status(),
                absl::StatusCode::kInvalidArgument, ::mrd::WSAEINVAL,
                "UNKNOWN_MEM_FLAGS");
  }
  for (uint32_t mem : {1u, 2u, 3u}) {
    SCOPED_TRACE(absl::StrCat("both forms, mem_flags ", mem));
    v1::RegisterMrRequest req =
        RegisterRequest(session, buffer.id(), 0, page_, kRemoteRead);
    req.set_mem_flags(mem);
    ExpectError(client_->RegisterMr(req).status(),
                absl::StatusCode::kInvalidArgument, ::mrd::WSAEINVAL,
                "BOTH_FLAG_FORMS");
  }
  EXPECT_EQ(DevicePinned(), baseline_pinned_);
  // MEM_READ alone is fine and readable by the peer.
  client::RegisterOptions o;
  o.buffer = buffer.id();
  o.length = page_;
  o.mem_flags = 1;
  auto reg = Registration::Register(session, o);
  ASSERT_TRUE(reg.ok()) << reg.status();
  auto peer = ConnectPeer(session);
  auto read = peer->Read(reg->rkey(), reg->base_address(), 9);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "mem-flags");
  ExpectSessionStillWorks(session);
}

// The proto's FastRegister: unknown flag bits are STATUS_INVALID_PARAMETER.
TEST_F(BadInputTest, FastRegisterUnknownFlagBitsAreInvalidParameter) {
  Session session = OpenFdSession();
  FastRegisterRig rig;
  ASSERT_NO_FATAL_FAILURE(MakeRig(session, &rig));
  for (uint32_t flags : {0x4u, 0x20u, 0x80u, 0x100u, 0x400u,
                         kOpRemoteRead | 0x4u, 0x80000000u}) {
    SCOPED_TRACE(absl::StrCat("flags 0x", absl::Hex(flags)));
    client::FastRegisterOptions fr = rig.Valid(1);
    fr.flags = flags;
    ExpectRefused(rig.mr->FastRegister(fr).status(), "UNKNOWN_FLAGS");
  }
  ExpectMrFree(session, rig.mr->id());
  ExpectFastRegisterWorks(rig, 10);
  ExpectSessionStillWorks(session);
}

// --- base addresses and page arrays ------------------------------------------

TEST_F(BadInputTest, ZeroBaseAddressOnRegisterMrIsRefusedR8) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, page_, "based");
  v1::RegisterMrRequest req =
      RegisterRequest(session, buffer.id(), 0, page_, kRemoteRead);
  req.set_base_address(0);
  ExpectRefused(client_->RegisterMr(req).status(), "ZERO_BASED_ADDRESS");
  req.set_offset(10);
  req.set_length(10);
  ExpectRefused(client_->RegisterMr(req).status(), "ZERO_BASED_ADDRESS");
  EXPECT_EQ(DevicePinned(), baseline_pinned_);
  // Any non-zero base is an index the peer uses (R7).
  client::RegisterOptions o;
  o.buffer = buffer.id();
  o.length = page_;
  o.flags = kRemoteRead;
  o.base_address = 0x1000;
  auto reg = Registration::Register(session, o);
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_EQ(reg->base_address(), 0x1000u);
  auto peer = ConnectPeer(session);
  auto read = peer->Read(reg->rkey(), 0x1000, 5);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "based");
  ExpectSessionStillWorks(session);
}

TEST_F(BadInputTest, ZeroBaseAddressOnFastRegisterIsRefusedF6) {
  Session session = OpenFdSession();
  FastRegisterRig rig;
  ASSERT_NO_FATAL_FAILURE(MakeRig(session, &rig));
  client::FastRegisterOptions fr = rig.Valid(1);
  fr.base_address = 0;
  ExpectRefused(rig.mr->FastRegister(fr).status(), "ZERO_BASED_ADDRESS");
  // Even with FBO 0, where 0 would be FBO + 0 * PAGE_SIZE.
  fr.fbo = 0;
  fr.length = page_;
  ExpectRefused(rig.mr->FastRegister(fr).status(), "ZERO_BASED_ADDRESS");
  ExpectMrFree(session, rig.mr->id());
  ExpectFastRegisterWorks(rig, 10);
  ExpectSessionStillWorks(session);
}

TEST_F(BadInputTest, FastRegisterBaseAddressNotAtFboIsRefused) {
  Session session = OpenFdSession();
  FastRegisterRig rig;
  ASSERT_NO_FATAL_FAILURE(MakeRig(session, &rig));
  for (uint64_t base :
       {kFrBase, kFrBase + kLamOffset + 8, kFrBase + kLamOffset - 1,
        kFrBase + page_ / 2, kLamOffset + 1}) {
    SCOPED_TRACE(absl::StrCat("base 0x", absl::Hex(base)));
    client::FastRegisterOptions fr = rig.Valid(1);
    fr.base_address = base;
    ExpectRefused(rig.mr->FastRegister(fr).status(), "BASE_NOT_AT_FBO");
  }
  ExpectMrFree(session, rig.mr->id());
  ExpectFastRegisterWorks(rig, 10);
  ExpectSessionStillWorks(session);
}

TEST_F(BadInputTest, PageArrayWithAMisalignedEntryIsRefused) {
  Session session = OpenFdSession();
  FastRegisterRig rig;
  ASSERT_NO_FATAL_FAILURE(MakeRig(session, &rig));
  for (size_t index : {size_t{0}, size_t{1}, size_t{2}}) {
    for (uint64_t delta : {uint64_t{1}, uint64_t{8}, page_ / 2}) {
      SCOPED_TRACE(absl::StrCat("page ", index, " + ", delta));
      client::FastRegisterOptions fr = rig.Valid(1);
      fr.pages[index] += delta;
      ExpectRefused(rig.mr->FastRegister(fr).status(), "MISALIGNED_PAGE");
    }
  }
  ExpectMrFree(session, rig.mr->id());
  ExpectFastRegisterWorks(rig, 10);
  ExpectSessionStillWorks(session);
}

TEST_F(BadInputTest, PageArrayTooShortForFboPlusLengthIsRefused) {
  Session session = OpenFdSession();
  FastRegisterRig rig;
  ASSERT_NO_FATAL_FAILURE(MakeRig(session, &rig));
  {
    // Two pages hold 2 * PAGE - FBO bytes, not 2 * PAGE.
    client::FastRegisterOptions fr = rig.Valid(1);
    fr.pages.resize(2);
    fr.length = 2 * page_;
    ExpectRefused(rig.mr->FastRegister(fr).status(), "LENGTH_EXCEEDS_PAGES");
    fr.length = 2 * page_ - kLamOffset + 1;
    ExpectRefused(rig.mr->FastRegister(fr).status(), "LENGTH_EXCEEDS_PAGES");
  }
  {
    client::FastRegisterOptions fr = rig.Valid(1);
    fr.pages.resize(1);
    fr.length = page_;
    ExpectRefused(rig.mr->FastRegister(fr).status(), "LENGTH_EXCEEDS_PAGES");
  }
  {
    client::FastRegisterOptions fr = rig.Valid(1);
    fr.length = 3 * page_;  // three pages minus FBO is less
    ExpectRefused(rig.mr->FastRegister(fr).status(), "LENGTH_EXCEEDS_PAGES");
  }
  {
    client::FastRegisterOptions fr = rig.Valid(1);
    fr.pages.clear();
    ExpectRefused(rig.mr->FastRegister(fr).status(), "EMPTY_PAGE_ARRAY");
  }
  {
    client::FastRegisterOptions fr = rig.Valid(1);
    fr.length = 0;
    ExpectRefused(rig.mr->FastRegister(fr).status(), "ZERO_LENGTH");
  }
  ExpectMrFree(session, rig.mr->id());
  ExpectFastRegisterWorks(rig, 10);
  ExpectSessionStillWorks(session);
}

TEST_F(BadInputTest, PageNotFromThisSessionsLamsIsRefused) {
  Session owner = OpenFdSession();
  Buffer owner_buffer = NewBuffer(owner, 3 * page_);
  client::BuildLamOptions o;
  o.buffer = owner_buffer.id();
  o.offset = kLamOffset;
  o.length = 2 * page_;
  auto owner_lam = Lam::Build(owner, o);
  ASSERT_TRUE(owner_lam.ok()) << owner_lam.status();
  ASSERT_EQ(owner_lam->pages().size(), 3u);

  Session session = OpenFdSession();
  FastRegisterRig rig;
  ASSERT_NO_FATAL_FAILURE(MakeRig(session, &rig));
  {
    SCOPED_TRACE("one page of another session's LAM");
    client::FastRegisterOptions fr = rig.Valid(1);
    fr.pages[1] = owner_lam->pages()[1];
    ExpectRefused(rig.mr->FastRegister(fr).status(), "UNKNOWN_LOGICAL_ADDRESS");
  }
  {
    SCOPED_TRACE("all pages of another session's LAM");
    client::FastRegisterOptions fr = rig.Valid(1);
    fr.pages.assign(owner_lam->pages().begin(), owner_lam->pages().end());
    ExpectRefused(rig.mr->FastRegister(fr).status(), "UNKNOWN_LOGICAL_ADDRESS");
  }
  {
    SCOPED_TRACE("the page right after this session's LAM");
    client::FastRegisterOptions fr = rig.Valid(1);
    fr.pages[2] = rig.lam->pages()[2] + page_;
    ExpectRefused(rig.mr->FastRegister(fr).status(), "UNKNOWN_LOGICAL_ADDRESS");
  }
  {
    SCOPED_TRACE("a page of a LAM this session released");
    client::BuildLamOptions lo;
    lo.buffer = rig.buffer->id();
    lo.length = page_;
    auto released = Lam::Build(session, lo);
    ASSERT_TRUE(released.ok()) << released.status();
    const uint64_t stale = released->pages()[0];
    ASSERT_TRUE(released->Release().ok());
    client::FastRegisterOptions fr = rig.Valid(1);
    fr.pages[0] = stale;
    ExpectRefused(rig.mr->FastRegister(fr).status(), "UNKNOWN_LOGICAL_ADDRESS");
  }
  ExpectMrFree(session, rig.mr->id());
  // The owner's LAM is untouched and still its own.
  auto list = owner.List();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->lams_size(), 1);
  EXPECT_EQ(list->lams(0).lam(), owner_lam->id());
  EXPECT_TRUE(owner_lam->Release().ok());
  ExpectFastRegisterWorks(rig, 10);
  ExpectSessionStillWorks(session);
}

// --- W2 descriptor space
// --------------------------------------------------------

TEST_F(BadInputTest, DescriptorCapacityTooSmallIsWsaefaultWithRequiredSize) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, page_);
  for (uint32_t capacity : {1u, 8u, 23u}) {
    SCOPED_TRACE(capacity);
    v1::RegisterMrRequest req =
        RegisterRequest(session, buffer.id(), 0, page_, kRemoteRead);
    req.set_descriptor_capacity(capacity);
    absl::Status s = client_->RegisterMr(req).status();
    ExpectError(s, absl::StatusCode::kOutOfRange, ::mrd::WSAEFAULT,
                "DESCRIPTOR_SPACE_TOO_SMALL");
    EXPECT_EQ(GetErrorDetail(s).required_size(), 24u);
    EXPECT_EQ(client::RequiredSizeOf(s).value_or(0), 24u);
  }
  auto list = session.List();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->registrations_size(), 0);
  EXPECT_EQ(DevicePinned(), baseline_pinned_);
  client::RegisterOptions o;
  o.buffer = buffer.id();
  o.length = page_;
  o.flags = kRemoteRead;
  o.descriptor_capacity = 24;
  auto reg = Registration::Register(session, o);
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_EQ(reg->descriptor().size(), 24u);
  ExpectSessionStillWorks(session);
}

// --- fds that are not importable memfds ------------------------------------

TEST_F(BadInputTest, RegularDiskFileIsNotShmem) {
  std::string dir;
  for (const std::string& candidate :
       {std::string("/var/tmp"), std::filesystem::current_path().string(),
        std::string("/tmp")}) {
    struct statfs fs;
    if (statfs(candidate.c_str(), &fs) == 0 &&
        static_cast<uint32_t>(fs.f_type) != TMPFS_MAGIC &&
        static_cast<uint32_t>(fs.f_type) != HUGETLBFS_MAGIC &&
        access(candidate.c_str(), W_OK) == 0) {
      dir = candidate;
      break;
    }
  }
  if (dir.empty()) GTEST_SKIP() << "no writable directory off tmpfs";
  std::string path = dir + "/mrd-bad-input-XXXXXX";
  UniqueFd file(mkstemp(path.data()));
  ASSERT_TRUE(file.valid()) << std::strerror(errno);
  unlink(path.c_str());
  struct statfs fs;
  ASSERT_EQ(fstatfs(file.get(), &fs), 0);
  ASSERT_NE(static_cast<uint32_t>(fs.f_type), TMPFS_MAGIC);
  ASSERT_EQ(ftruncate(file.get(), static_cast<off_t>(page_)), 0);
  ASSERT_EQ(fcntl(file.get(), F_GETFL) & O_ACCMODE, O_RDWR);

  Session session = OpenFdSession();
  const FdsSince fds(mrd_->pid());
  for (bool writable : {true, false}) {
    ExpectError(session.ImportMemfd(file.get(), writable, 0).status(),
                absl::StatusCode::kInvalidArgument,
                ::mrd::STATUS_INVALID_PARAMETER, "NOT_SHMEM");
  }
  EXPECT_TRUE(Eventually([&] { return fds.Added().empty(); }))
      << "mrd kept a refused fd: " << fds.Describe();
  ExpectSessionStillWorks(session);
}

TEST_F(BadInputTest, PipeIsNotARegularFile) {
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  UniqueFd read_end(p[0]);
  UniqueFd write_end(p[1]);
  Session session = OpenFdSession();
  const FdsSince fds(mrd_->pid());
  for (int fd : {read_end.get(), write_end.get()}) {
    ExpectError(session.ImportMemfd(fd, false, 0).status(),
                absl::StatusCode::kInvalidArgument,
                ::mrd::STATUS_INVALID_PARAMETER, "NOT_REGULAR_FILE");
  }
  EXPECT_TRUE(Eventually([&] { return fds.Added().empty(); }))
      << "mrd kept a refused fd: " << fds.Describe();
  ExpectSessionStillWorks(session);
}

TEST_F(BadInputTest, SocketIsNotARegularFile) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  UniqueFd a(sv[0]);
  UniqueFd b(sv[1]);
  Session session = OpenFdSession();
  const FdsSince fds(mrd_->pid());
  ExpectError(session.ImportMemfd(a.get(), true, 0).status(),
              absl::StatusCode::kInvalidArgument,
              ::mrd::STATUS_INVALID_PARAMETER, "NOT_REGULAR_FILE");
  // The fd socket itself, for good measure.
  ExpectError(session.ImportMemfd(session.fd_socket(), false, 0).status(),
              absl::StatusCode::kInvalidArgument,
              ::mrd::STATUS_INVALID_PARAMETER, "NOT_REGULAR_FILE");
  EXPECT_TRUE(Eventually([&] { return fds.Added().empty(); }))
      << "mrd kept a refused fd: " << fds.Describe();
  ExpectSessionStillWorks(session);
}

TEST_F(BadInputTest, UnsealedMemfdIsRefused) {
  Session session = OpenFdSession();
  const std::string name = absl::StrCat("mrd-unsealed-", getpid());
  UniqueFd fd = MakeMemfd(name, page_, /*seal=*/false, "unsealed");
  ExpectError(session.ImportMemfd(fd.get(), true, page_).status(),
              absl::StatusCode::kInvalidArgument,
              ::mrd::STATUS_INVALID_PARAMETER, "NOT_SEALED");
  // F_SEAL_GROW alone does not stop a shrink.
  ASSERT_EQ(fcntl(fd.get(), F_ADD_SEALS, F_SEAL_GROW), 0);
  ExpectError(session.ImportMemfd(fd.get(), false, page_).status(),
              absl::StatusCode::kInvalidArgument,
              ::mrd::STATUS_INVALID_PARAMETER, "NOT_SEALED");
  // A memfd that cannot be sealed at all.
  UniqueFd no_sealing(memfd_create("mrd-no-sealing", MFD_CLOEXEC));
  ASSERT_TRUE(no_sealing.valid());
  ASSERT_EQ(ftruncate(no_sealing.get(), static_cast<off_t>(page_)), 0);
  ExpectError(session.ImportMemfd(no_sealing.get(), false, page_).status(),
              absl::StatusCode::kInvalidArgument,
              ::mrd::STATUS_INVALID_PARAMETER, "NOT_SEALED");
  EXPECT_TRUE(Eventually([&] { return !HoldsMemfd(mrd_->pid(), name); }));
  // Sealed now, the same fd imports and registers.
  ASSERT_EQ(fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK), 0);
  auto buffer = session.ImportMemfd(fd.get(), false, page_);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  auto reg = Reg(session, *buffer, 0, page_, kRemoteRead);
  ASSERT_TRUE(reg.ok()) << reg.status();
  auto peer = ConnectPeer(session);
  auto read = peer->Read(reg->rkey(), reg->base_address(), 8);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "unsealed");
  ExpectSessionStillWorks(session);
}

TEST_F(BadInputTest, ClosedFdIsAClearClientSideError) {
  Session session = OpenFdSession();
  // A descriptor number that is certainly closed: far above what the
  // process's other threads get (they take the lowest free number).
  int probe = fcntl(STDERR_FILENO, F_DUPFD_CLOEXEC, 900);
  ASSERT_GE(probe, 900);
  ASSERT_EQ(close(probe), 0);
  for (int fd : {probe, -1}) {
    SCOPED_TRACE(fd);
    auto buffer = session.ImportMemfd(fd, true, page_);
    ExpectError(buffer.status(), absl::StatusCode::kInvalidArgument,
                ::mrd::SEED_STATUS_UNSPECIFIED, "BAD_FD");
  }
  EXPECT_TRUE(session.Ping().ok());
  ExpectSessionStillWorks(session);
}

// --- the fd socket, spoken by hand
// ---------------------------------------------

TEST_F(BadInputTest, GarbageDatagramsOnTheFdSocketGetAnErrorAndNoFdLeaks) {
  RawFdSocket raw(mrd_->fd_socket());
  ASSERT_TRUE(raw.connected());
  std::optional<v1::FdReply> welcome = raw.Receive();
  ASSERT_TRUE(welcome.has_value() && welcome->has_welcome());
  const std::string token = welcome->welcome().session();
  const pid_t pid = mrd_->pid();
  const FdsSince fds(pid);

  {
    SCOPED_TRACE("not a protobuf (field number 0)");
    ASSERT_TRUE(raw.Send(std::string("\x00garbage\xff\xff", 10)));
    ExpectFdError(raw.Receive(), 0, absl::StatusCode::kInvalidArgument,
                  ::mrd::SEED_STATUS_UNSPECIFIED, "MALFORMED_REQUEST");
  }
  {
    SCOPED_TRACE("a varint that never ends");
    ASSERT_TRUE(raw.Send(std::string(20, '\xff')));
    ExpectFdError(raw.Receive(), 0, absl::StatusCode::kInvalidArgument,
                  ::mrd::SEED_STATUS_UNSPECIFIED, "MALFORMED_REQUEST");
  }
  const std::string name = absl::StrCat("mrd-garbage-", getpid());
  {
    SCOPED_TRACE("garbage with a memfd attached");
    UniqueFd memfd = MakeMemfd(name, page_);
    ASSERT_TRUE(raw.Send(std::string("\x00junk", 5), {memfd.get()}));
    ExpectFdError(raw.Receive(), 0, absl::StatusCode::kInvalidArgument,
                  ::mrd::SEED_STATUS_UNSPECIFIED, "MALFORMED_REQUEST");
  }
  {
    SCOPED_TRACE("an empty datagram");
    ASSERT_TRUE(raw.Send(""));
    ExpectFdError(raw.Receive(), 0, absl::StatusCode::kInvalidArgument,
                  ::mrd::SEED_STATUS_UNSPECIFIED, "UNKNOWN_OPERATION");
  }
  {
    SCOPED_TRACE("an oversized datagram");
    ASSERT_TRUE(raw.Send(std::string(8192, 'x')));
    ExpectFdError(raw.Receive(), 0, absl::StatusCode::kInvalidArgument,
                  ::mrd::SEED_STATUS_UNSPECIFIED, "MESSAGE_TOO_LARGE");
  }
  {
    SCOPED_TRACE("ImportMemfd without an fd");
    ASSERT_TRUE(raw.Send(ImportRequestBytes(3, false, 0)));
    ExpectFdError(raw.Receive(), 3, absl::StatusCode::kInvalidArgument,
                  ::mrd::SEED_STATUS_UNSPECIFIED, "MISSING_FD");
  }
  {
    SCOPED_TRACE("Ping with an fd");
    UniqueFd memfd = MakeMemfd(name, page_);
    v1::FdRequest ping;
    ping.set_sequence(4);
    ping.mutable_ping();
    ASSERT_TRUE(raw.Send(ping.SerializeAsString(), {memfd.get()}));
    ExpectFdError(raw.Receive(), 4, absl::StatusCode::kInvalidArgument,
                  ::mrd::SEED_STATUS_UNSPECIFIED, "UNEXPECTED_FD");
  }
  // Every fd that came in was closed: mrd holds what it held before.
  EXPECT_TRUE(Eventually([&] { return fds.Added().empty(); }))
      << fds.Describe();
  EXPECT_FALSE(HoldsMemfd(pid, name));

  // The connection is still usable: a proper import works, and registers.
  const std::string good = absl::StrCat("mrd-good-", getpid());
  UniqueFd memfd = MakeMemfd(good, page_, true, "after garbage");
  ASSERT_TRUE(raw.Send(ImportRequestBytes(7, false, page_), {memfd.get()}));
  std::optional<v1::FdReply> imported = raw.Receive();
  ASSERT_TRUE(imported.has_value());
  ASSERT_TRUE(imported->has_buffer()) << imported->DebugString();
  EXPECT_EQ(imported->sequence(), 7u);
  EXPECT_EQ(imported->buffer().size(), page_);
  // The buffer's own fd, and nothing else.
  EXPECT_TRUE(Eventually([&] {
    const std::vector<std::string> added = fds.Added();
    return added.size() == 1 && absl::StartsWith(added[0], "/memfd:" + good);
  })) << fds.Describe();
  {
    Session attached = Session::Attach(*client_, token);
    v1::RegisterMrRequest req = RegisterRequest(
        attached, imported->buffer().buffer(), 0, page_, kRemoteRead);
    auto reg = client_->RegisterMr(req);
    ASSERT_TRUE(reg.ok()) << reg.status();
    auto peer = ConnectPeer(attached);
    auto read = peer->Read(reg->rkey(), reg->base_address(), 13);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(*read, "after garbage");
  }
  // Closing the socket ends the session: its socket and buffer fds go, and
  // nothing of it stays pinned.
  raw.Close();
  memfd.Reset();
  EXPECT_TRUE(Eventually([&] {
    return fds.Added().empty() && fds.SocketsRemoved() >= 1;
  })) << fds.Describe();
  EXPECT_TRUE(Eventually([&] { return DevicePinned() == baseline_pinned_; }));
  EXPECT_FALSE(HoldsMemfd(pid, good));
}

TEST_F(BadInputTest, TruncatedControlMessageGetsAnErrorAndEveryFdIsClosed) {
  RawFdSocket raw(mrd_->fd_socket());
  ASSERT_TRUE(raw.connected());
  std::optional<v1::FdReply> welcome = raw.Receive();
  ASSERT_TRUE(welcome.has_value() && welcome->has_welcome());
  const pid_t pid = mrd_->pid();
  const FdsSince fds(pid);
  const std::string prefix = absl::StrCat("mrd-ctrunc-", getpid(), "-");

  {
    SCOPED_TRACE("ten fds in one SCM_RIGHTS message");
    std::vector<UniqueFd> memfds;
    std::vector<int> sent;
    for (int i = 0; i < 10; ++i) {
      memfds.push_back(MakeMemfd(absl::StrCat(prefix, i), page_));
      sent.push_back(memfds.back().get());
    }
    ASSERT_TRUE(raw.Send(ImportRequestBytes(5, false, page_), sent));
    ExpectFdError(raw.Receive(), 5, absl::StatusCode::kInvalidArgument,
                  ::mrd::SEED_STATUS_UNSPECIFIED, "CONTROL_TRUNCATED");
  }
  {
    SCOPED_TRACE("two fds");
    UniqueFd a = MakeMemfd(prefix + "a", page_);
    UniqueFd b = MakeMemfd(prefix + "b", page_);
    ASSERT_TRUE(
        raw.Send(ImportRequestBytes(6, false, page_), {a.get(), b.get()}));
    ExpectFdError(raw.Receive(), 6, absl::StatusCode::kInvalidArgument,
                  ::mrd::SEED_STATUS_UNSPECIFIED, "TOO_MANY_FDS");
  }
  EXPECT_TRUE(Eventually([&] { return fds.Added().empty(); }))
      << fds.Describe();
  EXPECT_FALSE(HoldsMemfd(pid, prefix));

  // The connection still imports.
  UniqueFd memfd = MakeMemfd(prefix + "good", page_, true, "ok");
  ASSERT_TRUE(raw.Send(ImportRequestBytes(8, true, page_), {memfd.get()}));
  std::optional<v1::FdReply> imported = raw.Receive();
  ASSERT_TRUE(imported.has_value());
  ASSERT_TRUE(imported->has_buffer()) << imported->DebugString();
  EXPECT_EQ(imported->sequence(), 8u);
  EXPECT_TRUE(imported->buffer().writable());
  EXPECT_TRUE(Eventually([&] {
    const std::vector<std::string> added = fds.Added();
    return added.size() == 1 &&
           absl::StartsWith(added[0], "/memfd:" + prefix + "good");
  })) << fds.Describe();
  raw.Close();
  EXPECT_TRUE(Eventually([&] {
    return fds.Added().empty() && fds.SocketsRemoved() >= 1;
  })) << fds.Describe();
  EXPECT_FALSE(HoldsMemfd(pid, prefix));
}

// --- clients that go away mid-request ---------------------------------------

TEST_F(BadInputTest, FdClientThatHangsUpRightAfterAnImportLeavesNothing) {
  const pid_t pid = mrd_->pid();
  const FdsSince fds(pid);
  const std::string name = absl::StrCat("mrd-abandoned-", getpid());
  std::string token;
  {
    RawFdSocket raw(mrd_->fd_socket());
    ASSERT_TRUE(raw.connected());
    std::optional<v1::FdReply> welcome = raw.Receive();
    ASSERT_TRUE(welcome.has_value() && welcome->has_welcome());
    token = welcome->welcome().session();
    UniqueFd big = MakeMemfd(name, uint64_t{256} << 20);
    ASSERT_TRUE(raw.Send(ImportRequestBytes(1, true, 0), {big.get()}));
    raw.Close();  // before the reply
  }
  EXPECT_TRUE(Eventually([&] { return !HoldsMemfd(pid, name); }))
      << "mrd still holds the abandoned memfd";
  EXPECT_TRUE(Eventually([&] { return fds.Added().empty(); }))
      << fds.Describe();
  EXPECT_TRUE(Eventually([&] {
    v1::GetSessionRequest req;
    req.set_session(token);
    return client_->GetSession(req).status().code() ==
           absl::StatusCode::kFailedPrecondition;
  })) << "the session outlived its socket";
  EXPECT_EQ(DevicePinned(), baseline_pinned_);
}

// One worker thread: pool work runs in order, so a later pool RPC on the
// same connection finishing means every earlier one has finished too.
class BadInputCancelledRpcTest : public BadInputTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    o.extra_flags = {"--worker_threads=1"};
    return o;
  }
};

TEST_F(BadInputCancelledRpcTest,
       CancelledRegisterMrLeavesARegistrationOfTheSessionOrNone) {
  Session session = OpenFdSession();
  const uint64_t chunk = 128 * page_;
  constexpr int kCount = 8;
  Buffer buffer = NewBuffer(session, kCount * chunk);
  auto stub = v1::MemoryRegistration::NewStub(grpc::CreateChannel(
      mrd_->grpc_target(), grpc::InsecureChannelCredentials()));
  for (int i = 0; i < kCount; ++i) {
    SCOPED_TRACE(i);
    v1::RegisterMrRequest req =
        RegisterRequest(session, buffer.id(), i * chunk, chunk, kRemoteRead);
    v1::RegisterMrResponse resp;
    grpc::ClientContext ctx;
    grpc::Status status;
    if (i % 2 == 0) {
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::milliseconds(1));
      status = stub->RegisterMr(&ctx, req, &resp);
      EXPECT_TRUE(status.ok() ||
                  status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
          << status.error_code() << " " << status.error_message();
    } else {
      absl::Notification done;
      stub->async()->RegisterMr(&ctx, &req, &resp, [&](grpc::Status s) {
        status = std::move(s);
        done.Notify();
      });
      ctx.TryCancel();
      done.WaitForNotification();
      EXPECT_TRUE(status.ok() ||
                  status.error_code() == grpc::StatusCode::CANCELLED)
          << status.error_code() << " " << status.error_message();
    }
  }
  // Barrier: a pool RPC on the same connection.
  {
    grpc::ClientContext ctx;
    v1::CreateMrRequest req;
    req.set_session(session.token());
    v1::MrInfo info;
    ASSERT_TRUE(stub->CreateMr(&ctx, req, &info).ok());
  }
  // Each registration that exists is the session's, with one reference, and
  // the pinned accounting adds up: nothing pinned that the session does not
  // own.
  auto list = session.List();
  ASSERT_TRUE(list.ok()) << list.status();
  uint64_t owned = 0;
  for (const auto& r : list->registrations()) {
    EXPECT_EQ(r.buffer(), buffer.id());
    EXPECT_EQ(r.offset() % chunk, 0u);
    EXPECT_EQ(r.length(), chunk);
    EXPECT_EQ(r.references(), 1u);
    owned += r.length();
  }
  EXPECT_EQ(list->session().pinned_bytes(), owned);
  EXPECT_EQ(DevicePinned(), baseline_pinned_ + owned);
  // The session still works, and closing it gives back everything.
  ExpectSessionStillWorks(session);
  ASSERT_TRUE(session.Close().ok());
  EXPECT_TRUE(Eventually([&] { return DevicePinned() == baseline_pinned_; }))
      << DevicePinned() << " pinned, " << baseline_pinned_ << " before";
}

// --- limits -----------------------------------------------------------------

class BadInputRegistrationLimitTest : public BadInputTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    o.extra_flags = {"--max_session_registrations=2"};
    return o;
  }
};

TEST_F(BadInputRegistrationLimitTest, ThirdDistinctRegistrationIsRefused) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 3 * page_, "limited");
  auto first = Reg(session, buffer, 0, page_, kRemoteRead);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = Reg(session, buffer, page_, page_, kRemoteRead);
  ASSERT_TRUE(second.ok()) << second.status();
  ExpectError(Reg(session, buffer, 2 * page_, page_, kRemoteRead).status(),
              absl::StatusCode::kResourceExhausted,
              ::mrd::STATUS_INSUFFICIENT_RESOURCES,
              "LIMIT_SESSION_REGISTRATIONS");
  // Same range, other access: a distinct registration too.
  ExpectError(Reg(session, buffer, 0, page_, kRemoteWrite).status(),
              absl::StatusCode::kResourceExhausted,
              ::mrd::STATUS_INSUFFICIENT_RESOURCES,
              "LIMIT_SESSION_REGISTRATIONS");
  EXPECT_EQ(DevicePinned(), baseline_pinned_ + 2 * page_);
  // A cache hit adds no registration and is served.
  auto again = Reg(session, buffer, 0, page_, kRemoteRead);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->cache_hit());
  EXPECT_EQ(again->id(), first->id());
  EXPECT_EQ(again->references(), 2u);
  // Another session has its own allowance.
  Session other = OpenFdSession();
  Buffer other_buffer = NewBuffer(other, page_);
  EXPECT_TRUE(Reg(other, other_buffer, 0, page_, kRemoteRead).ok());
  // Giving one back makes room.
  ASSERT_TRUE(second->Deregister().ok());
  auto third = Reg(session, buffer, 2 * page_, page_, kRemoteRead);
  ASSERT_TRUE(third.ok()) << third.status();
  auto peer = ConnectPeer(session);
  auto read = peer->Read(third->rkey(), third->base_address(), 7);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, std::string("limited").substr(2 * page_ % 7) +
                       std::string("limited").substr(0, 2 * page_ % 7));
}

class BadInputSessionPinnedLimitTest : public BadInputTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    o.extra_flags = {
        absl::StrCat("--max_session_pinned_bytes=", 2 * HostPageSize())};
    return o;
  }
};

TEST_F(BadInputSessionPinnedLimitTest, PinningPastTheSessionLimitIsRefused) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, 4 * page_);
  auto two = Reg(session, buffer, 0, 2 * page_, kRemoteRead);
  ASSERT_TRUE(two.ok()) << two.status();
  ExpectError(Reg(session, buffer, 2 * page_, page_, kRemoteRead).status(),
              absl::StatusCode::kResourceExhausted,
              ::mrd::STATUS_INSUFFICIENT_RESOURCES,
              "LIMIT_SESSION_PINNED_BYTES");
  ExpectError(
      client_->BuildLam(BuildLamRequest(session, buffer.id(), 2 * page_, page_))
          .status(),
      absl::StatusCode::kResourceExhausted,
      ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_SESSION_PINNED_BYTES");
  // A single request larger than the limit.
  Session big = OpenFdSession();
  Buffer big_buffer = NewBuffer(big, 3 * page_);
  ExpectError(Reg(big, big_buffer, 0, 3 * page_, kRemoteRead).status(),
              absl::StatusCode::kResourceExhausted,
              ::mrd::STATUS_INSUFFICIENT_RESOURCES,
              "LIMIT_SESSION_PINNED_BYTES");
  EXPECT_EQ(DevicePinned(), baseline_pinned_ + 2 * page_);
  // A cache hit pins nothing more.
  auto hit = Reg(session, buffer, 0, 2 * page_, kRemoteRead);
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_TRUE(hit->cache_hit());
  // The limit is per session: another one may pin its own two pages.
  EXPECT_TRUE(Reg(big, big_buffer, 0, 2 * page_, kRemoteRead).ok());
  // Giving the pages back makes room.
  ASSERT_TRUE(hit->Deregister().ok());
  ASSERT_TRUE(two->Deregister().ok());
  auto other = Reg(session, buffer, 2 * page_, page_, kRemoteRead);
  EXPECT_TRUE(other.ok()) << other.status();
  ExpectSessionStillWorks(session);
}

class BadInputTotalPinnedLimitTest : public BadInputTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    // The bystander's page plus two.
    o.extra_flags = {
        absl::StrCat("--max_total_pinned_bytes=", 3 * HostPageSize()),
        "--tenant_default_percent=100"};
    return o;
  }
};

TEST_F(BadInputTotalPinnedLimitTest,
       PinningPastTheServerLimitIsRefusedAcrossSessions) {
  Session first = OpenFdSession();
  Buffer first_buffer = NewBuffer(first, 2 * page_);
  auto held = Reg(first, first_buffer, 0, 2 * page_, kRemoteRead);
  ASSERT_TRUE(held.ok()) << held.status();

  Session second = OpenFdSession();
  Buffer second_buffer = NewBuffer(second, page_);
  ExpectError(Reg(second, second_buffer, 0, page_, kRemoteRead).status(),
              absl::StatusCode::kResourceExhausted,
              ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_TOTAL_PINNED_BYTES");
  ExpectError(
      client_->BuildLam(BuildLamRequest(second, second_buffer.id(), 0, page_))
          .status(),
      absl::StatusCode::kResourceExhausted,
      ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_TOTAL_PINNED_BYTES");
  EXPECT_EQ(DevicePinned(), baseline_pinned_ + 2 * page_);
  ASSERT_TRUE(held->Deregister().ok());
  ExpectSessionStillWorks(second);
}

class BadInputSessionLimitTest : public BadInputTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    // One tenant (this uid) may hold every session here.
    o.extra_flags = {"--max_sessions=2", "--tenant_default_percent=100"};
    return o;
  }
};

TEST_F(BadInputSessionLimitTest, ThirdSessionIsRefused) {
  // The bystander is the first session.
  auto second = Session::OpenFd(*client_);
  ASSERT_TRUE(second.ok()) << second.status();
  ExpectError(Session::OpenFd(*client_).status(),
              absl::StatusCode::kResourceExhausted,
              ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_SESSIONS");
  ExpectError(Session::OpenLease(*client_, absl::Seconds(60)).status(),
              absl::StatusCode::kResourceExhausted,
              ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_SESSIONS");
  ExpectSessionStillWorks(*second);
  // Once one ends, a new one may open.
  ASSERT_TRUE(second->Close().ok());
  std::optional<Session> third;
  EXPECT_TRUE(Eventually([&] {
    auto s = Session::OpenFd(*client_);
    if (s.ok()) third.emplace(std::move(*s));
    return s.ok();
  }));
  ASSERT_TRUE(third.has_value());
  ExpectSessionStillWorks(*third);
}

class BadInputBufferSizeLimitTest : public BadInputTest {
 protected:
  MrdProcessOptions ServerOptions() override {
    MrdProcessOptions o;
    o.extra_flags = {absl::StrCat("--max_buffer_size=", 2 * HostPageSize())};
    return o;
  }
};

TEST_F(BadInputBufferSizeLimitTest, ImportsLargerThanTheLimitAreRefused) {
  Session session = OpenFdSession();
  const pid_t pid = mrd_->pid();
  const std::string name = absl::StrCat("mrd-too-big-", getpid());
  UniqueFd big = MakeMemfd(name, 3 * page_);
  ExpectError(session.ImportMemfd(big.get(), true, 0).status(),
              absl::StatusCode::kResourceExhausted,
              ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_BUFFER_SIZE");
  ExpectError(Buffer::Create(session, 2 * page_ + 1).status(),
              absl::StatusCode::kResourceExhausted,
              ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_BUFFER_SIZE");
  EXPECT_TRUE(Eventually([&] { return !HoldsMemfd(pid, name); }));
  // The lease path has the same limit.
  ASSERT_TRUE(WriteShmFile(mrd_->shm_dir(), "too-big", "x", 3 * page_).ok());
  auto lease = Session::OpenLease(*client_, absl::Seconds(60));
  ASSERT_TRUE(lease.ok()) << lease.status();
  ExpectError(Buffer::ImportFile(*lease, "too-big", false).status(),
              absl::StatusCode::kResourceExhausted,
              ::mrd::STATUS_INSUFFICIENT_RESOURCES, "LIMIT_BUFFER_SIZE");
  // Exactly the limit is fine.
  auto exact = Buffer::Create(session, 2 * page_);
  EXPECT_TRUE(exact.ok()) << exact.status();
  ExpectSessionStillWorks(session);
}

// --- access
// ---------------------------------------------------------------------

TEST_F(BadInputTest, WriteAccessOnAReadOnlyImportIsRefused) {
  Session session = OpenFdSession();
  auto ro = Buffer::Create(session, page_, "read-only", /*writable=*/false);
  ASSERT_TRUE(ro.ok()) << ro.status();
  ASSERT_FALSE(ro->writable());
  std::memcpy(ro->data(), "read-only", 9);
  for (uint32_t flags : {kLocalWrite, kRemoteWrite, kRemoteRead | kLocalWrite,
                         kRemoteRead | kRemoteWrite}) {
    SCOPED_TRACE(absl::StrCat("flags 0x", absl::Hex(flags)));
    ExpectRefused(Reg(session, *ro, 0, page_, flags).status(),
                  "BUFFER_READ_ONLY");
  }
  for (uint32_t mem : {2u, 3u}) {
    SCOPED_TRACE(absl::StrCat("mem_flags ", mem));
    v1::RegisterMrRequest req = RegisterRequest(session, ro->id(), 0, page_, 0);
    req.set_mem_flags(mem);
    ExpectRefused(client_->RegisterMr(req).status(), "BUFFER_READ_ONLY");
  }
  EXPECT_EQ(DevicePinned(), baseline_pinned_);
  // Reading is what it was imported for.
  auto reg = Reg(session, *ro, 0, page_, kRemoteRead);
  ASSERT_TRUE(reg.ok()) << reg.status();
  auto peer = ConnectPeer(session);
  auto read = peer->Read(reg->rkey(), reg->base_address(), 9);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "read-only");
  ExpectSessionStillWorks(session);
}

TEST_F(BadInputTest, FastRegisterWriteAccessOnAReadOnlyLamIsRefused) {
  Session session = OpenFdSession();
  FastRegisterRig rig;
  ASSERT_NO_FATAL_FAILURE(
      MakeRig(session, &rig, /*allow_remote=*/true, /*writable=*/false));
  for (uint32_t flags : {kOpRemoteWrite, 0x10u, kOpRemoteRead | 0x10u}) {
    SCOPED_TRACE(absl::StrCat("flags 0x", absl::Hex(flags)));
    client::FastRegisterOptions fr = rig.Valid(1);
    fr.flags = flags;
    ExpectRefused(rig.mr->FastRegister(fr).status(), "BUFFER_READ_ONLY");
  }
  ExpectMrFree(session, rig.mr->id());
  ExpectFastRegisterWorks(rig, 10);
}

TEST_F(BadInputTest, RegisterMrOnAFastRegisterMrIsRefusedR4) {
  Session session = OpenFdSession();
  Buffer buffer = NewBuffer(session, page_, "normal");
  auto fast = Mr::Create(session, /*fast_register=*/true, true);
  ASSERT_TRUE(fast.ok()) << fast.status();
  client::RegisterOptions o;
  o.buffer = buffer.id();
  o.length = page_;
  o.flags = kRemoteRead;
  ExpectRefused(fast->Register(o).status(), "MR_IS_FAST_REGISTER");
  v1::DeregisterMrRequest dereg;
  dereg.set_session(session.token());
  dereg.set_mr(fast->id());
  ExpectRefused(client_->DeregisterMr(dereg).status(), "MR_IS_FAST_REGISTER");
  EXPECT_EQ(DevicePinned(), baseline_pinned_);
  ExpectMrFree(session, fast->id());
  // A normal MR object registers.
  auto normal = Mr::Create(session, /*fast_register=*/false);
  ASSERT_TRUE(normal.ok()) << normal.status();
  auto reg = normal->Register(o);
  ASSERT_TRUE(reg.ok()) << reg.status();
  auto peer = ConnectPeer(session);
  auto read = peer->Read(reg->rkey(), reg->base_address(), 6);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "normal");
  ExpectSessionStillWorks(session);
}

TEST_F(BadInputTest, RemoteFastRegisterOnALocalOnlyMrIsAccessViolationF4) {
  Session session = OpenFdSession();
  FastRegisterRig rig;
  ASSERT_NO_FATAL_FAILURE(MakeRig(session, &rig, /*allow_remote=*/false));
  for (uint32_t flags :
       {kOpRemoteRead, kOpRemoteWrite, kOpRemoteRead | kOpSilentSuccess}) {
    SCOPED_TRACE(absl::StrCat("flags 0x", absl::Hex(flags)));
    client::FastRegisterOptions fr = rig.Valid(1);
    fr.flags = flags;
    ExpectError(rig.mr->FastRegister(fr).status(),
                absl::StatusCode::kPermissionDenied,
                ::mrd::STATUS_ACCESS_VIOLATION, "MR_NOT_REMOTE");
  }
  ExpectMrFree(session, rig.mr->id());
  // Local access is what the MR was made for.
  client::FastRegisterOptions fr = rig.Valid(5);
  fr.flags = 0x10;  // ALLOW_LOCAL_WRITE
  ASSERT_TRUE(rig.mr->FastRegister(fr).ok());
  v1::Completion done =
      NextOfKind(*rig.completions, v1::Completion::FAST_REGISTER);
  EXPECT_EQ(done.request_context(), 5u);
  EXPECT_EQ(done.status(), ::mrd::STATUS_SUCCESS) << done.message();
  // Its token grants peers nothing.
  ExpectRemoteAccessError(
      rig.peer->Read(done.rkey(), fr.base_address, 1).status());
  auto peer = ConnectPeer(session);
  ASSERT_NE(peer, nullptr);
  WaitConnected(*rig.completions, peer->connection_id());
  ASSERT_TRUE(rig.mr->Invalidate(peer->connection_id(), 6).ok());
  v1::Completion inval =
      NextOfKind(*rig.completions, v1::Completion::INVALIDATE);
  EXPECT_EQ(inval.status(), ::mrd::STATUS_SUCCESS) << inval.message();
  ExpectSessionStillWorks(session);
}

TEST_F(BadInputTest, ReleaseLamWhileFastRegisteredIsLamInUse) {
  Session session = OpenFdSession();
  FastRegisterRig rig;
  ASSERT_NO_FATAL_FAILURE(MakeRig(session, &rig));
  client::FastRegisterOptions fr = rig.Valid(1);
  ASSERT_TRUE(rig.mr->FastRegister(fr).ok());
  v1::Completion done =
      NextOfKind(*rig.completions, v1::Completion::FAST_REGISTER);
  ASSERT_EQ(done.status(), ::mrd::STATUS_SUCCESS) << done.message();

  v1::ReleaseLamRequest release;
  release.set_session(session.token());
  release.set_lam(rig.lam->id());
  ExpectError(client_->ReleaseLam(release).status(),
              absl::StatusCode::kFailedPrecondition,
              ::mrd::SEED_STATUS_UNSPECIFIED, "LAM_IN_USE");
  // Nothing was released: the pages are still mapped and pinned.
  auto read = rig.peer->Read(done.rkey(), fr.base_address, 13);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, FrBytesAt(kLamOffset, 13));
  EXPECT_EQ(DevicePinned(), baseline_pinned_ + 3 * page_);

  ASSERT_TRUE(rig.mr->Invalidate(rig.peer->connection_id(), 2).ok());
  v1::Completion inval =
      NextOfKind(*rig.completions, v1::Completion::INVALIDATE);
  ASSERT_EQ(inval.status(), ::mrd::STATUS_SUCCESS) << inval.message();
  rig.lam->Detach();
  EXPECT_TRUE(client_->ReleaseLam(release).ok());
  EXPECT_EQ(DevicePinned(), baseline_pinned_);
  ExpectSessionStillWorks(session);
}

// --- sessions
// -----------------------------------------------------------------

TEST_F(BadInputTest, UnknownSessionTokenIsWsaenotconn) {
  std::string closed_token;
  {
    auto lease = Session::OpenLease(*client_, absl::Seconds(60));
    ASSERT_TRUE(lease.ok()) << lease.status();
    closed_token = lease->token();
    ASSERT_TRUE(lease->Close().ok());
  }
  // An fd session's token once its socket closed.
  std::string hung_up_token;
  {
    Session fd_session = OpenFdSession();
    hung_up_token = fd_session.token();
  }
  ASSERT_TRUE(Eventually([&] {
    v1::GetSessionRequest req;
    req.set_session(hung_up_token);
    return !client_->GetSession(req).ok();
  }));
  const std::string bystander = bystander_->token();
  for (const std::string& token :
       {std::string(), std::string("0123456789abcdef0123456789abcdef"),
        bystander + "0", bystander.substr(1), closed_token, hung_up_token}) {
    SCOPED_TRACE("token '" + token + "'");
    auto expect = [](const absl::Status& s) {
      ExpectError(s, absl::StatusCode::kFailedPrecondition, ::mrd::WSAENOTCONN,
                  "SESSION_NOT_CONNECTED");
    };
    v1::GetSessionRequest get;
    get.set_session(token);
    expect(client_->GetSession(get).status());
    v1::CloseSessionRequest close;
    close.set_session(token);
    expect(client_->CloseSession(close).status());
    v1::ImportFileRequest import;
    import.set_session(token);
    import.set_path("anything");
    expect(client_->ImportFile(import).status());
    v1::ReleaseBufferRequest release;
    release.set_session(token);
    release.set_buffer(bystander_buffer_->id());
    expect(client_->ReleaseBuffer(release).status());
    v1::CreateMrRequest create;
    create.set_session(token);
    expect(client_->CreateMr(create).status());
    v1::CloseMrRequest close_mr;
    close_mr.set_session(token);
    close_mr.set_mr(1);
    expect(client_->CloseMr(close_mr).status());
    v1::RegisterMrRequest reg;
    reg.set_session(token);
    reg.set_buffer(bystander_buffer_->id());
    reg.set_length(page_);
    reg.set_flags(kRemoteRead);
    expect(client_->RegisterMr(reg).status());
    v1::DeregisterMrRequest dereg;
    dereg.set_session(token);
    dereg.set_registration(bystander_reg_->id());
    expect(client_->DeregisterMr(dereg).status());
    v1::BuildLamRequest lam;
    lam.set_session(token);
    lam.set_buffer(bystander_buffer_->id());
    lam.set_length(page_);
    expect(client_->BuildLam(lam).status());
    v1::ReleaseLamRequest release_lam;
    release_lam.set_session(token);
    release_lam.set_lam(1);
    expect(client_->ReleaseLam(release_lam).status());
    v1::FastRegisterRequest fr;
    fr.set_session(token);
    fr.set_connection(bystander_peer_->connection_id());
    fr.set_mr(1);
    fr.add_pages(0x10000);
    fr.set_length(page_);
    fr.set_base_address(kFrBase);
    expect(client_->FastRegister(fr).status());
    v1::InvalidateMrRequest inval;
    inval.set_session(token);
    inval.set_connection(bystander_peer_->connection_id());
    inval.set_mr(1);
    expect(client_->InvalidateMr(inval).status());
    v1::CreatePeerTicketRequest ticket;
    ticket.set_session(token);
    expect(client_->CreatePeerTicket(ticket).status());
    v1::ListRegistrationsRequest list;
    list.set_session(token);
    expect(client_->ListRegistrations(list).status());
    Session attached = Session::Attach(*client_, token);
    CompletionStream stream = CompletionStream::Open(attached);
    expect(stream.Next(absl::Seconds(10)).status());
  }
}

}  // namespace
}  // namespace mrd::testing
