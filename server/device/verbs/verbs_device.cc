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
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "mrd/net.h"
#include "mrd/status.h"
#include "server/common/log.h"

namespace mrd::device {
namespace {

constexpr int kWriteAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
// Logical addresses: the same layout as the software device's (random start
// in [4 GiB, 68 GiB) for 4 KiB pages, guard gaps, well below 2^56).
constexpr uint64_t kIovaFloorPages = uint64_t{1} << 20;
constexpr uint64_t kIovaSpreadPages = uint64_t{1} << 24;
constexpr uint64_t kIovaLimit = uint64_t{1} << 56;
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

// The opened device. Owned by the VerbsDevice; the cm thread destroys
// listen_id on its way out, ReleaseDevice after a loss, or the destructor
// when the device never started.
struct VerbsDevice::Adapter {
  ~Adapter() {
    if (listen_id != nullptr) rdma_destroy_id(listen_id);
    if (channel != nullptr) rdma_destroy_event_channel(channel);
  }
  // librdmacm's context of the device (listen_id->verbs); closed by
  // librdmacm once every id on it is gone (and, after a loss, the device is
  // noticed to be gone).
  ibv_context* context = nullptr;
  rdma_event_channel* channel = nullptr;
  rdma_cm_id* listen_id = nullptr;
  DeviceAttributes attributes;
  uint64_t max_mr_size = 0;
  uint32_t max_page_list_length = 0;
  uint64_t max_message_size = 0;
  uint32_t max_responder_resources = 0;  // device max_qp_rd_atom
  uint32_t max_initiator_depth = 0;      // device max_qp_init_rd_atom
  uint8_t port_num = 1;
  std::string port_problem;  // non-empty: the port was not active
};

struct VerbsDevice::VerbsPd final : ProviderState {
  explicit VerbsPd(ibv_pd* p) : pd(p) {}
  ibv_pd* pd;
};

// One verbs registration: the MR, and the view of the file mrd mapped for
// it when it did not register the caller's mapping (fast-registration
// remaps, writable views of read-only memory).
struct VerbsDevice::Memory final : ProviderState {
  ibv_mr* mr = nullptr;
  void* view = nullptr;
  uint64_t view_length = 0;
  uint64_t pinned = 0;  // page-rounded bytes the registration pins
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
  const uint64_t ps = static_cast<uint64_t>(page_size);
  uint64_t pick = 0;
  MRD_RETURN_IF_ERROR(SecureRandomBytes(&pick, sizeof(pick)));
  MRD_ASSIGN_OR_RETURN(std::unique_ptr<Adapter> adapter,
                       OpenAdapter(options, ps));
  DeviceModelOptions model;
  model.page_size = ps;
  model.max_mr_size = adapter->max_mr_size;
  model.max_page_list_length = adapter->max_page_list_length;
  model.max_session_connections = options.max_connections;
  model.iova_start = (kIovaFloorPages + pick % kIovaSpreadPages) * ps;
  model.iova_limit = kIovaLimit / ps * ps;
  auto device = std::unique_ptr<VerbsDevice>(
      new VerbsDevice(options, model, std::move(adapter)));
  device->cm_wake_.Reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  device->async_wake_.Reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!device->cm_wake_.valid() || !device->async_wake_.valid()) {
    return ErrnoError(errno, "eventfd", "VERBS_SETUP_FAILED");
  }
  return device;
}

VerbsDevice::VerbsDevice(const VerbsDeviceOptions& options,
                         DeviceModelOptions model,
                         std::unique_ptr<Adapter> adapter)
    : DeviceModel(adapter->attributes, model),
      options_(options),
      adapter_(std::move(adapter)) {
  absl::MutexLock lock(&verbs_mu_);
  port_problem_ = adapter_->port_problem;
}

absl::StatusOr<std::unique_ptr<VerbsDevice::Adapter>> VerbsDevice::OpenAdapter(
    const VerbsDeviceOptions& options, uint64_t page_size) {
  auto adapter = std::make_unique<Adapter>();
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
  MRD_RETURN_IF_ERROR(BindListener(options, names, adapter.get()));
  MRD_RETURN_IF_ERROR(QueryAdapter(options, page_size, adapter.get()));
  return adapter;
}

absl::Status VerbsDevice::BindListener(const VerbsDeviceOptions& options,
                                       const std::vector<std::string>& names,
                                       Adapter* adapter) {
  adapter->channel = rdma_create_event_channel();
  if (adapter->channel == nullptr) {
    return ErrnoError(errno,
                      "rdma_create_event_channel (is rdma_ucm loaded and "
                      "/dev/infiniband/rdma_cm accessible?)",
                      "VERBS_SETUP_FAILED");
  }
  MRD_RETURN_IF_ERROR(
      SetNonBlocking(adapter->channel->fd, "the rdma_cm channel"));
  if (rdma_create_id(adapter->channel, &adapter->listen_id, nullptr,
                     RDMA_PS_TCP) != 0) {
    adapter->listen_id = nullptr;
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
  int bind_rc = rdma_bind_addr(adapter->listen_id, resolved->ai_addr);
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
  if (adapter->listen_id->verbs == nullptr) {
    return MrdError(
        absl::StatusCode::kInvalidArgument, "PEER_ADDRESS_NOT_ON_DEVICE",
        absl::StrCat("peer address ", options.peer_address,
                     " is not an address configured on an RDMA device's "
                     "interface (wildcards are not allowed either); RDMA "
                     "devices: ",
                     absl::StrJoin(names, ", ")));
  }
  adapter->context = adapter->listen_id->verbs;
  const std::string name = ibv_get_device_name(adapter->context->device);
  if (!options.device_name.empty() && options.device_name != name) {
    return MrdError(absl::StatusCode::kInvalidArgument,
                    "PEER_ADDRESS_NOT_ON_DEVICE",
                    absl::StrCat("peer address ", options.peer_address,
                                 " belongs to RDMA device ", name, ", not ",
                                 options.device_name));
  }
  return absl::OkStatus();
}

absl::Status VerbsDevice::QueryAdapter(const VerbsDeviceOptions& options,
                                       uint64_t page_size, Adapter* adapter) {
  const std::string name = ibv_get_device_name(adapter->context->device);
  ibv_device_attr attr{};
  if (int rc = ibv_query_device(adapter->context, &attr); rc != 0) {
    return ErrnoError(rc, absl::StrCat("ibv_query_device(", name, ")"),
                      "VERBS_QUERY_FAILED");
  }
  if (attr.page_size_cap != 0 && (attr.page_size_cap & page_size) == 0) {
    return MrdError(
        absl::StatusCode::kFailedPrecondition, "PAGE_SIZE_UNSUPPORTED",
        absl::StrCat("device ", name, " supports page sizes ",
                     Hex(attr.page_size_cap), ", not the host's ", page_size));
  }
  adapter->port_num =
      adapter->listen_id->port_num != 0 ? adapter->listen_id->port_num : 1;
  ibv_port_attr port{};
  if (int rc = ibv_query_port(adapter->context, adapter->port_num, &port);
      rc != 0) {
    return ErrnoError(rc,
                      absl::StrCat("ibv_query_port(", name, ", ",
                                   static_cast<int>(adapter->port_num), ")"),
                      "VERBS_QUERY_FAILED");
  }

  MRD_RETURN_IF_ERROR(
      SetNonBlocking(adapter->context->async_fd, "the async fd"));

  uint64_t max_mr_size = attr.max_mr_size;
  if (options.max_mr_size_limit != 0) {
    max_mr_size = std::min(max_mr_size, options.max_mr_size_limit);
  }
  if (max_mr_size < page_size) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "MAX_MR_SIZE_TINY",
                    absl::StrCat("device ", name, " allows MRs of at most ",
                                 max_mr_size, " bytes, under one page"));
  }
  adapter->attributes.name = name;
  adapter->attributes.kind = "verbs";
  adapter->max_mr_size = max_mr_size;
  adapter->max_page_list_length = static_cast<uint32_t>(std::min<uint64_t>(
      options.max_page_list_length, max_mr_size / page_size));
  // A verbs RDMA READ sink needs only LOCAL_WRITE (R9).
  adapter->attributes.adapter_flags = kAdapterFlagReadSinkNotRequired;
  adapter->attributes.supports_memory_windows =
      (attr.device_cap_flags & IBV_DEVICE_MEM_WINDOW) != 0 || attr.max_mw > 0;
  adapter->attributes.peer_address =
      FormatSockaddr(rdma_get_local_addr(adapter->listen_id));
  adapter->max_message_size =
      port.max_msg_sz != 0 ? port.max_msg_sz : uint64_t{1} << 30;
  adapter->max_responder_resources = static_cast<uint32_t>(attr.max_qp_rd_atom);
  adapter->max_initiator_depth =
      static_cast<uint32_t>(attr.max_qp_init_rd_atom);
  LogInfo("verbs device ", name, " port ", static_cast<int>(adapter->port_num),
          ": max_mr_size ", max_mr_size, ", max_msg_sz ",
          adapter->max_message_size, ", max_qp_rd_atom ", attr.max_qp_rd_atom,
          ", memory windows ",
          adapter->attributes.supports_memory_windows ? "yes" : "no",
          ", port state ", ibv_port_state_str(port.state));
  if (port.state != IBV_PORT_ACTIVE) {
    adapter->port_problem =
        absl::StrCat("port ", static_cast<int>(adapter->port_num), " is ",
                     ibv_port_state_str(port.state));
  }
  return absl::OkStatus();
}

