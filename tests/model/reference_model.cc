#include "tests/model/reference_model.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/message_differencer.h"
#include "mrd/status.h"
#include "mrd/status_proto.h"

namespace mrd::model_test {
namespace {

constexpr uint32_t kDescriptorSize = 24;
constexpr uint32_t kMaxPageList = 4096;  // the software device's default
constexpr size_t kDeadTokensKept = 48;

std::string Hex(uint64_t v) { return absl::StrCat("0x", absl::Hex(v)); }

// The first mismatch of an expected error.
std::string ExpectError(absl::string_view op, const absl::Status& actual,
                        absl::string_view reason, uint64_t required_size = 0) {
  if (actual.ok()) {
    return absl::StrCat(op, ": expected error ", reason, ", got OK");
  }
  const ::mrd::ErrorDetail detail = GetErrorDetail(actual);
  if (detail.reason() != reason) {
    return absl::StrCat(op, ": expected error ", reason, ", got ",
                        DescribeStatus(actual));
  }
  if (required_size != 0 && detail.required_size() != required_size) {
    return absl::StrCat(op, ": expected required_size ", required_size,
                        " with ", reason, ", got ", detail.required_size());
  }
  return "";
}

std::string ExpectOk(absl::string_view op, const absl::Status& actual,
                     absl::string_view context = "") {
  if (actual.ok()) return "";
  return absl::StrCat(op, ": expected success", context, ", got ",
                      DescribeStatus(actual));
}

absl::Status ModelError(absl::string_view reason) {
  return absl::InvalidArgumentError(reason);
}

std::string EncodeDescriptor(uint32_t rkey, uint64_t base, uint64_t length) {
  std::string d;
  auto put = [&d](uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) {
      d.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    }
  };
  put(rkey, 4);
  put(0, 4);
  put(base, 8);
  put(length, 8);
  return d;
}

uint32_t FlagsFromAccess(uint32_t access) {
  uint32_t flags = 0;
  if (access & kLocalWrite) flags |= 0x1;
  if (access & kRemoteRead) flags |= 0x2;
  if (access & kRemoteWrite) flags |= 0x4;
  if (access & kReadSink) flags |= 0x8;
  return flags;
}

// The span rules of a buffer range (R2), or the reason it is refused.
std::optional<std::string> SpanError(uint64_t size, uint64_t offset,
                                     uint64_t length) {
  if (length == 0) return "ZERO_LENGTH";
  if (offset >= size) return "OFFSET_PAST_END";
  if (length > std::numeric_limits<uint64_t>::max() - offset) {
    return "LENGTH_OVERFLOW";
  }
  if (offset + length > size) return "LENGTH_PAST_BUFFER";
  return std::nullopt;
}

}  // namespace

std::string DescribeStatus(const absl::Status& status) {
  if (status.ok()) return "OK";
  const ::mrd::ErrorDetail d = GetErrorDetail(status);
  return absl::StrCat(absl::StatusCodeToString(status.code()), " [",
                      ::mrd::SeedStatusName(d.seed_status()), " ", d.reason(),
                      "] ", status.message());
}

absl::StatusOr<uint32_t> ModelRegistrationAccess(uint32_t flags,
                                                 uint32_t mem_flags) {
  if (flags != 0 && mem_flags != 0) return ModelError("BOTH_FLAG_FORMS");
  if (mem_flags != 0) {
    if (mem_flags & ~uint32_t{0x3}) return ModelError("UNKNOWN_MEM_FLAGS");
    uint32_t access = 0;
    if (mem_flags & 0x1) access |= kRemoteRead;                 // MEM_READ
    if (mem_flags & 0x2) access |= kRemoteWrite | kLocalWrite;  // MEM_WRITE
    return access;
  }
  if (flags & ~uint32_t{0xF}) return ModelError("UNKNOWN_FLAGS");
  // 0x4 exists only inside REMOTE_WRITE (0x5).
  if ((flags & 0x4) && !(flags & 0x1)) return ModelError("UNKNOWN_FLAGS");
  uint32_t access = 0;
  if (flags & 0x1) access |= kLocalWrite;
  if (flags & 0x2) access |= kRemoteRead;
  if (flags & 0x4) access |= kRemoteWrite;
  if (flags & 0x8) access |= kReadSink;
  return access;
}

ReferenceModel::ReferenceModel(uint64_t page_size) : page_size_(page_size) {}

uint64_t ReferenceModel::PageSpan(uint64_t page_size, uint64_t offset,
                                  uint64_t length) {
  return (offset + length - 1) / page_size - offset / page_size + 1;
}

// --- sessions ----------------------------------------------------------------

uint64_t ReferenceModel::OpenSession(const std::string& token, bool lease,
                                     absl::Duration ttl) {
  Session s;
  s.id = next_session_++;
  s.token = token;
  s.lease = lease;
  s.ttl = ttl;
  if (lease) s.expires = now_ + ttl;
  const uint64_t id = s.id;
  sessions_.emplace(id, std::move(s));
  return id;
}

Session* ReferenceModel::Find(uint64_t session) {
  auto it = sessions_.find(session);
  return it == sessions_.end() ? nullptr : &it->second;
}

const Session* ReferenceModel::Find(uint64_t session) const {
  auto it = sessions_.find(session);
  return it == sessions_.end() ? nullptr : &it->second;
}

void ReferenceModel::Touch(uint64_t session) {
  if (Session* s = Find(session)) Touch(*s);
}

void ReferenceModel::Touch(Session& s) {
  if (s.lease) s.expires = now_ + s.ttl;
}

void ReferenceModel::Kill(const Token& token) {
  dead_.push_back(token);
  while (dead_.size() > kDeadTokensKept) dead_.pop_front();
}

void ReferenceModel::EndSession(uint64_t session) {
  Session* s = Find(session);
  if (s == nullptr) return;
  for (const auto& [entry, r] : s->regs) {
    Kill(Token{r.rkey, r.base, r.length, s->id,
               absl::StrCat("registration ", entry, " of an ended session")});
  }
  for (const auto& [id, m] : s->mrs) {
    if (m.fast && m.valid && m.key_known) {
      Kill(Token{
          m.key, m.base, m.length, s->id,
          absl::StrCat("fast-registered MR ", id, " of an ended session")});
    }
  }
  sessions_.erase(session);
}

std::vector<uint64_t> ReferenceModel::ExpiredLeases() const {
  std::vector<uint64_t> out;
  for (const auto& [id, s] : sessions_) {
    if (s.lease && now_ >= s.expires) out.push_back(id);
  }
  return out;
}

