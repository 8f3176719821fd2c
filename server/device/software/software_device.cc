#include "server/device/software/software_device.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "mrd/peer_frame.h"
#include "mrd/status.h"
#include "server/common/log.h"

namespace mrd::device {
namespace {

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
// Key-table owners: an MR's slot in the model's MR table plus one (so never
// 0, and below 2^24 + 1), or this tag for a LAM's privileged key (L9).
constexpr uint32_t kLamKeyOwnerTag = uint32_t{1} << 31;

absl::Status IoError(absl::string_view call, int err, uint64_t offset) {
  return MrdError(
      absl::StatusCode::kInternal, "BACKING_IO_FAILED",
      absl::StrCat(call, " at file offset ", offset, ": ", std::strerror(err)));
}

}  // namespace

// One key of the key table: what the model keeps for a registration, a LAM
// or an MR object. lkey == rkey == key.
struct SoftwareDevice::Key final : ProviderState {
  explicit Key(uint32_t k) : key(k) {}
  uint32_t key;
};

// One TCP connection of the peer path (the listener's context for it).
struct SoftwareDevice::Peer {
  ConnectionId id = 0;  // the model's
  int fd = -1;          // the listener closes it after CloseConnection
  std::string remote;
  // Touched only by the connection's frame handler, which the listener runs
  // one frame at a time (its queue orders the accesses).
  bool said_hello = false;
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

// Copies `length` bytes from `in` to `fd`'s file at `offset` through a
// shared mapping of the whole `page`-aligned pages they touch (`page`: the
// file's page size, st_blksize: 2 MiB on hugetlbfs, whose mappings must be
// aligned to it).
absl::Status WriteThroughMapping(int fd, uint64_t offset, const char* in,
                                 uint64_t length, uint64_t page) {
  if (page == 0) page = 4096;
  const uint64_t start = offset - offset % page;
  const uint64_t span = (offset + length - start + page - 1) / page * page;
  void* view = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                      static_cast<off_t>(start));
  if (view == MAP_FAILED) return IoError("mmap", errno, offset);
  std::memcpy(static_cast<char*>(view) + (offset - start), in, length);
  ::munmap(view, span);
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
      if (n < 0 && errno == EINVAL) {
        // hugetlbfs has no write(2): through a mapping of the file instead.
        MRD_RETURN_IF_ERROR(
            WriteThroughMapping(segment.fd, offset, in, segment.length - done,
                                static_cast<uint64_t>(st.st_blksize)));
        in += segment.length - done;
        break;
      }
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
  const uint64_t ps = static_cast<uint64_t>(page_size);

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
  std::unique_ptr<PeerListener> listener;
  if (options.inherited_peer_listener >= 0) {
    UniqueFd own(fcntl(options.inherited_peer_listener, F_DUPFD_CLOEXEC, 0));
    if (!own.valid()) {
      return MrdError(absl::StatusCode::kInvalidArgument, "BAD_PEER_LISTENER",
                      absl::StrCat("inherited peer listener fd ",
                                   options.inherited_peer_listener, ": ",
                                   std::strerror(errno)));
    }
    MRD_ASSIGN_OR_RETURN(listener,
                         PeerListener::FromSocket(std::move(own), peer));
  } else {
    MRD_ASSIGN_OR_RETURN(listener,
                         PeerListener::Bind(options.peer_listen_address, peer));
  }
  uint64_t pick = 0;
  MRD_RETURN_IF_ERROR(SecureRandomBytes(&pick, sizeof(pick)));
  std::shared_ptr<Pins> pins;
  if (options.share_pins_with != nullptr) {
    pins = options.share_pins_with->pins_;
  } else {
    std::unique_ptr<KernelPinOps> own_pin_ops;
    if (options.pin_ops == nullptr) {
      MRD_ASSIGN_OR_RETURN(own_pin_ops,
                           KernelPinOps::Create(options.pin_options, true));
    }
    pins = std::make_shared<Pins>(ps, options.pin_ops, std::move(own_pin_ops),
                                  options.fault_points);
  }
  const KernelPinOps* own_pin_ops = pins->own_ops.get();

