#include "server/device/verbs/verbs_device.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "mrd/net.h"
#include "mrd/status.h"
#include "server/common/log.h"
#include "server/device/fast_register_rules.h"

namespace mrd::device {
namespace {

constexpr uint32_t kKnownAccess = kAccessLocalWrite | kAccessRemoteRead |
                                  kAccessRemoteWrite | kAccessReadSink;
constexpr uint32_t kRemoteAccess = kAccessRemoteRead | kAccessRemoteWrite;
constexpr uint32_t kKnownWorkFlags =
    kWorkSilentSuccess | kWorkReadFence | kWorkDefer;
constexpr int kWriteAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
// Logical addresses: the same layout as the software device's (random start
// in [4 GiB, 68 GiB) for 4 KiB pages, guard gaps, well below 2^56).
constexpr uint64_t kIovaFloorPages = uint64_t{1} << 20;
constexpr uint64_t kIovaSpreadPages = uint64_t{1} << 24;
constexpr uint64_t kIovaLimit = uint64_t{1} << 56;
constexpr uint64_t kMaxGuardPages = 16;
constexpr size_t kTicketBytes = 16;  // 128-bit secret, 32 hex characters
// RC connect private data (CM REQ) has room for 56 bytes after rdma_cm's
// own header.
constexpr size_t kMaxConnectPrivateData = 56;
constexpr int kListenBacklog = 64;
// A fast registration that keeps drawing the MR's previous rkey is retried
// this many times before it fails.
constexpr int kMaxKeyRenewals = 4;

std::string Hex(uint64_t value) { return absl::StrCat("0x", absl::Hex(value)); }

absl::Status InvalidParameter(absl::string_view reason,
                              absl::string_view message) {
  return SeedError(STATUS_INVALID_PARAMETER, reason, message);
}

absl::Status UnknownMr(MrId mr) {
  return MrdError(absl::StatusCode::kNotFound, "UNKNOWN_MR",
                  absl::StrCat("no memory region ", mr));
}

uint64_t PageRound(uint64_t address, uint64_t length, uint64_t page_size) {
  uint64_t first = address / page_size;
  uint64_t last = (address + length - 1) / page_size;
  return (last - first + 1) * page_size;
}

int VerbsAccess(uint32_t access) {
  int flags = 0;  // local read is always allowed
  if ((access & kAccessLocalWrite) != 0) flags |= IBV_ACCESS_LOCAL_WRITE;
  if ((access & kAccessRemoteRead) != 0) flags |= IBV_ACCESS_REMOTE_READ;
  if ((access & kAccessRemoteWrite) != 0) {
    // Verbs refuses REMOTE_WRITE without LOCAL_WRITE.
    flags |= IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
  }
  // kAccessReadSink: an RDMA READ sink needs LOCAL_WRITE only, which the
  // core asks for separately when the memory is written locally.
  return flags;
}

std::string MemlockLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return "unknown";
  if (limit.rlim_cur == RLIM_INFINITY) return "unlimited";
  return absl::StrCat(limit.rlim_cur, " bytes");
}

// The errno of ibv_reg_mr*, as a status.
absl::Status RegistrationError(int err, absl::string_view what,
                               uint64_t length) {
  std::string message =
      absl::StrCat(what, " of ", length, " bytes: ", std::strerror(err));
  switch (err) {
    case ENOMEM:
    case EAGAIN:
      return SeedError(
          STATUS_INSUFFICIENT_RESOURCES, "PIN_FAILED",
          absl::StrCat(message,
                       " (pinned memory is charged to RLIMIT_MEMLOCK, which "
                       "is ",
                       MemlockLimit(), ", unless mrd has CAP_IPC_LOCK)"));
    case EFAULT:
      return InvalidParameter(
          "MEMORY_NOT_MAPPED",
          absl::StrCat(message,
                       " (the range is not mapped, or not mapped writable "
                       "for the access asked for)"));
    case EINVAL:
      return InvalidParameter("REGISTRATION_REFUSED", message);
    case EPERM:
    case EACCES:
      return MrdError(absl::StatusCode::kPermissionDenied,
                      "REGISTRATION_NOT_PERMITTED", message);
    case EIO:
    case ENODEV:
      return MrdError(absl::StatusCode::kUnavailable, "DEVICE_LOST",
                      absl::StrCat("device lost: ", message));
    default:
      return ErrnoError(err, message, "REGISTRATION_FAILED");
  }
}

// A shared writable mapping of `length` bytes of `fd`'s file at `offset`,
// for pinning only (kernels before 6.2 cannot pin a read-only one). When
// `fd` itself is read-only, the file is reopened read-write through
// /proc/self/fd: a read-only import is pinned through a writable view that
// nothing writes through, and its registration keeps the access asked for,
// so no remote write is ever granted on it. MAP_FAILED with errno when the
// file cannot be opened or mapped writable (mode, F_SEAL_WRITE).
void* MapWritableView(int fd, uint64_t length, off_t offset, void* at,
                      int extra_flags) {
  void* view = ::mmap(at, length, PROT_READ | PROT_WRITE,
                      MAP_SHARED | extra_flags, fd, offset);
  if (view != MAP_FAILED || (errno != EACCES && errno != EPERM)) return view;
  const int first_err = errno;
  const int rw =
      ::open(absl::StrCat("/proc/self/fd/", fd).c_str(), O_RDWR | O_CLOEXEC);
  if (rw < 0) {
    errno = first_err;
    return MAP_FAILED;
  }
  view = ::mmap(at, length, PROT_READ | PROT_WRITE, MAP_SHARED | extra_flags,
                rw, offset);
  const int err = errno;
  ::close(rw);  // the mapping keeps the file
  errno = err;
  return view;
}

absl::Status ReadOnlyNotPinnable(absl::string_view what, uint64_t length,
                                 int mmap_err) {
  return InvalidParameter(
      "READ_ONLY_MEMORY_NOT_PINNABLE",
      absl::StrCat(what, " of ", length,
                   " bytes: the memory is mapped read-only, which this "
                   "kernel cannot pin (kernels before 6.2 pin with "
                   "FOLL_FORCE), and the file cannot be mapped writable "
                   "instead (",
                   std::strerror(mmap_err),
                   "): import it writable, or use a newer kernel"));
}

std::string FormatSockaddr(const sockaddr* addr) {
  if (addr == nullptr) return "unknown";
  char host[INET6_ADDRSTRLEN] = {};
  if (addr->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(addr);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    return absl::StrCat(host, ":", ntohs(in->sin_port));
  }
  if (addr->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(addr);
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    return absl::StrCat("[", host, "]:", ntohs(in6->sin6_port));
  }
  return absl::StrCat("address family ", addr->sa_family);
}

void PutLe64(uint8_t* out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(value >> (8 * i));
}

absl::Status SetNonBlocking(int fd, absl::string_view what) {
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    return ErrnoError(errno, absl::StrCat("fcntl(O_NONBLOCK) on ", what),
                      "VERBS_SETUP_FAILED");
  }
  return absl::OkStatus();
}

void Wake(int fd) {
  uint64_t one = 1;
  // An eventfd write fails only when the counter would overflow, in which
  // case the reader is woken anyway.
  while (::write(fd, &one, sizeof(one)) < 0 && errno == EINTR) {
  }
}

void DrainWake(int fd) {
  uint64_t value = 0;
  while (::read(fd, &value, sizeof(value)) > 0) {
  }
}

// Waits until `fd` (or `wake`) is readable. `fd` < 0 waits on `wake` only.
void WaitReadable(int fd, int wake) {
  pollfd fds[2] = {{fd, POLLIN, 0}, {wake, POLLIN, 0}};
  while (::poll(fds, 2, -1) < 0 && errno == EINTR) {
  }
}

}  // namespace

std::vector<std::string> ListVerbsDevices() {
  std::vector<std::string> names;
  int count = 0;
  ibv_device** list = ibv_get_device_list(&count);
  if (list == nullptr) return names;
  for (int i = 0; i < count; ++i) names.push_back(ibv_get_device_name(list[i]));
  ibv_free_device_list(list);
  return names;
}

// All fields below are guarded by VerbsDevice::mu_ unless marked immutable.

struct VerbsDevice::Pd {
  PdId id = 0;                  // immutable
  PdEventSink* sink = nullptr;  // immutable
  ibv_pd* pd = nullptr;         // null once DeallocatePd/ReleaseDevice took it
  bool dying = false;
  int busy = 0;  // see BeginPdOp
  absl::flat_hash_set<MrId> mrs;
  absl::flat_hash_set<LamId> lams;
  // Every connection with a QP in this PD, connecting or connected. Only
  // the connection-manager thread removes entries, after destroying the QP.
  absl::flat_hash_set<ConnectionId> connections;
  std::vector<std::string> tickets;
};

struct VerbsDevice::Mr {
  MrId id = 0;                // immutable
  PdId pd = 0;                // immutable
  bool fast = false;          // immutable
  bool allow_remote = false;  // immutable, fast only
  uint32_t max_pages = 0;     // immutable, fast only
  bool revoking = false;      // being destroyed: treat as gone
  bool valid = false;         // registered / fast-registered
  bool executing = false;     // the worker is fast-registering it now
  Memory memory;              // the live registration, if any
  uint32_t lkey = 0;
  uint32_t rkey = 0;
  uint32_t previous_rkey = 0;  // fast: the last registration's rkey
  std::vector<LamId> lams;     // fast: distinct LAMs the mapping holds a ref on
};

struct VerbsDevice::Lam {
  LamId id = 0;
  PdId pd = 0;
  MemorySpan span;
  uint32_t fbo = 0;
  uint64_t iova = 0;
  uint64_t page_count = 0;
  uint32_t fr_users = 0;
  Memory memory;  // local-only registration at the logical addresses
};

struct VerbsDevice::Connection {
  enum class State { kConnecting, kReady, kError, kClosed };
  ConnectionId id = 0;          // immutable
  PdId pd = 0;                  // immutable
  rdma_cm_id* cm_id = nullptr;  // immutable; the cm thread destroys it
  ibv_cq* cq = nullptr;         // immutable
  uint32_t qp_num = 0;          // immutable
  State state = State::kConnecting;
  bool announced = false;  // OnPeerConnected is queued
  std::string remote;
  std::deque<Work> deferred;
};