VerbsDevice::~VerbsDevice() { ShutdownAndReleaseAll(); }

DeviceHealth VerbsDevice::Health() const {
  const Phase phase = this->phase();
  const std::string& name = Attributes().name;
  absl::MutexLock lock(&verbs_mu_);
  if (!lost_reason_.empty()) {
    return {false, absl::StrCat("device lost: ", lost_reason_)};
  }
  if (phase == Phase::kShutDown) {
    return {false, absl::StrCat("verbs device ", name, " is shut down")};
  }
  if (phase == Phase::kNew) {
    return {false, absl::StrCat("verbs device ", name, " is not started")};
  }
  if (!port_problem_.empty()) {
    return {false, absl::StrCat("verbs device ", name, ": ", port_problem_)};
  }
  return {true, absl::StrCat("verbs device ", name, " port ",
                             static_cast<int>(adapter_->port_num),
                             ", peers at ", Attributes().peer_address)};
}

uint64_t VerbsDevice::PinnedBytes() const {
  absl::MutexLock lock(&verbs_mu_);
  return pinned_bytes_;
}

uint64_t VerbsDevice::max_message_size() const {
  return adapter_->max_message_size;
}

void VerbsDevice::AddPinned(int64_t bytes) {
  absl::MutexLock lock(&verbs_mu_);
  pinned_bytes_ += static_cast<uint64_t>(bytes);
}

