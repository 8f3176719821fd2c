#include "client/peer/verbs_peer.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "mrd/net.h"
#include "mrd/status.h"

namespace mrd::peer {
namespace {

// RC connect private data (CM REQ) has room for 56 bytes after rdma_cm's
// own header.
constexpr size_t kMaxTicketBytes = 56;
// Accept private data: {uint64 connection id, uint64 max message size}, LE.
constexpr size_t kAcceptBytes = 16;
constexpr char kBadTicket[] = "BAD_TICKET";
constexpr int kResolveTimeoutMs = 5000;
constexpr uint64_t kMinBounceBytes = 64 * 1024;

std::string Hex(uint64_t value) { return absl::StrCat("0x", absl::Hex(value)); }

uint64_t GetLe64(const char* in) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) {
    value = (value << 8) | static_cast<uint8_t>(in[i]);
  }
  return value;
}

absl::Status ConnectFailed(absl::string_view message) {
  return MrdError(absl::StatusCode::kUnavailable, "PEER_CONNECTION_FAILED",
                  message);
}

absl::Status SetNonBlocking(int fd) {
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    return ConnectFailed(
        absl::StrCat("fcntl(O_NONBLOCK): ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

int RemainingMs(absl::Time deadline) {
  absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(
      std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1 << 30));
}

void Wake(int fd) {
  uint64_t one = 1;
  while (::write(fd, &one, sizeof(one)) < 0 && errno == EINTR) {
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<VerbsPeer>> VerbsPeer::Connect(
    absl::string_view host_port, absl::string_view ticket) {
  std::unique_ptr<VerbsPeer> peer(new VerbsPeer());
  // On failure the destructor releases whatever Establish created.
  MRD_RETURN_IF_ERROR(peer->Establish(host_port, ticket));
  peer->watcher_ = std::thread([p = peer.get()] { p->WatchLoop(); });
  return peer;
}

absl::Status VerbsPeer::Establish(absl::string_view host_port,
                                  absl::string_view ticket) {
  absl::MutexLock lock(&mu_);
  if (ticket.empty() || ticket.size() > kMaxTicketBytes) {
    return MrdError(absl::StatusCode::kUnauthenticated, "BAD_TICKET",
                    absl::StrCat("a ticket is 1 to ", kMaxTicketBytes,
                                 " bytes, this one is ", ticket.size()));
  }
  MRD_ASSIGN_OR_RETURN(auto parts, SplitHostPort(host_port));
  stop_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  notify_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (stop_fd_ < 0 || notify_fd_ < 0) {
    return ConnectFailed(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* resolved = nullptr;
  if (int rc = getaddrinfo(parts.first.c_str(), parts.second.c_str(), &hints,
                           &resolved);
      rc != 0) {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "BAD_HOST_PORT",
        absl::StrCat("cannot resolve '", host_port, "': ", gai_strerror(rc)));
  }
  const absl::Time deadline = absl::Now() + kConnectTimeout;

  channel_ = rdma_create_event_channel();
  if (channel_ == nullptr) {
    freeaddrinfo(resolved);
    return ConnectFailed(
        absl::StrCat("rdma_create_event_channel: ", std::strerror(errno),
                     " (no RDMA device or no access to "
                     "/dev/infiniband/rdma_cm?)"));
  }
  if (absl::Status s = SetNonBlocking(channel_->fd); !s.ok()) {
    freeaddrinfo(resolved);
    return s;
  }
  if (rdma_create_id(channel_, &id_, nullptr, RDMA_PS_TCP) != 0) {
    id_ = nullptr;
    freeaddrinfo(resolved);
    return ConnectFailed(
        absl::StrCat("rdma_create_id: ", std::strerror(errno)));
  }
  int rc =
      rdma_resolve_addr(id_, nullptr, resolved->ai_addr, kResolveTimeoutMs);
  int err = errno;
  freeaddrinfo(resolved);
  if (rc != 0) {
    return ConnectFailed(absl::StrCat("rdma_resolve_addr(", host_port,
                                      "): ", std::strerror(err)));
  }
  std::string private_data;
  int event_status = 0;
  MRD_ASSIGN_OR_RETURN(rdma_cm_event_type event,
                       WaitCmEvent(deadline, &private_data, &event_status));
  if (event != RDMA_CM_EVENT_ADDR_RESOLVED) {
    return ConnectFailed(absl::StrCat("resolving ", host_port, ": ",
                                      rdma_event_str(event), " (status ",
                                      event_status, ")"));
  }
  if (rdma_resolve_route(id_, kResolveTimeoutMs) != 0) {
    return ConnectFailed(absl::StrCat("rdma_resolve_route(", host_port,
                                      "): ", std::strerror(errno)));
  }
  MRD_ASSIGN_OR_RETURN(event,
                       WaitCmEvent(deadline, &private_data, &event_status));
  if (event != RDMA_CM_EVENT_ROUTE_RESOLVED) {
    return ConnectFailed(absl::StrCat("route to ", host_port, ": ",
                                      rdma_event_str(event), " (status ",
                                      event_status, ")"));
  }

  ibv_context* context = id_->verbs;
  pd_ = ibv_alloc_pd(context);
  if (pd_ == nullptr) {
    return ConnectFailed(absl::StrCat("ibv_alloc_pd: ", std::strerror(errno)));
  }
  comp_channel_ = ibv_create_comp_channel(context);
  if (comp_channel_ == nullptr) {
    return ConnectFailed(
        absl::StrCat("ibv_create_comp_channel: ", std::strerror(errno)));
  }
  MRD_RETURN_IF_ERROR(SetNonBlocking(comp_channel_->fd));
  cq_ = ibv_create_cq(context, 4, nullptr, comp_channel_, 0);
  if (cq_ == nullptr) {
    return ConnectFailed(absl::StrCat("ibv_create_cq: ", std::strerror(errno)));
  }
  ibv_qp_init_attr init{};
  init.send_cq = cq_;
  init.recv_cq = cq_;
  init.qp_type = IBV_QPT_RC;
  init.cap.max_send_wr = 2;
  init.cap.max_recv_wr = 1;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  if (rdma_create_qp(id_, pd_, &init) != 0) {
    return ConnectFailed(
        absl::StrCat("rdma_create_qp: ", std::strerror(errno)));
  }
  qp_created_ = true;

  ibv_port_attr port{};
  uint64_t own_max_message = uint64_t{1} << 30;
  if (ibv_query_port(context, id_->port_num, &port) == 0 &&
      port.max_msg_sz != 0) {
    own_max_message = port.max_msg_sz;
  }

  std::string ticket_data(ticket);
  rdma_conn_param param{};
  param.private_data = ticket_data.data();
  param.private_data_len = static_cast<uint8_t>(ticket_data.size());
  // One READ in flight at a time; nobody reads from us.
  param.initiator_depth = 1;
  param.responder_resources = 1;
  param.retry_count = 7;
  param.rnr_retry_count = 7;
  if (rdma_connect(id_, &param) != 0) {
    return ConnectFailed(
        absl::StrCat("rdma_connect(", host_port, "): ", std::strerror(errno)));
  }
  MRD_ASSIGN_OR_RETURN(event,
                       WaitCmEvent(deadline, &private_data, &event_status));
  if (event == RDMA_CM_EVENT_REJECTED) {
    if (absl::StartsWith(private_data, kBadTicket)) {
      return MrdError(absl::StatusCode::kUnauthenticated, "BAD_TICKET",
                      absl::StrCat("the device at ", host_port,
                                   " rejected the ticket (unknown, or its "
                                   "session has ended)"));
    }
    std::string reason(private_data.c_str());  // up to the first NUL
    return MrdError(
        absl::StatusCode::kUnavailable, "PEER_CONNECTION_REJECTED",
        absl::StrCat("the device at ", host_port, " rejected the connection",
                     reason.empty() ? "" : absl::StrCat(": ", reason),
                     " (status ", event_status, ")"));
  }
  if (event != RDMA_CM_EVENT_ESTABLISHED) {
    return ConnectFailed(absl::StrCat("connecting to ", host_port, ": ",
                                      rdma_event_str(event), " (status ",
                                      event_status, ")"));
  }
  if (private_data.size() < kAcceptBytes) {
    return MrdError(absl::StatusCode::kInternal, "PEER_PROTOCOL_ERROR",
                    absl::StrCat("the accept carries ", private_data.size(),
                                 " bytes of private data, not ", kAcceptBytes));
  }
  connection_id_ = GetLe64(private_data.data());
  max_message_size_ = GetLe64(private_data.data() + 8);
  if (connection_id_ == 0 || max_message_size_ == 0) {
    return MrdError(absl::StatusCode::kInternal, "PEER_PROTOCOL_ERROR",
                    "the accept lacks the connection id or message size");
  }
  max_message_size_ = std::min(max_message_size_, own_max_message);
  return absl::OkStatus();
}

absl::StatusOr<rdma_cm_event_type> VerbsPeer::WaitCmEvent(
    absl::Time deadline, std::string* private_data, int* status) {
  while (true) {
    rdma_cm_event* event = nullptr;
    if (rdma_get_cm_event(channel_, &event) == 0) {
      rdma_cm_event_type type = event->event;
      *status = event->status;
      private_data->clear();
      if (event->param.conn.private_data != nullptr &&
          (type == RDMA_CM_EVENT_ESTABLISHED ||
           type == RDMA_CM_EVENT_REJECTED)) {
        private_data->assign(
            static_cast<const char*>(event->param.conn.private_data),
            event->param.conn.private_data_len);
      }
      rdma_ack_cm_event(event);
      return type;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return ConnectFailed(
          absl::StrCat("rdma_get_cm_event: ", std::strerror(errno)));
    }
    int wait = RemainingMs(deadline);
    if (wait == 0) {
      return MrdError(absl::StatusCode::kUnavailable, "PEER_CONNECTION_TIMEOUT",
                      absl::StrCat("no connection-manager event within ",
                                   absl::FormatDuration(kConnectTimeout)));
    }
    pollfd fd{channel_->fd, POLLIN, 0};
    ::poll(&fd, 1, wait);
  }
}

void VerbsPeer::WatchLoop() {
  while (true) {
    pollfd fds[2] = {{channel_->fd, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0 && errno != EINTR) return;
    if ((fds[1].revents & POLLIN) != 0) return;
    bool removal = false;
    while (true) {
      rdma_cm_event* event = nullptr;
      if (rdma_get_cm_event(channel_, &event) != 0) break;
      rdma_cm_event_type type = event->event;
      rdma_ack_cm_event(event);
      if (type == RDMA_CM_EVENT_DISCONNECTED) {
        disconnected_ = true;
        Wake(notify_fd_);
      } else if (type == RDMA_CM_EVENT_DEVICE_REMOVAL) {
        disconnected_ = true;
        removed_ = true;
        removal = true;
        Wake(notify_fd_);
      }
    }
    if (removal) {
      // A request in progress sees notify_fd_ and returns; then everything
      // on the device goes, and librdmacm is made to notice the device is
      // gone so that it closes its context too.
      absl::MutexLock lock(&mu_);
      ReleaseVerbsLocked();
      int count = 0;
      if (ibv_context** list = rdma_get_devices(&count); list != nullptr) {
        rdma_free_devices(list);
      }
      return;
    }
  }
}

void VerbsPeer::ReleaseVerbsLocked() {
  if (id_ != nullptr && qp_created_) {
    rdma_disconnect(id_);  // fails harmlessly when never connected
    rdma_destroy_qp(id_);
    qp_created_ = false;
  }
  if (bounce_mr_ != nullptr) ibv_dereg_mr(bounce_mr_);
  if (bounce_ != nullptr) ::munmap(bounce_, bounce_size_);
  bounce_mr_ = nullptr;
  bounce_ = nullptr;
  bounce_size_ = 0;
  if (cq_ != nullptr) ibv_destroy_cq(cq_);
  if (comp_channel_ != nullptr) ibv_destroy_comp_channel(comp_channel_);
  if (pd_ != nullptr) ibv_dealloc_pd(pd_);
  if (id_ != nullptr) rdma_destroy_id(id_);
  cq_ = nullptr;
  comp_channel_ = nullptr;
  pd_ = nullptr;
  id_ = nullptr;
}

VerbsPeer::~VerbsPeer() {
  if (watcher_.joinable()) {
    Wake(stop_fd_);
    watcher_.join();
  }
  {
    absl::MutexLock lock(&mu_);
    ReleaseVerbsLocked();
  }
  if (channel_ != nullptr) rdma_destroy_event_channel(channel_);
  if (stop_fd_ >= 0) ::close(stop_fd_);
  if (notify_fd_ >= 0) ::close(notify_fd_);
}

void VerbsPeer::BreakLocked(std::string reason) {
  if (broken_) return;
  broken_ = true;
  broken_reason_ = std::move(reason);
  if (id_ != nullptr) rdma_disconnect(id_);
}

absl::Status VerbsPeer::CheckUsableLocked(absl::string_view op,
                                          uint64_t length) {
  if (removed_ || id_ == nullptr) {
    BreakLocked("the local RDMA device was removed");
    return MrdError(absl::StatusCode::kUnavailable, "PEER_CONNECTION_CLOSED",
                    absl::StrCat("connection ", connection_id_,
                                 ": the local RDMA device was removed"));
  }
  if (broken_) {
    return MrdError(
        absl::StatusCode::kUnavailable, "PEER_CONNECTION_BROKEN",
        absl::StrCat("connection ", connection_id_, " failed earlier (",
                     broken_reason_, ") and is no longer usable"));
  }
  if (disconnected_) {
    BreakLocked("closed by the device");
    return MrdError(absl::StatusCode::kUnavailable, "PEER_CONNECTION_CLOSED",
                    absl::StrCat("connection ", connection_id_,
                                 " was closed by the device"));
  }
  if (length == 0 || length > max_message_size_) {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "REMOTE_INVALID_REQUEST",
        absl::StrCat(op, " of ", length, " bytes: length must be in [1, ",
                     max_message_size_, "]"));
  }
  return absl::OkStatus();
}

absl::Status VerbsPeer::EnsureBounceLocked(uint64_t length) {
  if (bounce_size_ >= length) return absl::OkStatus();
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  uint64_t size = std::max(length, kMinBounceBytes);
  size = (size + page - 1) / page * page;
  if (bounce_mr_ != nullptr) ibv_dereg_mr(bounce_mr_);
  if (bounce_ != nullptr) ::munmap(bounce_, bounce_size_);
  bounce_mr_ = nullptr;
  bounce_ = nullptr;
  bounce_size_ = 0;
  void* memory = ::mmap(nullptr, size, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (memory == MAP_FAILED) {
    return ErrnoError(errno,
                      absl::StrCat("mmap of a ", size, "-byte bounce buffer"),
                      "PEER_BOUNCE_BUFFER_FAILED");
  }
  ibv_mr* mr =
      ibv_reg_mr(pd_, memory, size, static_cast<int>(IBV_ACCESS_LOCAL_WRITE));
  if (mr == nullptr) {
    int err = errno;
    ::munmap(memory, size);
    return ErrnoError(
        err, absl::StrCat("ibv_reg_mr of a ", size, "-byte bounce buffer"),
        "PEER_BOUNCE_BUFFER_FAILED");
  }
  bounce_ = memory;
  bounce_size_ = size;
  bounce_mr_ = mr;
  return absl::OkStatus();
}

absl::Status VerbsPeer::PostAndWaitLocked(ibv_wr_opcode opcode, uint32_t rkey,
                                          uint64_t address, uint64_t length) {
  const char* op = opcode == IBV_WR_RDMA_READ ? "READ" : "WRITE";
  const std::string what =
      absl::StrCat(op, " of ", length, " bytes at ", Hex(address), " (rkey ",
                   Hex(rkey), ", connection ", connection_id_, ")");
  auto broken = [&](absl::string_view reason, absl::string_view message)
                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                      BreakLocked(std::string(message));
                      return MrdError(absl::StatusCode::kUnavailable, reason,
                                      absl::StrCat(what, ": ", message));
                    };
  ibv_sge sge{};
  sge.addr = reinterpret_cast<uint64_t>(bounce_);
  sge.length = static_cast<uint32_t>(length);
  sge.lkey = bounce_mr_->lkey;
  ibv_send_wr wr{};
  wr.wr_id = next_wr_id_++;
  wr.opcode = opcode;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.wr.rdma.remote_addr = address;
  wr.wr.rdma.rkey = rkey;
  ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(id_->qp, &wr, &bad); rc != 0) {
    return broken("PEER_CONNECTION_BROKEN",
                  absl::StrCat("ibv_post_send: ", std::strerror(rc)));
  }

  const absl::Time deadline = absl::Now() + kOpTimeout;
  bool armed = false;
  while (true) {
    ibv_wc wc{};
    int n = ibv_poll_cq(cq_, 1, &wc);
    if (n < 0) return broken("PEER_CONNECTION_BROKEN", "ibv_poll_cq failed");
    if (n == 1) {
      if (wc.wr_id != wr.wr_id) continue;  // not ours (cannot happen)
      switch (wc.status) {
        case IBV_WC_SUCCESS:
          return absl::OkStatus();
        case IBV_WC_REM_ACCESS_ERR:
          BreakLocked("remote access error");
          return MrdError(absl::StatusCode::kPermissionDenied,
                          "REMOTE_ACCESS_ERROR",
                          absl::StrCat(what,
                                       ": remote access error (bad key, "
                                       "bounds, rights or protection "
                                       "domain)"));
        case IBV_WC_REM_INV_REQ_ERR:
          BreakLocked("remote invalid request");
          return MrdError(absl::StatusCode::kInvalidArgument,
                          "REMOTE_INVALID_REQUEST",
                          absl::StrCat(what, ": remote invalid request"));
        default:
          return broken("PEER_CONNECTION_BROKEN",
                        absl::StrCat("work completion error: ",
                                     ibv_wc_status_str(wc.status), " (",
                                     static_cast<int>(wc.status), ")"));
      }
    }
    if (!armed) {
      // Arm, then poll once more: a completion that arrived before arming
      // raises no event.
      if (ibv_req_notify_cq(cq_, 0) != 0) {
        return broken("PEER_CONNECTION_BROKEN", "ibv_req_notify_cq failed");
      }
      armed = true;
      continue;
    }
    if (disconnected_) {
      return broken("PEER_CONNECTION_CLOSED",
                    removed_ ? "the local RDMA device was removed"
                             : "the device closed the connection");
    }
    int wait = RemainingMs(deadline);
    if (wait == 0) {
      return broken("PEER_CONNECTION_TIMEOUT",
                    absl::StrCat("no completion within ",
                                 absl::FormatDuration(kOpTimeout)));
    }
    pollfd fds[2] = {{comp_channel_->fd, POLLIN, 0}, {notify_fd_, POLLIN, 0}};
    ::poll(fds, 2, wait);
    if ((fds[0].revents & POLLIN) != 0) {
      ibv_cq* event_cq = nullptr;
      void* event_context = nullptr;
      if (ibv_get_cq_event(comp_channel_, &event_cq, &event_context) == 0) {
        ibv_ack_cq_events(event_cq, 1);
        armed = false;
      }
    }
    // On a disconnect (notify_fd_), loop once more: a completion that is
    // already there still counts.
  }
}

absl::StatusOr<std::string> VerbsPeer::Read(uint32_t rkey, uint64_t address,
                                            uint64_t length) {
  absl::MutexLock lock(&mu_);
  MRD_RETURN_IF_ERROR(CheckUsableLocked("READ", length));
  MRD_RETURN_IF_ERROR(EnsureBounceLocked(length));
  MRD_RETURN_IF_ERROR(
      PostAndWaitLocked(IBV_WR_RDMA_READ, rkey, address, length));
  return std::string(static_cast<const char*>(bounce_), length);
}

absl::Status VerbsPeer::Write(uint32_t rkey, uint64_t address,
                              absl::string_view data) {
  absl::MutexLock lock(&mu_);
  MRD_RETURN_IF_ERROR(CheckUsableLocked("WRITE", data.size()));
  MRD_RETURN_IF_ERROR(EnsureBounceLocked(data.size()));
  std::memcpy(bounce_, data.data(), data.size());
  return PostAndWaitLocked(IBV_WR_RDMA_WRITE, rkey, address, data.size());
}

}  // namespace mrd::peer
