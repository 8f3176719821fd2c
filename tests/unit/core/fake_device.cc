#include "tests/unit/core/fake_device.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"

namespace mrd::fake {
namespace {

using device::ConnectionId;
using device::LamId;
using device::MrId;
using device::PdId;

constexpr uint32_t kKnownAccess =
    device::kAccessLocalWrite | device::kAccessRemoteRead |
    device::kAccessRemoteWrite | device::kAccessReadSink;
constexpr uint32_t kKnownWorkFlags =
    device::kWorkSilentSuccess | device::kWorkReadFence | device::kWorkDefer;
// Logical addresses live far from any host address, so that a test that
// confuses the two notices.
constexpr uint64_t kFirstLogicalPage = uint64_t{0x5a} << 40;

absl::Status Invalid(absl::string_view reason, absl::string_view message) {
  return SeedError(::mrd::STATUS_INVALID_PARAMETER, reason, message);
}

absl::Status NotFound(absl::string_view reason, absl::string_view message) {
  return MrdError(absl::StatusCode::kNotFound, reason, message);
}

absl::Status AccessCheck(uint32_t access) {
  if (access & ~kKnownAccess) {
    return Invalid("UNKNOWN_ACCESS_BITS",
                   absl::StrCat("access 0x", absl::Hex(access),
                                " has bits the device does not define"));
  }
  if ((access & device::kAccessRemoteWrite) &&
      !(access & device::kAccessLocalWrite)) {
    // device.h: the core always adds kAccessLocalWrite to remote write.
    return Invalid("REMOTE_WRITE_WITHOUT_LOCAL_WRITE",
                   "remote write access without local write access");
  }
  return absl::OkStatus();
}

}  // namespace

FakeDevice::FakeDevice(FakeDeviceOptions options) : options_(options) {
  attributes_.name = "fake";
  attributes_.kind = "software";
  attributes_.page_size = options_.page_size != 0
                              ? options_.page_size
                              : static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  attributes_.max_mr_size = options_.max_mr_size;
  attributes_.max_page_list_length = options_.max_page_list_length;
  attributes_.adapter_flags = options_.adapter_flags;
  attributes_.peer_address = "fake:0";
  absl::MutexLock lock(&mu_);
  next_logical_page_ = kFirstLogicalPage;
}

FakeDevice::~FakeDevice() { Shutdown(); }

device::DeviceHealth FakeDevice::Health() const {
  absl::MutexLock lock(&mu_);
  return health_;
}

uint64_t FakeDevice::PinnedBytes() const {
  absl::MutexLock lock(&mu_);
  uint64_t total = 0;
  for (const auto& [id, mr] : mrs_) total += mr.pinned_bytes;
  for (const auto& [id, lam] : lams_) total += lam.pinned_bytes;
  return total;
}

absl::Status FakeDevice::Start() {
  absl::MutexLock lock(&mu_);
  if (started_) {
    return MrdError(absl::StatusCode::kFailedPrecondition, "ALREADY_STARTED",
                    "Start called twice");
  }
  started_ = true;
  if (options_.run_work_on_device_thread) {
    thread_ = std::thread([this] { DeviceThread(); });
  }
  return absl::OkStatus();
}

void FakeDevice::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [id, connection] : connections_) connection.connected = false;
  }
  if (thread_.joinable()) thread_.join();
}

void FakeDevice::DeviceThread() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      // Await calls the condition with mu_ held.
      mu_.Await(absl::Condition(
          +[](FakeDevice* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(d->mu_) {
            return d->stopping_ || !d->work_.empty();
          },
          this));
      if (stopping_ && work_.empty()) return;
    }
    RunPostedWork();
  }
}

// --- helpers
// ------------------------------------------------------------------