struct VerbsDevice::PageRef {
  int fd = -1;
  uint64_t file_offset = 0;
};

struct VerbsDevice::ResolvedPages {
  std::vector<PageRef> pages;
  std::vector<LamId> lams;  // distinct
};

struct VerbsDevice::CmEvent {
  rdma_cm_event_type type = RDMA_CM_EVENT_ADDR_ERROR;
  rdma_cm_id* id = nullptr;
  int status = 0;
  std::string private_data;
  uint8_t responder_resources = 0;
  uint8_t initiator_depth = 0;
};

// ---------------------------------------------------------------------------
// Creation, lifecycle.

absl::StatusOr<std::unique_ptr<VerbsDevice>> VerbsDevice::Create(
    const VerbsDeviceOptions& options) {
  auto bad = [](absl::string_view what) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_OPTION",
                    absl::StrCat("verbs device option ", what));
  };
  if (options.peer_address.empty()) {
    return bad("peer_address is required (ip:port of the rdma_cm listener)");
  }
  if (options.max_page_list_length == 0) {
    return bad("max_page_list_length must be > 0");
  }
  if (options.max_connections == 0) return bad("max_connections must be > 0");
  long page_size = sysconf(_SC_PAGESIZE);
  if (page_size <= 0) return ErrnoError(errno, "sysconf", "PAGE_SIZE_UNKNOWN");
  uint64_t ps = static_cast<uint64_t>(page_size);
  uint64_t pick = 0;
  MRD_RETURN_IF_ERROR(SecureRandomBytes(&pick, sizeof(pick)));
  uint64_t iova_start = (kIovaFloorPages + pick % kIovaSpreadPages) * ps;
  std::unique_ptr<VerbsDevice> device(new VerbsDevice(options, ps, iova_start));
  MRD_RETURN_IF_ERROR(device->Open(options));
  return device;
}

VerbsDevice::VerbsDevice(const VerbsDeviceOptions& options, uint64_t page_size,
                         uint64_t iova_start)
    : options_(options),
      page_size_(page_size),
      iova_(page_size, iova_start, kIovaLimit / page_size * page_size) {}

absl::Status VerbsDevice::Open(const VerbsDeviceOptions& options) {
  const std::vector<std::string> names = ListVerbsDevices();
  if (names.empty()) {
    return MrdError(absl::StatusCode::kNotFound, "NO_VERBS_DEVICE",
                    "no RDMA device found; is an RDMA driver (e.g. rdma_rxe) "
                    "loaded and /dev/infiniband accessible?");
  }
  if (!options.device_name.empty() &&
      std::find(names.begin(), names.end(), options.device_name) ==
          names.end()) {
    return MrdError(absl::StatusCode::kNotFound, "UNKNOWN_VERBS_DEVICE",
                    absl::StrCat("no RDMA device named '", options.device_name,
                                 "'; devices: ", absl::StrJoin(names, ", ")));
  }

  // The listener comes first: the address it binds to picks the device,
  // and librdmacm opens that device (only) for it.
  channel_ = rdma_create_event_channel();
  if (channel_ == nullptr) {
    return ErrnoError(errno,
                      "rdma_create_event_channel (is rdma_ucm loaded and "
                      "/dev/infiniband/rdma_cm accessible?)",
                      "VERBS_SETUP_FAILED");
  }
  MRD_RETURN_IF_ERROR(SetNonBlocking(channel_->fd, "the rdma_cm channel"));
  if (rdma_create_id(channel_, &listen_id_, nullptr, RDMA_PS_TCP) != 0) {
    listen_id_ = nullptr;
    return ErrnoError(errno, "rdma_create_id", "VERBS_SETUP_FAILED");
  }
  MRD_ASSIGN_OR_RETURN(auto host_port,
                       peer::SplitHostPort(options.peer_address));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV | AI_PASSIVE;
  addrinfo* resolved = nullptr;
  if (int rc = getaddrinfo(host_port.first.c_str(), host_port.second.c_str(),
                           &hints, &resolved);
      rc != 0) {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "BAD_HOST_PORT",
        absl::StrCat("peer address '", options.peer_address,
                     "' is not a numeric ip:port: ", gai_strerror(rc)));
  }
  int bind_rc = rdma_bind_addr(listen_id_, resolved->ai_addr);
  int bind_err = errno;
  freeaddrinfo(resolved);
  if (bind_rc != 0) {
    return ErrnoError(
        bind_err,
        absl::StrCat("rdma_bind_addr(", options.peer_address,
                     ") (is the address configured on an RDMA-capable "
                     "interface?)"),
        "PEER_LISTEN_FAILED");
  }
  if (listen_id_->verbs == nullptr) {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "PEER_ADDRESS_NOT_ON_DEVICE",
        absl::StrCat("peer address ", options.peer_address,
                     " is not an address configured on an RDMA device's "
                     "interface (wildcards are not allowed either); RDMA "
                     "devices: ",
                     absl::StrJoin(names, ", ")));
  }
  context_ = listen_id_->verbs;
  const std::string name = ibv_get_device_name(context_->device);
  if (!options.device_name.empty() && options.device_name != name) {
    return MrdError(absl::StatusCode::kInvalidArgument,
                    "PEER_ADDRESS_NOT_ON_DEVICE",
                    absl::StrCat("peer address ", options.peer_address,
                                 " belongs to RDMA device ", name, ", not ",
                                 options.device_name));
  }

  ibv_device_attr attr{};
  if (int rc = ibv_query_device(context_, &attr); rc != 0) {
    return ErrnoError(rc, absl::StrCat("ibv_query_device(", name, ")"),
                      "VERBS_QUERY_FAILED");
  }
  if (attr.page_size_cap != 0 && (attr.page_size_cap & page_size_) == 0) {
    return MrdError(
        absl::StatusCode::kFailedPrecondition, "PAGE_SIZE_UNSUPPORTED",
        absl::StrCat("device ", name, " supports page sizes ",
                     Hex(attr.page_size_cap), ", not the host's ", page_size_));
  }
  port_num_ = listen_id_->port_num != 0 ? listen_id_->port_num : 1;
  ibv_port_attr port{};
  if (int rc = ibv_query_port(context_, port_num_, &port); rc != 0) {
    return ErrnoError(rc,
                      absl::StrCat("ibv_query_port(", name, ", ",
                                   static_cast<int>(port_num_), ")"),
                      "VERBS_QUERY_FAILED");
  }

  MRD_RETURN_IF_ERROR(SetNonBlocking(context_->async_fd, "the async fd"));
  cm_wake_.Reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  async_wake_.Reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!cm_wake_.valid() || !async_wake_.valid()) {
    return ErrnoError(errno, "eventfd", "VERBS_SETUP_FAILED");
  }

  uint64_t max_mr_size = attr.max_mr_size;
  if (options.max_mr_size_limit != 0) {
    max_mr_size = std::min(max_mr_size, options.max_mr_size_limit);
  }
  if (max_mr_size < page_size_) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "MAX_MR_SIZE_TINY",
                    absl::StrCat("device ", name, " allows MRs of at most ",
                                 max_mr_size, " bytes, under one page"));
  }
  attributes_.name = name;
  attributes_.kind = "verbs";
  attributes_.page_size = page_size_;
  attributes_.max_mr_size = max_mr_size;
  attributes_.max_page_list_length = static_cast<uint32_t>(std::min<uint64_t>(
      options.max_page_list_length, max_mr_size / page_size_));
  // A verbs RDMA READ sink needs only LOCAL_WRITE (R9).
  attributes_.adapter_flags = kAdapterFlagReadSinkNotRequired;
  attributes_.supports_memory_windows =
      (attr.device_cap_flags & IBV_DEVICE_MEM_WINDOW) != 0 || attr.max_mw > 0;
  attributes_.peer_address = FormatSockaddr(rdma_get_local_addr(listen_id_));
  max_message_size_ =
      port.max_msg_sz != 0 ? port.max_msg_sz : uint64_t{1} << 30;
  max_responder_resources_ = static_cast<uint32_t>(attr.max_qp_rd_atom);
  max_initiator_depth_ = static_cast<uint32_t>(attr.max_qp_init_rd_atom);
  LogInfo("verbs device ", name, " port ", static_cast<int>(port_num_),
          ": max_mr_size ", max_mr_size, ", max_msg_sz ", max_message_size_,
          ", max_qp_rd_atom ", attr.max_qp_rd_atom, ", memory windows ",
          attributes_.supports_memory_windows ? "yes" : "no", ", port state ",
          ibv_port_state_str(port.state));
  if (port.state != IBV_PORT_ACTIVE) {
    absl::MutexLock lock(&mu_);
    port_problem_ = absl::StrCat("port ", static_cast<int>(port_num_), " is ",
                                 ibv_port_state_str(port.state));
  }
  return absl::OkStatus();
}

VerbsDevice::~VerbsDevice() {
  Shutdown();
  std::vector<PdId> left;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, pd] : pds_) left.push_back(id);
  }
  for (PdId pd : left) (void)DeallocatePd(pd);
  // Never started (Shutdown's cm thread destroys it otherwise).
  if (listen_id_ != nullptr) rdma_destroy_id(listen_id_);
  if (channel_ != nullptr) rdma_destroy_event_channel(channel_);
}

DeviceHealth VerbsDevice::Health() const {
  absl::MutexLock lock(&mu_);
  if (!lost_reason_.empty()) {
    return {false, absl::StrCat("device lost: ", lost_reason_)};
  }
  if (shut_down_) {
    return {false,
            absl::StrCat("verbs device ", attributes_.name, " is shut down")};
  }
  if (!started_) {
    return {false,
            absl::StrCat("verbs device ", attributes_.name, " is not started")};
  }
  if (!port_problem_.empty()) {
    return {false, absl::StrCat("verbs device ", attributes_.name, ": ",
                                port_problem_)};
  }
  return {true, absl::StrCat("verbs device ", attributes_.name, " port ",
                             static_cast<int>(port_num_), ", peers at ",
                             attributes_.peer_address)};
}

