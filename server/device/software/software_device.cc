#include "server/device/software/software_device.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "mrd/peer_frame.h"
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
// Room in a request frame for everything but the WRITE payload.
constexpr uint32_t kRequestOverheadBytes = 1024;
// Before hello only a small frame is read: an unauthenticated peer must not
// make the device buffer max_message_size bytes.
constexpr uint32_t kHelloFrameBytes = 4096;
constexpr uint64_t kMaxMessageSizeLimit = uint64_t{1} << 30;
// Logical addresses start at a random page in [4 GiB, 68 GiB) (4 KiB pages)
// and end well below 2^56, so no logical address is 0 or near a wrap.
constexpr uint64_t kIovaFloorPages = uint64_t{1} << 20;
constexpr uint64_t kIovaSpreadPages = uint64_t{1} << 24;
constexpr uint64_t kIovaLimit = uint64_t{1} << 56;
constexpr uint64_t kMaxGuardPages = 16;
// Key-table owner tag of LAM privileged keys (L9); MR ids never have it.
constexpr uint64_t kLamKeyOwnerTag = uint64_t{1} << 63;
constexpr size_t kTicketBytes = 16;  // 128-bit secret

std::string Hex(uint64_t value) { return absl::StrCat("0x", absl::Hex(value)); }

absl::Status InvalidParameter(absl::string_view reason,
                              absl::string_view message) {
  return SeedError(STATUS_INVALID_PARAMETER, reason, message);
}

absl::Status UnknownMr(MrId mr) {
  return MrdError(absl::StatusCode::kNotFound, "UNKNOWN_MR",
                  absl::StrCat("no memory region ", mr));
}

absl::Status IoError(absl::string_view call, int err, uint64_t offset) {
  return MrdError(
      absl::StatusCode::kInternal, "BACKING_IO_FAILED",
      absl::StrCat(call, " at file offset ", offset, ": ", std::strerror(err)));
}

}  // namespace

// All fields of the structs below are guarded by SoftwareDevice::mu_ unless
// marked immutable.

struct SoftwareDevice::Pd {
  PdId id = 0;                    // immutable
  PdEventSink* sink = nullptr;    // immutable
  bool dying = false;             // DeallocatePd has begun
  int busy = 0;                   // see BeginPdOp
  absl::flat_hash_set<MrId> mrs;  // normal and fast-register MRs
  absl::flat_hash_set<LamId> lams;
  absl::flat_hash_set<ConnectionId> connections;  // bound by hello
  std::vector<std::string> tickets;
};

// Where the bytes of one host page live: what fast registration maps.
struct PageRef {
  int fd = -1;
  uint64_t file_offset = 0;
};

struct SoftwareDevice::Mr {
  MrId id = 0;                // immutable
  PdId pd = 0;                // immutable
  bool fast = false;          // immutable: a fast-register MR object (C1)
  bool allow_remote = false;  // immutable, fast only (F4)
  uint32_t max_pages = 0;     // immutable, fast only
  uint32_t key = 0;           // lkey == rkey
  bool revoking = false;      // being destroyed: treat as gone
  bool valid = false;         // registered / fast-registered: peers may use it
  uint64_t base = 0;
  uint64_t length = 0;
  uint32_t access = 0;
  MemorySpan span;   // normal MRs: the registered memory
  uint32_t fbo = 0;  // fast-registered: the mapping
  std::vector<PageRef> pages;
  std::vector<LamId> lams;  // distinct LAMs the mapping holds a ref on
  int inflight = 0;         // peer ops inside the mapping now
};

struct SoftwareDevice::Lam {
  LamId id = 0;
  PdId pd = 0;
  MemorySpan span;
  uint32_t fbo = 0;
  uint64_t iova = 0;  // logical address of the first page
  uint64_t page_count = 0;
  uint32_t fr_users = 0;  // fast-registered MRs mapping any of its pages
  uint32_t key = 0;       // L9 privileged key: local only, never on the wire
};

struct SoftwareDevice::Connection {
  enum class State { kHandshake, kReady, kError, kClosed };
  ConnectionId id = 0;  // immutable
  int fd = -1;          // immutable; the listener closes it after removal
  std::string remote;   // immutable
  State state = State::kHandshake;
  PdId pd = 0;                // set by hello
  std::deque<Work> deferred;  // kWorkDefer work held back
  // Not guarded: touched only by the connection's frame handler, which the
  // listener runs one frame at a time (its queue orders the accesses).
  bool said_hello = false;
};