std::string ReferenceModel::CallOnEndedSession(
    absl::string_view op, const absl::Status& actual) const {
  return ExpectError(absl::StrCat(op, " on an ended session"), actual,
                     "SESSION_NOT_CONNECTED");
}

// --- checks of server-chosen values ---------------------------------------

std::string ReferenceModel::CheckNewHandle(absl::string_view what,
                                           uint64_t id) {
  if (id <= max_handle_) {
    return absl::StrCat(what, ": handle ", id,
                        " is not new (handles so far reach ", max_handle_, ")");
  }
  max_handle_ = id;
  return "";
}

std::string ReferenceModel::CheckNewRkey(absl::string_view what,
                                         uint32_t rkey) const {
  for (const auto& [sid, s] : sessions_) {
    for (const auto& [entry, r] : s.regs) {
      if (r.rkey == rkey) {
        return absl::StrCat(what, ": key ", Hex(rkey),
                            " is already the key of live registration ", entry,
                            " of session ", sid);
      }
    }
    for (const auto& [id, m] : s.mrs) {
      if (m.fast && m.key_known && m.key == rkey) {
        return absl::StrCat(what, ": key ", Hex(rkey),
                            " is already the key of fast-register MR ", id,
                            " of session ", sid);
      }
    }
    for (const auto& [id, l] : s.lams) {
      if (l.privileged_token != 0 && l.privileged_token == rkey) {
        return absl::StrCat(what, ": key ", Hex(rkey),
                            " is already the privileged token of LAM ", id);
      }
    }
  }
  return "";
}

// --- buffers
// -------------------------------------------------------------------

std::string ReferenceModel::ImportBuffer(
    uint64_t sid, int file, uint64_t size, bool writable, uint64_t device,
    uint64_t inode, const std::string& source,
    const absl::StatusOr<v1::BufferInfo>& actual) {
  const std::string op = "Import";
  Session* s = Find(sid);
  if (s == nullptr) return CallOnEndedSession(op, actual.status());
  Touch(*s);
  if (std::string e = ExpectOk(op, actual.status()); !e.empty()) return e;
  const v1::BufferInfo& info = *actual;
  if (std::string e = CheckNewHandle("buffer", info.buffer()); !e.empty()) {
    return e;
  }
  constexpr uint64_t kAlign = uint64_t{2} << 20;
  const uint64_t address = s->next_buffer_address;
  if (info.size() != size || info.writable() != writable ||
      info.device() != device || info.inode() != inode ||
      info.source() != source || info.address() != address) {
    return absl::StrCat(op, ": expected size ", size, " writable ", writable,
                        " device ", device, " inode ", inode, " source ",
                        source, " address ", Hex(address), ", got ",
                        info.ShortDebugString());
  }
  s->next_buffer_address += (size + kAlign - 1) / kAlign * kAlign + kAlign;
  Buffer b;
  b.id = info.buffer();
  b.file = file;
  b.size = size;
  b.writable = writable;
  b.address = address;
  s->buffers.emplace(b.id, b);
  return "";
}

void ReferenceModel::RemoveRegistration(Session& s, uint64_t entry,
                                        absl::string_view why) {
  auto it = s.regs.find(entry);
  if (it == s.regs.end()) return;
  const Registration& r = it->second;
  Kill(Token{r.rkey, r.base, r.length, s.id,
             absl::StrCat("registration ", entry, " (", why, ")")});
  for (auto& [id, m] : s.mrs) {
    if (!m.fast && m.registration == entry) m.registration = 0;
  }
  s.regs.erase(it);
}

std::string ReferenceModel::ReleaseBuffer(
    uint64_t sid, uint64_t buffer,
    const absl::StatusOr<v1::ReleaseBufferResponse>& actual) {
  const std::string op = absl::StrCat("ReleaseBuffer ", buffer);
  Session* s = Find(sid);
  if (s == nullptr) return CallOnEndedSession(op, actual.status());
  Touch(*s);
  if (!s->buffers.contains(buffer)) {
    return ExpectError(op, actual.status(), "UNKNOWN_BUFFER");
  }
  std::vector<uint64_t> entries;
  for (const auto& [entry, r] : s->regs) {
    if (r.buffer == buffer) entries.push_back(entry);
  }
  std::vector<uint64_t> lams;
  for (const auto& [id, l] : s->lams) {
    if (l.buffer == buffer) lams.push_back(id);
  }
  if (std::string e = ExpectOk(op, actual.status()); !e.empty()) return e;
  if (actual->invalidated_registrations() != entries.size() ||
      actual->released_lams() != lams.size()) {
    return absl::StrCat(op, ": expected ", entries.size(),
                        " invalidated registrations and ", lams.size(),
                        " released LAMs, got ", actual->ShortDebugString());
  }
  // W11: everything made on the buffer goes with it.
  for (uint64_t entry : entries) {
    RemoveRegistration(*s, entry, "its buffer was released");
  }
  for (auto& [id, m] : s->mrs) {
    if (!m.fast || !m.valid) continue;
    bool maps = false;
    for (uint64_t lam : m.lams) {
      maps = maps || std::find(lams.begin(), lams.end(), lam) != lams.end();
    }
    if (!maps) continue;
    // mrd replaces the device MR object: the token dies, the lkey changes,
    // posted work for the old object fails.
    if (m.key_known) {
      Kill(Token{m.key, m.base, m.length, s->id,
                 absl::StrCat("fast-registered MR ", id,
                              " (its LAM's buffer was released)")});
    }
    m.valid = false;
    m.key_known = false;
    m.pages.clear();
    m.lams.clear();
    ++m.generation;
    m.lkey_known = false;
  }
  for (uint64_t id : lams) {
    for (uint64_t page : s->lams[id].pages) s->page_map.erase(page);
    s->lams.erase(id);
  }
  s->buffers.erase(buffer);
  return "";
}

// --- registration ------------------------------------------------------------

