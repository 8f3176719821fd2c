#include "tests/unit/client/fake_mrd.h"

#include <fcntl.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/common/log.h"
#include "server/common/status.h"

namespace mrd::testing {
namespace {

using grpc::ServerContext;

grpc::Status Fail(ServerContext* ctx, const absl::Status& status) {
  v1::ErrorDetail d = GetErrorDetail(status);
  ctx->AddTrailingMetadata("mrd-seed-status",
                           v1::SeedStatus_Name(d.seed_status()));
  ctx->AddTrailingMetadata("mrd-reason", d.reason());
  if (d.required_size() != 0) {
    ctx->AddTrailingMetadata("mrd-required-size",
                             absl::StrCat(d.required_size()));
  }
  ctx->AddTrailingMetadata("mrd-error-bin", d.SerializeAsString());
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

absl::Status NoSession() {
  return SeedError(v1::WSAENOTCONN, "UNKNOWN_SESSION", "no such session");
}

absl::Status NotFound(absl::string_view what) {
  return MrdError(absl::StatusCode::kNotFound, absl::StrCat("UNKNOWN_", what),
                  absl::StrCat("no such ", what));
}

void SendReply(int fd, const v1::FdReply& reply) {
  std::string bytes = reply.SerializeAsString();
  (void)::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
}

}  // namespace

class FakeMrd::Service final : public v1::MemoryRegistration::Service {
 public:
  explicit Service(FakeMrd* fake) : f_(fake) {}

  grpc::Status GetDeviceInfo(ServerContext*, const v1::GetDeviceInfoRequest*,
                             v1::DeviceInfo* r) override {
    r->set_name("fake");
    r->set_kind("software");
    r->set_page_size(4096);
    r->set_healthy(true);
    return grpc::Status::OK;
  }

  grpc::Status OpenLeaseSession(ServerContext*,
                                const v1::OpenLeaseSessionRequest* q,
                                v1::SessionInfo* r) override {
    r->set_session(f_->NewSession("lease"));
    r->set_kind("lease");
    r->set_ttl_seconds(q->ttl_seconds() == 0 ? 60 : q->ttl_seconds());
    return grpc::Status::OK;
  }

  grpc::Status GetSession(ServerContext* ctx, const v1::GetSessionRequest* q,
                          v1::SessionInfo* r) override {
    absl::MutexLock l(&f_->mu_);
    auto it = f_->sessions_.find(q->session());
    if (it == f_->sessions_.end()) return Fail(ctx, NoSession());
    r->set_session(q->session());
    r->set_kind(it->second.kind);
    return grpc::Status::OK;
  }

  grpc::Status CloseSession(ServerContext* ctx,
                            const v1::CloseSessionRequest* q,
                            v1::CloseSessionResponse*) override {
    {
      absl::MutexLock l(&f_->mu_);
      if (f_->sessions_.count(q->session()) == 0) return Fail(ctx, NoSession());
    }
    f_->EndSession(q->session());
    return grpc::Status::OK;
  }

  grpc::Status ImportFile(ServerContext* ctx, const v1::ImportFileRequest* q,
                          v1::BufferInfo* r) override {
    absl::MutexLock l(&f_->mu_);
    auto it = f_->sessions_.find(q->session());
    if (it == f_->sessions_.end()) return Fail(ctx, NoSession());
    if (q->path() == "missing") return Fail(ctx, NotFound("FILE"));
    uint64_t id = f_->next_id_++;
    f_->buffers_[id] = q->session();
    it->second.buffers.insert(id);
    r->set_buffer(id);
    r->set_size(16384);
    r->set_writable(q->writable());
    r->set_source("file:" + q->path());
    r->set_address(0x10000000 + id * 0x100000);
    return grpc::Status::OK;
  }

  grpc::Status ReleaseBuffer(ServerContext* ctx,
                             const v1::ReleaseBufferRequest* q,
                             v1::ReleaseBufferResponse* r) override {
    absl::MutexLock l(&f_->mu_);
    if (f_->sessions_.count(q->session()) == 0) return Fail(ctx, NoSession());
    auto it = f_->buffers_.find(q->buffer());
    if (it == f_->buffers_.end() || it->second != q->session()) {
      return Fail(ctx, NotFound("BUFFER"));
    }
    f_->buffers_.erase(it);
    f_->sessions_[q->session()].buffers.erase(q->buffer());
    uint32_t invalidated = 0;
    for (auto reg = f_->registrations_.begin();
         reg != f_->registrations_.end();) {
      if (reg->second.buffer == q->buffer()) {
        reg = f_->registrations_.erase(reg);
        ++invalidated;
      } else {
        ++reg;
      }
    }
    r->set_invalidated_registrations(invalidated);
    return grpc::Status::OK;
  }

