// ReferenceModel: a small, independent statement of what mrd must do, against
// which the model test (model_test.cc) checks the real Core over the real
// software device step by step.
//
// The model knows sessions, buffers, registrations with their reference
// counts (W5), LAMs, MR objects, posted fast-register and invalidate work
// (held while DEFER, executed in post order per connection, flushed when the
// connection dies), and from that: which tokens must work on the peer path
// and which bytes of which file a peer READ/WRITE must touch, which pages
// must be pinned, and which completions must arrive.
//
// Each operation takes what the real call returned, compares it with what
// the model expects, applies the expected effect, and returns an empty string
// or a description of the first mismatch. Values only the server can choose
// (handles, keys, logical addresses, work-request ids) are taken from the
// real answer, after checking what can be checked about them (new handles
// are new, keys of live tokens are unique, logical pages are never reused).
//
// Not thread-safe: the model test is single-threaded.
#ifndef MRD_TESTS_MODEL_REFERENCE_MODEL_H_
#define MRD_TESTS_MODEL_REFERENCE_MODEL_H_

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "mrd/v1/mrd.pb.h"

namespace mrd::model_test {

// Access rights, the model's own copy (the test checks they equal the
// device's AccessBits).
inline constexpr uint32_t kLocalWrite = 1u << 0;
inline constexpr uint32_t kRemoteRead = 1u << 1;
inline constexpr uint32_t kRemoteWrite = 1u << 2;
inline constexpr uint32_t kReadSink = 1u << 3;

// NDK_OP_FLAG_* bits the model interprets (F3).
inline constexpr uint32_t kOpSilent = 0x1;
inline constexpr uint32_t kOpReadFence = 0x2;
inline constexpr uint32_t kOpRemoteRead = 0x8;
inline constexpr uint32_t kOpLocalWrite = 0x10;
inline constexpr uint32_t kOpRemoteWrite = 0x30;  // includes LOCAL_WRITE
inline constexpr uint32_t kOpReadSink = 0x40;
inline constexpr uint32_t kOpDefer = 0x200;

struct Buffer {
  uint64_t id = 0;
  int file = -1;  // the test's file (client memory) behind it
  uint64_t size = 0;
  bool writable = false;
  uint64_t address = 0;  // default base address
};

struct Registration {
  uint64_t entry = 0;
  uint64_t buffer = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint32_t access = 0;
  uint64_t base = 0;
  uint32_t lkey = 0;
  uint32_t rkey = 0;
  std::string descriptor;
  uint32_t implicit_refs = 0;
  uint32_t mr_refs = 0;
  uint32_t refs() const { return implicit_refs + mr_refs; }
};

struct Lam {
  uint64_t id = 0;
  uint64_t buffer = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  std::vector<uint64_t> pages;  // logical addresses
  uint32_t fbo = 0;
  uint32_t privileged_token = 0;  // L9, never usable by a peer (0: none)
};

// One entry of a fast registration's page array, resolved.
struct MappedPage {
  uint64_t lam = 0;
  uint64_t index = 0;  // page index within the LAM
};

struct Mr {
  uint64_t id = 0;
  bool fast = false;
  bool allow_remote = false;
  uint64_t registration = 0;  // normal MR objects: the entry held (0: none)
  // Fast-register MR objects. The generation changes when mrd replaces the
  // device object (ReleaseBuffer of a buffer it maps): work posted before
  // then fails.
  uint64_t generation = 0;
  uint32_t lkey = 0;  // as CreateMr (and ListRegistrations) report it
  bool lkey_known = true;
  // The device's current key of the object: the remote token while
  // fast-registered. Unknown from a fast registration's execution until its
  // completion (or, after SILENT_SUCCESS, the MR's state) tells it.
  uint32_t key = 0;
  bool key_known = false;
  // The key before the last fast registration: the new one must differ.
  uint32_t prev_key = 0;
  bool prev_key_known = false;
  bool valid = false;   // fast-registered
  uint64_t fr_seq = 0;  // which fast registration made it valid
  uint64_t base = 0;
  uint64_t length = 0;
  uint32_t access = 0;
  uint32_t fbo = 0;
  std::vector<MappedPage> pages;
  std::vector<uint64_t> lams;  // distinct, in page-array order
};

// A posted work request, as the model executes it.
struct Work {
  bool fast_register = true;
  uint64_t mr = 0;
  uint64_t generation = 0;
  uint64_t work_request = 0;
  uint64_t request_context = 0;
  uint64_t connection = 0;
  bool silent = false;
  // Fast registration only.
  std::vector<uint64_t> pages;
  uint32_t fbo = 0;
  uint64_t length = 0;
  uint64_t base = 0;
  uint32_t access = 0;
};

struct ExpectedCompletion {
  bool fast_register = true;
  uint64_t connection = 0;
  uint64_t work_request = 0;
  uint64_t request_context = 0;
  uint64_t mr = 0;  // 0: the MR object was closed or replaced meanwhile
  bool success = false;
  bool flushed = false;  // failed because its connection closed
  uint64_t fr_seq = 0;   // fast-register success: which registration
  std::string why;
};

struct RegisterParams {
  uint64_t buffer = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint32_t flags = 0;
  uint32_t mem_flags = 0;
  bool has_base = false;
  uint64_t base = 0;
  uint64_t mr = 0;
  std::string request_id;
  uint32_t descriptor_capacity = 0;
};

struct FastRegisterParams {
  uint64_t connection = 0;
  uint64_t mr = 0;
  std::vector<uint64_t> pages;
  uint32_t fbo = 0;
  uint64_t length = 0;
  uint64_t base = 0;
  uint32_t flags = 0;
  uint64_t request_context = 0;
};

struct Session {
  uint64_t id = 0;  // the model's own numbering
  std::string token;
  bool lease = false;
  absl::Duration ttl;
  absl::Time expires = absl::InfiniteFuture();
  uint64_t next_buffer_address = uint64_t{1} << 32;
  std::map<uint64_t, Buffer> buffers;
  std::map<uint64_t, Registration> regs;
  std::map<uint64_t, Lam> lams;
  std::map<uint64_t, Mr> mrs;
  std::map<uint64_t, MappedPage> page_map;  // logical page -> LAM page
  std::map<std::string, v1::RegisterMrResponse> request_ids;
  uint64_t request_ids_used = 0;
  uint64_t connection = 0;  // the live peer connection, 0 if none
  std::deque<Work> held;    // DEFER work held on `connection`
  std::deque<ExpectedCompletion> expected;
};

// A token a peer may present: rkey and the region it names (or named).
struct Token {
  uint32_t rkey = 0;
  uint64_t base = 0;
  uint64_t length = 0;
  uint64_t session = 0;  // model id of the session it belongs (belonged) to
  std::string what;
  uint32_t access = 0;  // live tokens: the rights it grants
};

// Where the bytes of a peer READ/WRITE live: a file of the test, at offset.
struct Segment {
  int file = -1;
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct ProbeExpectation {
  bool ok = false;
  std::vector<Segment> segments;  // when ok
  std::string why;                // which token grants it, or why not
};

// What the core's statistics must say.
struct Totals {
  uint64_t sessions = 0;
  uint64_t buffers = 0;
  uint64_t registrations = 0;
  uint64_t lams = 0;
  uint64_t mrs = 0;
  uint64_t accounted_pinned_bytes = 0;  // per registration + per LAM
  uint64_t pinned_bytes = 0;            // distinct pages, as the device
};

class ReferenceModel {
 public:
  explicit ReferenceModel(uint64_t page_size);