struct SoftwareDevice::IoSegment {
  int fd = -1;
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct SoftwareDevice::ResolvedPages {
  std::vector<PageRef> pages;
  std::vector<LamId> lams;  // distinct
};

namespace {

// pread/pwrite of a plan, outside the device mutex. Errors name the cause;
// the caller answers REMOTE_ACCESS_ERROR whatever it is.
template <typename Segment>
absl::Status ReadSegments(const std::vector<Segment>& plan, char* out) {
  for (const Segment& segment : plan) {
    uint64_t done = 0;
    while (done < segment.length) {
      uint64_t offset = segment.offset + done;
      ssize_t n = ::pread(segment.fd, out, segment.length - done,
                          static_cast<off_t>(offset));
      if (n < 0) {
        int err = errno;
        if (err == EINTR) continue;
        return IoError("pread", err, offset);
      }
      if (n == 0) {
        return MrdError(absl::StatusCode::kOutOfRange, "BACKING_FILE_SHORT",
                        absl::StrCat("backing file ends before offset ", offset,
                                     " (truncated?)"));
      }
      done += static_cast<uint64_t>(n);
      out += n;
    }
  }
  return absl::OkStatus();
}

template <typename Segment>
absl::Status WriteSegments(const std::vector<Segment>& plan, const char* in) {
  for (const Segment& segment : plan) {
    // pwrite past the end would silently grow a truncated file; a NIC
    // writing to memory that is gone fails, and so does this.
    struct stat st {};
    if (::fstat(segment.fd, &st) != 0) {
      return IoError("fstat", errno, segment.offset);
    }
    uint64_t size = static_cast<uint64_t>(st.st_size);
    if (size < segment.offset || size - segment.offset < segment.length) {
      return MrdError(
          absl::StatusCode::kOutOfRange, "BACKING_FILE_SHORT",
          absl::StrCat("backing file is ", size, " bytes, write needs ",
                       segment.offset + segment.length, " (truncated?)"));
    }
    uint64_t done = 0;
    while (done < segment.length) {
      uint64_t offset = segment.offset + done;
      ssize_t n = ::pwrite(segment.fd, in, segment.length - done,
                           static_cast<off_t>(offset));
      if (n < 0) {
        int err = errno;
        if (err == EINTR) continue;
        return IoError("pwrite", err, offset);
      }
      done += static_cast<uint64_t>(n);
      in += n;
    }
  }
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------------------
// Creation, lifecycle.

absl::StatusOr<std::unique_ptr<SoftwareDevice>> SoftwareDevice::Create(
    const SoftwareDeviceOptions& options) {
  auto bad = [](absl::string_view what) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_OPTION",
                    absl::StrCat("software device option ", what));
  };
  if (options.max_mr_size == 0) return bad("max_mr_size must be > 0");
  if (options.max_page_list_length == 0) {
    return bad("max_page_list_length must be > 0");
  }
  if (options.max_keys == 0 || options.max_keys > KeyTable::kMaxSlots) {
    return bad(absl::StrCat("max_keys must be in [1, ", KeyTable::kMaxSlots,
                            "], got ", options.max_keys));
  }
  if (options.key_chunk_slots == 0) {
    return bad("key_chunk_slots must be > 0");
  }
  if (options.max_message_size == 0 ||
      options.max_message_size > kMaxMessageSizeLimit) {
    return bad(absl::StrCat("max_message_size must be in [1, ",
                            kMaxMessageSizeLimit, "], got ",
                            options.max_message_size));
  }
  if (options.max_session_connections == 0) {
    return bad("max_session_connections must be > 0");
  }

  long page_size = sysconf(_SC_PAGESIZE);
  if (page_size <= 0) return ErrnoError(errno, "sysconf", "PAGE_SIZE_UNKNOWN");
  uint64_t ps = static_cast<uint64_t>(page_size);

  PeerListenerOptions peer;
  peer.max_connections = options.max_connections;
  peer.max_unauthenticated = options.max_unauthenticated_connections;
  peer.hello_timeout = options.peer_hello_timeout;
  peer.stall_timeout = options.peer_stall_timeout;
  peer.buffer_bytes = options.peer_buffer_bytes;
  peer.workers = options.peer_workers;
  peer.hello_frame_bytes = kHelloFrameBytes;
  peer.max_frame_bytes =
      static_cast<uint32_t>(options.max_message_size) + kRequestOverheadBytes;
  peer.fault_points = options.fault_points;
  MRD_ASSIGN_OR_RETURN(std::unique_ptr<PeerListener> listener,
                       PeerListener::Bind(options.peer_listen_address, peer));
  uint64_t pick = 0;
  MRD_RETURN_IF_ERROR(SecureRandomBytes(&pick, sizeof(pick)));
  uint64_t iova_start = (kIovaFloorPages + pick % kIovaSpreadPages) * ps;
  std::unique_ptr<KernelPinOps> own_pin_ops;
  if (options.pin_ops == nullptr) {
    MRD_ASSIGN_OR_RETURN(own_pin_ops,
                         KernelPinOps::Create(options.pin_options, true));
  }
  return std::unique_ptr<SoftwareDevice>(new SoftwareDevice(
      options, ps, std::move(listener), iova_start, std::move(own_pin_ops)));
}

SoftwareDevice::SoftwareDevice(const SoftwareDeviceOptions& options,
                               uint64_t page_size,
                               std::unique_ptr<PeerListener> listener,
                               uint64_t iova_start,
                               std::unique_ptr<KernelPinOps> own_pin_ops)
    : options_(options),
      page_size_(page_size),
      own_pin_ops_(std::move(own_pin_ops)),
      pins_(page_size,
            options.pin_ops != nullptr ? options.pin_ops : own_pin_ops_.get(),
            options.fault_points),
      listener_(std::move(listener)),
      keys_(options.max_keys, &random_, options.fault_points,
            options.key_chunk_slots),
      iova_(page_size, iova_start, kIovaLimit / page_size * page_size,
            options.fault_points) {
  attributes_.name = "software";
  attributes_.kind = "software";
  attributes_.shares_pins = true;  // PinTracker: page refcounts
  attributes_.page_size = page_size;
  attributes_.max_mr_size = options.max_mr_size;
  attributes_.max_page_list_length = options.max_page_list_length;
  // Software moves bytes with pread/pwrite: any registered memory can be
  // the sink of a read, so RDMA_READ_SINK is never needed (R9).
  attributes_.adapter_flags = kAdapterFlagReadSinkNotRequired;
  attributes_.peer_address = listener_->address();
}

SoftwareDevice::~SoftwareDevice() {
  Shutdown();
  std::vector<PdId> left;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, pd] : pds_) left.push_back(id);
  }
  for (PdId pd : left) (void)DeallocatePd(pd);
}

DeviceHealth SoftwareDevice::Health() const {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return {false, "software device is shut down"};
  if (!started_) return {false, "software device is not started"};
  return {true,
          absl::StrCat("software device, peers at ", attributes_.peer_address)};
}

uint64_t SoftwareDevice::PinnedBytes() const { return pins_.PinnedBytes(); }

