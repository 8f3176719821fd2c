#include "server/device/verbs/verbs_device.h"

#include <fcntl.h>
#include <netdb.h>
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
#include "server/device/verbs/verbs_internal.h"
#include "server/device/verbs/verbs_sysfs.h"

namespace mrd::device {
namespace {

constexpr int kWriteAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
// Logical addresses: the same layout as the software device's (random start
// in [4 GiB, 68 GiB) for 4 KiB pages, guard gaps, well below 2^56).
constexpr uint64_t kIovaFloorPages = uint64_t{1} << 20;
constexpr uint64_t kIovaSpreadPages = uint64_t{1} << 24;
constexpr uint64_t kIovaLimit = uint64_t{1} << 56;
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

absl::Status SetNonBlocking(int fd, absl::string_view what) {
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    return ErrnoError(errno, absl::StrCat("fcntl(O_NONBLOCK) on ", what),
                      "VERBS_SETUP_FAILED");
  }
  return absl::OkStatus();
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
  model.connection_id_base = options.connection_id_base;
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
      verbs_internal::FormatSockaddr(rdma_get_local_addr(adapter->listen_id));
  // The GID peers address: the one rdma_cm bound the listener to, else the
  // port's first.
  ibv_gid gid = adapter->listen_id->route.addr.addr.ibaddr.sgid;
  if (gid.global.subnet_prefix == 0 && gid.global.interface_id == 0) {
    if (int rc = ibv_query_gid(adapter->context, adapter->port_num, 0, &gid);
        rc != 0) {
      gid = ibv_gid{};
    }
  }
  adapter->attributes.gid = verbs_internal::FormatGid(gid.raw);
  adapter->attributes.lid = port.lid;
  adapter->attributes.link_layer = LinkLayerName(port.link_layer);
  adapter->attributes.numa_node = VerbsDeviceNumaNode(name);
  adapter->attributes.pci_address = VerbsDevicePciAddress(name);
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

absl::Status VerbsDevice::ProviderCanHandOver() const {
  return MrdError(
      absl::StatusCode::kFailedPrecondition, "HANDOVER_UNSUPPORTED_DEVICE",
      absl::StrCat("the verbs device ", Attributes().name,
                   " cannot hand over: its PDs, MRs and queue pairs cannot "
                   "outlive this process (importing them into another "
                   "process with ibv_import_device is refused, EOPNOTSUPP, "
                   "and the adapter picks an MR's keys itself)"));
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
  verbs_internal::Wake(cm_wake_.get());
  cm_thread.Join();
  Thread async_thread;
  {
    absl::MutexLock lock(&verbs_mu_);
    async_stop_ = true;  // after a device release in progress
    async_thread = std::move(async_thread_);
  }
  verbs_internal::Wake(async_wake_.get());
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

}  // namespace mrd::device