uint64_t VerbsDevice::PinnedBytes() const {
  absl::MutexLock lock(&mu_);
  return pinned_bytes_;
}

absl::Status VerbsDevice::Start() {
  absl::MutexLock lock(&mu_);
  if (started_ || shut_down_) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "ALREADY_STARTED",
                    "the verbs device was started or shut down before");
  }
  if (rdma_listen(listen_id_, kListenBacklog) != 0) {
    return ErrnoError(errno,
                      absl::StrCat("rdma_listen on ", attributes_.peer_address),
                      "PEER_LISTEN_FAILED");
  }
  started_ = true;
  cm_running_ = true;
  // A thread that cannot be made is an error (Shutdown joins those made).
  MRD_ASSIGN_OR_RETURN(
      worker_, Thread::Start("mrd-verbs-work", [this] { WorkerLoop(); }));
  MRD_ASSIGN_OR_RETURN(cm_thread_,
                       Thread::Start("mrd-verbs-cm", [this] { CmLoop(); }));
  MRD_ASSIGN_OR_RETURN(
      async_thread_, Thread::Start("mrd-verbs-async", [this] { AsyncLoop(); }));
  return absl::OkStatus();
}

void VerbsDevice::Shutdown() {
  Thread cm_thread;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;  // from here connect requests are rejected
    cm_stop_ = true;
    cm_thread = std::move(cm_thread_);
  }
  // The cm thread closes every connection (queueing flushes and
  // disconnects for the worker) and destroys the listener on its way out.
  Wake(cm_wake_.get());
  cm_thread.Join();
  Thread worker;
  Thread async_thread;
  {
    absl::MutexLock lock(&mu_);
    worker_stop_ = true;  // after draining what is queued
    async_stop_ = true;   // after a device release in progress
    worker = std::move(worker_);
    async_thread = std::move(async_thread_);
  }
  Wake(async_wake_.get());
  worker.Join();
  async_thread.Join();
}