  grpc::Status CreateMr(ServerContext* ctx, const v1::CreateMrRequest* q,
                        v1::MrInfo* r) override {
    absl::MutexLock l(&f_->mu_);
    if (f_->sessions_.count(q->session()) == 0) return Fail(ctx, NoSession());
    uint64_t id = f_->next_id_++;
    f_->mrs_[id] = q->session();
    r->set_mr(id);
    r->set_fast_register(q->fast_register());
    r->set_allow_remote_access(q->allow_remote_access());
    r->set_state("free");
    return grpc::Status::OK;
  }

  grpc::Status CloseMr(ServerContext* ctx, const v1::CloseMrRequest* q,
                       v1::CloseMrResponse*) override {
    absl::MutexLock l(&f_->mu_);
    if (f_->sessions_.count(q->session()) == 0) return Fail(ctx, NoSession());
    if (f_->mrs_.erase(q->mr()) == 0) return Fail(ctx, NotFound("MR"));
    for (auto reg = f_->registrations_.begin();
         reg != f_->registrations_.end();) {
      reg = reg->second.mr == q->mr() ? f_->registrations_.erase(reg)
                                      : std::next(reg);
    }
    return grpc::Status::OK;
  }

  grpc::Status RegisterMr(ServerContext* ctx, const v1::RegisterMrRequest* q,
                          v1::RegisterMrResponse* r) override {
    absl::Duration delay;
    {
      absl::MutexLock l(&f_->mu_);
      delay = f_->register_delay_;
      ++f_->registers_in_flight_;
      f_->max_registers_in_flight_ =
          std::max(f_->max_registers_in_flight_, f_->registers_in_flight_);
    }
    absl::SleepFor(delay);
    absl::MutexLock l(&f_->mu_);
    --f_->registers_in_flight_;
    if (f_->sessions_.count(q->session()) == 0) return Fail(ctx, NoSession());
    auto buffer = f_->buffers_.find(q->buffer());
    if (buffer == f_->buffers_.end() || buffer->second != q->session()) {
      return Fail(ctx, NotFound("BUFFER"));
    }
    if (q->length() == 0) {
      return Fail(ctx, SeedError(v1::STATUS_INVALID_PARAMETER, "ZERO_LENGTH",
                                 "length is zero"));
    }
    if (q->descriptor_capacity() != 0 && q->descriptor_capacity() < 24) {
      return Fail(ctx, SeedError(v1::WSAEFAULT, "DESCRIPTOR_CAPACITY",
                                 "descriptor needs 24 bytes", 24));
    }
    if (q->mr() != 0 && f_->mrs_.count(q->mr()) == 0) {
      return Fail(ctx, NotFound("MR"));
    }
    uint64_t id = 0;
    bool hit = false;
    if (q->mr() == 0) {
      for (auto& [rid, reg] : f_->registrations_) {
        if (reg.mr == 0 && reg.session == q->session() &&
            reg.buffer == q->buffer() && reg.offset == q->offset() &&
            reg.length == q->length() && reg.flags == q->flags()) {
          ++reg.references;
          id = rid;
          hit = true;
          break;
        }
      }
    }
    if (!hit) {
      id = f_->next_id_++;
      f_->registrations_[id] = {q->session(), q->buffer(), q->offset(),
                                q->length(),  q->flags(),  1,
                                q->mr()};
    }
    const Registration& reg = f_->registrations_[id];
    r->set_registration(id);
    r->set_lkey(static_cast<uint32_t>(id * 16));
    r->set_rkey(static_cast<uint32_t>(id * 16 + 1));
    r->set_base_address(q->has_base_address()
                            ? q->base_address()
                            : 0x10000000 + q->buffer() * 0x100000 +
                                  q->offset());
    r->set_length(q->length());
    r->set_references(reg.references);
    r->set_cache_hit(hit);
    r->set_rdma_descriptor(std::string(24, 'd'));
    r->set_mr(q->mr());
    return grpc::Status::OK;
  }

  grpc::Status DeregisterMr(ServerContext* ctx,
                            const v1::DeregisterMrRequest* q,
                            v1::DeregisterMrResponse* r) override {
    absl::MutexLock l(&f_->mu_);
    if (f_->sessions_.count(q->session()) == 0) return Fail(ctx, NoSession());
    auto it = f_->registrations_.end();
    if (q->has_mr()) {
      for (auto i = f_->registrations_.begin(); i != f_->registrations_.end();
           ++i) {
        if (i->second.mr == q->mr()) it = i;
      }
    } else {
      it = f_->registrations_.find(q->registration());
      if (it != f_->registrations_.end() && it->second.mr != 0) {
        it = f_->registrations_.end();
      }
    }
    if (it == f_->registrations_.end() || it->second.session != q->session()) {
      return Fail(ctx, NotFound("REGISTRATION"));
    }
    uint32_t left = --it->second.references;
    if (left == 0) f_->registrations_.erase(it);
    r->set_references(left);
    return grpc::Status::OK;
  }