std::string ReferenceModel::Register(
    uint64_t sid, const RegisterParams& p,
    const absl::StatusOr<v1::RegisterMrResponse>& actual) {
  const std::string op = absl::StrCat(
      "RegisterMr(buffer ", p.buffer, " [", p.offset, ", +", p.length,
      ") flags ", Hex(p.flags), " mem ", Hex(p.mem_flags),
      p.has_base ? " base " : "", p.has_base ? Hex(p.base) : "", " mr ", p.mr,
      " id '", p.request_id, "')");
  Session* s = Find(sid);
  if (s == nullptr) return CallOnEndedSession(op, actual.status());
  Touch(*s);
  absl::StatusOr<uint32_t> access =
      ModelRegistrationAccess(p.flags, p.mem_flags);
  if (!access.ok()) {
    return ExpectError(op, actual.status(), access.status().message());
  }
  if (p.descriptor_capacity != 0 && p.descriptor_capacity < kDescriptorSize) {
    return ExpectError(op, actual.status(), "DESCRIPTOR_SPACE_TOO_SMALL",
                       kDescriptorSize);
  }
  if (!p.request_id.empty()) {
    auto seen = s->request_ids.find(p.request_id);
    if (seen != s->request_ids.end()) {
      auto r = s->regs.find(seen->second.registration());
      if (r != s->regs.end()) {
        // A retry: the first answer again, nothing changes.
        if (std::string e = ExpectOk(op, actual.status(), " (a retry)");
            !e.empty()) {
          return e;
        }
        v1::RegisterMrResponse want = seen->second;
        want.set_references(r->second.refs());
        if (!google::protobuf::util::MessageDifferencer::Equals(want,
                                                                *actual)) {
          return absl::StrCat(op, ": a retry must return the first answer ",
                              want.ShortDebugString(), ", got ",
                              actual->ShortDebugString());
        }
        return "";
      }
      s->request_ids.erase(seen);  // released since: a new registration
    }
  }
  // The Winsock form (MEM_* flags, W2) reports memory that is not the
  // caller's as WSAEFAULT.
  const bool winsock = p.mem_flags != 0;
  auto b = s->buffers.find(p.buffer);
  if (b == s->buffers.end()) {
    return ExpectError(
        op, actual.status(),
        winsock ? "BUFFER_OUTSIDE_CALLER_MEMORY" : "UNKNOWN_BUFFER");
  }
  if (p.mr != 0) {
    auto m = s->mrs.find(p.mr);
    if (m == s->mrs.end())
      return ExpectError(op, actual.status(), "UNKNOWN_MR");
    if (m->second.fast) {
      return ExpectError(op, actual.status(), "MR_IS_FAST_REGISTER");
    }
    if (m->second.registration != 0) {
      return ExpectError(op, actual.status(), "MR_ALREADY_REGISTERED");
    }
  }
  if ((*access & (kLocalWrite | kRemoteWrite)) && !b->second.writable) {
    return ExpectError(op, actual.status(), "BUFFER_READ_ONLY");
  }
  if (std::optional<std::string> e =
          SpanError(b->second.size, p.offset, p.length)) {
    return ExpectError(op, actual.status(),
                       winsock ? "BUFFER_OUTSIDE_CALLER_MEMORY" : *e);
  }
  const uint64_t base = p.has_base ? p.base : b->second.address + p.offset;
  if (p.has_base && p.base == 0) {
    return ExpectError(op, actual.status(), "ZERO_BASED_ADDRESS");
  }
  if (base > std::numeric_limits<uint64_t>::max() - p.length) {
    return ExpectError(op, actual.status(), "BASE_ADDRESS_OVERFLOW");
  }
  // W5: the same buffer, range, access and base share one registration.
  Registration* hit = nullptr;
  for (auto& [entry, r] : s->regs) {
    if (r.buffer == p.buffer && r.offset == p.offset && r.length == p.length &&
        r.access == *access && r.base == base) {
      hit = &r;
    }
  }
  if (std::string e = ExpectOk(op, actual.status()); !e.empty()) return e;
  const v1::RegisterMrResponse& got = *actual;
  if (got.base_address() != base || got.length() != p.length ||
      got.mr() != p.mr) {
    return absl::StrCat(op, ": expected base ", Hex(base), " length ", p.length,
                        " mr ", p.mr, ", got ", got.ShortDebugString());
  }
  Registration* r = hit;
  if (hit != nullptr) {
    if (!got.cache_hit() || got.registration() != hit->entry ||
        got.rkey() != hit->rkey || got.lkey() != hit->lkey ||
        got.rdma_descriptor() != hit->descriptor ||
        got.references() != hit->refs() + 1) {
      return absl::StrCat(op, ": expected a cache hit on registration ",
                          hit->entry, " (rkey ", Hex(hit->rkey), ", ",
                          hit->refs() + 1,
                          " references, the same "
                          "descriptor), got ",
                          got.ShortDebugString());
    }
  } else {
    if (got.cache_hit() || got.references() != 1) {
      return absl::StrCat(op,
                          ": expected a new registration with 1 "
                          "reference, got ",
                          got.ShortDebugString());
    }
    if (got.registration() <= max_entry_) {
      return absl::StrCat(op, ": registration id ", got.registration(),
                          " is not new (ids so far reach ", max_entry_, ")");
    }
    if (std::string e = CheckNewRkey(op, got.rkey()); !e.empty()) return e;
    if (got.rdma_descriptor() != EncodeDescriptor(got.rkey(), base, p.length)) {
      return absl::StrCat(op, ": the descriptor is not rkey|base|length");
    }
    max_entry_ = got.registration();
    Registration fresh;
    fresh.entry = got.registration();
    fresh.buffer = p.buffer;
    fresh.offset = p.offset;
    fresh.length = p.length;
    fresh.access = *access;
    fresh.base = base;
    fresh.lkey = got.lkey();
    fresh.rkey = got.rkey();
    fresh.descriptor = got.rdma_descriptor();
    r = &s->regs.emplace(fresh.entry, fresh).first->second;
  }
  if (p.mr != 0) {
    ++r->mr_refs;
    s->mrs[p.mr].registration = r->entry;
  } else {
    ++r->implicit_refs;
  }
  if (!p.request_id.empty()) {
    s->request_ids[p.request_id] = got;
    ++s->request_ids_used;
  }
  return "";
}