absl::Status VerbsDevice::CheckUsableLocked() const {
  if (!lost_reason_.empty()) {
    return MrdError(absl::StatusCode::kUnavailable, "DEVICE_LOST",
                    absl::StrCat("device lost: ", lost_reason_));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Protection domains.

absl::StatusOr<VerbsDevice::Pd*> VerbsDevice::FindPdLocked(PdId pd) {
  auto it = pds_.find(pd);
  if (it == pds_.end() || it->second->dying) {
    return MrdError(absl::StatusCode::kNotFound, "UNKNOWN_PD",
                    absl::StrCat("no protection domain ", pd));
  }
  return it->second.get();
}

absl::StatusOr<ibv_pd*> VerbsDevice::BeginPdOp(PdId pd) {
  absl::MutexLock lock(&mu_);
  MRD_RETURN_IF_ERROR(CheckUsableLocked());
  MRD_ASSIGN_OR_RETURN(Pd * found, FindPdLocked(pd));
  ++found->busy;
  return found->pd;
}

void VerbsDevice::EndPdOp(PdId pd) {
  absl::MutexLock lock(&mu_);
  EndPdOpLocked(pd);
}

void VerbsDevice::EndPdOpLocked(PdId pd) {
  auto it = pds_.find(pd);
  MRD_CHECK(it != pds_.end() && it->second->busy > 0);
  --it->second->busy;
}

absl::StatusOr<PdId> VerbsDevice::AllocatePd(PdEventSink* sink) {
  if (sink == nullptr) {
    return MrdError(absl::StatusCode::kInvalidArgument, "NULL_SINK",
                    "AllocatePd needs an event sink");
  }
  // Under the mutex, so that ReleaseDevice never misses a verbs PD.
  absl::MutexLock lock(&mu_);
  MRD_RETURN_IF_ERROR(CheckUsableLocked());
  ibv_pd* verbs_pd = ibv_alloc_pd(context_);
  if (verbs_pd == nullptr) {
    return ErrnoError(errno, "ibv_alloc_pd", "PD_ALLOCATION_FAILED");
  }
  auto pd = std::make_unique<Pd>();
  pd->id = next_pd_++;
  pd->sink = sink;
  pd->pd = verbs_pd;
  PdId id = pd->id;
  pds_.emplace(id, std::move(pd));
  return id;
}

absl::Status VerbsDevice::DeallocatePd(PdId pd_id) {
  std::vector<Memory> memories;
  ibv_pd* verbs_pd = nullptr;
  {
    absl::MutexLock lock(&mu_);
    MRD_ASSIGN_OR_RETURN(Pd * pd, FindPdLocked(pd_id));
    // From here calls naming the PD fail, its tickets are refused, and the
    // worker drops its queued tasks.
    pd->dying = true;
    for (const std::string& ticket : pd->tickets) tickets_.erase(ticket);
    pd->tickets.clear();
    for (ConnectionId id : pd->connections) {
      auto it = connections_.find(id);
      if (it == connections_.end()) continue;
      it->second->state = Connection::State::kClosed;
      it->second->deferred.clear();
    }
    // Registrations, connection setups and sink calls in progress finish
    // first.
    mu_.Await(absl::Condition(
        +[](const Pd* p) { return p->busy == 0; }, static_cast<const Pd*>(pd)));
    // QPs live in the PD: the cm thread destroys them (it owns every id and
    // QP). When it is not running there are none (never started, or
    // already torn down by Shutdown).
    if (!pd->connections.empty()) {
      CmCommand command;
      command.kind = CmCommand::Kind::kClosePd;
      command.pd = pd_id;
      CommandCm(command);
      mu_.Await(absl::Condition(
          +[](const Pd* p) { return p->connections.empty(); },
          static_cast<const Pd*>(pd)));
    }
    for (MrId id : pd->mrs) {
      auto it = mrs_.find(id);
      if (it == mrs_.end()) continue;
      it->second->revoking = true;
      memories.push_back(TakeResourcesLocked(*it->second).memory);
      mrs_.erase(it);
    }
    pd->mrs.clear();
    for (LamId id : pd->lams) {
      auto it = lams_.find(id);
      if (it == lams_.end()) continue;
      iova_.Free(it->second->iova);
      memories.push_back(std::exchange(it->second->memory, {}));
      lams_.erase(it);
    }
    pd->lams.clear();
    verbs_pd = std::exchange(pd->pd, nullptr);  // null after a device loss
    ++pd->busy;  // ReleaseDevice waits for the verbs calls below
  }
  absl::Status status;
  uint64_t unpinned = 0;
  for (const Memory& memory : memories) {
    absl::Status s = ReleaseMemory(memory);
    if (s.ok()) {
      unpinned += memory.pinned;
    } else if (status.ok()) {
      status = s;
    }
  }
  if (verbs_pd != nullptr) {
    if (int rc = ibv_dealloc_pd(verbs_pd); rc != 0) {
      LogError("DeallocatePd ", pd_id, ": ibv_dealloc_pd: ", std::strerror(rc));
      if (status.ok()) {
        status = ErrnoError(rc, "ibv_dealloc_pd", "PD_DEALLOCATION_FAILED");
      }
    }
  }
  absl::MutexLock lock(&mu_);
  pinned_bytes_ -= unpinned;
  pds_.erase(pd_id);
  return status;
}

absl::StatusOr<std::string> VerbsDevice::CreatePeerTicket(PdId pd_id) {
  MRD_ASSIGN_OR_RETURN(std::string ticket, SecureRandomHex(kTicketBytes));
  static_assert(2 * kTicketBytes <= 48, "tickets must fit connect data");
  absl::MutexLock lock(&mu_);
  MRD_RETURN_IF_ERROR(CheckUsableLocked());
  MRD_ASSIGN_OR_RETURN(Pd * pd, FindPdLocked(pd_id));
  tickets_.emplace(ticket, pd_id);
  pd->tickets.push_back(ticket);
  return ticket;
}

// ---------------------------------------------------------------------------
// Registrations.

absl::StatusOr<VerbsDevice::Memory> VerbsDevice::RegisterSpan(
    ibv_pd* pd, const MemorySpan& span, uint64_t iova, int access,
    absl::string_view what) const {
  const uint64_t host = reinterpret_cast<uint64_t>(span.host_address);
  Memory memory;
  memory.mr =
      ibv_reg_mr_iova2(pd, span.host_address, span.length, iova, access);
  if (memory.mr != nullptr) {
    memory.pinned = PageRound(host, span.length, page_size_);
    return memory;
  }
  const int err = errno;
  const uint64_t fbo = host % page_size_;
  if (err != EFAULT || (access & kWriteAccess) != 0 ||
      span.file_offset % page_size_ != fbo) {
    return RegistrationError(err, what, span.length);
  }
  // EFAULT without write access: a read-only shared mapping, which kernels
  // before 6.2 refuse to pin. A writable view of the same file pages pins
  // the same pages; mrd never writes through it (MapWritableView).
  const uint64_t view_length = PageRound(host, span.length, page_size_);
  void* view =
      MapWritableView(span.fd, view_length,
                      static_cast<off_t>(span.file_offset - fbo), nullptr, 0);
  if (view == MAP_FAILED) {
    int mmap_err = errno;
    if (mmap_err == EACCES || mmap_err == EPERM) {
      return ReadOnlyNotPinnable(what, span.length, mmap_err);
    }
    return RegistrationError(err, what, span.length);
  }
  memory.mr = ibv_reg_mr_iova2(pd, static_cast<char*>(view) + fbo, span.length,
                               iova, access);
  if (memory.mr == nullptr) {
    int view_err = errno;
    ::munmap(view, view_length);
    return RegistrationError(view_err, what, span.length);
  }
  memory.view = view;
  memory.view_length = view_length;
  memory.pinned = view_length;
  return memory;
}

absl::Status VerbsDevice::ReleaseMemory(const Memory& memory) {
  if (memory.mr != nullptr) {
    if (int rc = ibv_dereg_mr(memory.mr); rc != 0) {
      // The key may still be live and the pages stay pinned: say so, and
      // keep the view (the registration may still point into it).
      LogError("ibv_dereg_mr: ", std::strerror(rc));
      return ErrnoError(rc, "ibv_dereg_mr", "DEREGISTRATION_FAILED");
    }
  }
  if (memory.view != nullptr) ::munmap(memory.view, memory.view_length);
  return absl::OkStatus();
}

absl::Status VerbsDevice::ValidateSpan(const MemorySpan& span,
                                       absl::string_view call) const {
  if (span.host_address == nullptr || span.fd < 0) {
    return InvalidParameter(
        "INVALID_SPAN",
        absl::StrCat(call, ": span has host address ",
                     Hex(reinterpret_cast<uint64_t>(span.host_address)),
                     " and fd ", span.fd));
  }
  if (span.length == 0) {
    return InvalidParameter("ZERO_LENGTH",
                            absl::StrCat(call, ": span length is 0"));
  }
  if (span.length > attributes_.max_mr_size) {
    // Never truncated: the caller learns both sizes.
    return InvalidParameter(
        "LENGTH_OVER_MAX_MR_SIZE",
        absl::StrCat(call, ": length ", span.length,
                     " exceeds the device's max_mr_size ",
                     attributes_.max_mr_size, " (", attributes_.name, ")"));
  }
  uint64_t host = reinterpret_cast<uint64_t>(span.host_address);
  uint64_t end = 0;
  uint64_t file_end = 0;
  if (__builtin_add_overflow(host, span.length, &end) ||
      __builtin_add_overflow(span.file_offset, span.length, &file_end) ||
      file_end > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
    return InvalidParameter(
        "SPAN_OVERFLOW",
        absl::StrCat(call, ": span of ", span.length, " bytes at ", Hex(host),
                     " (file offset ", span.file_offset, ") wraps around"));
  }
  return absl::OkStatus();
}

absl::StatusOr<MrKeys> VerbsDevice::RegisterMr(PdId pd_id,
                                               const MemorySpan& span,
                                               uint64_t base_address,
                                               uint32_t access) {
  MRD_RETURN_IF_ERROR(ValidateSpan(span, "RegisterMr"));
  if (base_address == 0) {
    return InvalidParameter(
        "ZERO_BASED_ADDRESS",
        "RegisterMr: base address 0: zero-based addressing is not supported");
  }
  uint64_t end = 0;
  if (__builtin_add_overflow(base_address, span.length, &end)) {
    return InvalidParameter(
        "BASE_ADDRESS_OVERFLOW",
        absl::StrCat("RegisterMr: base address ", Hex(base_address), " + ",
                     span.length, " bytes wraps around"));
  }
  if ((access & ~kKnownAccess) != 0) {
    return InvalidParameter(
        "UNKNOWN_ACCESS_BITS",
        absl::StrCat("RegisterMr: access ", Hex(access), " has unknown bits ",
                     Hex(access & ~kKnownAccess)));
  }
  // The adapter translates whole pages: the base address must sit at the
  // same offset within its page as the memory does (the kernel refuses
  // anything else with EINVAL).
  const uint64_t in_page =
      reinterpret_cast<uint64_t>(span.host_address) % page_size_;
  if (base_address % page_size_ != in_page) {
    return InvalidParameter(
        "BASE_ADDRESS_MISALIGNED",
        absl::StrCat("RegisterMr: base address ", Hex(base_address),
                     " is at offset ", base_address % page_size_,
                     " within its page, but the memory starts at offset ",
                     in_page, " within its page; the ", attributes_.name,
                     " adapter maps whole pages, so base_address % ",
                     page_size_, " must be ", in_page));
  }
  MRD_ASSIGN_OR_RETURN(ibv_pd * verbs_pd, BeginPdOp(pd_id));
  absl::StatusOr<Memory> memory =
      RegisterSpan(verbs_pd, span, base_address, VerbsAccess(access),
                   "RegisterMr: ibv_reg_mr");
  if (!memory.ok()) {
    EndPdOp(pd_id);
    return memory.status();
  }
  absl::StatusOr<MrKeys> keys = [&]() -> absl::StatusOr<MrKeys> {
    absl::MutexLock lock(&mu_);
    MRD_RETURN_IF_ERROR(CheckUsableLocked());
    MRD_ASSIGN_OR_RETURN(Pd * pd, FindPdLocked(pd_id));
    auto mr = std::make_shared<Mr>();
    mr->id = next_mr_++;
    mr->pd = pd_id;
    mr->valid = true;
    mr->memory = *memory;
    mr->lkey = memory->mr->lkey;
    mr->rkey = memory->mr->rkey;
    pinned_bytes_ += memory->pinned;
    pd->mrs.insert(mr->id);
    MrKeys result{mr->id, mr->lkey, mr->rkey};
    mrs_.emplace(mr->id, std::move(mr));
    return result;
  }();
  // The PD began dying or the device was lost meanwhile: undo (L7) before
  // the PD stops being busy, so that no teardown misses this MR.
  if (!keys.ok()) (void)ReleaseMemory(*memory);
  EndPdOp(pd_id);
  return keys;
}

absl::StatusOr<std::shared_ptr<VerbsDevice::Mr>> VerbsDevice::FindMrLocked(
    MrId mr) const {
  auto it = mrs_.find(mr);
  if (it == mrs_.end() || it->second->revoking) return UnknownMr(mr);
  auto pd = pds_.find(it->second->pd);
  if (pd == pds_.end() || pd->second->dying) return UnknownMr(mr);
  return it->second;
}

VerbsDevice::MrResources VerbsDevice::TakeResourcesLocked(Mr& mr) {
  MrResources resources;
  resources.memory = std::exchange(mr.memory, {});
  resources.lams = std::exchange(mr.lams, {});
  mr.valid = false;
  return resources;
}

void VerbsDevice::DetachMrLocked(const std::shared_ptr<Mr>& mr) {
  mr->revoking = true;
  // A fast registration of this MR in progress on the worker finishes (and
  // commits) first; its result is torn down with the rest.
  mu_.Await(absl::Condition(
      +[](const Mr* m) { return !m->executing; },
      static_cast<const Mr*>(mr.get())));
  auto pd = pds_.find(mr->pd);
  if (pd != pds_.end()) pd->second->mrs.erase(mr->id);
  mrs_.erase(mr->id);
}

absl::Status VerbsDevice::ReleaseMrResources(MrResources resources) {
  absl::Status status = ReleaseMemory(resources.memory);
  absl::MutexLock lock(&mu_);
  DropLamRefsLocked(resources.lams);
  if (status.ok()) pinned_bytes_ -= resources.memory.pinned;
  return status;
}

void VerbsDevice::DropLamRefsLocked(const std::vector<LamId>& lams) {
  for (LamId id : lams) {
    auto it = lams_.find(id);
    if (it == lams_.end()) continue;  // DeallocatePd took it
    MRD_CHECK(it->second->fr_users > 0);
    --it->second->fr_users;
  }
}

absl::Status VerbsDevice::DeregisterMr(MrId mr_id) {
  MrResources resources;
  PdId pd = 0;
  {
    absl::MutexLock lock(&mu_);
    MRD_ASSIGN_OR_RETURN(std::shared_ptr<Mr> mr, FindMrLocked(mr_id));
    if (mr->fast) {
      return MrdError(absl::StatusCode::kInvalidArgument, "WRONG_MR_KIND",
                      absl::StrCat("MR ", mr_id,
                                   " is a fast-register MR object: free it "
                                   "with FreeFastRegisterMr"));
    }
    pd = mr->pd;
    ++pds_.find(pd)->second->busy;  // until deregistered
    DetachMrLocked(mr);
    resources = TakeResourcesLocked(*mr);
  }
  // ibv_dereg_mr returns once the adapter no longer honours the key.
  absl::Status status = ReleaseMrResources(std::move(resources));
  EndPdOp(pd);
  return status;
}

// ---------------------------------------------------------------------------
// Logical address mappings.

absl::StatusOr<LogicalMapping> VerbsDevice::BuildLam(PdId pd_id,
                                                     const MemorySpan& span) {
  MRD_RETURN_IF_ERROR(ValidateSpan(span, "BuildLam"));
  const uint64_t host = reinterpret_cast<uint64_t>(span.host_address);
  if (span.file_offset % page_size_ != host % page_size_) {
    return InvalidParameter(
        "SPAN_MISALIGNED",
        absl::StrCat("BuildLam: host address ", Hex(host), " and file offset ",
                     span.file_offset,
                     " are at different offsets within a page"));
  }
  const uint32_t fbo = static_cast<uint32_t>(host % page_size_);
  const uint64_t page_count = (fbo + span.length + page_size_ - 1) / page_size_;
  // The logical range first: the pinning registration lives at it.
  ibv_pd* verbs_pd = nullptr;
  auto lam = std::make_unique<Lam>();
  {
    absl::MutexLock lock(&mu_);
    MRD_RETURN_IF_ERROR(CheckUsableLocked());
    MRD_ASSIGN_OR_RETURN(Pd * pd, FindPdLocked(pd_id));
    MRD_ASSIGN_OR_RETURN(uint64_t pick, random_.Uint64());
    lam->id = next_lam_++;
    MRD_ASSIGN_OR_RETURN(
        lam->iova,
        iova_.Allocate(page_count, 1 + pick % kMaxGuardPages, lam->id));
    ++pd->busy;
    verbs_pd = pd->pd;
  }
  // Local read only: it pins the pages, and its lkey is the privileged
  // token for the logical addresses (L9).
  absl::StatusOr<Memory> memory =
      RegisterSpan(verbs_pd, span, lam->iova + fbo, 0, "BuildLam: ibv_reg_mr");
  absl::StatusOr<LogicalMapping> mapping =
      [&]() -> absl::StatusOr<LogicalMapping> {
    absl::MutexLock lock(&mu_);
    absl::Status status = memory.status();
    if (status.ok()) status = CheckUsableLocked();
    if (status.ok()) status = FindPdLocked(pd_id).status();
    if (!status.ok()) {
      iova_.Free(lam->iova);
      return status;
    }
    Pd& pd = *pds_.find(pd_id)->second;
    lam->pd = pd_id;
    lam->span = span;
    lam->fbo = fbo;
    lam->page_count = page_count;
    lam->memory = *memory;
    pinned_bytes_ += memory->pinned;
    LogicalMapping result;
    result.lam = lam->id;
    result.fbo = fbo;
    result.privileged_key = memory->mr->lkey;
    result.pages.reserve(page_count);
    for (uint64_t i = 0; i < page_count; ++i) {
      result.pages.push_back(lam->iova + i * page_size_);
    }
    pd.lams.insert(lam->id);
    lams_.emplace(lam->id, std::move(lam));
    return result;
  }();
  // L7: nothing stays pinned or mapped on failure; released while the PD
  // is still busy, so that no teardown misses the registration.
  if (!mapping.ok() && memory.ok()) (void)ReleaseMemory(*memory);
  EndPdOp(pd_id);
  return mapping;
}

absl::Status VerbsDevice::ReleaseLam(LamId lam_id) {
  Memory memory;
  PdId pd_id = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = lams_.find(lam_id);
    if (it == lams_.end() || pds_.find(it->second->pd)->second->dying) {
      return MrdError(absl::StatusCode::kNotFound, "UNKNOWN_LAM",
                      absl::StrCat("no logical address mapping ", lam_id));
    }
    Lam& lam = *it->second;
    if (lam.fr_users > 0) {
      return MrdError(
          absl::StatusCode::kFailedPrecondition, "LAM_IN_USE",
          absl::StrCat("LAM ", lam_id, " has pages fast-registered by ",
                       lam.fr_users, " MR(s); invalidate them first"));
    }
    pd_id = lam.pd;
    Pd& pd = *pds_.find(pd_id)->second;
    ++pd.busy;  // until deregistered
    pd.lams.erase(lam_id);
    iova_.Free(lam.iova);
    memory = std::exchange(lam.memory, {});
    lams_.erase(it);
  }
  absl::Status status = ReleaseMemory(memory);
  absl::MutexLock lock(&mu_);
  if (status.ok()) pinned_bytes_ -= memory.pinned;
  EndPdOpLocked(pd_id);
  return status;
}

// ---------------------------------------------------------------------------
// Fast registration.

absl::StatusOr<MrKeys> VerbsDevice::AllocateFastRegisterMr(PdId pd_id,
                                                           bool allow_remote,
                                                           uint32_t max_pages) {
  if (max_pages == 0 || max_pages > attributes_.max_page_list_length) {
    return InvalidParameter(
        "BAD_MAX_PAGES",
        absl::StrCat("AllocateFastRegisterMr: max_pages ", max_pages,
                     " is not in [1, ", attributes_.max_page_list_length, "]"));
  }
  absl::MutexLock lock(&mu_);
  MRD_RETURN_IF_ERROR(CheckUsableLocked());
  MRD_ASSIGN_OR_RETURN(Pd * pd, FindPdLocked(pd_id));
  auto mr = std::make_shared<Mr>();
  mr->id = next_mr_++;
  mr->pd = pd_id;
  mr->fast = true;
  mr->allow_remote = allow_remote;
  mr->max_pages = max_pages;
  // No verbs MR yet: keys 0 name nothing until a fast registration.
  pd->mrs.insert(mr->id);
  MrKeys result{mr->id, 0, 0};
  mrs_.emplace(mr->id, std::move(mr));
  return result;
}

absl::Status VerbsDevice::FreeFastRegisterMr(MrId mr_id) {
  MrResources resources;
  PdId pd = 0;
  {
    absl::MutexLock lock(&mu_);
    MRD_ASSIGN_OR_RETURN(std::shared_ptr<Mr> mr, FindMrLocked(mr_id));
    if (!mr->fast) {
      return MrdError(absl::StatusCode::kInvalidArgument, "WRONG_MR_KIND",
                      absl::StrCat("MR ", mr_id,
                                   " is a registered MR: deregister it with "
                                   "DeregisterMr"));
    }
    pd = mr->pd;
    ++pds_.find(pd)->second->busy;
    DetachMrLocked(mr);
    resources = TakeResourcesLocked(*mr);
  }
  absl::Status status = ReleaseMrResources(std::move(resources));
  EndPdOp(pd);
  return status;
}

absl::StatusOr<MrKeys> VerbsDevice::QueryMr(MrId mr_id) const {
  absl::MutexLock lock(&mu_);
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Mr> mr, FindMrLocked(mr_id));
  return MrKeys{mr->id, mr->lkey, mr->rkey};
}