  DeviceModelOptions model;
  model.page_size = ps;
  model.max_mr_size = options.max_mr_size;
  model.max_page_list_length = options.max_page_list_length;
  model.max_session_connections = options.max_session_connections;
  model.iova_start = (kIovaFloorPages + pick % kIovaSpreadPages) * ps;
  model.iova_limit = kIovaLimit / ps * ps;
  model.fault_points = options.fault_points;
  model.connection_id_base = options.connection_id_base;
  DeviceAttributes attributes;
  attributes.name = options.name;
  attributes.numa_node = options.numa_node;
  attributes.kind = "software";
  attributes.shares_pins = true;  // PinTracker: page refcounts
  if (own_pin_ops != nullptr) {
    // Read-only memory is mlocked (io_uring pins for writing); all of it
    // when io_uring is not used.
    const PinMethod method = own_pin_ops->options().method;
    const bool uring =
        method != PinMethod::kMlock && own_pin_ops->io_uring_available();
    attributes.map_splits_per_read_only_pin =
        method == PinMethod::kIoUring ? 0 : 2;
    attributes.map_splits_per_writable_pin = uring ? 0 : 2;
    attributes.max_map_splits = own_pin_ops->max_map_splits();
  }
  // Software moves bytes with pread/pwrite: any registered memory can be
  // the sink of a read, so RDMA_READ_SINK is never needed (R9).
  attributes.adapter_flags = kAdapterFlagReadSinkNotRequired;
  attributes.peer_address = listener->address();
  return std::unique_ptr<SoftwareDevice>(
      new SoftwareDevice(options, model, std::move(attributes),
                         std::move(listener), std::move(pins)));
}

SoftwareDevice::SoftwareDevice(const SoftwareDeviceOptions& options,
                               DeviceModelOptions model,
                               DeviceAttributes attributes,
                               std::unique_ptr<PeerListener> listener,
                               std::shared_ptr<Pins> pins)
    : DeviceModel(std::move(attributes), model),
      options_(options),
      pins_(std::move(pins)),
      listener_(std::move(listener)),
      keys_(options.max_keys, &random_, options.fault_points,
            options.key_chunk_slots) {}

SoftwareDevice::~SoftwareDevice() { ShutdownAndReleaseAll(); }

DeviceHealth SoftwareDevice::Health() const {
  switch (phase()) {
    case Phase::kShutDown:
      return {false, "software device is shut down"};
    case Phase::kNew:
      return {false, "software device is not started"};
    case Phase::kStarted:
      break;
  }
  return {true, absl::StrCat("software device, peers at ",
                             Attributes().peer_address)};
}

uint64_t SoftwareDevice::PinnedBytes() const {
  return pins_->tracker.PinnedBytes();
}

absl::Status SoftwareDevice::ProviderStart() {
  PeerListener::Handler handler;
  handler.open = [this](int fd, const std::string& remote) {
    return std::static_pointer_cast<void>(OpenConnection(fd, remote));
  };
  handler.frame = [this](const std::shared_ptr<void>& context,
                         absl::StatusOr<std::string> body, std::string* out) {
    return HandleFrame(std::static_pointer_cast<Peer>(context), std::move(body),
                       out);
  };
  handler.close = [this](const std::shared_ptr<void>& context) {
    CloseConnection(std::static_pointer_cast<Peer>(context));
  };
  return listener_->Start(std::move(handler));
}

// Closes the listener, then every connection (CloseConnection tells the
// model, which queues their flushes and disconnects), after the frames
// being handled.
void SoftwareDevice::ProviderStop() { listener_->Stop(); }

absl::Status SoftwareDevice::ProviderCanHandOver() const {
  return absl::OkStatus();
}

absl::StatusOr<UniqueFd> SoftwareDevice::ProviderStopPeerAccepting() {
  return listener_->StopAccepting();
}

void SoftwareDevice::ProviderResumePeerAccepting() {
  listener_->ResumeAccepting();
}

absl::StatusOr<UniqueFd> SoftwareDevice::ProviderDuplicatePeerListener() {
  return listener_->DuplicateSocket();
}

absl::StatusOr<std::vector<DeviceHandover::HandedOverPeer>>
SoftwareDevice::ProviderFreezePeers(absl::Duration timeout) {
  MRD_ASSIGN_OR_RETURN(std::vector<PeerListener::HeldConnection> held,
                       listener_->FreezeConnections(timeout));
  std::vector<HandedOverPeer> peers;
  for (PeerListener::HeldConnection& connection : held) {
    // Frozen: no frame handler runs, and the freeze ordered their writes
    // of said_hello before this read.
    auto peer = std::static_pointer_cast<Peer>(connection.context);
    if (peer == nullptr || !peer->said_hello) continue;  // closes at commit
    std::optional<PdId> pd = MovableConnection(peer->id);
    if (!pd.has_value()) continue;
    HandedOverPeer out;
    out.id = peer->id;
    out.pd = *pd;
    out.remote = std::move(connection.remote);
    out.socket = std::move(connection.fd);
    out.received = std::move(connection.received);
    out.unsent = std::move(connection.unsent);
    peers.push_back(std::move(out));
  }
  return peers;
}

void SoftwareDevice::ProviderThawPeers() {
  std::vector<HandedOverPeer> adopting;
  {
    absl::MutexLock lock(&mu_);
    adopting.swap(adopting_);
  }
  if (!adopting.empty()) {
    // The listener takes connections only frozen (it accepted none yet:
    // this process was taking over).
    absl::StatusOr<std::vector<PeerListener::HeldConnection>> own =
        listener_->FreezeConnections(absl::Seconds(5));
    if (!own.ok()) {
      LogError("peer connections handed over are closed: ",
               own.status().ToString());
      adopting.clear();
    }
  }
  for (HandedOverPeer& peer : adopting) {
    const ConnectionId id = peer.id;
    const std::string remote = peer.remote;
    absl::Status adopted = AdoptConnection(id, peer.pd, remote);
    if (adopted.ok()) {
      auto context = std::make_shared<Peer>();
      context->id = id;
      context->fd = peer.socket.get();
      context->remote = remote;
      context->said_hello = true;
      {
        absl::MutexLock lock(&mu_);
        sockets_.emplace(id, context->fd);
      }
      PeerListener::HeldConnection held;
      held.fd = std::move(peer.socket);
      held.remote = remote;
      held.authenticated = true;
      held.received = std::move(peer.received);
      held.unsent = std::move(peer.unsent);
      adopted = listener_->AdoptConnection(std::move(held), context);
      if (!adopted.ok()) CloseConnection(context);
    }
    if (!adopted.ok()) {
      LogWarning("peer connection ", id, " (", remote,
                 ") handed over is closed: ", adopted.ToString());
    }
  }
  listener_->ThawConnections();
}

void SoftwareDevice::ProviderDropFrozenPeers() { listener_->DropConnections(); }

absl::Status SoftwareDevice::ProviderAdoptPeer(PdId pd, HandedOverPeer peer) {
  if (!peer.socket.valid()) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_PEER_CONNECTION",
                    absl::StrCat("peer connection ", peer.id,
                                 " was handed over without its socket"));
  }
  peer.pd = pd;
  absl::MutexLock lock(&mu_);
  adopting_.push_back(std::move(peer));
  return absl::OkStatus();
}