std::string ReferenceModel::Deregister(uint64_t sid, bool by_mr,
                                       uint64_t target,
                                       const absl::StatusOr<uint32_t>& actual) {
  const std::string op =
      absl::StrCat("DeregisterMr(", by_mr ? "mr " : "reg ", target, ")");
  Session* s = Find(sid);
  if (s == nullptr) return CallOnEndedSession(op, actual.status());
  Touch(*s);
  uint64_t entry = 0;
  if (by_mr) {
    auto m = s->mrs.find(target);
    if (m == s->mrs.end())
      return ExpectError(op, actual.status(), "UNKNOWN_MR");
    if (m->second.fast) {
      return ExpectError(op, actual.status(), "MR_IS_FAST_REGISTER");
    }
    if (m->second.registration == 0) {
      return ExpectError(op, actual.status(), "MR_NOT_REGISTERED");
    }
    entry = m->second.registration;
  } else {
    auto r = s->regs.find(target);
    if (r == s->regs.end()) {
      return ExpectError(op, actual.status(), "UNKNOWN_REGISTRATION");
    }
    if (r->second.implicit_refs == 0) {
      return ExpectError(op, actual.status(), "HELD_BY_MR_OBJECT");
    }
    entry = target;
  }
  Registration& r = s->regs[entry];
  const uint32_t left = r.refs() - 1;
  if (std::string e = ExpectOk(op, actual.status()); !e.empty()) return e;
  if (*actual != left) {
    return absl::StrCat(op, ": expected ", left, " references left, got ",
                        *actual);
  }
  if (by_mr) {
    --r.mr_refs;
    s->mrs[target].registration = 0;
  } else {
    --r.implicit_refs;
  }
  if (left == 0) RemoveRegistration(*s, entry, "deregistered");
  return "";
}

// --- MR objects
// ----------------------------------------------------------------

std::string ReferenceModel::CreateMr(uint64_t sid, bool fast, bool allow_remote,
                                     const absl::StatusOr<v1::MrInfo>& actual) {
  const std::string op =
      absl::StrCat("CreateMr(fast ", fast, " remote ", allow_remote, ")");
  Session* s = Find(sid);
  if (s == nullptr) return CallOnEndedSession(op, actual.status());
  Touch(*s);
  if (std::string e = ExpectOk(op, actual.status()); !e.empty()) return e;
  if (std::string e = CheckNewHandle("MR", actual->mr()); !e.empty()) return e;
  if (actual->fast_register() != fast ||
      actual->allow_remote_access() != allow_remote ||
      actual->state() != "free" || (!fast && actual->lkey() != 0)) {
    return absl::StrCat(op, ": got ", actual->ShortDebugString());
  }
  if (fast) {
    if (std::string e = CheckNewRkey(op, actual->lkey()); !e.empty()) return e;
  }
  Mr m;
  m.id = actual->mr();
  m.fast = fast;
  m.allow_remote = allow_remote;
  m.lkey = actual->lkey();
  m.key = m.lkey;
  m.key_known = fast;
  s->mrs.emplace(m.id, m);
  return "";
}

std::string ReferenceModel::CloseMr(uint64_t sid, uint64_t mr,
                                    const absl::Status& actual) {
  const std::string op = absl::StrCat("CloseMr ", mr);
  Session* s = Find(sid);
  if (s == nullptr) return CallOnEndedSession(op, actual);
  Touch(*s);
  auto m = s->mrs.find(mr);
  if (m == s->mrs.end()) return ExpectError(op, actual, "UNKNOWN_MR");
  if (std::string e = ExpectOk(op, actual); !e.empty()) return e;
  if (m->second.fast) {
    if (m->second.valid && m->second.key_known) {
      Kill(Token{m->second.key, m->second.base, m->second.length, s->id,
                 absl::StrCat("fast-registered MR ", mr, " (closed)")});
    }
  } else if (m->second.registration != 0) {
    Registration& r = s->regs[m->second.registration];
    --r.mr_refs;
    if (r.refs() == 0) RemoveRegistration(*s, r.entry, "its MR was closed");
  }
  s->mrs.erase(mr);
  return "";
}

// --- LAMs
// -----------------------------------------------------------------------

std::string ReferenceModel::BuildLam(
    uint64_t sid, uint64_t buffer, uint64_t offset, uint64_t length,
    uint32_t lam_capacity, const absl::StatusOr<v1::BuildLamResponse>& actual) {
  const std::string op =
      absl::StrCat("BuildLam(buffer ", buffer, " [", offset, ", +", length,
                   ") capacity ", lam_capacity, ")");
  Session* s = Find(sid);
  if (s == nullptr) return CallOnEndedSession(op, actual.status());
  Touch(*s);
  auto b = s->buffers.find(buffer);
  if (b == s->buffers.end()) {
    return ExpectError(op, actual.status(), "UNKNOWN_BUFFER");
  }
  if (std::optional<std::string> e =
          SpanError(b->second.size, offset, length)) {
    return ExpectError(op, actual.status(), *e);
  }
  const uint64_t count = PageSpan(page_size_, offset, length);
  const uint64_t lam_size = 8 + 8 * count;
  if (lam_capacity != 0 && lam_capacity < lam_size) {
    return ExpectError(op, actual.status(), "LAM_SPACE_TOO_SMALL", lam_size);
  }
  if (std::string e = ExpectOk(op, actual.status()); !e.empty()) return e;
  const v1::BuildLamResponse& got = *actual;
  if (std::string e = CheckNewHandle("LAM", got.lam()); !e.empty()) return e;
  if (static_cast<uint64_t>(got.pages_size()) != count ||
      got.fbo() != offset % page_size_ || got.length() != length ||
      got.lam_size() != lam_size) {
    return absl::StrCat(op, ": expected ", count, " pages, fbo ",
                        offset % page_size_, ", length ", length, ", lam_size ",
                        lam_size, ", got ", got.ShortDebugString());
  }
  for (uint64_t page : got.pages()) {
    if (page % page_size_ != 0 || page == 0) {
      return absl::StrCat(op, ": logical page ", Hex(page),
                          " is not a non-zero PAGE_SIZE multiple");
    }
    if (!logical_pages_seen_.insert(page).second) {
      return absl::StrCat(op, ": logical page ", Hex(page),
                          " was handed out before");
    }
  }
  if (got.privileged_token() != 0) {
    if (std::string e = CheckNewRkey(op, got.privileged_token()); !e.empty()) {
      return e;
    }
  }
  Lam l;
  l.id = got.lam();
  l.buffer = buffer;
  l.offset = offset;
  l.length = length;
  l.pages.assign(got.pages().begin(), got.pages().end());
  l.fbo = got.fbo();
  l.privileged_token = got.privileged_token();
  for (uint64_t i = 0; i < l.pages.size(); ++i) {
    s->page_map[l.pages[i]] = MappedPage{l.id, i};
  }
  s->lams.emplace(l.id, std::move(l));
  return "";
}