absl::StatusOr<VerbsDevice::ResolvedPages> VerbsDevice::ResolvePagesLocked(
    PdId pd, const std::vector<uint64_t>& pages) const {
  ResolvedPages resolved;
  resolved.pages.reserve(pages.size());
  absl::flat_hash_set<LamId> seen;
  for (size_t i = 0; i < pages.size(); ++i) {
    uint64_t page = pages[i];
    std::optional<IovaSpace::Hit> hit = iova_.Lookup(page);
    const Lam* lam = nullptr;
    if (hit.has_value()) {
      auto it = lams_.find(hit->owner);
      if (it != lams_.end()) lam = it->second.get();
    }
    // Another PD's pages read exactly like unmapped ones (W8).
    if (lam == nullptr || lam->pd != pd) {
      return InvalidParameter(
          "PAGE_NOT_MAPPED",
          absl::StrCat("page[", i, "] = ", Hex(page),
                       " is not a logical page mapped in protection domain ",
                       pd));
    }
    resolved.pages.push_back(PageRef{
        lam->span.fd,
        lam->span.file_offset - lam->fbo + hit->page_index * page_size_});
    if (seen.insert(lam->id).second) resolved.lams.push_back(lam->id);
  }
  return resolved;
}

absl::StatusOr<VerbsDevice::Connection*> VerbsDevice::FindPostConnectionLocked(
    ConnectionId connection, PdId pd) const {
  auto it = connections_.find(connection);
  // Unknown, connecting, failed, closed and other-PD connections all read
  // the same.
  if (it == connections_.end() ||
      it->second->state != Connection::State::kReady || it->second->pd != pd) {
    return SeedError(STATUS_CONNECTION_INVALID, "CONNECTION_INVALID",
                     absl::StrCat("connection ", connection,
                                  " is not a connected queue pair of "
                                  "protection domain ",
                                  pd));
  }
  return it->second.get();
}

void VerbsDevice::ReleaseDeferredLocked(Connection& connection) {
  for (Work& work : connection.deferred) {
    Task task;
    task.kind = Task::Kind::kWork;
    task.pd = work.pd;
    task.connection = work.connection;
    task.work = std::move(work);
    tasks_.push_back(std::move(task));
  }
  connection.deferred.clear();
}

uint64_t VerbsDevice::EnqueueLocked(Connection& connection, Work work) {
  work.id = next_work_++;
  uint64_t id = work.id;
  if ((work.flags & kWorkDefer) != 0) {
    connection.deferred.push_back(std::move(work));
    return id;
  }
  // Deferred work goes first, in post order, with the next non-deferred
  // request.
  ReleaseDeferredLocked(connection);
  Task task;
  task.kind = Task::Kind::kWork;
  task.pd = work.pd;
  task.connection = work.connection;
  task.work = std::move(work);
  tasks_.push_back(std::move(task));
  return id;
}

absl::StatusOr<uint64_t> VerbsDevice::PostFastRegister(
    ConnectionId connection_id, const FastRegisterWork& work) {
  if ((work.flags & ~kKnownWorkFlags) != 0) {
    return InvalidParameter("UNKNOWN_WORK_FLAGS",
                            absl::StrCat("fast register: flags ",
                                         Hex(work.flags), " have unknown bits ",
                                         Hex(work.flags & ~kKnownWorkFlags)));
  }
  if ((work.access & ~kKnownAccess) != 0) {
    return InvalidParameter(
        "UNKNOWN_ACCESS_BITS",
        absl::StrCat("fast register: access ", Hex(work.access),
                     " has unknown bits ", Hex(work.access & ~kKnownAccess)));
  }
  absl::MutexLock lock(&mu_);
  MRD_RETURN_IF_ERROR(CheckUsableLocked());
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Mr> mr, FindMrLocked(work.mr));
  if (!mr->fast) {
    return InvalidParameter(
        "NOT_FAST_REGISTER_MR",
        absl::StrCat("MR ", work.mr,
                     " was not created for fast registration (R4/C1)"));
  }
  MRD_ASSIGN_OR_RETURN(Connection * connection,
                       FindPostConnectionLocked(connection_id, mr->pd));
  if ((work.access & kRemoteAccess) != 0 && !mr->allow_remote) {
    return SeedError(
        STATUS_ACCESS_VIOLATION, "REMOTE_ACCESS_NOT_ALLOWED",
        absl::StrCat("MR ", work.mr,
                     " was allocated without remote access, but the fast "
                     "registration asks for access ",
                     Hex(work.access)));
  }
  // F2/F6, the same rules the core applied, against this MR's own
  // max_pages.
  MRD_RETURN_IF_ERROR(ValidatePageArray(page_size_, mr->max_pages, work.pages,
                                        work.fbo, work.length,
                                        work.base_address));
  MRD_RETURN_IF_ERROR(ResolvePagesLocked(mr->pd, work.pages).status());

  Work queued;
  queued.kind = WorkCompletion::Kind::kFastRegister;
  queued.connection = connection_id;
  queued.pd = mr->pd;
  queued.mr = work.mr;
  queued.flags = work.flags;
  queued.request_context = work.request_context;
  queued.fast_register = work;
  return EnqueueLocked(*connection, std::move(queued));
}