absl::Status FakeDevice::Enter(Op op) {
  absl::Duration delay;
  absl::Status failure;
  {
    absl::MutexLock lock(&mu_);
    ++calls_[op];
    if (held_.contains(op)) {
      ++held_calls_[op];
      auto released = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !held_.contains(op);
      };
      mu_.Await(absl::Condition(&released));
      --held_calls_[op];
    }
    if (auto d = delays_.find(op); d != delays_.end()) delay = d->second;
    if (auto f = failures_.find(op);
        f != failures_.end() && !f->second.empty()) {
      failure = std::move(f->second.front());
      f->second.pop_front();
    }
  }
  if (delay > absl::ZeroDuration()) absl::SleepFor(delay);
  return failure;
}

uint32_t FakeDevice::NewKeyLocked() {
  uint32_t key = next_key_;
  next_key_ += 0x101;  // fresh and never reused in a test's lifetime
  if (next_key_ < 0x1000) next_key_ = 0x1000;
  return key;
}

uint64_t FakeDevice::PageRound(uint64_t address, uint64_t length) const {
  const uint64_t page = attributes_.page_size;
  const uint64_t first = address / page;
  const uint64_t last = (address + length - 1) / page;
  return (last - first + 1) * page;
}

absl::StatusOr<FakeDevice::SpanIdentity> FakeDevice::CheckSpan(
    const device::MemorySpan& span) const {
  if (span.host_address == nullptr || span.length == 0) {
    return Invalid("BAD_SPAN", "null address or zero length");
  }
  if (span.length > attributes_.max_mr_size) {
    return Invalid("SPAN_TOO_LONG",
                   absl::StrCat("length ", span.length, " exceeds max_mr_size ",
                                attributes_.max_mr_size));
  }
  struct stat st;
  if (span.fd < 0 || ::fstat(span.fd, &st) != 0) {
    return Invalid("BAD_SPAN_FD", absl::StrCat("fd ", span.fd, " is not open"));
  }
  if (!S_ISREG(st.st_mode) ||
      span.file_offset + span.length > static_cast<uint64_t>(st.st_size)) {
    return Invalid(
        "SPAN_PAST_FILE",
        absl::StrCat("file offset ", span.file_offset, " + ", span.length,
                     " is past the file's ", st.st_size, " bytes"));
  }
  const uint64_t page = attributes_.page_size;
  const uint64_t address = reinterpret_cast<uintptr_t>(span.host_address);
  const uint64_t start = address / page * page;
  if (::msync(reinterpret_cast<void*>(start), PageRound(address, span.length),
              MS_ASYNC) != 0) {
    return Invalid(
        "SPAN_NOT_MAPPED",
        absl::StrCat("span at 0x", absl::Hex(address), " (", span.length,
                     " bytes) is not mapped: ", std::strerror(errno)));
  }
  SpanIdentity identity;
  identity.span = span;
  identity.file_device = static_cast<uint64_t>(st.st_dev);
  identity.file_inode = static_cast<uint64_t>(st.st_ino);
  return identity;
}

absl::StatusOr<FakeDevice::PdState*> FakeDevice::LivePdLocked(PdId pd) {
  auto it = pds_.find(pd);
  if (it == pds_.end() || it->second.dying) {
    return NotFound("UNKNOWN_PD", absl::StrCat("PD ", pd, " does not exist"));
  }
  return &it->second;
}

// --- PDs
// --------------------------------------------------------------------------