SoftwareDevice::ResourceCounts SoftwareDevice::CountResources() const {
  ResourceCounts counts;
  static_cast<ModelCounts&>(counts) = CountModel();
  absl::MutexLock lock(&keys_mu_);
  counts.keys = keys_.in_use();
  counts.key_slots_grown = keys_.grown_slots();
  return counts;
}

SoftwareDevice::PeerPathStats SoftwareDevice::PeerStats() const {
  PeerPathStats stats;
  stats.listener = listener_->Stats();
  stats.max_session_connections = options_.max_session_connections;
  stats.session_limit_refusals = CountModel().session_limit_refusals;
  return stats;
}

std::optional<PeerPathCounts> SoftwareDevice::ProviderPeerPath() const {
  const PeerPathStats s = PeerStats();
  PeerPathCounts c;
  c.connections = s.listener.connections;
  c.unauthenticated = s.listener.unauthenticated;
  c.buffered_bytes = s.listener.buffered_bytes;
  c.threads = s.listener.threads;
  c.accepted = s.listener.accepted;
  c.refused = s.listener.refused;
  c.shed = s.listener.shed;
  c.hello_timeouts = s.listener.hello_timeouts;
  c.stall_timeouts = s.listener.stall_timeouts;
  c.session_limit_refusals = s.session_limit_refusals;
  c.max_connections = s.listener.max_connections;
  c.max_unauthenticated = s.listener.max_unauthenticated;
  c.max_buffer_bytes = s.listener.max_buffer_bytes;
  c.max_session_connections = s.max_session_connections;
  return c;
}