absl::Status VerbsDevice::ProviderStart() {
  if (rdma_listen(adapter_->listen_id, kListenBacklog) != 0) {
    return ErrnoError(
        errno, absl::StrCat("rdma_listen on ", Attributes().peer_address),
        "PEER_LISTEN_FAILED");
  }
  absl::MutexLock lock(&verbs_mu_);
  cm_running_ = true;
  // A thread that cannot be made is an error (ProviderStop joins those
  // made).
  MRD_ASSIGN_OR_RETURN(cm_thread_,
                       Thread::Start("mrd-verbs-cm", [this] { CmLoop(); }));
  MRD_ASSIGN_OR_RETURN(
      async_thread_, Thread::Start("mrd-verbs-async", [this] { AsyncLoop(); }));
  return absl::OkStatus();
}

void VerbsDevice::ProviderStop() {
  Thread cm_thread;
  {
    absl::MutexLock lock(&verbs_mu_);
    cm_stop_ = true;
    cm_thread = std::move(cm_thread_);
  }
  // The cm thread closes every connection (the model queues flushes and
  // disconnects for its worker) and destroys the listener on its way out.
  Wake(cm_wake_.get());
  cm_thread.Join();
  Thread async_thread;
  {
    absl::MutexLock lock(&verbs_mu_);
    async_stop_ = true;  // after a device release in progress
    async_thread = std::move(async_thread_);
  }
  Wake(async_wake_.get());
  async_thread.Join();
}