absl::StatusOr<uint64_t> VerbsDevice::PostInvalidate(
    ConnectionId connection_id, const InvalidateWork& work) {
  if ((work.flags & ~kKnownWorkFlags) != 0) {
    return InvalidParameter("UNKNOWN_WORK_FLAGS",
                            absl::StrCat("invalidate: flags ", Hex(work.flags),
                                         " have unknown bits ",
                                         Hex(work.flags & ~kKnownWorkFlags)));
  }
  absl::MutexLock lock(&mu_);
  MRD_RETURN_IF_ERROR(CheckUsableLocked());
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Mr> mr, FindMrLocked(work.mr));
  if (!mr->fast) {
    return InvalidParameter(
        "NOT_FAST_REGISTER_MR",
        absl::StrCat("MR ", work.mr,
                     " was not created for fast registration; deregister "
                     "it instead"));
  }
  MRD_ASSIGN_OR_RETURN(Connection * connection,
                       FindPostConnectionLocked(connection_id, mr->pd));
  Work queued;
  queued.kind = WorkCompletion::Kind::kInvalidate;
  queued.connection = connection_id;
  queued.pd = mr->pd;
  queued.mr = work.mr;
  queued.flags = work.flags;
  queued.request_context = work.request_context;
  return EnqueueLocked(*connection, std::move(queued));
}

// ---------------------------------------------------------------------------
// Worker.

bool VerbsDevice::WorkerHasTask() const {
  return worker_stop_ || !tasks_.empty();
}

bool VerbsDevice::WorkerIdle() const { return tasks_.empty() && !worker_busy_; }

void VerbsDevice::WaitForWorkerIdle() {
  absl::MutexLock lock(&mu_);
  if (!started_) return;
  mu_.Await(absl::Condition(this, &VerbsDevice::WorkerIdle));
}

void VerbsDevice::WorkerLoop() {
  while (true) {
    Task task;
    PdEventSink* sink = nullptr;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &VerbsDevice::WorkerHasTask));
      if (tasks_.empty()) return;  // asked to stop, and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
      auto it = pds_.find(task.pd);
      // A deallocated PD's tasks vanish: its sink is never called again
      // once DeallocatePd returns.
      if (it == pds_.end() || it->second->dying) continue;
      ++it->second->busy;
      sink = it->second->sink;
      worker_busy_ = true;
    }
    switch (task.kind) {
      case Task::Kind::kWork:
        if (std::optional<WorkCompletion> completion = Execute(task.work)) {
          sink->OnCompletion(*completion);
        }
        break;
      case Task::Kind::kConnected:
        sink->OnPeerConnected(task.connection, task.remote);
        break;
      case Task::Kind::kDisconnected:
        sink->OnPeerDisconnected(task.connection);
        break;
    }
    absl::MutexLock lock(&mu_);
    EndPdOpLocked(task.pd);
    worker_busy_ = false;
  }
}

std::optional<WorkCompletion> VerbsDevice::Execute(const Work& work) {
  WorkCompletion completion;
  completion.kind = work.kind;
  completion.connection = work.connection;
  completion.work_request = work.id;
  completion.request_context = work.request_context;
  completion.mr = work.mr;
  bool ready = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = connections_.find(work.connection);
    ready = it != connections_.end() &&
            it->second->state == Connection::State::kReady;
  }
  if (!ready) {
    completion.status = SeedError(
        STATUS_CONNECTION_INVALID, "FLUSHED",
        absl::StrCat("work request ", work.id, " flushed: connection ",
                     work.connection, " is closed or in error"));
  } else if (work.kind == WorkCompletion::Kind::kFastRegister) {
    completion.status = ExecuteFastRegister(work, &completion.rkey);
  } else {
    completion.status = ExecuteInvalidate(work);
  }
  // SILENT_SUCCESS hides successes only; failures always complete (F3).
  if (completion.status.ok() && (work.flags & kWorkSilentSuccess) != 0) {
    return std::nullopt;
  }
  return completion;
}

namespace {

// A contiguous view of `pages` (file pages): a PROT_NONE reservation, then
// one MAP_FIXED|MAP_SHARED mapping per run of consecutive file pages.
// Writable when the file allows it (see "Read-only memory" in the header);
// read-only otherwise, unless `need_write`.
template <typename PageRefT>
absl::StatusOr<std::pair<void*, uint64_t>> BuildRemap(
    const std::vector<PageRefT>& pages, uint64_t page_size, bool need_write) {
  const uint64_t length = pages.size() * page_size;
  void* base = ::mmap(nullptr, length, PROT_NONE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    return ErrnoError(errno,
                      absl::StrCat("mmap reserving ", length,
                                   " bytes for a fast registration"),
                      "REMAP_FAILED");
  }
  size_t i = 0;
  while (i < pages.size()) {
    size_t run = 1;
    while (i + run < pages.size() && pages[i + run].fd == pages[i].fd &&
           pages[i + run].file_offset ==
               pages[i].file_offset + run * page_size) {
      ++run;
    }
    void* at = static_cast<char*>(base) + i * page_size;
    const off_t offset = static_cast<off_t>(pages[i].file_offset);
    // Write access: the fd's own rights decide. Read only: a writable view
    // (reopened if need be) for kernels that cannot pin read-only pages.
    void* got = need_write ? ::mmap(at, run * page_size, PROT_READ | PROT_WRITE,
                                    MAP_SHARED | MAP_FIXED, pages[i].fd, offset)
                           : MapWritableView(pages[i].fd, run * page_size,
                                             offset, at, MAP_FIXED);
    if (got == MAP_FAILED && !need_write &&
        (errno == EACCES || errno == EPERM)) {
      got = ::mmap(at, run * page_size, PROT_READ, MAP_SHARED | MAP_FIXED,
                   pages[i].fd, offset);
    }
    if (got == MAP_FAILED) {
      int err = errno;
      ::munmap(base, length);
      std::string message = absl::StrCat(
          "mmap of ", run, " page(s) at file offset ", pages[i].file_offset,
          " for page[", i, "]: ", std::strerror(err));
      if ((err == EACCES || err == EPERM) && need_write) {
        return SeedError(
            STATUS_ACCESS_VIOLATION, "PAGES_NOT_WRITABLE",
            absl::StrCat(message,
                         " (write access asked for on a read-only file)"));
      }
      if (err == EINVAL) {
        return InvalidParameter(
            "REMAP_FAILED",
            absl::StrCat(message,
                         " (hugetlbfs pages cannot be remapped one base "
                         "page at a time)"));
      }
      return ErrnoError(err, message, "REMAP_FAILED");
    }
    i += run;
  }
  return std::make_pair(base, length);
}

}  // namespace

absl::Status VerbsDevice::ExecuteFastRegister(const Work& work,
                                              uint32_t* rkey) {
  const FastRegisterWork& fr = work.fast_register;
  std::shared_ptr<Mr> mr;
  ResolvedPages resolved;
  ibv_pd* verbs_pd = nullptr;
  uint32_t previous_rkey = 0;
  {
    absl::MutexLock lock(&mu_);
    MRD_RETURN_IF_ERROR(CheckUsableLocked());
    MRD_ASSIGN_OR_RETURN(mr, FindMrLocked(work.mr));
    if (mr->valid) {
      return InvalidParameter(
          "MR_NOT_FREE",
          absl::StrCat("MR ", work.mr, " is already fast-registered (rkey ",
                       Hex(mr->rkey), "); invalidate it first"));
    }
    // The LAMs may have been released since the post.
    MRD_ASSIGN_OR_RETURN(resolved, ResolvePagesLocked(mr->pd, fr.pages));
    for (LamId id : resolved.lams) ++lams_.find(id)->second->fr_users;
    mr->executing = true;
    verbs_pd = pds_.find(mr->pd)->second->pd;  // busy: held by the worker
    previous_rkey = mr->previous_rkey;
  }

  const int access = VerbsAccess(fr.access);
  Memory memory;
  absl::StatusOr<std::pair<void*, uint64_t>> remap =
      BuildRemap(resolved.pages, page_size_, (access & kWriteAccess) != 0);
  absl::Status status = remap.status();
  if (status.ok()) {
    memory.view = remap->first;
    memory.view_length = remap->second;
    char* start = static_cast<char*>(memory.view) + fr.fbo;
    // Re-register while the adapter hands back the previous rkey, so that
    // every fast registration yields a new key; the older registration is
    // dropped only after the newer one exists, so the two never coincide.
    for (int attempt = 0; attempt < kMaxKeyRenewals; ++attempt) {
      ibv_mr* next =
          ibv_reg_mr_iova2(verbs_pd, start, fr.length, fr.base_address, access);
      if (next == nullptr) {
        int err = errno;
        status = err == EFAULT && (access & kWriteAccess) == 0
                     ? ReadOnlyNotPinnable("fast register: ibv_reg_mr",
                                           fr.length, EACCES)
                     : RegistrationError(err, "fast register: ibv_reg_mr",
                                         fr.length);
        break;
      }
      if (memory.mr != nullptr) ibv_dereg_mr(memory.mr);
      memory.mr = next;
      if (previous_rkey == 0 || memory.mr->rkey != previous_rkey) break;
    }
    if (status.ok() && previous_rkey != 0 && memory.mr->rkey == previous_rkey) {
      status = MrdError(
          absl::StatusCode::kInternal, "KEY_NOT_RENEWED",
          absl::StrCat("the adapter returned rkey ", Hex(previous_rkey),
                       " again ", kMaxKeyRenewals, " times"));
    }
    if (!status.ok()) (void)ReleaseMemory(memory);
  }

  absl::MutexLock lock(&mu_);
  mr->executing = false;
  if (!status.ok()) {
    DropLamRefsLocked(resolved.lams);
    return status;
  }
  // Committed even when FreeFastRegisterMr waits for us (it tears the
  // registration down right after) or the device was lost meanwhile
  // (ReleaseDevice waits for the worker's busy count, then takes it).
  memory.pinned = PageRound(reinterpret_cast<uint64_t>(memory.view) + fr.fbo,
                            fr.length, page_size_);
  mr->memory = memory;
  mr->lkey = memory.mr->lkey;
  mr->rkey = memory.mr->rkey;
  mr->previous_rkey = memory.mr->rkey;
  mr->lams = std::move(resolved.lams);
  mr->valid = true;
  pinned_bytes_ += memory.pinned;
  *rkey = memory.mr->rkey;
  return absl::OkStatus();
}