absl::StatusOr<PdId> FakeDevice::AllocatePd(device::PdEventSink* sink) {
  if (absl::Status s = Enter(Op::kAllocatePd); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (sink == nullptr) return Invalid("NULL_SINK", "AllocatePd needs a sink");
  PdId id = next_id_++;
  pds_[id].sink = sink;
  return id;
}

absl::Status FakeDevice::DeallocatePd(PdId pd) {
  if (absl::Status s = Enter(Op::kDeallocatePd); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  absl::StatusOr<PdState*> state = LivePdLocked(pd);
  if (!state.ok()) return state.status();
  PdState* raw = *state;
  raw->dying = true;
  // No sink call for this PD may be under way once we return.
  mu_.Await(absl::Condition(
      +[](PdState* p) { return p->deliveries_in_flight == 0; }, raw));
  for (auto it = connections_.begin(); it != connections_.end();) {
    it = it->second.pd == pd ? connections_.erase(it) : std::next(it);
  }
  for (auto it = mrs_.begin(); it != mrs_.end();) {
    if (it->second.pd == pd) {
      valid_rkeys_.erase(it->second.rkey);
      it = mrs_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = lams_.begin(); it != lams_.end();) {
    if (it->second.pd == pd) {
      for (uint64_t page : it->second.pages) logical_pages_.erase(page);
      it = lams_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = tickets_.begin(); it != tickets_.end();) {
    it = it->second == pd ? tickets_.erase(it) : std::next(it);
  }
  work_.erase(std::remove_if(work_.begin(), work_.end(),
                             [pd](const Work& w) { return w.pd == pd; }),
              work_.end());
  pds_.erase(pd);
  return absl::OkStatus();
}

// --- registered MRs
// ---------------------------------------------------------------

absl::StatusOr<device::MrKeys> FakeDevice::RegisterMr(
    PdId pd, const device::MemorySpan& span, uint64_t base_address,
    uint32_t access) {
  if (absl::Status s = Enter(Op::kRegisterMr); !s.ok()) return s;
  if (absl::Status s = AccessCheck(access); !s.ok()) return s;
  if (base_address == 0) {
    return Invalid("ZERO_BASED_ADDRESS", "base address 0 (R8)");
  }
  absl::StatusOr<SpanIdentity> memory = CheckSpan(span);
  if (!memory.ok()) return memory.status();
  if (base_address > std::numeric_limits<uint64_t>::max() - span.length) {
    return Invalid("BASE_ADDRESS_OVERFLOW", "base + length overflows");
  }
  absl::MutexLock lock(&mu_);
  if (absl::StatusOr<PdState*> state = LivePdLocked(pd); !state.ok()) {
    return state.status();
  }
  MrId id = next_id_++;
  MrState& mr = mrs_[id];
  mr.pd = pd;
  mr.lkey = NewKeyLocked();
  mr.rkey = mr.lkey;
  mr.memory = *memory;
  mr.base_address = base_address;
  mr.length = span.length;
  mr.access = access;
  mr.pinned_bytes =
      PageRound(reinterpret_cast<uintptr_t>(span.host_address), span.length);
  valid_rkeys_[mr.rkey] = id;
  return device::MrKeys{id, mr.lkey, mr.rkey};
}

absl::Status FakeDevice::DeregisterMr(MrId mr) {
  if (absl::Status s = Enter(Op::kDeregisterMr); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto it = mrs_.find(mr);
  if (it == mrs_.end() || it->second.fast_register ||
      pds_.at(it->second.pd).dying) {
    return NotFound("UNKNOWN_MR", absl::StrCat("no registered MR ", mr));
  }
  valid_rkeys_.erase(it->second.rkey);
  mrs_.erase(it);
  return absl::OkStatus();
}

// --- LAMs
// ---------------------------------------------------------------------------

absl::StatusOr<device::LogicalMapping> FakeDevice::BuildLam(
    PdId pd, const device::MemorySpan& span) {
  if (absl::Status s = Enter(Op::kBuildLam); !s.ok()) return s;
  absl::StatusOr<SpanIdentity> memory = CheckSpan(span);
  if (!memory.ok()) return memory.status();
  absl::MutexLock lock(&mu_);
  if (absl::StatusOr<PdState*> state = LivePdLocked(pd); !state.ok()) {
    return state.status();
  }
  const uint64_t page = attributes_.page_size;
  const uint64_t address = reinterpret_cast<uintptr_t>(span.host_address);
  const uint64_t pinned = PageRound(address, span.length);
  LamId id = next_id_++;
  LamState& lam = lams_[id];
  lam.pd = pd;
  lam.memory = *memory;
  lam.pinned_bytes = pinned;
  for (uint64_t i = 0; i < pinned / page; ++i) {
    lam.pages.push_back(next_logical_page_);
    logical_pages_[next_logical_page_] = id;
    next_logical_page_ += page;
  }
  next_logical_page_ += page;  // a hole between LAMs
  device::LogicalMapping mapping;
  mapping.lam = id;
  mapping.pages = lam.pages;
  mapping.fbo = static_cast<uint32_t>(address % page);
  return mapping;
}

absl::Status FakeDevice::ReleaseLam(LamId lam) {
  if (absl::Status s = Enter(Op::kReleaseLam); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto it = lams_.find(lam);
  if (it == lams_.end() || pds_.at(it->second.pd).dying) {
    return NotFound("UNKNOWN_LAM", absl::StrCat("no LAM ", lam));
  }
  for (const auto& [id, mr] : mrs_) {
    if (mr.fast_registered &&
        std::find(mr.mapped_lams.begin(), mr.mapped_lams.end(), lam) !=
            mr.mapped_lams.end()) {
      return MrdError(absl::StatusCode::kFailedPrecondition, "LAM_MAPPED",
                      absl::StrCat("LAM ", lam,
                                   " is mapped by fast-registered "
                                   "MR ",
                                   id));
    }
  }
  for (uint64_t page : it->second.pages) logical_pages_.erase(page);
  lams_.erase(it);
  return absl::OkStatus();
}

// --- fast-register MRs ------------------------------------------------------

absl::StatusOr<device::MrKeys> FakeDevice::AllocateFastRegisterMr(
    PdId pd, bool allow_remote, uint32_t max_pages) {
  if (absl::Status s = Enter(Op::kAllocateFastRegisterMr); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (absl::StatusOr<PdState*> state = LivePdLocked(pd); !state.ok()) {
    return state.status();
  }
  if (max_pages == 0 || max_pages > attributes_.max_page_list_length) {
    return Invalid("BAD_MAX_PAGES",
                   absl::StrCat("max_pages ", max_pages, " not in 1..",
                                attributes_.max_page_list_length));
  }
  MrId id = next_id_++;
  MrState& mr = mrs_[id];
  mr.pd = pd;
  mr.fast_register = true;
  mr.allow_remote = allow_remote;
  mr.max_pages = max_pages;
  mr.lkey = NewKeyLocked();
  mr.rkey = mr.lkey;  // not valid for peers until fast-registered
  return device::MrKeys{id, mr.lkey, mr.rkey};
}

absl::Status FakeDevice::FreeFastRegisterMr(MrId mr) {
  if (absl::Status s = Enter(Op::kFreeFastRegisterMr); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto it = mrs_.find(mr);
  if (it == mrs_.end() || !it->second.fast_register ||
      pds_.at(it->second.pd).dying) {
    return NotFound("UNKNOWN_MR", absl::StrCat("no fast-register MR ", mr));
  }
  if (it->second.fast_registered) valid_rkeys_.erase(it->second.rkey);
  mrs_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<device::MrKeys> FakeDevice::QueryMr(MrId mr) const {
  absl::MutexLock lock(&mu_);
  auto it = mrs_.find(mr);
  if (it == mrs_.end()) {
    return NotFound("UNKNOWN_MR", absl::StrCat("no MR ", mr));
  }
  return device::MrKeys{mr, it->second.lkey, it->second.rkey};
}

absl::StatusOr<std::string> FakeDevice::CreatePeerTicket(PdId pd) {
  if (absl::Status s = Enter(Op::kCreatePeerTicket); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (absl::StatusOr<PdState*> state = LivePdLocked(pd); !state.ok()) {
    return state.status();
  }
  std::string ticket = absl::StrCat("fake-ticket-", pd, "-", next_ticket_++);
  tickets_[ticket] = pd;
  return ticket;
}

// --- posted work
// -----------------------------------------------------------------

absl::StatusOr<uint64_t> FakeDevice::PostFastRegister(
    ConnectionId connection, const device::FastRegisterWork& work) {
  if (absl::Status s = Enter(Op::kPostFastRegister); !s.ok()) return s;
  const uint64_t page = attributes_.page_size;
  absl::MutexLock lock(&mu_);
  auto c = connections_.find(connection);
  if (c == connections_.end() || !c->second.connected || stopping_) {
    return SeedError(
        ::mrd::STATUS_CONNECTION_INVALID, "CONNECTION_NOT_CONNECTED",
        absl::StrCat("connection ", connection, " is not connected"));
  }
  auto m = mrs_.find(work.mr);
  if (m == mrs_.end() || !m->second.fast_register) {
    return NotFound("UNKNOWN_MR",
                    absl::StrCat("no fast-register MR ", work.mr));
  }
  const MrState& mr = m->second;
  if (mr.pd != c->second.pd) {
    return SeedError(::mrd::STATUS_CONNECTION_INVALID,
                     "CONNECTION_OF_ANOTHER_PD",
                     "the connection belongs to another PD than the MR");
  }
  if (absl::StatusOr<PdState*> state = LivePdLocked(mr.pd); !state.ok()) {
    return state.status();
  }
  if (work.pages.empty() || work.pages.size() > mr.max_pages) {
    return Invalid(
        "BAD_PAGE_COUNT",
        absl::StrCat(work.pages.size(), " pages for an MR of ", mr.max_pages));
  }
  for (uint64_t p : work.pages) {
    if (p % page != 0) return Invalid("MISALIGNED_PAGE", "misaligned page");
    auto owner = logical_pages_.find(p);
    if (owner == logical_pages_.end() || lams_.at(owner->second).pd != mr.pd) {
      return Invalid(
          "UNKNOWN_LOGICAL_ADDRESS",
          absl::StrCat("page 0x", absl::Hex(p), " is not mapped in this PD"));
    }
  }
  if (work.fbo >= page || work.length == 0 ||
      work.length > work.pages.size() * page - work.fbo) {
    return Invalid("BAD_LENGTH", "fbo or length out of range");
  }
  if (work.base_address == 0 || work.base_address % page != work.fbo) {
    return Invalid("BAD_BASE_ADDRESS", "base address 0 or not fbo + n*page");
  }
  if (work.flags & ~kKnownWorkFlags) {
    return Invalid("UNKNOWN_WORK_FLAGS", "unknown work flags");
  }
  if (absl::Status s = AccessCheck(work.access); !s.ok()) return s;
  if ((work.access &
       (device::kAccessRemoteRead | device::kAccessRemoteWrite)) &&
      !mr.allow_remote) {
    return SeedError(::mrd::STATUS_ACCESS_VIOLATION, "MR_NOT_REMOTE",
                     "remote access on an MR allocated without it");
  }
  Work w;
  w.kind = device::WorkCompletion::Kind::kFastRegister;
  w.connection = connection;
  w.pd = mr.pd;
  w.id = next_work_id_++;
  w.fast_register = work;
  work_.push_back(std::move(w));
  return work_.back().id;
}

absl::StatusOr<uint64_t> FakeDevice::PostInvalidate(
    ConnectionId connection, const device::InvalidateWork& work) {
  if (absl::Status s = Enter(Op::kPostInvalidate); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto c = connections_.find(connection);
  if (c == connections_.end() || !c->second.connected || stopping_) {
    return SeedError(
        ::mrd::STATUS_CONNECTION_INVALID, "CONNECTION_NOT_CONNECTED",
        absl::StrCat("connection ", connection, " is not connected"));
  }
  auto m = mrs_.find(work.mr);
  if (m == mrs_.end() || !m->second.fast_register) {
    return NotFound("UNKNOWN_MR",
                    absl::StrCat("no fast-register MR ", work.mr));
  }
  if (m->second.pd != c->second.pd) {
    return SeedError(::mrd::STATUS_CONNECTION_INVALID,
                     "CONNECTION_OF_ANOTHER_PD",
                     "the connection belongs to another PD than the MR");
  }
  if (work.flags & ~kKnownWorkFlags) {
    return Invalid("UNKNOWN_WORK_FLAGS", "unknown work flags");
  }
  Work w;
  w.kind = device::WorkCompletion::Kind::kInvalidate;
  w.connection = connection;
  w.pd = m->second.pd;
  w.id = next_work_id_++;
  w.invalidate = work;
  work_.push_back(std::move(w));
  return work_.back().id;
}

std::optional<device::WorkCompletion> FakeDevice::ExecuteLocked(const Work& w) {
  auto pd = pds_.find(w.pd);
  if (pd == pds_.end() || pd->second.dying) return std::nullopt;
  const bool fast_register =
      w.kind == device::WorkCompletion::Kind::kFastRegister;
  device::WorkCompletion c;
  c.kind = w.kind;
  c.connection = w.connection;
  c.work_request = w.id;
  c.mr = fast_register ? w.fast_register.mr : w.invalidate.mr;
  c.request_context = fast_register ? w.fast_register.request_context
                                    : w.invalidate.request_context;
  const uint32_t flags =
      fast_register ? w.fast_register.flags : w.invalidate.flags;

  absl::Status status;
  auto conn = connections_.find(w.connection);
  auto m = mrs_.find(c.mr);
  if (!work_failures_.empty()) {
    status = std::move(work_failures_.front());
    work_failures_.pop_front();
  } else if (conn == connections_.end() || !conn->second.connected) {
    status = SeedError(::mrd::STATUS_CONNECTION_INVALID, "WORK_FLUSHED",
                       "the connection went down before the work ran");
  } else if (m == mrs_.end()) {
    status = Invalid("MR_GONE", "the MR was freed before the work ran");
  } else if (fast_register) {
    MrState& mr = m->second;
    std::vector<LamId> lams;
    for (uint64_t p : w.fast_register.pages) {
      auto owner = logical_pages_.find(p);
      if (owner == logical_pages_.end()) {
        status = Invalid("UNKNOWN_LOGICAL_ADDRESS",
                         "a page was released before the work ran");
        break;
      }
      if (std::find(lams.begin(), lams.end(), owner->second) == lams.end()) {
        lams.push_back(owner->second);
      }
    }
    if (status.ok() && mr.fast_registered) {
      status = Invalid("MR_NOT_FREE", "the MR is already fast-registered");
    }
    if (status.ok()) {
      mr.fast_registered = true;
      mr.rkey = NewKeyLocked();
      mr.base_address = w.fast_register.base_address;
      mr.length = w.fast_register.length;
      mr.access = w.fast_register.access;
      mr.mapped_lams = std::move(lams);
      valid_rkeys_[mr.rkey] = c.mr;
      c.rkey = mr.rkey;
    }
  } else {
    MrState& mr = m->second;
    if (mr.fast_registered) {
      valid_rkeys_.erase(mr.rkey);
      mr.fast_registered = false;
      mr.mapped_lams.clear();
      mr.base_address = 0;
      mr.length = 0;
      mr.access = 0;
    }
  }
  if (status.ok() && (flags & device::kWorkSilentSuccess)) return std::nullopt;
  c.status = std::move(status);
  return c;
}

void FakeDevice::Deliver(const Delivery& d) {
  device::PdEventSink* sink;
  {
    absl::MutexLock lock(&mu_);
    auto it = pds_.find(d.pd);
    if (it == pds_.end() || it->second.dying) return;
    ++it->second.deliveries_in_flight;
    sink = it->second.sink;
  }
  switch (d.kind) {
    case Delivery::Kind::kCompletion:
      sink->OnCompletion(d.completion);
      break;
    case Delivery::Kind::kConnected:
      sink->OnPeerConnected(d.connection, d.peer);
      break;
    case Delivery::Kind::kDisconnected:
      sink->OnPeerDisconnected(d.connection);
      break;
  }
  absl::MutexLock lock(&mu_);
  --pds_.at(d.pd).deliveries_in_flight;
}

int FakeDevice::RunPostedWork() {
  absl::MutexLock run_lock(&run_mu_);
  std::vector<Delivery> deliveries;
  int executed = 0;
  {
    absl::MutexLock lock(&mu_);
    while (!work_.empty()) {
      Work w = std::move(work_.front());
      work_.pop_front();
      ++executed;
      std::optional<device::WorkCompletion> c = ExecuteLocked(w);
      if (!c.has_value()) continue;
      Delivery d;
      d.pd = w.pd;
      d.kind = Delivery::Kind::kCompletion;
      d.completion = std::move(*c);
      deliveries.push_back(std::move(d));
    }
  }
  for (const Delivery& d : deliveries) Deliver(d);
  return executed;
}

// --- peers
// ----------------------------------------------------------------------

absl::StatusOr<ConnectionId> FakeDevice::ConnectPeer(PdId pd) {
  Delivery d;
  {
    absl::MutexLock lock(&mu_);
    if (absl::StatusOr<PdState*> state = LivePdLocked(pd); !state.ok()) {
      return state.status();
    }
    ConnectionId id = next_id_++;
    connections_[id].pd = pd;
    d.pd = pd;
    d.kind = Delivery::Kind::kConnected;
    d.connection = id;
    d.peer = absl::StrCat("fake-peer-", id);
  }
  Deliver(d);
  return d.connection;
}

absl::StatusOr<ConnectionId> FakeDevice::ConnectPeerWithTicket(
    const std::string& ticket) {
  PdId pd;
  {
    absl::MutexLock lock(&mu_);
    auto it = tickets_.find(ticket);
    if (it == tickets_.end()) {
      return NotFound("UNKNOWN_TICKET", "no such peer ticket");
    }
    pd = it->second;
  }
  return ConnectPeer(pd);
}

absl::Status FakeDevice::DisconnectPeer(ConnectionId connection) {
  Delivery d;
  {
    absl::MutexLock lock(&mu_);
    auto it = connections_.find(connection);
    if (it == connections_.end() || !it->second.connected) {
      return NotFound("UNKNOWN_CONNECTION",
                      absl::StrCat("no connected connection ", connection));
    }
    it->second.connected = false;
    d.pd = it->second.pd;
    d.kind = Delivery::Kind::kDisconnected;
    d.connection = connection;
  }
  Deliver(d);
  return absl::OkStatus();
}

// --- controls
// -------------------------------------------------------------------

void FakeDevice::FailNext(Op op, absl::Status status) {
  absl::MutexLock lock(&mu_);
  failures_[op].push_back(std::move(status));
}

void FakeDevice::FailNextWork(absl::Status status) {
  absl::MutexLock lock(&mu_);
  work_failures_.push_back(std::move(status));
}

void FakeDevice::SetDelay(Op op, absl::Duration delay) {
  absl::MutexLock lock(&mu_);
  delays_[op] = delay;
}

void FakeDevice::HoldCalls(Op op) {
  absl::MutexLock lock(&mu_);
  held_.insert(op);
}

void FakeDevice::ReleaseCalls(Op op) {
  absl::MutexLock lock(&mu_);
  held_.erase(op);
}

bool FakeDevice::AwaitHeldCalls(Op op, uint64_t count, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return held_calls_[op] >= count;
  };
  return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
}

void FakeDevice::SetHealth(device::DeviceHealth health) {
  absl::MutexLock lock(&mu_);
  health_ = std::move(health);
}

// --- queries
// --------------------------------------------------------------------

size_t FakeDevice::LiveMrCount() const {
  absl::MutexLock lock(&mu_);
  return mrs_.size();
}

size_t FakeDevice::LiveRegisteredMrCount() const {
  absl::MutexLock lock(&mu_);
  return static_cast<size_t>(
      std::count_if(mrs_.begin(), mrs_.end(),
                    [](const auto& m) { return !m.second.fast_register; }));
}

size_t FakeDevice::LiveFastRegisterMrCount() const {
  absl::MutexLock lock(&mu_);
  return static_cast<size_t>(
      std::count_if(mrs_.begin(), mrs_.end(),
                    [](const auto& m) { return m.second.fast_register; }));
}

size_t FakeDevice::LiveLamCount() const {
  absl::MutexLock lock(&mu_);
  return lams_.size();
}

size_t FakeDevice::LivePdCount() const {
  absl::MutexLock lock(&mu_);
  return pds_.size();
}

size_t FakeDevice::LiveConnectionCount() const {
  absl::MutexLock lock(&mu_);
  return static_cast<size_t>(
      std::count_if(connections_.begin(), connections_.end(),
                    [](const auto& c) { return c.second.connected; }));
}

size_t FakeDevice::PendingWorkCount() const {
  absl::MutexLock lock(&mu_);
  return work_.size();
}

std::vector<PdId> FakeDevice::LivePds() const {
  absl::MutexLock lock(&mu_);
  std::vector<PdId> out;
  for (const auto& [id, pd] : pds_) {
    if (!pd.dying) out.push_back(id);
  }
  return out;
}

PdId FakeDevice::NewestPd() const {
  std::vector<PdId> pds = LivePds();
  return pds.empty() ? 0 : pds.back();
}

uint64_t FakeDevice::Calls(Op op) const {
  absl::MutexLock lock(&mu_);
  auto it = calls_.find(op);
  return it == calls_.end() ? 0 : it->second;
}

bool FakeDevice::IsKeyValid(uint32_t rkey) const {
  absl::MutexLock lock(&mu_);
  return valid_rkeys_.contains(rkey);
}

absl::Status FakeDevice::PeerAccess(uint32_t rkey, uint64_t address,
                                    uint64_t length, bool write) const {
  absl::MutexLock lock(&mu_);
  auto k = valid_rkeys_.find(rkey);
  if (k == valid_rkeys_.end()) {
    return absl::PermissionDeniedError(
        absl::StrCat("rkey 0x", absl::Hex(rkey), " is not valid"));
  }
  const MrState& mr = mrs_.at(k->second);
  const uint32_t needed =
      write ? device::kAccessRemoteWrite : device::kAccessRemoteRead;
  if (!(mr.access & needed)) {
    return absl::PermissionDeniedError(absl::StrCat("rkey 0x", absl::Hex(rkey),
                                                    " does not grant remote ",
                                                    write ? "write" : "read"));
  }
  if (length == 0 || address < mr.base_address ||
      address - mr.base_address > mr.length ||
      length > mr.length - (address - mr.base_address)) {
    return absl::PermissionDeniedError("out of the region's bounds");
  }
  return absl::OkStatus();
}

bool FakeDevice::IsFastRegistered(MrId mr) const {
  absl::MutexLock lock(&mu_);
  auto it = mrs_.find(mr);
  return it != mrs_.end() && it->second.fast_registered;
}

absl::Status FakeDevice::CheckLiveMemory() const {
  absl::MutexLock lock(&mu_);
  auto check = [this](absl::string_view what, uint64_t id,
                      const SpanIdentity& m) -> absl::Status {
    const uint64_t page = attributes_.page_size;
    const uint64_t address = reinterpret_cast<uintptr_t>(m.span.host_address);
    if (::msync(reinterpret_cast<void*>(address / page * page),
                PageRound(address, m.span.length), MS_ASYNC) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, " ", id, ": its memory at 0x", absl::Hex(address),
                       " is no longer mapped"));
    }
    struct stat st;
    if (::fstat(m.span.fd, &st) != 0 ||
        static_cast<uint64_t>(st.st_dev) != m.file_device ||
        static_cast<uint64_t>(st.st_ino) != m.file_inode) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, " ", id, ": its fd ", m.span.fd,
                       " no longer refers to the registered file"));
    }
    return absl::OkStatus();
  };
  for (const auto& [id, mr] : mrs_) {
    if (mr.fast_register) continue;
    if (absl::Status s = check("MR", id, mr.memory); !s.ok()) return s;
  }
  for (const auto& [id, lam] : lams_) {
    if (absl::Status s = check("LAM", id, lam.memory); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace mrd::fake