  grpc::Status BuildLam(ServerContext* ctx, const v1::BuildLamRequest* q,
                        v1::BuildLamResponse* r) override {
    absl::MutexLock l(&f_->mu_);
    if (f_->sessions_.count(q->session()) == 0) return Fail(ctx, NoSession());
    uint64_t fbo = q->offset() % 4096;
    uint64_t pages = (fbo + q->length() + 4095) / 4096;
    uint64_t need = 8 + 8 * pages;
    if (q->lam_capacity() != 0 && q->lam_capacity() < need) {
      return Fail(ctx, SeedError(v1::STATUS_BUFFER_TOO_SMALL, "LAM_CAPACITY",
                                 "mapping space too small", need));
    }
    uint64_t id = f_->next_id_++;
    f_->lams_[id] = q->session();
    r->set_lam(id);
    for (uint64_t i = 0; i < pages; ++i) r->add_pages(0x100000 * id + 4096 * i);
    r->set_fbo(static_cast<uint32_t>(fbo));
    r->set_length(q->length());
    r->set_lam_size(static_cast<uint32_t>(need));
    return grpc::Status::OK;
  }

  grpc::Status ReleaseLam(ServerContext* ctx, const v1::ReleaseLamRequest* q,
                          v1::ReleaseLamResponse*) override {
    absl::MutexLock l(&f_->mu_);
    if (f_->sessions_.count(q->session()) == 0) return Fail(ctx, NoSession());
    if (f_->lams_.erase(q->lam()) == 0) return Fail(ctx, NotFound("LAM"));
    return grpc::Status::OK;
  }

  grpc::Status FastRegister(ServerContext* ctx,
                            const v1::FastRegisterRequest* q,
                            v1::FastRegisterResponse* r) override {
    absl::MutexLock l(&f_->mu_);
    if (f_->sessions_.count(q->session()) == 0) return Fail(ctx, NoSession());
    if (f_->mrs_.count(q->mr()) == 0) return Fail(ctx, NotFound("MR"));
    uint64_t wr = f_->next_id_++;
    v1::Completion c;
    c.set_kind(v1::Completion::FAST_REGISTER);
    c.set_request_context(q->request_context());
    c.set_status(v1::STATUS_SUCCESS);
    c.set_mr(q->mr());
    c.set_rkey(0xabc);
    c.set_work_request(wr);
    f_->completions_[q->session()].push_back(c);
    r->set_work_request(wr);
    return grpc::Status::OK;
  }