absl::Status SoftwareDevice::Start() {
  {
    absl::MutexLock lock(&mu_);
    if (started_ || shut_down_) {
      return MrdError(absl::StatusCode::kFailedPrecondition, "ALREADY_STARTED",
                      "the software device was started or shut down before");
    }
    MRD_RETURN_IF_ERROR(FaultPoint(options_.fault_points, "thread.create"));
    MRD_ASSIGN_OR_RETURN(
        worker_, Thread::Start("mrd-soft-work", [this] { WorkerLoop(); }));
    started_ = true;
  }
  PeerListener::Handler handler;
  handler.open = [this](int fd, const std::string& remote) {
    return std::static_pointer_cast<void>(OpenConnection(fd, remote));
  };
  handler.frame = [this](const std::shared_ptr<void>& context,
                         absl::StatusOr<std::string> body, std::string* out) {
    return HandleFrame(std::static_pointer_cast<Connection>(context),
                       std::move(body), out);
  };
  handler.close = [this](const std::shared_ptr<void>& context) {
    CloseConnection(std::static_pointer_cast<Connection>(context));
  };
  absl::Status status = listener_->Start(std::move(handler));
  if (!status.ok()) {
    // No peer can ever connect: stop the worker again, so that the device
    // is cleanly shut down rather than half started.
    Shutdown();
  }
  return status;
}

void SoftwareDevice::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;  // from here OpenConnection refuses new connections
  }
  // Closes the listener, then every connection (CloseConnection queues
  // their flushes and disconnects), after the frames being handled.
  listener_->Stop();
  Thread worker;
  {
    absl::MutexLock lock(&mu_);
    // The worker drains what the closing connections queued (flushes,
    // disconnects): their PDs, and so their sinks, are still alive.
    worker_stop_ = true;
    worker = std::move(worker_);
  }
  worker.Join();
}

// ---------------------------------------------------------------------------
// Protection domains.

absl::StatusOr<SoftwareDevice::Pd*> SoftwareDevice::FindPdLocked(PdId pd) {
  auto it = pds_.find(pd);
  if (it == pds_.end() || it->second->dying) {
    return MrdError(absl::StatusCode::kNotFound, "UNKNOWN_PD",
                    absl::StrCat("no protection domain ", pd));
  }
  return it->second.get();
}

absl::Status SoftwareDevice::BeginPdOp(PdId pd) {
  absl::MutexLock lock(&mu_);
  MRD_ASSIGN_OR_RETURN(Pd * found, FindPdLocked(pd));
  ++found->busy;
  return absl::OkStatus();
}

void SoftwareDevice::EndPdOp(PdId pd) {
  absl::MutexLock lock(&mu_);
  EndPdOpLocked(pd);
}

void SoftwareDevice::EndPdOpLocked(PdId pd) {
  // DeallocatePd waits for busy == 0 before erasing, so the PD is here.
  auto it = pds_.find(pd);
  MRD_CHECK(it != pds_.end() && it->second->busy > 0);
  --it->second->busy;
}

absl::StatusOr<PdId> SoftwareDevice::AllocatePd(PdEventSink* sink) {
  if (sink == nullptr) {
    return MrdError(absl::StatusCode::kInvalidArgument, "NULL_SINK",
                    "AllocatePd needs an event sink");
  }
  MRD_RETURN_IF_ERROR(FaultPoint(options_.fault_points, "pd.allocate"));
  absl::MutexLock lock(&mu_);
  auto pd = std::make_unique<Pd>();
  pd->id = next_pd_++;
  pd->sink = sink;
  PdId id = pd->id;
  pds_.emplace(id, std::move(pd));
  return id;
}