// ---------------------------------------------------------------------------
// Pins and keys.

namespace {

class ClearingBatch final : public DeviceBatch {
 public:
  explicit ClearingBatch(KernelPinOps* ops) : clears_(ops) {}

 private:
  KernelPinOps::ClearBatch clears_;
};

}  // namespace

std::unique_ptr<DeviceBatch> SoftwareDevice::BeginBatch() {
  if (pins_->own_ops == nullptr) return nullptr;
  return std::make_unique<ClearingBatch>(pins_->own_ops.get());
}

namespace {

class TrackerBatchPin final : public BatchPin {
 public:
  TrackerBatchPin(PinTracker* tracker, uint64_t address, uint64_t length)
      : tracker_(tracker), address_(address), length_(length) {}
  ~TrackerBatchPin() override { tracker_->Unpin(address_, length_); }
  TrackerBatchPin(const TrackerBatchPin&) = delete;
  TrackerBatchPin& operator=(const TrackerBatchPin&) = delete;

 private:
  PinTracker* const tracker_;
  const uint64_t address_;
  const uint64_t length_;
};

}  // namespace

std::unique_ptr<BatchPin> SoftwareDevice::PinForBatch(const MemorySpan& span) {
  if (span.pages != SpanPages::kBase || span.length == 0) return nullptr;
  const uint64_t address = reinterpret_cast<uint64_t>(span.host_address);
  if (!pins_->tracker.PinInPieces(address, span.length, kBatchPinPieceBytes)
           .ok()) {
    return nullptr;
  }
  return std::make_unique<TrackerBatchPin>(&pins_->tracker, address,
                                           span.length);
}

absl::Status SoftwareDevice::ProviderPin(const MemorySpan& span) {
  // hugetlbfs memory is pinned the way that suits huge pages
  // (KernelPinOps::LockHugePages).
  bool huge = span.pages == SpanPages::kHuge;
  if (span.pages == SpanPages::kUnknown) {
    struct statfs fs {};
    huge = span.fd >= 0 && ::fstatfs(span.fd, &fs) == 0 &&
           static_cast<uint64_t>(fs.f_type) == HUGETLBFS_MAGIC;
  }
  return pins_->tracker.Pin(reinterpret_cast<uint64_t>(span.host_address),
                            span.length, huge, span.progress);
}

void SoftwareDevice::ProviderUnpin(const MemorySpan& span) {
  pins_->tracker.Unpin(reinterpret_cast<uint64_t>(span.host_address),
                       span.length);
}

absl::StatusOr<DeviceModel::Registration> SoftwareDevice::NewKey(
    uint32_t owner, bool with_object) {
  absl::MutexLock lock(&keys_mu_);
  MRD_ASSIGN_OR_RETURN(uint32_t key, keys_.Allocate(owner));
  return Registration{key, key,
                      with_object ? std::make_unique<Key>(key) : nullptr};
}

absl::StatusOr<DeviceModel::Registration> SoftwareDevice::ProviderRegister(
    ProviderState* /*pd*/, const MemorySpan& /*span*/, uint64_t /*iova*/,
    uint32_t /*access*/, uint64_t owner, bool lam) {
  // A LAM's key is owned by the tag alone, so that no peer lookup can ever
  // resolve it to an MR (L9). An MR's registration is its key alone: the
  // model keeps no object for it and releases it with
  // ProviderDeregisterKey.
  return lam ? NewKey(kLamKeyOwnerTag, /*with_object=*/true)
             : NewKey(MrSlot(owner) + 1, /*with_object=*/false);
}

absl::StatusOr<DeviceModel::Registration> SoftwareDevice::ClaimKey(
    absl::string_view call, uint32_t lkey, uint32_t rkey, uint32_t owner,
    bool with_object) {
  // One key per object, as NewKey gives it.
  if (lkey != rkey) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_KEY",
                    absl::StrCat(call, ": lkey 0x", absl::Hex(lkey),
                                 " differs from rkey 0x", absl::Hex(rkey),
                                 "; the software device gives an MR one key "
                                 "for both"));
  }
  absl::MutexLock lock(&keys_mu_);
  MRD_ASSIGN_OR_RETURN(uint32_t key, keys_.Claim(rkey, owner));
  return Registration{key, key,
                      with_object ? std::make_unique<Key>(key) : nullptr};
}