std::string ReferenceModel::ReleaseLam(uint64_t sid, uint64_t lam,
                                       const absl::Status& actual) {
  const std::string op = absl::StrCat("ReleaseLam ", lam);
  Session* s = Find(sid);
  if (s == nullptr) return CallOnEndedSession(op, actual);
  Touch(*s);
  auto l = s->lams.find(lam);
  if (l == s->lams.end()) return ExpectError(op, actual, "UNKNOWN_LAM");
  for (const auto& [id, m] : s->mrs) {
    if (m.fast && m.valid &&
        std::find(m.lams.begin(), m.lams.end(), lam) != m.lams.end()) {
      return ExpectError(op, actual, "LAM_IN_USE");
    }
  }
  if (std::string e = ExpectOk(op, actual); !e.empty()) return e;
  for (uint64_t page : l->second.pages) s->page_map.erase(page);
  s->lams.erase(l);
  return "";
}

// --- fast registration
// ---------------------------------------------------------

std::string ReferenceModel::FastRegister(
    uint64_t sid, const FastRegisterParams& p,
    const absl::StatusOr<v1::FastRegisterResponse>& actual) {
  const std::string op = absl::StrCat(
      "FastRegister(mr ", p.mr, " conn ", p.connection, " ", p.pages.size(),
      " pages fbo ", p.fbo, " length ", p.length, " base ", Hex(p.base),
      " flags ", Hex(p.flags), " ctx ", p.request_context, ")");
  Session* s = Find(sid);
  if (s == nullptr) return CallOnEndedSession(op, actual.status());
  Touch(*s);
  // F3: flags.
  constexpr uint32_t kKnown = kOpSilent | kOpReadFence | kOpRemoteRead |
                              kOpLocalWrite | kOpRemoteWrite | kOpReadSink |
                              kOpDefer;
  if ((p.flags & ~kKnown) || ((p.flags & 0x20) && !(p.flags & 0x10))) {
    return ExpectError(op, actual.status(), "UNKNOWN_FLAGS");
  }
  uint32_t access = 0;
  if (p.flags & kOpRemoteRead) access |= kRemoteRead;
  if (p.flags & kOpLocalWrite) access |= kLocalWrite;
  if (p.flags & 0x20) access |= kRemoteWrite;
  if (p.flags & kOpReadSink) access |= kReadSink;
  // F2/F6: the page array.
  if (p.pages.empty()) {
    return ExpectError(op, actual.status(), "EMPTY_PAGE_ARRAY");
  }
  if (p.pages.size() > kMaxPageList) {
    return ExpectError(op, actual.status(), "PAGE_ARRAY_TOO_LONG");
  }
  for (uint64_t page : p.pages) {
    if (page % page_size_ != 0) {
      return ExpectError(op, actual.status(), "MISALIGNED_PAGE");
    }
  }
  if (p.fbo >= page_size_) {
    return ExpectError(op, actual.status(), "FBO_TOO_LARGE");
  }
  if (p.length == 0) return ExpectError(op, actual.status(), "ZERO_LENGTH");
  if (p.length > p.pages.size() * page_size_ - p.fbo) {
    return ExpectError(op, actual.status(), "LENGTH_EXCEEDS_PAGES");
  }
  if (p.base == 0) {
    return ExpectError(op, actual.status(), "ZERO_BASED_ADDRESS");
  }
  if (p.base % page_size_ != p.fbo) {
    return ExpectError(op, actual.status(), "BASE_NOT_AT_FBO");
  }
  // C1/F4: the MR object.
  auto m = s->mrs.find(p.mr);
  if (m == s->mrs.end()) return ExpectError(op, actual.status(), "UNKNOWN_MR");
  if (!m->second.fast) {
    return ExpectError(op, actual.status(), "MR_NOT_FAST_REGISTER");
  }
  if ((access & (kRemoteRead | kRemoteWrite)) && !m->second.allow_remote) {
    return ExpectError(op, actual.status(), "MR_NOT_REMOTE");
  }
  for (uint64_t page : p.pages) {
    auto mapped = s->page_map.find(page);
    if (mapped == s->page_map.end()) {
      return ExpectError(op, actual.status(), "UNKNOWN_LOGICAL_ADDRESS");
    }
    const Lam& lam = s->lams[mapped->second.lam];
    if ((access & (kLocalWrite | kRemoteWrite)) &&
        !s->buffers[lam.buffer].writable) {
      return ExpectError(op, actual.status(), "BUFFER_READ_ONLY");
    }
  }
  if (p.connection == 0 || p.connection != s->connection) {
    return ExpectError(op, actual.status(), "NO_SUCH_CONNECTION");
  }
  if (std::string e = ExpectOk(op, actual.status()); !e.empty()) return e;
  if (actual->work_request() <= max_work_request_) {
    return absl::StrCat(op, ": work request id ", actual->work_request(),
                        " is not new");
  }
  max_work_request_ = actual->work_request();
  Work w;
  w.fast_register = true;
  w.mr = p.mr;
  w.generation = m->second.generation;
  w.work_request = actual->work_request();
  w.request_context = p.request_context;
  w.connection = p.connection;
  w.silent = (p.flags & kOpSilent) != 0;
  w.pages = p.pages;
  w.fbo = p.fbo;
  w.length = p.length;
  w.base = p.base;
  w.access = access;
  Post(*s, std::move(w), (p.flags & kOpDefer) != 0);
  return "";
}

std::string ReferenceModel::Invalidate(
    uint64_t sid, uint64_t connection, uint64_t mr, uint32_t flags,
    uint64_t request_context,
    const absl::StatusOr<v1::InvalidateMrResponse>& actual) {
  const std::string op =
      absl::StrCat("InvalidateMr(mr ", mr, " conn ", connection, " flags ",
                   Hex(flags), " ctx ", request_context, ")");
  Session* s = Find(sid);
  if (s == nullptr) return CallOnEndedSession(op, actual.status());
  Touch(*s);
  if (flags & ~(kOpSilent | kOpReadFence | kOpDefer)) {
    return ExpectError(op, actual.status(), "UNKNOWN_FLAGS");
  }
  auto m = s->mrs.find(mr);
  if (m == s->mrs.end()) return ExpectError(op, actual.status(), "UNKNOWN_MR");
  if (!m->second.fast) {
    return ExpectError(op, actual.status(), "MR_NOT_FAST_REGISTER");
  }
  if (connection == 0 || connection != s->connection) {
    return ExpectError(op, actual.status(), "NO_SUCH_CONNECTION");
  }
  if (std::string e = ExpectOk(op, actual.status()); !e.empty()) return e;
  if (actual->work_request() <= max_work_request_) {
    return absl::StrCat(op, ": work request id ", actual->work_request(),
                        " is not new");
  }
  max_work_request_ = actual->work_request();
  Work w;
  w.fast_register = false;
  w.mr = mr;
  w.generation = m->second.generation;
  w.work_request = actual->work_request();
  w.request_context = request_context;
  w.connection = connection;
  w.silent = (flags & kOpSilent) != 0;
  Post(*s, std::move(w), (flags & kOpDefer) != 0);
  return "";
}