absl::Status VerbsDevice::ExecuteInvalidate(const Work& work) {
  MrResources resources;
  {
    absl::MutexLock lock(&mu_);
    MRD_ASSIGN_OR_RETURN(std::shared_ptr<Mr> mr, FindMrLocked(work.mr));
    if (!mr->valid) {
      return InvalidParameter(
          "MR_NOT_FAST_REGISTERED",
          absl::StrCat("MR ", work.mr, " is not fast-registered"));
    }
    // The rkey stays what QueryMr reports, now dead, until the next fast
    // registration.
    resources = TakeResourcesLocked(*mr);
  }
  // The old rkey is dead before the completion is delivered.
  return ReleaseMrResources(std::move(resources));
}

// ---------------------------------------------------------------------------
// Connection manager.

void VerbsDevice::CommandCm(CmCommand command) {
  cm_commands_.push_back(command);
  Wake(cm_wake_.get());
}

void VerbsDevice::CmLoop() {
  while (true) {
    RunCmCommands();
    {
      absl::MutexLock lock(&mu_);
      if (cm_stop_) break;
    }
    while (true) {
      rdma_cm_event* event = nullptr;
      if (rdma_get_cm_event(channel_, &event) != 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          LogError("verbs device: rdma_get_cm_event: ", std::strerror(errno));
        }
        break;
      }
      CmEvent copy;
      copy.type = event->event;
      copy.id = event->id;
      copy.status = event->status;
      if (event->event == RDMA_CM_EVENT_CONNECT_REQUEST) {
        const rdma_conn_param& param = event->param.conn;
        if (param.private_data != nullptr) {
          copy.private_data.assign(static_cast<const char*>(param.private_data),
                                   param.private_data_len);
        }
        copy.responder_resources = param.responder_resources;
        copy.initiator_depth = param.initiator_depth;
      }
      // Acknowledged before handling: destroying an id waits for its
      // events to be acknowledged.
      rdma_ack_cm_event(event);
      HandleCmEvent(copy);
    }
    WaitReadable(channel_->fd, cm_wake_.get());
    DrainWake(cm_wake_.get());
  }
  // Stopping: every connection closes (sinks hear of it through the
  // worker), then the listener goes, unless a device release owns it now.
  bool released = false;
  {
    absl::MutexLock lock(&mu_);
    released = cm_released_;
  }
  CloseAllCmIds(/*listener=*/!released);
  absl::MutexLock lock(&mu_);
  cm_running_ = false;
}

void VerbsDevice::CloseAllCmIds(bool listener) {
  std::vector<rdma_cm_id*> ids;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, connection] : by_cm_id_) ids.push_back(id);
  }
  for (rdma_cm_id* id : ids) CloseCmId(id, /*notify=*/true);
  if (listener && listen_id_ != nullptr) {
    rdma_destroy_id(listen_id_);
    listen_id_ = nullptr;
  }
}

void VerbsDevice::RunCmCommands() {
  std::deque<CmCommand> commands;
  {
    absl::MutexLock lock(&mu_);
    commands.swap(cm_commands_);
  }
  for (const CmCommand& command : commands) {
    if (command.kind == CmCommand::Kind::kReleaseAll) {
      // The listener stays: its reference keeps librdmacm's context open
      // until ReleaseDevice has let go of everything else (another user of
      // librdmacm in this process could otherwise make it close the context
      // under our MRs), and ReleaseDevice destroys it.
      CloseAllCmIds(/*listener=*/false);
      absl::MutexLock lock(&mu_);
      cm_released_ = true;
      continue;
    }
    std::vector<rdma_cm_id*> ids;
    bool notify = false;
    {
      absl::MutexLock lock(&mu_);
      if (command.kind == CmCommand::Kind::kClosePd) {
        auto pd = pds_.find(command.pd);
        if (pd == pds_.end()) continue;
        for (ConnectionId id : pd->second->connections) {
          auto it = connections_.find(id);
          if (it != connections_.end()) ids.push_back(it->second->cm_id);
        }
      } else {
        auto it = connections_.find(command.connection);
        if (it != connections_.end()) ids.push_back(it->second->cm_id);
        notify = true;
      }
    }
    for (rdma_cm_id* id : ids) CloseCmId(id, notify);
  }
}

void VerbsDevice::HandleCmEvent(const CmEvent& event) {
  switch (event.type) {
    case RDMA_CM_EVENT_CONNECT_REQUEST:
      HandleConnectRequest(event);
      return;
    case RDMA_CM_EVENT_ESTABLISHED:
      HandleEstablished(event.id);
      return;
    case RDMA_CM_EVENT_DISCONNECTED:
    case RDMA_CM_EVENT_CONNECT_ERROR:
    case RDMA_CM_EVENT_UNREACHABLE:
    case RDMA_CM_EVENT_REJECTED:
      LogDebug("verbs device: ", rdma_event_str(event.type), " (status ",
               event.status, ")");
      CloseCmId(event.id, /*notify=*/true);
      return;
    case RDMA_CM_EVENT_DEVICE_REMOVAL:
      // Every id on the device gets one; the release closes them all.
      LoseDevice("the RDMA device is being removed (rdma_cm DEVICE_REMOVAL)");
      return;
    default:
      LogDebug("verbs device: rdma_cm event ", rdma_event_str(event.type));
      return;
  }
}

void VerbsDevice::HandleConnectRequest(const CmEvent& event) {
  rdma_cm_id* id = event.id;
  const std::string remote = FormatSockaddr(rdma_get_peer_addr(id));
  auto reject = [&](absl::string_view data, absl::string_view why) {
    LogInfo("verbs device: connect request from ", remote, " rejected: ", why);
    rdma_reject(id, data.data(), static_cast<uint8_t>(data.size()));
    rdma_destroy_id(id);
  };
  if (id->verbs != context_) {
    reject("WRONG_DEVICE", "it arrived on another RDMA device");
    return;
  }
  size_t ticket_length =
      std::min(event.private_data.size(), kMaxConnectPrivateData);
  ticket_length = strnlen(event.private_data.data(), ticket_length);
  const std::string ticket = event.private_data.substr(0, ticket_length);
  PdId pd_id = 0;
  ibv_pd* verbs_pd = nullptr;
  ConnectionId connection_id = 0;
  std::string reject_data;  // non-empty: reject, for reject_why
  std::string reject_why;
  {
    absl::MutexLock lock(&mu_);
    auto it = tickets_.find(ticket);
    Pd* pd = nullptr;
    if (it != tickets_.end()) {
      auto p = pds_.find(it->second);
      if (p != pds_.end() && !p->second->dying) pd = p->second.get();
    }
    if (shut_down_ || !lost_reason_.empty()) {
      reject_data = "UNAVAILABLE";
      reject_why = "the device is shutting down or lost";
    } else if (pd == nullptr) {
      reject_data = kBadTicketRejectData;
      reject_why = "unknown ticket, or its session has ended";
    } else if (connections_.size() >= options_.max_connections) {
      reject_data = "TOO_MANY_CONNECTIONS";
      reject_why = absl::StrCat("the device has its maximum of ",
                                options_.max_connections, " connections");
    } else {
      ++pd->busy;  // DeallocatePd waits until the QP is registered or gone
      pd_id = pd->id;
      verbs_pd = pd->pd;
      connection_id = next_connection_++;
    }
  }
  if (!reject_data.empty()) {
    reject(reject_data, reject_why);
    return;
  }

  // A small RC QP with its own CQ: mrd never posts on it; the adapter
  // answers the peer's READ/WRITE from the PD's MRs.
  ibv_cq* cq = ibv_create_cq(context_, 2, nullptr, nullptr, 0);
  bool created = false;
  if (cq != nullptr) {
    ibv_qp_init_attr init{};
    init.send_cq = cq;
    init.recv_cq = cq;
    init.qp_type = IBV_QPT_RC;
    init.cap.max_send_wr = 1;
    init.cap.max_recv_wr = 1;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    created = rdma_create_qp(id, verbs_pd, &init) == 0;
  }
  if (!created) {
    int err = errno;
    if (cq != nullptr) ibv_destroy_cq(cq);
    EndPdOp(pd_id);
    reject("NO_RESOURCES",
           absl::StrCat("creating the queue pair: ", std::strerror(err)));
    return;
  }
  bool dying = false;
  {
    absl::MutexLock lock(&mu_);
    Pd& pd = *pds_.find(pd_id)->second;  // busy keeps it
    dying = pd.dying || shut_down_ || !lost_reason_.empty();
    if (!dying) {
      auto connection = std::make_unique<Connection>();
      connection->id = connection_id;
      connection->pd = pd_id;
      connection->cm_id = id;
      connection->cq = cq;
      connection->qp_num = id->qp->qp_num;
      connection->remote = remote;
      by_cm_id_.emplace(id, connection_id);
      by_qp_num_.emplace(connection->qp_num, connection_id);
      pd.connections.insert(connection_id);
      connections_.emplace(connection_id, std::move(connection));
      EndPdOpLocked(pd_id);
    }
  }
  if (dying) {
    rdma_destroy_qp(id);
    ibv_destroy_cq(cq);
    EndPdOp(pd_id);
    reject(kBadTicketRejectData, "the session ended during the connect");
    return;
  }

  uint8_t reply[kAcceptPrivateDataBytes];
  PutLe64(reply, connection_id);
  PutLe64(reply + 8, max_message_size_);
  rdma_conn_param param{};
  param.private_data = reply;
  param.private_data_len = sizeof(reply);
  param.responder_resources = static_cast<uint8_t>(
      std::min<uint32_t>(event.responder_resources, max_responder_resources_));
  param.initiator_depth = static_cast<uint8_t>(
      std::min<uint32_t>(event.initiator_depth, max_initiator_depth_));
  param.rnr_retry_count = 7;
  if (rdma_accept(id, &param) != 0) {
    LogWarning("verbs device: rdma_accept for ", remote, ": ",
               std::strerror(errno));
    CloseCmId(id, /*notify=*/false);
    return;
  }
  LogDebug("verbs device: accepted connection ", connection_id, " from ",
           remote, " (PD ", pd_id, ", QP ", id->qp->qp_num, ")");
}