  uint64_t page_size() const { return page_size_; }

  // --- sessions -------------------------------------------------------------
  // A session the server just opened. Returns its model id.
  uint64_t OpenSession(const std::string& token, bool lease,
                       absl::Duration ttl);
  // The session ended (CloseSession, socket closed, lease expired): every
  // token dies, nothing stays pinned, queued completions are never seen.
  void EndSession(uint64_t session);
  Session* Find(uint64_t session);
  const Session* Find(uint64_t session) const;
  const std::map<uint64_t, Session>& sessions() const { return sessions_; }
  // A call the model does not otherwise interpret (GetSession,
  // CreatePeerTicket, ListRegistrations, SubscribeCompletions) named the
  // session: a lease is renewed.
  void Touch(uint64_t session);
  // Lease clock: every call naming a live lease session renews it.
  void SetNow(absl::Time now) { now_ = now; }
  absl::Time now() const { return now_; }
  // Lease sessions whose lease has run out at now().
  std::vector<uint64_t> ExpiredLeases() const;
  // A call that names `token` of a session the model knows to be gone
  // must fail with SESSION_NOT_CONNECTED.
  std::string CallOnEndedSession(absl::string_view op,
                                 const absl::Status& actual) const;

  // --- operations: compare, then apply ----------------------------------
  std::string ImportBuffer(uint64_t s, int file, uint64_t size, bool writable,
                           uint64_t device, uint64_t inode,
                           const std::string& source,
                           const absl::StatusOr<v1::BufferInfo>& actual);
  std::string ReleaseBuffer(
      uint64_t s, uint64_t buffer,
      const absl::StatusOr<v1::ReleaseBufferResponse>& actual);
  std::string Register(uint64_t s, const RegisterParams& p,
                       const absl::StatusOr<v1::RegisterMrResponse>& actual);
  // by_mr: DeregisterMr{mr}; else DeregisterMr{registration}.
  std::string Deregister(uint64_t s, bool by_mr, uint64_t target,
                         const absl::StatusOr<uint32_t>& actual);
  std::string CreateMr(uint64_t s, bool fast, bool allow_remote,
                       const absl::StatusOr<v1::MrInfo>& actual);
  std::string CloseMr(uint64_t s, uint64_t mr, const absl::Status& actual);
  std::string BuildLam(uint64_t s, uint64_t buffer, uint64_t offset,
                       uint64_t length, uint32_t lam_capacity,
                       const absl::StatusOr<v1::BuildLamResponse>& actual);
  std::string ReleaseLam(uint64_t s, uint64_t lam, const absl::Status& actual);
  std::string FastRegister(
      uint64_t s, const FastRegisterParams& p,
      const absl::StatusOr<v1::FastRegisterResponse>& actual);
  std::string Invalidate(
      uint64_t s, uint64_t connection, uint64_t mr, uint32_t flags,
      uint64_t request_context,
      const absl::StatusOr<v1::InvalidateMrResponse>& actual);
  // The held (DEFER) work of the session's connection goes to the device.
  void FlushDeferred(uint64_t s);