void ReferenceModel::Post(Session& s, Work work, bool deferred) {
  if (deferred) {
    s.held.push_back(std::move(work));
    return;
  }
  // Held work goes to the device ahead of the next non-deferred request.
  FlushDeferred(s.id);
  Execute(s, work, /*flushed=*/false);
}

void ReferenceModel::FlushDeferred(uint64_t sid) {
  Session* s = Find(sid);
  if (s == nullptr) return;
  std::deque<Work> held;
  held.swap(s->held);
  for (const Work& w : held) Execute(*s, w, /*flushed=*/false);
}

void ReferenceModel::Execute(Session& s, const Work& w, bool flushed) {
  ExpectedCompletion e;
  e.fast_register = w.fast_register;
  e.connection = w.connection;
  e.work_request = w.work_request;
  e.request_context = w.request_context;
  auto it = s.mrs.find(w.mr);
  Mr* m = (it != s.mrs.end() && it->second.generation == w.generation)
              ? &it->second
              : nullptr;
  e.mr = m != nullptr ? m->id : 0;
  if (flushed) {
    e.flushed = true;
    e.why = "flushed: its connection closed";
  } else if (m == nullptr) {
    e.why = "the MR object was closed or replaced";
  } else if (w.fast_register) {
    std::vector<MappedPage> pages;
    for (uint64_t page : w.pages) {
      auto mapped = s.page_map.find(page);
      if (mapped == s.page_map.end()) break;
      pages.push_back(mapped->second);
    }
    if (m->valid) {
      e.why = "the MR is already fast-registered";
    } else if (pages.size() != w.pages.size()) {
      e.why = "a page is no longer mapped (its LAM was released)";
    } else {
      m->valid = true;
      m->prev_key = m->key;
      m->prev_key_known = m->key_known;
      m->key_known = false;
      m->fr_seq = ++fr_counter_;
      m->base = w.base;
      m->length = w.length;
      m->access = w.access;
      m->fbo = w.fbo;
      m->pages = std::move(pages);
      m->lams.clear();
      for (const MappedPage& mp : m->pages) {
        if (std::find(m->lams.begin(), m->lams.end(), mp.lam) ==
            m->lams.end()) {
          m->lams.push_back(mp.lam);
        }
      }
      e.success = true;
      e.fr_seq = m->fr_seq;
      e.why = "fast registration";
    }
  } else {
    if (!m->valid) {
      e.why = "the MR is not fast-registered";
    } else {
      if (m->key_known) {
        Kill(Token{
            m->key, m->base, m->length, s.id,
            absl::StrCat("fast-registered MR ", m->id, " (invalidated)")});
      }
      m->valid = false;
      m->pages.clear();
      m->lams.clear();
      e.success = true;
      e.why = "invalidation";
    }
  }
  // SILENT_SUCCESS hides successes only (F3).
  if (e.success && w.silent) return;
  s.expected.push_back(std::move(e));
}

// --- connections and completions
// ------------------------------------------------

void ReferenceModel::ConnectionUp(uint64_t sid, uint64_t connection) {
  Session* s = Find(sid);
  if (s == nullptr) return;
  s->connection = connection;
}

void ReferenceModel::ConnectionDied(uint64_t sid) {
  Session* s = Find(sid);
  if (s == nullptr) return;
  std::deque<Work> held;
  held.swap(s->held);
  for (const Work& w : held) Execute(*s, w, /*flushed=*/true);
  s->connection = 0;
}

std::string ReferenceModel::OnCompletion(uint64_t sid,
                                         const v1::Completion& c) {
  Session* s = Find(sid);
  if (s == nullptr) return "";
  if (s->expected.empty()) {
    return absl::StrCat("unexpected completion ", c.ShortDebugString());
  }
  ExpectedCompletion e = std::move(s->expected.front());
  s->expected.pop_front();
  const v1::Completion::Kind kind = e.fast_register
                                        ? v1::Completion::FAST_REGISTER
                                        : v1::Completion::INVALIDATE;
  const ::mrd::SeedStatus status = e.success ? ::mrd::STATUS_SUCCESS
                                   : e.flushed
                                       ? ::mrd::STATUS_CONNECTION_INVALID
                                       : ::mrd::STATUS_INVALID_PARAMETER;
  if (c.kind() != kind || c.request_context() != e.request_context ||
      c.connection() != e.connection || c.work_request() != e.work_request ||
      c.mr() != e.mr || c.status() != ::mrd::SeedStatusToProto(status) ||
      (e.fast_register && e.success && c.rkey() == 0) ||
      (!e.success && c.message().empty())) {
    return absl::StrCat(
        "completion mismatch: expected ", v1::Completion::Kind_Name(kind),
        " ctx ", e.request_context, " conn ", e.connection, " wr ",
        e.work_request, " mr ", e.mr, " ", ::mrd::SeedStatusName(status), " (",
        e.why, "), got ", c.ShortDebugString());
  }
  if (e.fast_register && e.success) {
    auto m = s->mrs.find(e.mr);
    if (m != s->mrs.end() && m->second.valid && m->second.fr_seq == e.fr_seq) {
      if (std::string err = CheckNewRkey("fast registration", c.rkey());
          !err.empty()) {
        return err;
      }
      if (m->second.prev_key_known && c.rkey() == m->second.prev_key) {
        return absl::StrCat("fast registration of MR ", e.mr,
                            " kept the MR's previous key ", Hex(c.rkey()));
      }
      m->second.key = c.rkey();
      m->second.key_known = true;
    }
  }
  return "";
}

std::string ReferenceModel::CheckNothingExpected(uint64_t sid) const {
  const Session* s = Find(sid);
  if (s == nullptr || s->expected.empty()) return "";
  const ExpectedCompletion& e = s->expected.front();
  return absl::StrCat(
      s->expected.size(), " expected completion(s) never arrived, first: ",
      e.fast_register ? "FAST_REGISTER" : "INVALIDATE", " ctx ",
      e.request_context, " wr ", e.work_request, " (", e.why, ")");
}