  grpc::Status StreamCompletions(
      ServerContext* ctx, const v1::StreamCompletionsRequest* q,
      grpc::ServerWriter<v1::Completion>* writer) override {
    {
      absl::MutexLock l(&f_->mu_);
      if (f_->sessions_.count(q->session()) == 0) return Fail(ctx, NoSession());
      ++f_->streams_open_;
    }
    grpc::Status result = grpc::Status::OK;
    while (true) {
      std::vector<v1::Completion> batch;
      {
        absl::MutexLock l(&f_->mu_);
        if (f_->sessions_.count(q->session()) == 0) break;
        batch.swap(f_->completions_[q->session()]);
      }
      for (const v1::Completion& c : batch) writer->Write(c);
      if (ctx->IsCancelled()) {
        result = grpc::Status::CANCELLED;
        break;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    absl::MutexLock l(&f_->mu_);
    --f_->streams_open_;
    return result;
  }

  grpc::Status CreatePeerTicket(ServerContext* ctx,
                                const v1::CreatePeerTicketRequest* q,
                                v1::PeerTicket* r) override {
    absl::MutexLock l(&f_->mu_);
    if (f_->sessions_.count(q->session()) == 0) return Fail(ctx, NoSession());
    r->set_ticket("ticket-" + q->session());
    r->set_peer_address("127.0.0.1:1");
    return grpc::Status::OK;
  }

  grpc::Status ListRegistrations(ServerContext* ctx,
                                 const v1::ListRegistrationsRequest* q,
                                 v1::ListRegistrationsResponse* r) override {
    absl::MutexLock l(&f_->mu_);
    auto s = f_->sessions_.find(q->session());
    if (s == f_->sessions_.end()) return Fail(ctx, NoSession());
    r->mutable_session()->set_session(q->session());
    r->mutable_session()->set_kind(s->second.kind);
    for (uint64_t b : s->second.buffers) r->add_buffers()->set_buffer(b);
    for (const auto& [id, reg] : f_->registrations_) {
      if (reg.session != q->session()) continue;
      v1::RegistrationInfo* info = r->add_registrations();
      info->set_registration(id);
      info->set_buffer(reg.buffer);
      info->set_references(reg.references);
    }
    return grpc::Status::OK;
  }

 private:
  FakeMrd* const f_;
};

FakeMrd::FakeMrd() {
  char templ[] = "/tmp/mrd-client-test-XXXXXX";
  MRD_CHECK(::mkdtemp(templ) != nullptr);
  dir_ = templ;

  service_ = std::make_unique<Service>(this);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + grpc_socket(),
                           grpc::InsecureServerCredentials());
  builder.RegisterService(service_.get());
  server_ = builder.BuildAndStart();
  MRD_CHECK(server_ != nullptr);

  listener_.Reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  MRD_CHECK(listener_.valid());
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::string path = fd_socket();
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  MRD_CHECK(::bind(listener_.get(), reinterpret_cast<sockaddr*>(&addr),
                   sizeof(addr)) == 0);
  MRD_CHECK(::listen(listener_.get(), 16) == 0);
  int pipe_fds[2];
  MRD_CHECK(::pipe2(pipe_fds, O_CLOEXEC) == 0);
  stop_pipe_read_.Reset(pipe_fds[0]);
  stop_pipe_write_.Reset(pipe_fds[1]);
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

FakeMrd::~FakeMrd() {
  server_->Shutdown(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(200));
  server_->Wait();
  char byte = 1;
  (void)::write(stop_pipe_write_.get(), &byte, 1);
  acceptor_.join();
  std::vector<std::thread> threads;
  {
    absl::MutexLock l(&mu_);
    threads.swap(fd_threads_);
  }
  for (std::thread& t : threads) t.join();
  ::unlink(grpc_socket().c_str());
  ::unlink(fd_socket().c_str());
  ::rmdir(dir_.c_str());
}

std::string FakeMrd::NewSession(const std::string& kind) {
  absl::MutexLock l(&mu_);
  std::string token = absl::StrCat(kind, "-", next_id_++);
  sessions_[token].kind = kind;
  return token;
}

void FakeMrd::EndSession(const std::string& token) {
  absl::MutexLock l(&mu_);
  sessions_.erase(token);
  completions_.erase(token);
  for (auto it = buffers_.begin(); it != buffers_.end();) {
    it = it->second == token ? buffers_.erase(it) : std::next(it);
  }
  for (auto it = registrations_.begin(); it != registrations_.end();) {
    it = it->second.session == token ? registrations_.erase(it) : std::next(it);
  }
  for (auto it = mrs_.begin(); it != mrs_.end();) {
    it = it->second == token ? mrs_.erase(it) : std::next(it);
  }
  for (auto it = lams_.begin(); it != lams_.end();) {
    it = it->second == token ? lams_.erase(it) : std::next(it);
  }
}

void FakeMrd::RefuseNextFdConnection(absl::StatusCode code,
                                     std::string message) {
  absl::MutexLock l(&mu_);
  refuse_next_ = true;
  refuse_code_ = code;
  refuse_message_ = std::move(message);
}

void FakeMrd::QueueCompletion(const std::string& session, v1::Completion c) {
  absl::MutexLock l(&mu_);
  completions_[session].push_back(std::move(c));
}

void FakeMrd::DropFdConnections() {
  absl::MutexLock l(&mu_);
  for (int fd : fd_connections_) ::shutdown(fd, SHUT_RDWR);
}

void FakeMrd::AcceptLoop() {
  while (true) {
    pollfd fds[2] = {{listener_.get(), POLLIN, 0},
                     {stop_pipe_read_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) continue;
    if (fds[1].revents != 0) return;
    UniqueFd conn(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!conn.valid()) continue;
    absl::MutexLock l(&mu_);
    fd_connections_.push_back(conn.get());
    fd_threads_.emplace_back([this, c = conn.Release()]() mutable {
      ServeFdConnection(UniqueFd(c));
    });
  }
}

void FakeMrd::ServeFdConnection(UniqueFd conn) {
  {
    absl::MutexLock l(&mu_);
    if (refuse_next_) {
      refuse_next_ = false;
      v1::FdReply reply;
      reply.mutable_error()->set_code(static_cast<int>(refuse_code_));
      reply.mutable_error()->set_message(refuse_message_);
      reply.mutable_error()->mutable_detail()->set_reason("UID_NOT_ALLOWED");
      SendReply(conn.get(), reply);
      return;
    }
  }
  const std::string token = NewSession("fd");
  v1::FdReply welcome;
  welcome.mutable_welcome()->set_session(token);
  welcome.mutable_welcome()->set_peer_uid(::getuid());
  welcome.mutable_welcome()->set_peer_pid(static_cast<uint32_t>(::getpid()));
  welcome.mutable_welcome()->set_protocol_version(1);
  SendReply(conn.get(), welcome);

  while (true) {
    pollfd fds[2] = {{conn.get(), POLLIN, 0},
                     {stop_pipe_read_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) continue;
    if (fds[1].revents != 0) break;
    char data[4096];
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
    iovec iov{data, sizeof(data)};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t n = ::recvmsg(conn.get(), &msg, MSG_CMSG_CLOEXEC);
    if (n <= 0) break;
    std::vector<UniqueFd> received;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr;
         c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        received.emplace_back(fd);
      }
    }
    v1::FdRequest request;
    v1::FdReply reply;
    if (!request.ParseFromArray(data, static_cast<int>(n))) {
      reply.mutable_error()->set_code(3);
      reply.mutable_error()->set_message("malformed");
      SendReply(conn.get(), reply);
      continue;
    }
    reply.set_sequence(request.sequence());
    if (request.has_ping()) {
      reply.mutable_pong();
    } else if (request.has_import_memfd()) {
      struct stat st {};
      int seals =
          received.size() == 1 ? ::fcntl(received[0].get(), F_GET_SEALS) : -1;
      if (received.size() != 1 || ::fstat(received[0].get(), &st) != 0) {
        reply.mutable_error()->set_code(3);
        reply.mutable_error()->set_message("need exactly one fd");
      } else if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
        reply.mutable_error()->set_code(3);
        reply.mutable_error()->set_message("memfd not sealed");
        reply.mutable_error()->mutable_detail()->set_seed_status(
            v1::STATUS_INVALID_PARAMETER);
        reply.mutable_error()->mutable_detail()->set_reason("MEMFD_NOT_SEALED");
      } else if (request.import_memfd().expected_size() != 0 &&
                 request.import_memfd().expected_size() !=
                     static_cast<uint64_t>(st.st_size)) {
        reply.mutable_error()->set_code(3);
        reply.mutable_error()->set_message("size mismatch");
      } else {
        absl::MutexLock l(&mu_);
        last_seals_ = seals;
        last_size_ = static_cast<uint64_t>(st.st_size);
        uint64_t id = next_id_++;
        buffers_[id] = token;
        sessions_[token].buffers.insert(id);
        v1::BufferInfo* b = reply.mutable_buffer();
        b->set_buffer(id);
        b->set_size(static_cast<uint64_t>(st.st_size));
        b->set_writable(request.import_memfd().writable());
        b->set_source("memfd");
        b->set_address(0x10000000 + id * 0x100000);
      }
    } else {
      reply.mutable_error()->set_code(3);
      reply.mutable_error()->set_message("no op");
    }
    SendReply(conn.get(), reply);
  }
  {
    absl::MutexLock l(&mu_);
    fd_connections_.erase(
        std::remove(fd_connections_.begin(), fd_connections_.end(), conn.get()),
        fd_connections_.end());
  }
  EndSession(token);
}

int FakeMrd::sessions() const {
  absl::MutexLock l(&mu_);
  return static_cast<int>(sessions_.size());
}
int FakeMrd::buffers() const {
  absl::MutexLock l(&mu_);
  return static_cast<int>(buffers_.size());
}
int FakeMrd::registration_references() const {
  absl::MutexLock l(&mu_);
  int total = 0;
  for (const auto& [id, reg] : registrations_) total += reg.references;
  return total;
}
int FakeMrd::mrs() const {
  absl::MutexLock l(&mu_);
  return static_cast<int>(mrs_.size());
}
int FakeMrd::lams() const {
  absl::MutexLock l(&mu_);
  return static_cast<int>(lams_.size());
}
int FakeMrd::max_concurrent_registers() const {
  absl::MutexLock l(&mu_);
  return max_registers_in_flight_;
}
int FakeMrd::last_import_seals() const {
  absl::MutexLock l(&mu_);
  return last_seals_;
}
uint64_t FakeMrd::last_import_size() const {
  absl::MutexLock l(&mu_);
  return last_size_;
}
int FakeMrd::streams_open() const {
  absl::MutexLock l(&mu_);
  return streams_open_;
}

}  // namespace mrd::testing