void VerbsDevice::HandleEstablished(rdma_cm_id* id) {
  absl::MutexLock lock(&mu_);
  auto by_id = by_cm_id_.find(id);
  if (by_id == by_cm_id_.end()) return;
  Connection& connection = *connections_.find(by_id->second)->second;
  if (connection.state != Connection::State::kConnecting) return;
  auto pd = pds_.find(connection.pd);
  if (pd == pds_.end() || pd->second->dying) return;  // kClosePd is coming
  connection.state = Connection::State::kReady;
  connection.announced = true;
  // Queued before any post can find the connection ready, so
  // OnPeerConnected precedes every completion on it.
  Task task;
  task.kind = Task::Kind::kConnected;
  task.pd = connection.pd;
  task.connection = connection.id;
  task.remote = connection.remote;
  tasks_.push_back(std::move(task));
}

void VerbsDevice::CloseCmId(rdma_cm_id* id, bool notify) {
  ConnectionId connection_id = 0;
  PdId pd_id = 0;
  ibv_cq* cq = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto by_id = by_cm_id_.find(id);
    if (by_id != by_cm_id_.end()) {
      connection_id = by_id->second;
      by_cm_id_.erase(by_id);
      auto it = connections_.find(connection_id);
      Connection& connection = *it->second;
      pd_id = connection.pd;
      cq = connection.cq;
      by_qp_num_.erase(connection.qp_num);
      connection.state = Connection::State::kClosed;
      auto pd = pds_.find(pd_id);
      if (notify && connection.announced && pd != pds_.end() &&
          !pd->second->dying) {
        // Held work is flushed by the worker (the connection is gone), so
        // every post gets its completion, then the disconnect.
        ReleaseDeferredLocked(connection);
        Task task;
        task.kind = Task::Kind::kDisconnected;
        task.pd = pd_id;
        task.connection = connection_id;
        tasks_.push_back(std::move(task));
      }
      connections_.erase(it);
    }
  }
  if (connection_id != 0) {
    rdma_disconnect(id);  // harmless when the peer already disconnected
    rdma_destroy_qp(id);
    ibv_destroy_cq(cq);
  }
  rdma_destroy_id(id);
  if (connection_id != 0) {
    absl::MutexLock lock(&mu_);
    auto pd = pds_.find(pd_id);
    if (pd != pds_.end()) pd->second->connections.erase(connection_id);
    LogDebug("verbs device: connection ", connection_id, " closed");
  }
}

// ---------------------------------------------------------------------------
// Device loss.

void VerbsDevice::LoseDevice(const std::string& reason) {
  absl::MutexLock lock(&mu_);
  LoseDeviceLocked(reason);
}

void VerbsDevice::LoseDeviceLocked(const std::string& reason) {
  if (!lost_reason_.empty()) return;
  lost_reason_ = reason;
  LogError("verbs device ", attributes_.name, " lost: ", reason,
           "; releasing everything on it");
  for (auto& [id, connection] : connections_) {
    if (connection->state != Connection::State::kClosed) {
      connection->state = Connection::State::kError;
    }
  }
  CmCommand command;
  command.kind = CmCommand::Kind::kReleaseAll;
  CommandCm(command);
  Wake(async_wake_.get());
}

bool VerbsDevice::ReadyToRelease() const {
  if (!cm_released_ && cm_running_) return false;
  for (const auto& [id, pd] : pds_) {
    if (pd->busy > 0) return false;
  }
  return true;
}

void VerbsDevice::ReleaseDevice() {
  std::vector<Memory> memories;
  std::vector<ibv_pd*> verbs_pds;
  {
    absl::MutexLock lock(&mu_);
    // Every id is closed (so every QP and CQ is gone), and no verbs call on
    // a PD's objects is in progress; new ones are refused (DEVICE_LOST).
    mu_.Await(absl::Condition(this, &VerbsDevice::ReadyToRelease));
    for (auto& [id, mr] : mrs_) {
      memories.push_back(TakeResourcesLocked(*mr).memory);
    }
    for (auto& [id, lam] : lams_) {
      memories.push_back(std::exchange(lam->memory, {}));
      lam->fr_users = 0;  // the fast registrations are gone too
    }
    for (auto& [id, pd] : pds_) {
      if (pd->pd != nullptr)
        verbs_pds.push_back(std::exchange(pd->pd, nullptr));
    }
  }
  uint64_t unpinned = 0;
  for (const Memory& memory : memories) {
    if (ReleaseMemory(memory).ok()) unpinned += memory.pinned;
  }
  for (ibv_pd* pd : verbs_pds) {
    if (int rc = ibv_dealloc_pd(pd); rc != 0) {
      LogError("verbs device: ibv_dealloc_pd after device loss: ",
               std::strerror(rc));
    }
  }
  // The listener last (see kReleaseAll): then nothing of ours is left on
  // the device. librdmacm closes its context once it notices the device is
  // gone, which a device list sync does. The cm thread no longer touches
  // listen_id_ once cm_released_ is set.
  if (listen_id_ != nullptr) {
    rdma_destroy_id(listen_id_);
    listen_id_ = nullptr;
  }
  int count = 0;
  if (ibv_context** list = rdma_get_devices(&count); list != nullptr) {
    rdma_free_devices(list);
  }
  absl::MutexLock lock(&mu_);
  pinned_bytes_ -= unpinned;
  released_ = true;
  LogInfo("verbs device ", attributes_.name, ": released after the loss (",
          memories.size(), " registrations, ", verbs_pds.size(), " PDs)");
}

// ---------------------------------------------------------------------------
// Async events.

void VerbsDevice::MarkConnectionErrorLocked(Connection& connection,
                                            const std::string& why) {
  if (connection.state == Connection::State::kClosed ||
      connection.state == Connection::State::kError) {
    return;
  }
  LogInfo("verbs device: connection ", connection.id, " (", connection.remote,
          ") in error: ", why);
  connection.state = Connection::State::kError;
  CmCommand command;
  command.kind = CmCommand::Kind::kClose;
  command.connection = connection.id;
  CommandCm(command);
}

void VerbsDevice::AsyncLoop() {
  bool readable = true;  // false once the device is lost
  while (true) {
    bool release = false;
    {
      absl::MutexLock lock(&mu_);
      if (!lost_reason_.empty() && !released_) {
        release = true;
      } else if (async_stop_) {
        return;
      }
    }
    if (release) {
      // The context closes during the release: never touch it again.
      readable = false;
      ReleaseDevice();
      continue;
    }
    while (readable) {
      ibv_async_event event{};
      if (ibv_get_async_event(context_, &event) != 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          int err = errno;
          readable = false;
          LoseDevice(absl::StrCat("reading async events failed: ",
                                  std::strerror(err)));
        }
        break;
      }
      // Copied and acknowledged first: destroying a QP waits for its
      // events to be acknowledged, and the QP may be gone afterwards.
      AsyncEvent copy;
      copy.type = event.event_type;
      switch (event.event_type) {
        case IBV_EVENT_QP_FATAL:
        case IBV_EVENT_QP_REQ_ERR:
        case IBV_EVENT_QP_ACCESS_ERR:
        case IBV_EVENT_PATH_MIG_ERR:
        case IBV_EVENT_COMM_EST:
        case IBV_EVENT_SQ_DRAINED:
        case IBV_EVENT_QP_LAST_WQE_REACHED:
          copy.qp_num = event.element.qp->qp_num;
          break;
        case IBV_EVENT_CQ_ERR:
          copy.cq = event.element.cq;
          break;
        case IBV_EVENT_PORT_ERR:
        case IBV_EVENT_PORT_ACTIVE:
        case IBV_EVENT_LID_CHANGE:
        case IBV_EVENT_GID_CHANGE:
        case IBV_EVENT_PKEY_CHANGE:
        case IBV_EVENT_SM_CHANGE:
        case IBV_EVENT_CLIENT_REREGISTER:
          copy.port_num = event.element.port_num;
          break;
        default:
          break;
      }
      ibv_ack_async_event(&event);
      HandleAsyncEvent(copy);
      if (copy.type == IBV_EVENT_DEVICE_FATAL) break;
    }
    WaitReadable(readable ? context_->async_fd : -1, async_wake_.get());
    DrainWake(async_wake_.get());
  }
}

void VerbsDevice::HandleAsyncEvent(const AsyncEvent& event) {
  const char* name = ibv_event_type_str(event.type);
  switch (event.type) {
    case IBV_EVENT_QP_FATAL:
    case IBV_EVENT_QP_REQ_ERR:
    case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_PATH_MIG_ERR: {
      absl::MutexLock lock(&mu_);
      auto it = by_qp_num_.find(event.qp_num);
      if (it == by_qp_num_.end()) return;
      MarkConnectionErrorLocked(*connections_.find(it->second)->second, name);
      return;
    }
    case IBV_EVENT_CQ_ERR: {
      absl::MutexLock lock(&mu_);
      for (auto& [id, connection] : connections_) {
        if (connection->cq == event.cq) {
          MarkConnectionErrorLocked(*connection, name);
        }
      }
      return;
    }
    case IBV_EVENT_DEVICE_FATAL:
      LoseDevice("fatal device error (IBV_EVENT_DEVICE_FATAL)");
      return;
    case IBV_EVENT_PORT_ERR:
      if (event.port_num == port_num_) {
        absl::MutexLock lock(&mu_);
        port_problem_ =
            absl::StrCat("port ", event.port_num, " is down (", name, ")");
        LogWarning("verbs device ", attributes_.name, ": ", port_problem_);
      }
      return;
    case IBV_EVENT_PORT_ACTIVE:
      if (event.port_num == port_num_) {
        absl::MutexLock lock(&mu_);
        if (!port_problem_.empty()) {
          LogInfo("verbs device ", attributes_.name, ": port ", event.port_num,
                  " is active again");
        }
        port_problem_.clear();
      }
      return;
    case IBV_EVENT_COMM_EST:
    case IBV_EVENT_SQ_DRAINED:
    case IBV_EVENT_QP_LAST_WQE_REACHED:
      LogDebug("verbs device: async event ", name, " on QP ", event.qp_num);
      return;
    default:
      LogInfo("verbs device ", attributes_.name, ": async event ", name);
      return;
  }
}

}  // namespace mrd::device