std::vector<uint64_t> ReferenceModel::MrsWithUnknownKeys(uint64_t sid) const {
  std::vector<uint64_t> out;
  const Session* s = Find(sid);
  if (s == nullptr) return out;
  for (const auto& [id, m] : s->mrs) {
    if (m.fast && ((m.valid && !m.key_known) || !m.lkey_known)) {
      out.push_back(id);
    }
  }
  return out;
}

std::string ReferenceModel::LearnFromList(
    uint64_t sid, const v1::ListRegistrationsResponse& list) {
  Session* s = Find(sid);
  if (s == nullptr) return "";
  for (const v1::MrInfo& info : list.mrs()) {
    auto m = s->mrs.find(info.mr());
    if (m == s->mrs.end() || !m->second.fast) continue;
    Mr& mr = m->second;
    if (mr.valid && !mr.key_known) {
      if (info.state() != "fast_registered") {
        return absl::StrCat("MR ", mr.id, " should be fast_registered, got ",
                            info.ShortDebugString());
      }
      if (std::string e = CheckNewRkey("silent fast registration", info.rkey());
          !e.empty()) {
        return e;
      }
      if (mr.prev_key_known && info.rkey() == mr.prev_key) {
        return absl::StrCat("silent fast registration of MR ", mr.id,
                            " kept the MR's previous key ", Hex(info.rkey()));
      }
      mr.key = info.rkey();
      mr.key_known = true;
    }
    if (!mr.lkey_known) {
      // A replaced device object: a new key, which the MR reports.
      mr.lkey = info.lkey();
      mr.lkey_known = true;
      if (!mr.valid) {
        mr.key = info.lkey();
        mr.key_known = true;
      }
    }
  }
  return "";
}

// --- state checks
// -----------------------------------------------------------------

std::string ReferenceModel::CheckList(uint64_t sid,
                                      const v1::ListRegistrationsResponse& list,
                                      uint64_t pinned_slack) const {
  const Session* s = Find(sid);
  if (s == nullptr) return "";
  const std::string where = absl::StrCat("ListRegistrations of session ", sid);
  uint64_t accounted = 0;
  for (const auto& [entry, r] : s->regs) {
    accounted += PageSpan(page_size_, r.offset, r.length) * page_size_;
  }
  for (const auto& [id, l] : s->lams) {
    accounted += l.pages.size() * page_size_;
  }
  if (list.session().registrations() != s->regs.size() ||
      list.session().pinned_bytes() < accounted ||
      list.session().pinned_bytes() > accounted + pinned_slack) {
    return absl::StrCat(where, ": expected ", s->regs.size(),
                        " registrations and ", accounted, " (+ up to ",
                        pinned_slack, ") accounted pinned bytes, got ",
                        list.session().ShortDebugString());
  }
  if (static_cast<size_t>(list.buffers_size()) != s->buffers.size() ||
      static_cast<size_t>(list.registrations_size()) != s->regs.size() ||
      static_cast<size_t>(list.lams_size()) != s->lams.size() ||
      static_cast<size_t>(list.mrs_size()) != s->mrs.size()) {
    return absl::StrCat(where, ": expected ", s->buffers.size(), " buffers, ",
                        s->regs.size(), " registrations, ", s->lams.size(),
                        " LAMs, ", s->mrs.size(), " MRs; got ",
                        list.buffers_size(), ", ", list.registrations_size(),
                        ", ", list.lams_size(), ", ", list.mrs_size());
  }
  for (const v1::BufferInfo& b : list.buffers()) {
    auto it = s->buffers.find(b.buffer());
    if (it == s->buffers.end() || it->second.size != b.size() ||
        it->second.writable != b.writable() ||
        it->second.address != b.address()) {
      return absl::StrCat(where, ": unexpected buffer ", b.ShortDebugString());
    }
  }
  for (const v1::RegistrationInfo& info : list.registrations()) {
    auto it = s->regs.find(info.registration());
    if (it == s->regs.end()) {
      return absl::StrCat(where, ": unexpected registration ",
                          info.ShortDebugString());
    }
    const Registration& r = it->second;
    if (info.buffer() != r.buffer || info.offset() != r.offset ||
        info.length() != r.length ||
        info.flags() != FlagsFromAccess(r.access) || info.lkey() != r.lkey ||
        info.rkey() != r.rkey || info.base_address() != r.base ||
        info.references() != r.refs()) {
      return absl::StrCat(
          where, ": registration ", r.entry, " should be buffer ", r.buffer,
          " [", r.offset, ", +", r.length, ") flags ",
          Hex(FlagsFromAccess(r.access)), " rkey ", Hex(r.rkey), " base ",
          Hex(r.base), " refs ", r.refs(), ", got ", info.ShortDebugString());
    }
  }
  for (const v1::LamInfo& info : list.lams()) {
    auto it = s->lams.find(info.lam());
    if (it == s->lams.end() || info.buffer() != it->second.buffer ||
        info.offset() != it->second.offset ||
        info.length() != it->second.length ||
        info.page_count() != it->second.pages.size() ||
        info.fbo() != it->second.fbo) {
      return absl::StrCat(where, ": unexpected LAM ", info.ShortDebugString());
    }
  }
  for (const v1::MrInfo& info : list.mrs()) {
    auto it = s->mrs.find(info.mr());
    if (it == s->mrs.end()) {
      return absl::StrCat(where, ": unexpected MR ", info.ShortDebugString());
    }
    const Mr& m = it->second;
    std::string want;
    bool same = info.fast_register() == m.fast &&
                info.allow_remote_access() == m.allow_remote;
    if (m.fast) {
      same = same && info.state() == (m.valid ? "fast_registered" : "free") &&
             (!m.valid ||
              (info.base_address() == m.base && info.length() == m.length &&
               (!m.key_known || info.rkey() == m.key)));
    } else {
      same = same && info.state() == (m.registration ? "registered" : "free") &&
             info.registration() == m.registration;
      if (m.registration != 0) {
        const Registration& r = s->regs.at(m.registration);
        same = same && info.rkey() == r.rkey && info.base_address() == r.base &&
               info.length() == r.length;
      }
    }
    if (!same) {
      return absl::StrCat(
          where, ": MR ", m.id, " should be ", m.fast ? "fast " : "normal ",
          m.fast ? (m.valid ? "fast_registered" : "free")
                 : (m.registration ? "registered" : "free"),
          " base ", Hex(m.base), " length ", m.length, " registration ",
          m.registration, ", got ", info.ShortDebugString());
    }
  }
  return "";
}