absl::StatusOr<DeviceModel::Registration> SoftwareDevice::ProviderAdoptRegister(
    ProviderState* /*pd*/, const MemorySpan& /*span*/, uint64_t /*iova*/,
    uint32_t /*access*/, uint64_t owner, uint32_t lkey, uint32_t rkey,
    bool lam) {
  // Owners and objects as ProviderRegister gives them.
  return lam ? ClaimKey("AdoptLam", lkey, rkey, kLamKeyOwnerTag,
                        /*with_object=*/true)
             : ClaimKey("AdoptMr", lkey, rkey, MrSlot(owner) + 1,
                        /*with_object=*/false);
}

absl::StatusOr<DeviceModel::Registration> SoftwareDevice::ProviderAdoptFastMr(
    ProviderState* /*pd*/, MrId owner, uint32_t lkey, uint32_t rkey) {
  // As ProviderAllocateFastMr; a fast-registered object's key is its
  // mapping's too (ProviderFastRegister keeps no other state), and a later
  // fast registration reissues it like any other.
  return ClaimKey("AdoptFastRegisterMr", lkey, rkey, MrSlot(owner) + 1,
                  /*with_object=*/true);
}

absl::Status SoftwareDevice::ProviderDeregister(
    std::unique_ptr<ProviderState> state) {
  absl::MutexLock lock(&keys_mu_);
  keys_.Release(static_cast<Key*>(state.get())->key);
  return absl::OkStatus();
}

absl::Status SoftwareDevice::ProviderDeregisterKey(uint32_t lkey) {
  absl::MutexLock lock(&keys_mu_);
  keys_.Release(lkey);
  return absl::OkStatus();
}

absl::StatusOr<DeviceModel::Registration>
SoftwareDevice::ProviderAllocateFastMr(ProviderState* /*pd*/, MrId owner) {
  return NewKey(MrSlot(owner) + 1, /*with_object=*/true);
}

absl::StatusOr<DeviceModel::Registration> SoftwareDevice::ProviderFastRegister(
    ProviderState* /*pd*/, ProviderState* object, MrId /*mr*/,
    const std::vector<PageRef>& /*pages*/, const FastRegisterWork& /*fr*/,
    uint32_t /*previous_rkey*/) {
  // The model maps the pages (peer operations go through its page array);
  // the MR only needs a new key, never its previous one.
  Key& key = *static_cast<Key*>(object);
  {
    absl::MutexLock lock(&keys_mu_);
    MRD_ASSIGN_OR_RETURN(key.key, keys_.Reissue(key.key));
  }
  // A failure from here leaves the MR free (its new key matches nothing
  // while it is not valid).
  MRD_RETURN_IF_ERROR(FaultPoint(options_.fault_points, "fast_register.map"));
  return Registration{key.key, key.key, nullptr};
}

// ---------------------------------------------------------------------------
// Peer path.

void SoftwareDevice::ProviderCloseConnectionsLocked(
    const std::vector<ConnectionId>& connections) {
  // The reactor sees the shutdown and closes each (CloseConnection).
  for (ConnectionId id : connections) {
    if (auto it = sockets_.find(id); it != sockets_.end()) {
      ::shutdown(it->second, SHUT_RDWR);
    }
  }
}

std::shared_ptr<SoftwareDevice::Peer> SoftwareDevice::OpenConnection(
    int fd, const std::string& remote) {
  std::optional<ConnectionId> id = NewConnection(remote);
  if (!id.has_value()) return nullptr;  // shut down: the listener closes fd
  auto peer = std::make_shared<Peer>();
  peer->id = *id;
  peer->fd = fd;
  peer->remote = remote;
  absl::MutexLock lock(&mu_);
  sockets_.emplace(*id, fd);
  return peer;
}

void SoftwareDevice::CloseConnection(const std::shared_ptr<Peer>& peer) {
  {
    absl::MutexLock lock(&mu_);
    sockets_.erase(peer->id);
  }
  ConnectionClosed(peer->id);
}