absl::Status SoftwareDevice::DeallocatePd(PdId pd_id) {
  std::vector<MemorySpan> unpin;
  {
    absl::MutexLock lock(&mu_);
    MRD_ASSIGN_OR_RETURN(Pd * pd, FindPdLocked(pd_id));
    // From here new calls naming the PD fail, hellos with its tickets fail,
    // and the worker drops its queued tasks.
    pd->dying = true;
    for (const std::string& ticket : pd->tickets) tickets_.erase(ticket);
    pd->tickets.clear();
    for (ConnectionId id : pd->connections) {
      auto it = connections_.find(id);
      if (it == connections_.end()) continue;
      Connection& connection = *it->second;
      connection.state = Connection::State::kClosed;
      connection.deferred.clear();
      ::shutdown(connection.fd, SHUT_RDWR);
    }
    pd->connections.clear();
    // Pins in progress, teardowns and sink calls finish first: after this
    // the PD's objects are ours alone (peers in flight aside).
    mu_.Await(absl::Condition(
        +[](const Pd* p) { return p->busy == 0; }, static_cast<const Pd*>(pd)));
    std::vector<MrId> mrs(pd->mrs.begin(), pd->mrs.end());
    for (MrId id : mrs) {
      auto it = mrs_.find(id);
      if (it == mrs_.end()) continue;
      MemorySpan span = DestroyMrLocked(it->second);  // copies the pointer
      if (span.length > 0) unpin.push_back(span);
    }
    for (LamId id : pd->lams) {
      auto it = lams_.find(id);
      if (it == lams_.end()) continue;
      // Every MR of the PD is gone, so no fast registration maps it.
      MRD_CHECK(it->second->fr_users == 0);
      iova_.Free(it->second->iova);
      keys_.Release(it->second->key);
      unpin.push_back(it->second->span);
      lams_.erase(it);
    }
    pds_.erase(pd_id);
  }
  for (const MemorySpan& span : unpin) {
    pins_.Unpin(reinterpret_cast<uint64_t>(span.host_address), span.length);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SoftwareDevice::CreatePeerTicket(PdId pd_id) {
  MRD_RETURN_IF_ERROR(FaultPoint(options_.fault_points, "random.ticket"));
  MRD_ASSIGN_OR_RETURN(std::string ticket, SecureRandomHex(kTicketBytes));
  absl::MutexLock lock(&mu_);
  MRD_ASSIGN_OR_RETURN(Pd * pd, FindPdLocked(pd_id));
  MRD_RETURN_IF_ERROR(FaultPoint(options_.fault_points, "ticket.insert"));
  tickets_.emplace(ticket, pd_id);
  pd->tickets.push_back(ticket);
  return ticket;
}

// ---------------------------------------------------------------------------
// Memory regions.

absl::Status SoftwareDevice::ValidateSpan(const MemorySpan& span,
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
  if (span.length > options_.max_mr_size) {
    return InvalidParameter("LENGTH_OVER_MAX_MR_SIZE",
                            absl::StrCat(call, ": length ", span.length,
                                         " exceeds the device's max_mr_size ",
                                         options_.max_mr_size));
  }
  uint64_t host = reinterpret_cast<uint64_t>(span.host_address);
  uint64_t end = 0;
  uint64_t file_end = 0;
  // pread/pwrite take a signed off_t: the whole span must stay below it.
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

absl::StatusOr<MrKeys> SoftwareDevice::RegisterMr(PdId pd,
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
  MRD_RETURN_IF_ERROR(BeginPdOp(pd));
  absl::StatusOr<MrKeys> keys = RegisterPinned(pd, span, base_address, access);
  EndPdOp(pd);
  return keys;
}

absl::StatusOr<MrKeys> SoftwareDevice::RegisterPinned(PdId pd_id,
                                                      const MemorySpan& span,
                                                      uint64_t base_address,
                                                      uint32_t access) {
  const uint64_t host = reinterpret_cast<uint64_t>(span.host_address);
  MRD_RETURN_IF_ERROR(pins_.Pin(host, span.length));
  absl::StatusOr<MrKeys> keys = [&]() -> absl::StatusOr<MrKeys> {
    absl::MutexLock lock(&mu_);
    MRD_ASSIGN_OR_RETURN(Pd * pd, FindPdLocked(pd_id));
    auto mr = std::make_shared<Mr>();
    mr->id = next_mr_++;
    MRD_ASSIGN_OR_RETURN(mr->key, keys_.Allocate(mr->id));
    if (absl::Status s = FaultPoint(options_.fault_points, "mr.insert");
        !s.ok()) {
      keys_.Release(mr->key);
      return s;
    }
    mr->pd = pd_id;
    mr->valid = true;
    mr->base = base_address;
    mr->length = span.length;
    mr->access = access;
    mr->span = span;
    pd->mrs.insert(mr->id);
    MrKeys result{mr->id, mr->key, mr->key};
    mrs_.emplace(mr->id, std::move(mr));
    return result;
  }();
  if (!keys.ok()) pins_.Unpin(host, span.length);
  return keys;
}

absl::StatusOr<std::shared_ptr<SoftwareDevice::Mr>>
SoftwareDevice::FindMrLocked(MrId mr) const {
  auto it = mrs_.find(mr);
  if (it == mrs_.end() || it->second->revoking) return UnknownMr(mr);
  auto pd = pds_.find(it->second->pd);
  // A dying PD's objects belong to DeallocatePd now.
  if (pd == pds_.end() || pd->second->dying) return UnknownMr(mr);
  return it->second;
}

std::vector<LamId> SoftwareDevice::UnmapLocked(const std::shared_ptr<Mr>& mr) {
  mr->valid = false;
  std::vector<LamId> lams = std::move(mr->lams);
  mr->lams.clear();
  mr->pages.clear();
  // `mr` is a shared_ptr held by our caller, so the object outlives this
  // wait even if another thread erases it from mrs_ meanwhile.
  mu_.Await(absl::Condition(
      +[](const Mr* m) { return m->inflight == 0; },
      static_cast<const Mr*>(mr.get())));
  return lams;
}

void SoftwareDevice::DropLamRefsLocked(const std::vector<LamId>& lams) {
  for (LamId id : lams) {
    auto it = lams_.find(id);
    // A LAM is never released while fr_users > 0.
    MRD_CHECK(it != lams_.end() && it->second->fr_users > 0);
    --it->second->fr_users;
  }
}

MemorySpan SoftwareDevice::DestroyMrLocked(std::shared_ptr<Mr> mr) {
  // `mr` is our own reference: UnmapLocked releases the mutex while it
  // waits, and the map slot it came from may move or go meanwhile.
  const MrId id = mr->id;
  // The key stops matching before anything else: a peer that looks it up
  // from now on fails, and one already inside is waited for below.
  mr->revoking = true;
  keys_.Release(mr->key);
  DropLamRefsLocked(UnmapLocked(mr));
  auto pd = pds_.find(mr->pd);
  if (pd != pds_.end()) pd->second->mrs.erase(id);
  mrs_.erase(id);
  return mr->fast ? MemorySpan{} : mr->span;
}

absl::Status SoftwareDevice::DeregisterMr(MrId mr_id) {
  MemorySpan span;
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
    ++pds_.find(pd)->second->busy;  // until unpinned
    span = DestroyMrLocked(mr);
  }
  pins_.Unpin(reinterpret_cast<uint64_t>(span.host_address), span.length);
  EndPdOp(pd);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Logical address mappings.

absl::StatusOr<LogicalMapping> SoftwareDevice::BuildLam(
    PdId pd, const MemorySpan& span) {
  MRD_RETURN_IF_ERROR(ValidateSpan(span, "BuildLam"));
  uint64_t host = reinterpret_cast<uint64_t>(span.host_address);
  // The host page and the file page must line up, as they do in any mmap;
  // otherwise a logical page would not correspond to one file page.
  if (span.file_offset % page_size_ != host % page_size_) {
    return InvalidParameter(
        "SPAN_MISALIGNED",
        absl::StrCat("BuildLam: host address ", Hex(host), " and file offset ",
                     span.file_offset,
                     " are at different offsets within a page"));
  }
  MRD_RETURN_IF_ERROR(BeginPdOp(pd));
  absl::StatusOr<LogicalMapping> mapping = MapPinned(pd, span);
  EndPdOp(pd);
  return mapping;
}

absl::StatusOr<LogicalMapping> SoftwareDevice::MapPinned(
    PdId pd_id, const MemorySpan& span) {
  const uint64_t host = reinterpret_cast<uint64_t>(span.host_address);
  const uint32_t fbo = static_cast<uint32_t>(host % page_size_);
  const uint64_t page_count = (fbo + span.length + page_size_ - 1) / page_size_;
  // L7: on any failure below, nothing stays pinned or mapped.
  MRD_RETURN_IF_ERROR(pins_.Pin(host, span.length));
  absl::StatusOr<LogicalMapping> mapping =
      [&]() -> absl::StatusOr<LogicalMapping> {
    absl::MutexLock lock(&mu_);
    MRD_ASSIGN_OR_RETURN(Pd * pd, FindPdLocked(pd_id));
    MRD_RETURN_IF_ERROR(FaultPoint(options_.fault_points, "random.iova_guard"));
    MRD_ASSIGN_OR_RETURN(uint64_t pick, random_.Uint64());
    auto lam = std::make_unique<Lam>();
    lam->id = next_lam_++;
    MRD_ASSIGN_OR_RETURN(
        lam->iova,
        iova_.Allocate(page_count, 1 + pick % kMaxGuardPages, lam->id));
    // Key-table owners are MR ids; a LAM's key is owned by a tagged id so
    // that no peer lookup can ever resolve it to an MR (L9).
    absl::StatusOr<uint32_t> key = keys_.Allocate(kLamKeyOwnerTag | lam->id);
    if (!key.ok()) {
      iova_.Free(lam->iova);
      return key.status();
    }
    if (absl::Status s = FaultPoint(options_.fault_points, "lam.insert");
        !s.ok()) {
      keys_.Release(*key);
      iova_.Free(lam->iova);
      return s;
    }
    lam->key = *key;
    lam->pd = pd_id;
    lam->span = span;
    lam->fbo = fbo;
    lam->page_count = page_count;
    LogicalMapping result;
    result.lam = lam->id;
    result.fbo = fbo;
    result.privileged_key = lam->key;
    result.pages.reserve(page_count);
    for (uint64_t i = 0; i < page_count; ++i) {
      result.pages.push_back(lam->iova + i * page_size_);
    }
    pd->lams.insert(lam->id);
    lams_.emplace(lam->id, std::move(lam));
    return result;
  }();
  if (!mapping.ok()) pins_.Unpin(host, span.length);
  return mapping;
}

absl::Status SoftwareDevice::ReleaseLam(LamId lam_id) {
  MemorySpan span;
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
    ++pd.busy;  // until unpinned
    pd.lams.erase(lam_id);
    iova_.Free(lam.iova);
    keys_.Release(lam.key);
    span = lam.span;
    lams_.erase(it);
  }
  pins_.Unpin(reinterpret_cast<uint64_t>(span.host_address), span.length);
  EndPdOp(pd_id);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Fast registration.

absl::StatusOr<MrKeys> SoftwareDevice::AllocateFastRegisterMr(
    PdId pd_id, bool allow_remote, uint32_t max_pages) {
  if (max_pages == 0 || max_pages > options_.max_page_list_length) {
    return InvalidParameter(
        "BAD_MAX_PAGES",
        absl::StrCat("AllocateFastRegisterMr: max_pages ", max_pages,
                     " is not in [1, ", options_.max_page_list_length, "]"));
  }
  absl::MutexLock lock(&mu_);
  MRD_ASSIGN_OR_RETURN(Pd * pd, FindPdLocked(pd_id));
  auto mr = std::make_shared<Mr>();
  mr->id = next_mr_++;
  // The key exists from the start, as an MR object's does, but matches
  // nothing until a fast registration makes the MR valid.
  MRD_ASSIGN_OR_RETURN(mr->key, keys_.Allocate(mr->id));
  if (absl::Status s = FaultPoint(options_.fault_points, "mr.insert");
      !s.ok()) {
    keys_.Release(mr->key);
    return s;
  }
  mr->pd = pd_id;
  mr->fast = true;
  mr->allow_remote = allow_remote;
  mr->max_pages = max_pages;
  pd->mrs.insert(mr->id);
  MrKeys result{mr->id, mr->key, mr->key};
  mrs_.emplace(mr->id, std::move(mr));
  return result;
}

absl::Status SoftwareDevice::FreeFastRegisterMr(MrId mr_id) {
  absl::MutexLock lock(&mu_);
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Mr> mr, FindMrLocked(mr_id));
  if (!mr->fast) {
    return MrdError(absl::StatusCode::kInvalidArgument, "WRONG_MR_KIND",
                    absl::StrCat("MR ", mr_id,
                                 " is a registered MR: deregister it with "
                                 "DeregisterMr"));
  }
  PdId pd = mr->pd;
  ++pds_.find(pd)->second->busy;  // DestroyMrLocked may wait for peers
  DestroyMrLocked(mr);
  EndPdOpLocked(pd);
  return absl::OkStatus();
}

absl::StatusOr<MrKeys> SoftwareDevice::QueryMr(MrId mr_id) const {
  absl::MutexLock lock(&mu_);
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Mr> mr, FindMrLocked(mr_id));
  return MrKeys{mr->id, mr->key, mr->key};
}

absl::StatusOr<SoftwareDevice::ResolvedPages>
SoftwareDevice::ResolvePagesLocked(PdId pd,
                                   const std::vector<uint64_t>& pages) const {
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
    // Pages of another PD read exactly like unmapped ones: the caller learns
    // nothing about other sessions' mappings (W8).
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

absl::StatusOr<SoftwareDevice::Connection*>
SoftwareDevice::FindPostConnectionLocked(ConnectionId connection,
                                         PdId pd) const {
  auto it = connections_.find(connection);
  // Unknown, closing, failed and other-PD connections all read the same:
  // which one it was is none of this PD's business.
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

void SoftwareDevice::ReleaseDeferredLocked(Connection& connection) {
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

uint64_t SoftwareDevice::EnqueueLocked(Connection& connection, Work work) {
  work.id = next_work_++;
  uint64_t id = work.id;
  if ((work.flags & kWorkDefer) != 0) {
    connection.deferred.push_back(std::move(work));
    return id;
  }
  // Deferred work goes to the "hardware" with the next non-deferred work,
  // ahead of it, in post order.
  ReleaseDeferredLocked(connection);
  Task task;
  task.kind = Task::Kind::kWork;
  task.pd = work.pd;
  task.connection = work.connection;
  task.work = std::move(work);
  tasks_.push_back(std::move(task));
  return id;
}

absl::StatusOr<uint64_t> SoftwareDevice::PostFastRegister(
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
  MRD_RETURN_IF_ERROR(FaultPoint(options_.fault_points, "work.post"));

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

absl::StatusOr<uint64_t> SoftwareDevice::PostInvalidate(
    ConnectionId connection_id, const InvalidateWork& work) {
  if ((work.flags & ~kKnownWorkFlags) != 0) {
    return InvalidParameter("UNKNOWN_WORK_FLAGS",
                            absl::StrCat("invalidate: flags ", Hex(work.flags),
                                         " have unknown bits ",
                                         Hex(work.flags & ~kKnownWorkFlags)));
  }
  absl::MutexLock lock(&mu_);
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
  MRD_RETURN_IF_ERROR(FaultPoint(options_.fault_points, "work.post"));
  Work queued;
  queued.kind = WorkCompletion::Kind::kInvalidate;
  queued.connection = connection_id;
  queued.pd = mr->pd;
  queued.mr = work.mr;
  queued.flags = work.flags;
  queued.request_context = work.request_context;
  return EnqueueLocked(*connection, std::move(queued));
}

absl::Status SoftwareDevice::FlushDeferred(ConnectionId connection_id) {
  absl::MutexLock lock(&mu_);
  auto it = connections_.find(connection_id);
  if (it == connections_.end() ||
      it->second->state != Connection::State::kReady) {
    return SeedError(STATUS_CONNECTION_INVALID, "CONNECTION_INVALID",
                     absl::StrCat("connection ", connection_id,
                                  " is not a connected queue pair"));
  }
  ReleaseDeferredLocked(*it->second);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Worker.

bool SoftwareDevice::WorkerHasTask() const {
  return worker_stop_ || !tasks_.empty();
}

bool SoftwareDevice::WorkerIdle() const {
  return tasks_.empty() && !worker_busy_;
}

void SoftwareDevice::WaitForWorkerIdle() {
  absl::MutexLock lock(&mu_);
  if (!started_) return;
  mu_.Await(absl::Condition(this, &SoftwareDevice::WorkerIdle));
}

SoftwareDevice::ResourceCounts SoftwareDevice::CountResources() const {
  absl::MutexLock lock(&mu_);
  ResourceCounts counts;
  counts.pds = pds_.size();
  counts.mrs = mrs_.size();
  for (const auto& [id, mr] : mrs_) counts.valid_mrs += mr->valid ? 1 : 0;
  counts.lams = lams_.size();
  counts.keys = keys_.in_use();
  counts.key_slots_grown = keys_.grown_slots();
  counts.iova_ranges = iova_.ranges();
  counts.tickets = tickets_.size();
  for (const auto& [id, lam] : lams_) {
    counts.lam_fast_register_refs += lam->fr_users;
  }
  for (const auto& [id, pd] : pds_) {
    counts.pd_objects += pd->mrs.size() + pd->lams.size();
  }
  return counts;
}

SoftwareDevice::PeerPathStats SoftwareDevice::PeerStats() const {
  PeerPathStats stats;
  stats.listener = listener_->Stats();
  stats.max_session_connections = options_.max_session_connections;
  absl::MutexLock lock(&mu_);
  stats.session_limit_refusals = session_limit_refusals_;
  return stats;
}

void SoftwareDevice::WorkerLoop() {
  while (true) {
    Task task;
    PdEventSink* sink = nullptr;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &SoftwareDevice::WorkerHasTask));
      if (tasks_.empty()) return;  // asked to stop, and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
      auto it = pds_.find(task.pd);
      // A deallocated PD's queued tasks vanish: its sink is never called
      // again once DeallocatePd returns.
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

std::optional<WorkCompletion> SoftwareDevice::Execute(const Work& work) {
  WorkCompletion completion;
  completion.kind = work.kind;
  completion.connection = work.connection;
  completion.work_request = work.id;
  completion.request_context = work.request_context;
  completion.mr = work.mr;
  {
    absl::MutexLock lock(&mu_);
    auto it = connections_.find(work.connection);
    if (it == connections_.end() ||
        it->second->state != Connection::State::kReady) {
      completion.status = SeedError(
          STATUS_CONNECTION_INVALID, "FLUSHED",
          absl::StrCat("work request ", work.id, " flushed: connection ",
                       work.connection, " is closed"));
    } else if (work.kind == WorkCompletion::Kind::kFastRegister) {
      completion.status = ExecuteFastRegisterLocked(work, &completion.rkey);
    } else {
      completion.status = ExecuteInvalidateLocked(work);
    }
  }
  // SILENT_SUCCESS hides successes only; failures always complete (F3).
  if (completion.status.ok() && (work.flags & kWorkSilentSuccess) != 0) {
    return std::nullopt;
  }
  return completion;
}

absl::Status SoftwareDevice::ExecuteFastRegisterLocked(const Work& work,
                                                       uint32_t* rkey) {
  MRD_RETURN_IF_ERROR(
      FaultPoint(options_.fault_points, "fast_register.execute"));
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Mr> mr, FindMrLocked(work.mr));
  if (mr->valid) {
    return InvalidParameter(
        "MR_NOT_FREE",
        absl::StrCat("MR ", work.mr, " is already fast-registered (rkey ",
                     Hex(mr->key), "); invalidate it first"));
  }
  // The LAMs may have been released since the post.
  MRD_ASSIGN_OR_RETURN(ResolvedPages resolved,
                       ResolvePagesLocked(mr->pd, work.fast_register.pages));
  MRD_ASSIGN_OR_RETURN(mr->key, keys_.Reissue(mr->key));
  // A failure from here leaves the MR free (its new key matches nothing
  // while it is not valid) and no LAM referenced.
  MRD_RETURN_IF_ERROR(FaultPoint(options_.fault_points, "fast_register.map"));
  const FastRegisterWork& fr = work.fast_register;
  mr->base = fr.base_address;
  mr->length = fr.length;
  mr->access = fr.access;
  mr->fbo = fr.fbo;
  mr->pages = std::move(resolved.pages);
  mr->lams = std::move(resolved.lams);
  for (LamId id : mr->lams) ++lams_.find(id)->second->fr_users;
  mr->valid = true;
  *rkey = mr->key;
  return absl::OkStatus();
}

absl::Status SoftwareDevice::ExecuteInvalidateLocked(const Work& work) {
  MRD_ASSIGN_OR_RETURN(std::shared_ptr<Mr> mr, FindMrLocked(work.mr));
  if (!mr->valid) {
    return InvalidParameter(
        "MR_NOT_FAST_REGISTERED",
        absl::StrCat("MR ", work.mr, " is not fast-registered"));
  }
  // The old rkey is dead, and no peer op is inside the mapping, before the
  // completion is delivered.
  DropLamRefsLocked(UnmapLocked(mr));
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Peer path.

std::shared_ptr<SoftwareDevice::Connection> SoftwareDevice::OpenConnection(
    int fd, const std::string& remote) {
  auto connection = std::make_shared<Connection>();
  absl::MutexLock lock(&mu_);
  if (shut_down_) return nullptr;  // the listener closes the socket
  connection->id = next_connection_++;
  connection->fd = fd;
  connection->remote = remote;
  connections_.emplace(connection->id, connection);
  return connection;
}

PeerListener::Verdict SoftwareDevice::HandleFrame(
    const std::shared_ptr<Connection>& connection,
    absl::StatusOr<std::string> body, std::string* out) {
  PeerListener::Verdict verdict;
  v1::PeerResponse response;
  v1::PeerRequest request;
  if (body.ok() && !request.ParseFromString(*body)) {
    body = MrdError(absl::StatusCode::kInvalidArgument, "FRAME_UNPARSABLE",
                    absl::StrCat("peer frame of ", body->size(),
                                 " bytes is not a valid message"));
  }
  if (!body.ok()) {
    // A frame we cannot take: answer, then drop the connection, since an
    // RC queue pair fails on a malformed packet too.
    response.set_status(v1::PEER_REMOTE_INVALID_REQUEST);
    response.set_message(std::string(body.status().message()));
    verdict.keep_open = false;
  } else {
    response.set_id(request.id());
    if (!connection->said_hello && !request.has_hello()) {
      response.set_status(v1::PEER_REMOTE_INVALID_REQUEST);
      response.set_message("the first request must be hello");
      verdict.keep_open = false;
    } else {
      verdict.keep_open = HandleRequest(connection, request, &response);
    }
    if (request.has_hello() && response.status() == v1::PEER_SUCCESS) {
      connection->said_hello = true;
    }
  }
  verdict.authenticated = connection->said_hello;
  if (absl::Status status = peer::AppendFrame(response, out); !status.ok()) {
    LogWarning("peer connection ", connection->id, " (", connection->remote,
               "): ", status.message());
    verdict.keep_open = false;
  }
  return verdict;
}

bool SoftwareDevice::HandleRequest(
    const std::shared_ptr<Connection>& connection,
    const v1::PeerRequest& request, v1::PeerResponse* response) {
  switch (request.op_case()) {
    case v1::PeerRequest::kHello:
      return HandleHello(connection, request.hello(), response);
    case v1::PeerRequest::kRead:
    case v1::PeerRequest::kWrite:
      return HandleData(connection, request, response);
    case v1::PeerRequest::OP_NOT_SET:
      break;
  }
  response->set_status(v1::PEER_REMOTE_INVALID_REQUEST);
  response->set_message("request carries no operation");
  return true;
}

bool SoftwareDevice::HandleHello(const std::shared_ptr<Connection>& connection,
                                 const v1::PeerHello& hello,
                                 v1::PeerResponse* response) {
  absl::MutexLock lock(&mu_);
  if (connection->state != Connection::State::kHandshake) {
    response->set_status(v1::PEER_REMOTE_INVALID_REQUEST);
    response->set_message(
        absl::StrCat("connection ", connection->id, " has already said hello"));
    return true;
  }
  auto ticket = tickets_.find(hello.ticket());
  Pd* pd = nullptr;
  if (ticket != tickets_.end()) {
    auto it = pds_.find(ticket->second);
    if (it != pds_.end() && !it->second->dying) pd = it->second.get();
  }
  if (pd == nullptr) {
    response->set_status(v1::PEER_BAD_TICKET);
    response->set_message("unknown ticket, or its session has ended");
    return false;
  }
  if (pd->connections.size() >= options_.max_session_connections) {
    ++session_limit_refusals_;
    response->set_status(v1::PEER_RESOURCE_EXHAUSTED);
    response->set_message(
        absl::StrCat("LIMIT_PEER_CONNECTIONS: the session already has ",
                     pd->connections.size(), " peer connections (max ",
                     options_.max_session_connections, ")"));
    return false;
  }
  if (absl::Status admitted = pd->sink->AdmitPeerConnection(); !admitted.ok()) {
    ++session_limit_refusals_;
    response->set_status(v1::PEER_RESOURCE_EXHAUSTED);
    response->set_message(absl::StrCat(GetErrorDetail(admitted).reason(), ": ",
                                       admitted.message()));
    return false;
  }
  connection->pd = pd->id;
  connection->state = Connection::State::kReady;
  pd->connections.insert(connection->id);
  // Queued before the reply goes out, so OnPeerConnected precedes every
  // completion of work posted on this connection.
  Task task;
  task.kind = Task::Kind::kConnected;
  task.pd = pd->id;
  task.connection = connection->id;
  task.remote = connection->remote;
  tasks_.push_back(std::move(task));
  response->set_status(v1::PEER_SUCCESS);
  response->set_connection(connection->id);
  response->set_max_message_size(options_.max_message_size);
  return true;
}

absl::Status SoftwareDevice::CheckPeerAccessLocked(
    const Connection& connection, uint32_t rkey, uint64_t address,
    uint64_t length, uint32_t need, std::vector<IoSegment>* plan,
    std::shared_ptr<Mr>* out) const {
  auto denied = [](std::string message) {
    return MrdError(absl::StatusCode::kPermissionDenied, "REMOTE_ACCESS_ERROR",
                    message);
  };
  if (connection.state != Connection::State::kReady) {
    return denied(absl::StrCat("connection ", connection.id, " is closing"));
  }
  std::shared_ptr<Mr> mr;
  // A LAM's privileged key (owner tagged kLamKeyOwnerTag) is local-only
  // (L9): it never names an MR here, so it is refused like any bad key.
  if (uint64_t owner = keys_.Lookup(rkey);
      owner != 0 && (owner & kLamKeyOwnerTag) == 0) {
    auto it = mrs_.find(owner);
    if (it != mrs_.end()) mr = it->second;
  }
  // One answer for a wrong key byte, a free or dying MR and another PD's MR:
  // a peer must not learn that a key exists elsewhere (W8).
  if (mr == nullptr || mr->revoking || !mr->valid || mr->pd != connection.pd) {
    return denied(
        absl::StrCat("rkey ", Hex(rkey), " is not valid on this connection"));
  }
  if (address < mr->base || length > mr->length ||
      address - mr->base > mr->length - length) {
    return denied(absl::StrCat("[", Hex(address), ", +", length,
                               ") is outside the region [", Hex(mr->base),
                               ", +", mr->length, ") of rkey ", Hex(rkey)));
  }
  if ((mr->access & need) == 0) {
    return denied(absl::StrCat("rkey ", Hex(rkey), " does not grant remote ",
                               need == kAccessRemoteRead ? "read" : "write"));
  }
  const uint64_t offset = address - mr->base;
  plan->clear();
  if (!mr->fast) {
    plan->push_back(
        IoSegment{mr->span.fd, mr->span.file_offset + offset, length});
  } else {
    // VA -> position in the page array -> logical page -> file page.
    uint64_t position = mr->fbo + offset;
    uint64_t left = length;
    while (left > 0) {
      const PageRef& page = mr->pages[position / page_size_];
      uint64_t within = position % page_size_;
      uint64_t chunk = std::min(left, page_size_ - within);
      IoSegment segment{page.fd, page.file_offset + within, chunk};
      if (!plan->empty() && plan->back().fd == segment.fd &&
          plan->back().offset + plan->back().length == segment.offset) {
        plan->back().length += chunk;  // neighbouring file pages: one call
      } else {
        plan->push_back(segment);
      }
      position += chunk;
      left -= chunk;
    }
  }
  *out = std::move(mr);
  return absl::OkStatus();
}

bool SoftwareDevice::HandleData(const std::shared_ptr<Connection>& connection,
                                const v1::PeerRequest& request,
                                v1::PeerResponse* response) {
  const bool is_read = request.has_read();
  const uint32_t rkey =
      is_read ? request.read().rkey() : request.write().rkey();
  const uint64_t address =
      is_read ? request.read().address() : request.write().address();
  const uint64_t length =
      is_read ? request.read().length() : request.write().data().size();
  if (length == 0 || length > options_.max_message_size) {
    response->set_status(v1::PEER_REMOTE_INVALID_REQUEST);
    response->set_message(absl::StrCat(is_read ? "READ" : "WRITE", " of ",
                                       length, " bytes: length must be in [1, ",
                                       options_.max_message_size, "]"));
    return true;
  }
  std::vector<IoSegment> plan;
  std::shared_ptr<Mr> mr;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    status = CheckPeerAccessLocked(
        *connection, rkey, address, length,
        is_read ? kAccessRemoteRead : kAccessRemoteWrite, &plan, &mr);
    if (status.ok()) ++mr->inflight;
  }
  std::string data;
  if (status.ok()) {
    if (options_.peer_io_hook_for_test) options_.peer_io_hook_for_test();
    if (is_read) {
      data.resize(length);
      status = ReadSegments(plan, data.data());
    } else {
      status = WriteSegments(plan, request.write().data().data());
    }
    absl::MutexLock lock(&mu_);
    --mr->inflight;
  }
  if (!status.ok()) {
    LogDebug("peer connection ", connection->id, " (", connection->remote,
             "): ", is_read ? "READ" : "WRITE", " refused: ", status.message());
    {
      // An RC queue pair moves to the error state on a remote access
      // error: posts are refused from now, and the connection closes.
      absl::MutexLock lock(&mu_);
      if (connection->state == Connection::State::kReady) {
        connection->state = Connection::State::kError;
      }
    }
    response->set_status(v1::PEER_REMOTE_ACCESS_ERROR);
    response->set_message(std::string(status.message()));
    return false;
  }
  response->set_status(v1::PEER_SUCCESS);
  if (is_read) response->set_data(std::move(data));
  return true;
}

void SoftwareDevice::CloseConnection(
    const std::shared_ptr<Connection>& connection) {
  absl::MutexLock lock(&mu_);
  connection->state = Connection::State::kClosed;
  connections_.erase(connection->id);
  if (connection->pd == 0) return;  // never said hello
  auto it = pds_.find(connection->pd);
  if (it == pds_.end() || it->second->dying) return;
  it->second->connections.erase(connection->id);
  // Held work goes to the worker too, which flushes it (the connection is
  // gone), so every post gets its completion, then the disconnect.
  ReleaseDeferredLocked(*connection);
  Task task;
  task.kind = Task::Kind::kDisconnected;
  task.pd = connection->pd;
  task.connection = connection->id;
  tasks_.push_back(std::move(task));
}

}  // namespace mrd::device