  // --- the peer connection ------------------------------------------------
  void ConnectionUp(uint64_t s, uint64_t connection);
  // The connection died (a remote access error): held work is flushed with
  // failed completions.
  void ConnectionDied(uint64_t s);

  // --- completions ----------------------------------------------------------
  // A FAST_REGISTER or INVALIDATE completion popped from the session's
  // stream; must be the next one expected.
  std::string OnCompletion(uint64_t s, const v1::Completion& c);
  // Every completion due has been delivered: none may still be expected.
  std::string CheckNothingExpected(uint64_t s) const;
  // MR objects fast-registered silently: their new rkey must be read from
  // the MR (F5, ListRegistrations).
  std::vector<uint64_t> MrsWithUnknownKeys(uint64_t s) const;
  std::string LearnFromList(uint64_t s,
                            const v1::ListRegistrationsResponse& list);

  // --- state checks ---------------------------------------------------------
  // Everything ListRegistrations shows for the session. `pinned_slack`: the
  // session's pinned bytes may exceed the model's by up to this much (warm
  // pins, which count towards the session's pinned bytes).
  std::string CheckList(uint64_t s, const v1::ListRegistrationsResponse& list,
                        uint64_t pinned_slack = 0) const;
  Totals ExpectedTotals() const;

  // --- the peer path --------------------------------------------------------
  // What a READ (write=false) or WRITE of [address, +length) with `rkey` on
  // the connection of session `s` must do.
  ProbeExpectation ExpectProbe(uint64_t s, uint32_t rkey, uint64_t address,
                               uint64_t length, bool write) const;
  // Tokens that must work (each with its access), and tokens that must not:
  // recently deregistered, released, invalidated, of ended sessions, LAM
  // privileged tokens, keys of free fast-register MR objects.
  std::vector<Token> LiveTokens() const;
  std::vector<Token> DeadTokens() const;

  // Whether this session may use another request id: the model stops
  // below the server's memory of ids (4096), so that none is forgotten.
  bool RequestIdsLeft(uint64_t s) const;

 private:
  void Touch(Session& s);
  void Kill(const Token& token);
  void RemoveRegistration(Session& s, uint64_t entry, absl::string_view why);
  void Post(Session& s, Work work, bool deferred);
  void Execute(Session& s, const Work& work, bool flushed);
  std::string CheckNewHandle(absl::string_view what, uint64_t id);
  std::string CheckNewRkey(absl::string_view what, uint32_t rkey) const;
  static uint64_t PageSpan(uint64_t page_size, uint64_t offset,
                           uint64_t length);

  const uint64_t page_size_;
  absl::Time now_ = absl::UnixEpoch() + absl::Hours(1);
  uint64_t next_session_ = 1;
  std::map<uint64_t, Session> sessions_;
  uint64_t max_handle_ = 0;  // buffers, MR objects, LAMs share one space
  uint64_t max_entry_ = 0;   // registration ids
  uint64_t max_work_request_ = 0;
  uint64_t fr_counter_ = 0;
  std::set<uint64_t> logical_pages_seen_;
  std::deque<Token> dead_;  // the most recent dead tokens
};

// Helpers shared with the test.
std::string DescribeStatus(const absl::Status& status);
// Access bits from NDK_MR_FLAG_* / MEM_* the way R3/W6 define them, or an
// error reason.
absl::StatusOr<uint32_t> ModelRegistrationAccess(uint32_t flags,
                                                 uint32_t mem_flags);

}  // namespace mrd::model_test

#endif  // MRD_TESTS_MODEL_REFERENCE_MODEL_H_