absl::Status VerbsDevice::ProviderUsable() const {
  absl::MutexLock lock(&verbs_mu_);
  if (!lost_reason_.empty()) {
    return MrdError(absl::StatusCode::kUnavailable, "DEVICE_LOST",
                    absl::StrCat("device lost: ", lost_reason_));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Protection domains and registrations.

absl::StatusOr<std::unique_ptr<ProviderState>>
VerbsDevice::ProviderAllocatePd() {
  ibv_pd* pd = ibv_alloc_pd(adapter_->context);
  if (pd == nullptr) {
    return ErrnoError(errno, "ibv_alloc_pd", "PD_ALLOCATION_FAILED");
  }
  return std::make_unique<VerbsPd>(pd);
}

absl::Status VerbsDevice::ProviderDeallocatePd(
    std::unique_ptr<ProviderState> state) {
  if (state == nullptr) return absl::OkStatus();  // released after a loss
  if (int rc = ibv_dealloc_pd(static_cast<VerbsPd*>(state.get())->pd);
      rc != 0) {
    LogError("ibv_dealloc_pd: ", std::strerror(rc));
    return ErrnoError(rc, "ibv_dealloc_pd", "PD_DEALLOCATION_FAILED");
  }
  return absl::OkStatus();
}

absl::Status VerbsDevice::ProviderCheckBase(const MemorySpan& span,
                                            uint64_t base_address) const {
  // The adapter translates whole pages: the base address must sit at the
  // same offset within its page as the memory does (the kernel refuses
  // anything else with EINVAL).
  const uint64_t page_size = Attributes().page_size;
  const uint64_t in_page =
      reinterpret_cast<uint64_t>(span.host_address) % page_size;
  if (base_address % page_size == in_page) return absl::OkStatus();
  return InvalidParameter(
      "BASE_ADDRESS_MISALIGNED",
      absl::StrCat("RegisterMr: base address ", Hex(base_address),
                   " is at offset ", base_address % page_size,
                   " within its page, but the memory starts at offset ",
                   in_page, " within its page; the ", Attributes().name,
                   " adapter maps whole pages, so base_address % ", page_size,
                   " must be ", in_page));
}

absl::StatusOr<std::unique_ptr<VerbsDevice::Memory>> VerbsDevice::RegisterSpan(
    ibv_pd* pd, const MemorySpan& span, uint64_t iova, int access,
    absl::string_view what) const {
  const uint64_t page_size = Attributes().page_size;
  const uint64_t host = reinterpret_cast<uint64_t>(span.host_address);
  auto memory = std::make_unique<Memory>();
  memory->mr =
      ibv_reg_mr_iova2(pd, span.host_address, span.length, iova, access);
  if (memory->mr != nullptr) {
    memory->pinned = PageRound(host, span.length, page_size);
    return memory;
  }
  const int err = errno;
  const uint64_t fbo = host % page_size;
  if (err != EFAULT || (access & kWriteAccess) != 0 ||
      span.file_offset % page_size != fbo) {
    return RegistrationError(err, what, span.length);
  }
  // EFAULT without write access: a read-only shared mapping, which kernels
  // before 6.2 refuse to pin. A writable view of the same file pages pins
  // the same pages; mrd never writes through it (MapWritableView).
  const uint64_t view_length = PageRound(host, span.length, page_size);
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
  memory->mr = ibv_reg_mr_iova2(pd, static_cast<char*>(view) + fbo, span.length,
                                iova, access);
  if (memory->mr == nullptr) {
    int view_err = errno;
    ::munmap(view, view_length);
    return RegistrationError(view_err, what, span.length);
  }
  memory->view = view;
  memory->view_length = view_length;
  memory->pinned = view_length;
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

absl::StatusOr<DeviceModel::Registration> VerbsDevice::ProviderRegister(
    ProviderState* pd, const MemorySpan& span, uint64_t iova, uint32_t access,
    uint64_t /*owner*/, bool lam) {
  // A LAM's registration is local read only: it pins the pages, and its
  // lkey is the privileged token for the logical addresses (L9).
  MRD_ASSIGN_OR_RETURN(
      std::unique_ptr<Memory> memory,
      RegisterSpan(static_cast<VerbsPd*>(pd)->pd, span, iova,
                   lam ? 0 : VerbsAccess(access),
                   lam ? "BuildLam: ibv_reg_mr" : "RegisterMr: ibv_reg_mr"));
  AddPinned(static_cast<int64_t>(memory->pinned));
  Registration registration{memory->mr->lkey, memory->mr->rkey, nullptr};
  registration.state = std::move(memory);
  return registration;
}

absl::Status VerbsDevice::ProviderDeregister(
    std::unique_ptr<ProviderState> state) {
  // ibv_dereg_mr returns once the adapter no longer honours the key.
  const Memory& memory = *static_cast<Memory*>(state.get());
  MRD_RETURN_IF_ERROR(ReleaseMemory(memory));
  AddPinned(-static_cast<int64_t>(memory.pinned));
  return absl::OkStatus();
}

absl::StatusOr<DeviceModel::Registration> VerbsDevice::ProviderAllocateFastMr(
    ProviderState* /*pd*/, MrId /*owner*/) {
  // Keys come with the first fast registration's verbs registration.
  return Registration{};
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

absl::StatusOr<DeviceModel::Registration> VerbsDevice::ProviderFastRegister(
    ProviderState* pd, ProviderState* /*object*/, MrId /*mr*/,
    const std::vector<PageRef>& pages, const FastRegisterWork& fr,
    uint32_t previous_rkey) {
  const int access = VerbsAccess(fr.access);
  MRD_ASSIGN_OR_RETURN(auto remap, BuildRemap(pages, Attributes().page_size,
                                              (access & kWriteAccess) != 0));
  auto memory = std::make_unique<Memory>();
  memory->view = remap.first;
  memory->view_length = remap.second;
  char* start = static_cast<char*>(memory->view) + fr.fbo;
  ibv_pd* verbs_pd = static_cast<VerbsPd*>(pd)->pd;
  absl::Status status;
  // Re-register while the adapter hands back the previous rkey, so that
  // every fast registration yields a new key; the older registration is
  // dropped only after the newer one exists, so the two never coincide.
  for (int attempt = 0; attempt < kMaxKeyRenewals; ++attempt) {
    ibv_mr* next =
        ibv_reg_mr_iova2(verbs_pd, start, fr.length, fr.base_address, access);
    if (next == nullptr) {
      const int err = errno;
      status =
          err == EFAULT && (access & kWriteAccess) == 0
              ? ReadOnlyNotPinnable("fast register: ibv_reg_mr", fr.length,
                                    EACCES)
              : RegistrationError(err, "fast register: ibv_reg_mr", fr.length);
      break;
    }
    if (memory->mr != nullptr) ibv_dereg_mr(memory->mr);
    memory->mr = next;
    if (previous_rkey == 0 || memory->mr->rkey != previous_rkey) break;
  }
  if (status.ok() && previous_rkey != 0 && memory->mr->rkey == previous_rkey) {
    status =
        MrdError(absl::StatusCode::kInternal, "KEY_NOT_RENEWED",
                 absl::StrCat("the adapter returned rkey ", Hex(previous_rkey),
                              " again ", kMaxKeyRenewals, " times"));
  }
  if (!status.ok()) {
    (void)ReleaseMemory(*memory);
    return status;
  }
  memory->pinned = PageRound(reinterpret_cast<uint64_t>(start), fr.length,
                             Attributes().page_size);
  AddPinned(static_cast<int64_t>(memory->pinned));
  Registration registration{memory->mr->lkey, memory->mr->rkey, nullptr};
  registration.state = std::move(memory);
  return registration;
}

// ---------------------------------------------------------------------------
// Connection manager.

void VerbsDevice::ProviderCloseConnectionsLocked(
    const std::vector<ConnectionId>& connections) {
  absl::MutexLock lock(&verbs_mu_);
  CmCommand command;
  for (ConnectionId id : connections) {
    if (auto it = links_.find(id); it != links_.end()) {
      command.ids.push_back(it->second.id);
    }
  }
  // Without links there is nothing to close (and no cm thread may be
  // running to do it).
  if (!command.ids.empty()) CommandCmLocked(std::move(command));
}

void VerbsDevice::CommandCmLocked(CmCommand command) {
  cm_commands_.push_back(std::move(command));
  Wake(cm_wake_.get());
}

void VerbsDevice::CmLoop() {
  while (true) {
    RunCmCommands();
    {
      absl::MutexLock lock(&verbs_mu_);
      if (cm_stop_) break;
    }
    while (true) {
      rdma_cm_event* event = nullptr;
      if (rdma_get_cm_event(adapter_->channel, &event) != 0) {
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
    WaitReadable(adapter_->channel->fd, cm_wake_.get());
    DrainWake(cm_wake_.get());
  }
  // Stopping: every connection closes (sinks hear of it through the
  // worker), then the listener goes, unless a device release owns it now.
  bool released = false;
  {
    absl::MutexLock lock(&verbs_mu_);
    released = cm_released_;
  }
  CloseAllCmIds(/*listener=*/!released);
  absl::MutexLock lock(&verbs_mu_);
  cm_running_ = false;
}

void VerbsDevice::CloseAllCmIds(bool listener) {
  std::vector<rdma_cm_id*> ids;
  {
    absl::MutexLock lock(&verbs_mu_);
    for (const auto& [id, connection] : by_cm_id_) ids.push_back(id);
  }
  for (rdma_cm_id* id : ids) CloseCmId(id);
  if (listener && adapter_->listen_id != nullptr) {
    rdma_destroy_id(adapter_->listen_id);
    adapter_->listen_id = nullptr;
  }
}

void VerbsDevice::RunCmCommands() {
  std::deque<CmCommand> commands;
  {
    absl::MutexLock lock(&verbs_mu_);
    commands.swap(cm_commands_);
  }
  for (const CmCommand& command : commands) {
    if (command.kind == CmCommand::Kind::kReleaseAll) {
      // The listener stays: its reference keeps librdmacm's context open
      // until ReleaseDevice has let go of everything else (another user of
      // librdmacm in this process could otherwise make it close the context
      // under our MRs), and ReleaseDevice destroys it.
      CloseAllCmIds(/*listener=*/false);
      absl::MutexLock lock(&verbs_mu_);
      cm_released_ = true;
      continue;
    }
    for (rdma_cm_id* id : command.ids) {
      bool known = false;
      {
        absl::MutexLock lock(&verbs_mu_);
        known = by_cm_id_.contains(id);
      }
      if (known) CloseCmId(id);  // not closed meanwhile
    }
  }
}

void VerbsDevice::HandleCmEvent(const CmEvent& event) {
  switch (event.type) {
    case RDMA_CM_EVENT_CONNECT_REQUEST:
      HandleConnectRequest(event);
      return;
    case RDMA_CM_EVENT_ESTABLISHED: {
      ConnectionId connection = 0;
      {
        absl::MutexLock lock(&verbs_mu_);
        auto it = by_cm_id_.find(event.id);
        if (it == by_cm_id_.end()) return;
        connection = it->second;
      }
      ConnectionEstablished(connection);
      return;
    }
    case RDMA_CM_EVENT_DISCONNECTED:
    case RDMA_CM_EVENT_CONNECT_ERROR:
    case RDMA_CM_EVENT_UNREACHABLE:
    case RDMA_CM_EVENT_REJECTED:
      LogDebug("verbs device: ", rdma_event_str(event.type), " (status ",
               event.status, ")");
      CloseCmId(event.id);
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

namespace {

// A connect request refused: the rejection's private data is the reason.
absl::Status Refused(absl::string_view data, absl::string_view why) {
  return MrdError(absl::StatusCode::kUnavailable, data, why);
}

}  // namespace

void VerbsDevice::HandleConnectRequest(const CmEvent& event) {
  rdma_cm_id* id = event.id;
  const std::string remote = FormatSockaddr(rdma_get_peer_addr(id));
  absl::StatusOr<Admitted> admitted = AdmitConnectRequest(event, remote);
  absl::Status status = admitted.status();
  if (status.ok()) status = CreateQueuePair(id, *admitted);
  if (!status.ok()) {
    const std::string data = GetErrorDetail(status).reason();
    LogInfo("verbs device: connect request from ", remote,
            " rejected: ", status.message());
    rdma_reject(id, data.data(), static_cast<uint8_t>(data.size()));
    rdma_destroy_id(id);
    return;
  }
  uint8_t reply[kAcceptPrivateDataBytes];
  PutLe64(reply, admitted->connection);
  PutLe64(reply + 8, adapter_->max_message_size);
  rdma_conn_param param{};
  param.private_data = reply;
  param.private_data_len = sizeof(reply);
  param.responder_resources = static_cast<uint8_t>(std::min<uint32_t>(
      event.responder_resources, adapter_->max_responder_resources));
  param.initiator_depth = static_cast<uint8_t>(
      std::min<uint32_t>(event.initiator_depth, adapter_->max_initiator_depth));
  param.rnr_retry_count = 7;
  if (rdma_accept(id, &param) != 0) {
    LogWarning("verbs device: rdma_accept for ", remote, ": ",
               std::strerror(errno));
    CloseCmId(id);
    return;
  }
  LogDebug("verbs device: accepted connection ", admitted->connection, " from ",
           remote, " (PD ", admitted->bound.pd, ", QP ", id->qp->qp_num, ")");
}

absl::StatusOr<VerbsDevice::Admitted> VerbsDevice::AdmitConnectRequest(
    const CmEvent& event, const std::string& remote) {
  if (event.id->verbs != adapter_->context) {
    return Refused("WRONG_DEVICE", "it arrived on another RDMA device");
  }
  size_t ticket_length =
      std::min(event.private_data.size(), kMaxConnectPrivateData);
  ticket_length = strnlen(event.private_data.data(), ticket_length);
  const std::string ticket = event.private_data.substr(0, ticket_length);
  {
    absl::MutexLock lock(&verbs_mu_);
    if (!lost_reason_.empty()) {
      return Refused("UNAVAILABLE", "the device is lost");
    }
    if (links_.size() >= options_.max_connections) {
      return Refused("TOO_MANY_CONNECTIONS",
                     absl::StrCat("the device has its maximum of ",
                                  options_.max_connections, " connections"));
    }
  }
  std::optional<ConnectionId> connection = NewConnection(remote);
  if (!connection.has_value()) {
    return Refused("UNAVAILABLE", "the device is shutting down");
  }
  absl::StatusOr<BindResult> bound =
      BindConnection(*connection, ticket, /*ready=*/false);
  if (!bound.ok()) {
    ConnectionClosed(*connection);
    return Refused(bound.status().code() == absl::StatusCode::kNotFound
                       ? kBadTicketRejectData
                       : "TOO_MANY_CONNECTIONS",
                   bound.status().message());
  }
  // Before the QP exists: a PD that dies meanwhile finds the connection
  // here and has the cm thread (this one, next) close it.
  absl::MutexLock lock(&verbs_mu_);
  links_[*connection].id = event.id;
  by_cm_id_.emplace(event.id, *connection);
  return Admitted{*connection, *bound};
}

absl::Status VerbsDevice::CreateQueuePair(rdma_cm_id* id,
                                          const Admitted& admitted) {
  // A small RC QP with its own CQ: mrd never posts on it; the adapter
  // answers the peer's READ/WRITE from the PD's MRs. The PD's state stays
  // until the connection is reported closed.
  ibv_cq* cq = ibv_create_cq(adapter_->context, 2, nullptr, nullptr, 0);
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
    ibv_pd* pd = static_cast<VerbsPd*>(admitted.bound.pd_state)->pd;
    created = rdma_create_qp(id, pd, &init) == 0;
  }
  if (!created) {
    const int err = errno;
    if (cq != nullptr) ibv_destroy_cq(cq);
    {
      absl::MutexLock lock(&verbs_mu_);
      links_.erase(admitted.connection);
      by_cm_id_.erase(id);
    }
    ConnectionClosed(admitted.connection);
    return Refused("NO_RESOURCES", absl::StrCat("creating the queue pair: ",
                                                std::strerror(err)));
  }
  absl::MutexLock lock(&verbs_mu_);
  Link& link = links_[admitted.connection];
  link.cq = cq;
  link.qp_num = id->qp->qp_num;
  by_qp_num_.emplace(link.qp_num, admitted.connection);
  return absl::OkStatus();
}

void VerbsDevice::CloseCmId(rdma_cm_id* id) {
  ConnectionId connection = 0;
  Link link;
  {
    absl::MutexLock lock(&verbs_mu_);
    auto by_id = by_cm_id_.find(id);
    if (by_id != by_cm_id_.end()) {
      connection = by_id->second;
      by_cm_id_.erase(by_id);
      auto it = links_.find(connection);
      link = it->second;
      links_.erase(it);
      if (link.cq != nullptr) by_qp_num_.erase(link.qp_num);
    }
  }
  if (link.cq != nullptr) {
    rdma_disconnect(id);  // harmless when the peer already disconnected
    rdma_destroy_qp(id);
    ibv_destroy_cq(link.cq);
  }
  rdma_destroy_id(id);
  // After the QP is gone: the PD may be deallocated once the model hears
  // this.
  if (connection != 0) {
    ConnectionClosed(connection);
    LogDebug("verbs device: connection ", connection, " closed");
  }
}

// ---------------------------------------------------------------------------
// Device loss.

void VerbsDevice::LoseDevice(const std::string& reason) {
  {
    absl::MutexLock lock(&verbs_mu_);
    if (!lost_reason_.empty()) return;
    lost_reason_ = reason;  // from here ProviderUsable fails
    LogError("verbs device ", Attributes().name, " lost: ", reason,
             "; releasing everything on it");
    CmCommand command;
    command.kind = CmCommand::Kind::kReleaseAll;
    CommandCmLocked(std::move(command));
    Wake(async_wake_.get());
  }
  MarkAllConnectionsError();
}

void VerbsDevice::ReleaseDevice() {
  {
    // Every id is closed (so every QP and CQ is gone) before the PDs go.
    absl::MutexLock lock(&verbs_mu_);
    verbs_mu_.Await(absl::Condition(
        +[](VerbsDevice* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(d->verbs_mu_) {
          return d->cm_released_ || !d->cm_running_;
        },
        this));
  }
  // Then no verbs call on a PD's objects is in progress; new ones are
  // refused (DEVICE_LOST).
  Taken taken = TakeAllProviderState();
  uint64_t unpinned = 0;
  for (const std::unique_ptr<ProviderState>& state : taken.memory) {
    const Memory& memory = *static_cast<Memory*>(state.get());
    if (ReleaseMemory(memory).ok()) unpinned += memory.pinned;
  }
  for (const std::unique_ptr<ProviderState>& state : taken.pds) {
    if (int rc = ibv_dealloc_pd(static_cast<VerbsPd*>(state.get())->pd);
        rc != 0) {
      LogError("verbs device: ibv_dealloc_pd after device loss: ",
               std::strerror(rc));
    }
  }
  // The listener last (see kReleaseAll): then nothing of ours is left on
  // the device. librdmacm closes its context once it notices the device is
  // gone, which a device list sync does. The cm thread no longer touches
  // the listener once cm_released_ is set.
  if (adapter_->listen_id != nullptr) {
    rdma_destroy_id(adapter_->listen_id);
    adapter_->listen_id = nullptr;
  }
  int count = 0;
  if (ibv_context** list = rdma_get_devices(&count); list != nullptr) {
    rdma_free_devices(list);
  }
  absl::MutexLock lock(&verbs_mu_);
  pinned_bytes_ -= unpinned;
  released_ = true;
  LogInfo("verbs device ", Attributes().name, ": released after the loss (",
          taken.memory.size(), " registrations, ", taken.pds.size(), " PDs)");
}

// ---------------------------------------------------------------------------
// Async events.

void VerbsDevice::FailLinks(const std::vector<ConnectionId>& connections,
                            const std::string& why) {
  std::vector<ConnectionId> failed;
  {
    absl::MutexLock lock(&verbs_mu_);
    CmCommand command;
    for (ConnectionId connection : connections) {
      auto it = links_.find(connection);
      if (it == links_.end() || it->second.error) continue;
      it->second.error = true;
      LogInfo("verbs device: connection ", connection, " in error: ", why);
      command.ids.push_back(it->second.id);
      failed.push_back(connection);
    }
    if (!command.ids.empty()) CommandCmLocked(std::move(command));
  }
  for (ConnectionId connection : failed) ConnectionError(connection);
}

void VerbsDevice::AsyncLoop() {
  bool readable = true;  // false once the device is lost
  while (true) {
    bool release = false;
    {
      absl::MutexLock lock(&verbs_mu_);
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
      if (ibv_get_async_event(adapter_->context, &event) != 0) {
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
    WaitReadable(readable ? adapter_->context->async_fd : -1,
                 async_wake_.get());
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
      std::vector<ConnectionId> failed;
      {
        absl::MutexLock lock(&verbs_mu_);
        auto it = by_qp_num_.find(event.qp_num);
        if (it == by_qp_num_.end()) return;
        failed.push_back(it->second);
      }
      FailLinks(failed, name);
      return;
    }
    case IBV_EVENT_CQ_ERR: {
      std::vector<ConnectionId> failed;
      {
        absl::MutexLock lock(&verbs_mu_);
        for (const auto& [connection, link] : links_) {
          if (link.cq == event.cq) failed.push_back(connection);
        }
      }
      FailLinks(failed, name);
      return;
    }
    case IBV_EVENT_DEVICE_FATAL:
      LoseDevice("fatal device error (IBV_EVENT_DEVICE_FATAL)");
      return;
    case IBV_EVENT_PORT_ERR:
      if (event.port_num == adapter_->port_num) {
        absl::MutexLock lock(&verbs_mu_);
        port_problem_ =
            absl::StrCat("port ", event.port_num, " is down (", name, ")");
        LogWarning("verbs device ", Attributes().name, ": ", port_problem_);
      }
      return;
    case IBV_EVENT_PORT_ACTIVE:
      if (event.port_num == adapter_->port_num) {
        absl::MutexLock lock(&verbs_mu_);
        if (!port_problem_.empty()) {
          LogInfo("verbs device ", Attributes().name, ": port ", event.port_num,
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
      LogInfo("verbs device ", Attributes().name, ": async event ", name);
      return;
  }
}

}  // namespace mrd::device