Totals ReferenceModel::ExpectedTotals() const {
  Totals t;
  t.sessions = sessions_.size();
  for (const auto& [sid, s] : sessions_) {
    t.buffers += s.buffers.size();
    t.registrations += s.regs.size();
    t.lams += s.lams.size();
    t.mrs += s.mrs.size();
    // Pages are pinned through mrd's own mapping of each buffer, so two
    // imports of one file pin separately; within one buffer a page counts
    // once however many registrations and LAMs cover it.
    std::map<uint64_t, std::set<uint64_t>> pages;  // buffer -> page indices
    auto cover = [&](uint64_t buffer, uint64_t offset, uint64_t length) {
      std::set<uint64_t>& set = pages[buffer];
      for (uint64_t p = offset / page_size_;
           p <= (offset + length - 1) / page_size_; ++p) {
        set.insert(p);
      }
    };
    for (const auto& [entry, r] : s.regs) {
      t.accounted_pinned_bytes +=
          PageSpan(page_size_, r.offset, r.length) * page_size_;
      cover(r.buffer, r.offset, r.length);
    }
    for (const auto& [id, l] : s.lams) {
      t.accounted_pinned_bytes += l.pages.size() * page_size_;
      cover(l.buffer, l.offset, l.length);
    }
    for (const auto& [buffer, set] : pages) {
      t.pinned_bytes += set.size() * page_size_;
    }
  }
  return t;
}

// --- the peer path
// -----------------------------------------------------------------

ProbeExpectation ReferenceModel::ExpectProbe(uint64_t sid, uint32_t rkey,
                                             uint64_t address, uint64_t length,
                                             bool write) const {
  ProbeExpectation out;
  const Session* s = Find(sid);
  if (s == nullptr) {
    out.why = "the probing session has ended";
    return out;
  }
  const uint32_t need = write ? kRemoteWrite : kRemoteRead;
  auto inside = [&](uint64_t base, uint64_t len) {
    return address >= base && length <= len && address - base <= len - length;
  };
  for (const auto& [entry, r] : s->regs) {
    if (r.rkey != rkey) continue;
    if (!inside(r.base, r.length)) {
      out.why = absl::StrCat("registration ", entry, " does not cover it");
      return out;
    }
    if ((r.access & need) == 0) {
      out.why = absl::StrCat("registration ", entry, " lacks remote ",
                             write ? "write" : "read");
      return out;
    }
    out.ok = true;
    out.why = absl::StrCat("registration ", entry);
    out.segments.push_back(Segment{s->buffers.at(r.buffer).file,
                                   r.offset + (address - r.base), length});
    return out;
  }
  for (const auto& [id, m] : s->mrs) {
    if (!m.fast || !m.valid || !m.key_known || m.key != rkey) continue;
    if (!inside(m.base, m.length)) {
      out.why = absl::StrCat("fast-registered MR ", id, " does not cover it");
      return out;
    }
    if ((m.access & need) == 0) {
      out.why = absl::StrCat("fast-registered MR ", id, " lacks remote ",
                             write ? "write" : "read");
      return out;
    }
    out.ok = true;
    out.why = absl::StrCat("fast-registered MR ", id);
    uint64_t position = m.fbo + (address - m.base);
    uint64_t left = length;
    while (left > 0) {
      const MappedPage& mp = m.pages[position / page_size_];
      const Lam& lam = s->lams.at(mp.lam);
      const uint64_t within = position % page_size_;
      const uint64_t chunk = std::min(left, page_size_ - within);
      const uint64_t file_offset =
          (lam.offset / page_size_ + mp.index) * page_size_ + within;
      const Buffer& buffer = s->buffers.at(lam.buffer);
      if (file_offset + chunk > buffer.size) {
        // The last page of a LAM may reach past the end of its file: those
        // bytes are not backed, and the device refuses them.
        out = ProbeExpectation();
        out.why = absl::StrCat("fast-registered MR ", id,
                               " maps bytes past the end of buffer ", buffer.id,
                               "'s file there");
        return out;
      }
      const int file = buffer.file;
      if (!out.segments.empty() && out.segments.back().file == file &&
          out.segments.back().offset + out.segments.back().length ==
              file_offset) {
        out.segments.back().length += chunk;
      } else {
        out.segments.push_back(Segment{file, file_offset, chunk});
      }
      position += chunk;
      left -= chunk;
    }
    return out;
  }
  out.why = "no live token of this session has this key";
  return out;
}

std::vector<Token> ReferenceModel::LiveTokens() const {
  std::vector<Token> out;
  for (const auto& [sid, s] : sessions_) {
    for (const auto& [entry, r] : s.regs) {
      out.push_back(Token{r.rkey, r.base, r.length, sid,
                          absl::StrCat("registration ", entry), r.access});
    }
    for (const auto& [id, m] : s.mrs) {
      if (m.fast && m.valid && m.key_known) {
        out.push_back(Token{m.key, m.base, m.length, sid,
                            absl::StrCat("fast-registered MR ", id), m.access});
      }
    }
  }
  return out;
}

std::vector<Token> ReferenceModel::DeadTokens() const {
  std::vector<Token> out(dead_.begin(), dead_.end());
  for (const auto& [sid, s] : sessions_) {
    for (const auto& [id, l] : s.lams) {
      if (l.privileged_token == 0) continue;
      // L9: local only, at any address, even the LAM's own logical ones.
      out.push_back(Token{l.privileged_token, l.pages.front() + l.fbo, l.length,
                          sid, absl::StrCat("privileged token of LAM ", id)});
    }
    for (const auto& [id, m] : s.mrs) {
      if (m.fast && !m.valid && m.key_known) {
        out.push_back(Token{m.key, m.base != 0 ? m.base : 0x10000, 4096, sid,
                            absl::StrCat("key of free fast-register MR ", id)});
      }
    }
  }
  return out;
}

bool ReferenceModel::RequestIdsLeft(uint64_t sid) const {
  const Session* s = Find(sid);
  // Well below the server's memory (4096 by default): no id is forgotten.
  return s != nullptr && s->request_ids_used < 3000;
}

}  // namespace mrd::model_test