PeerListener::Verdict SoftwareDevice::HandleFrame(
    const std::shared_ptr<Peer>& peer, absl::StatusOr<std::string> body,
    std::string* out) {
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
    if (!peer->said_hello && !request.has_hello()) {
      response.set_status(v1::PEER_REMOTE_INVALID_REQUEST);
      response.set_message("the first request must be hello");
      verdict.keep_open = false;
    } else {
      verdict.keep_open = HandleRequest(peer, request, &response);
    }
    if (request.has_hello() && response.status() == v1::PEER_SUCCESS) {
      peer->said_hello = true;
    }
  }
  verdict.authenticated = peer->said_hello;
  if (absl::Status status = peer::AppendFrame(response, out); !status.ok()) {
    LogWarning("peer connection ", peer->id, " (", peer->remote,
               "): ", status.message());
    verdict.keep_open = false;
  }
  return verdict;
}

bool SoftwareDevice::HandleRequest(const std::shared_ptr<Peer>& peer,
                                   const v1::PeerRequest& request,
                                   v1::PeerResponse* response) {
  switch (request.op_case()) {
    case v1::PeerRequest::kHello:
      return HandleHello(peer, request.hello(), response);
    case v1::PeerRequest::kRead:
    case v1::PeerRequest::kWrite:
      return HandleData(peer, request, response);
    case v1::PeerRequest::OP_NOT_SET:
      break;
  }
  response->set_status(v1::PEER_REMOTE_INVALID_REQUEST);
  response->set_message("request carries no operation");
  return true;
}

bool SoftwareDevice::HandleHello(const std::shared_ptr<Peer>& peer,
                                 const v1::PeerHello& hello,
                                 v1::PeerResponse* response) {
  if (peer->said_hello) {
    response->set_status(v1::PEER_REMOTE_INVALID_REQUEST);
    response->set_message(
        absl::StrCat("connection ", peer->id, " has already said hello"));
    return true;
  }
  absl::StatusOr<BindResult> bound = BindConnection(peer->id, hello.ticket());
  if (!bound.ok()) {
    response->set_status(bound.status().code() ==
                                 absl::StatusCode::kResourceExhausted
                             ? v1::PEER_RESOURCE_EXHAUSTED
                             : v1::PEER_BAD_TICKET);
    response->set_message(std::string(bound.status().message()));
    return false;
  }
  response->set_status(v1::PEER_SUCCESS);
  response->set_connection(peer->id);
  response->set_max_message_size(options_.max_message_size);
  return true;
}

bool SoftwareDevice::HandleData(const std::shared_ptr<Peer>& peer,
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
  // The MR the key names. A LAM's privileged key (owner tagged
  // kLamKeyOwnerTag) is local-only (L9): it never names an MR here, so it
  // is refused like any bad key.
  uint32_t owner = 0;
  {
    absl::MutexLock lock(&keys_mu_);
    owner = keys_.Lookup(rkey);
  }
  const uint32_t mr_slot =
      owner == 0 || (owner & kLamKeyOwnerTag) != 0 ? kNoMrSlot : owner - 1;
  absl::StatusOr<PeerAccess> access =
      BeginPeerAccess(peer->id, mr_slot, rkey, address, length,
                      is_read ? kAccessRemoteRead : kAccessRemoteWrite);
  absl::Status status = access.status();
  std::string data;
  if (status.ok()) {
    if (options_.peer_io_hook_for_test) options_.peer_io_hook_for_test();
    if (is_read) {
      data.resize(length);
      status = ReadSegments(access->plan, data.data());
    } else {
      status = WriteSegments(access->plan, request.write().data().data());
    }
    EndPeerAccess(*access);
  }
  if (!status.ok()) {
    LogDebug("peer connection ", peer->id, " (", peer->remote,
             "): ", is_read ? "READ" : "WRITE", " refused: ", status.message());
    // An RC queue pair moves to the error state on a remote access error:
    // posts are refused from now, and the connection closes.
    ConnectionError(peer->id);
    response->set_status(v1::PEER_REMOTE_ACCESS_ERROR);
    response->set_message(std::string(status.message()));
    return false;
  }
  response->set_status(v1::PEER_SUCCESS);
  if (is_read) response->set_data(std::move(data));
  return true;
}

}  // namespace mrd::device
