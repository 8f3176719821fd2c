// mrd::client::Mr: an MR object (CreateMr, C1/C2), for normal registration
// (fast_register=false; pass id() in RegisterOptions::mr) or for fast
// registration on a peer connection (FastRegister/Invalidate post work
// requests whose results arrive on a CompletionStream). The destructor calls
// CloseMr, which deregisters or invalidates it first (errors logged).
//
// Movable, not copyable. Thread-compatible.
#ifndef MRD_CLIENT_LIB_MR_H_
#define MRD_CLIENT_LIB_MR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/lib/registration.h"
#include "client/lib/session.h"
#include "mrd/v1/mrd.pb.h"

namespace mrd::client {

class Lam;

// FastRegisterRequest without session and MR.
struct FastRegisterOptions {
  uint64_t connection = 0;           // the queue pair (a peer connection)
  uint64_t request_context = 0;      // echoed in the completion
  std::vector<uint64_t> pages = {};  // logical addresses from a Lam
  uint32_t fbo = 0;
  uint64_t length = 0;
  uint64_t base_address = 0;  // FBO + n*PAGE_SIZE (F2)
  uint32_t flags = 0;         // OpFlag bits (F3)

  // pages, fbo and length taken from `lam`.
  static FastRegisterOptions FromLam(const Lam& lam);
};

class Mr {
 public:
  // On mrd's device `device` (GetDeviceInfo's devices[].name; "": the
  // first, whatever the session's default devices). A fast-register MR is
  // posted on that device's connections only, over LAMs of that device.
  // Errors: RESOURCE_EXHAUSTED, FAILED_PRECONDITION (WSAENOTCONN),
  // INVALID_ARGUMENT (UNKNOWN_DEVICE).
  static absl::StatusOr<Mr> Create(const Session& session, bool fast_register,
                                   bool allow_remote_access = false,
                                   const std::string& device = "");
  static Mr Adopt(const Session& session, const v1::MrInfo& info);

  Mr(Mr&& other) noexcept;
  Mr& operator=(Mr&& other) noexcept;
  Mr(const Mr&) = delete;
  Mr& operator=(const Mr&) = delete;
  ~Mr();

  bool valid() const { return core_ != nullptr; }
  uint64_t id() const { return info_.mr(); }
  bool fast_register() const { return info_.fast_register(); }
  bool allow_remote_access() const { return info_.allow_remote_access(); }
  // The device it belongs to, as mrd named it.
  const std::string& device() const { return info_.device(); }
  // As returned by CreateMr (state "free").
  const v1::MrInfo& info() const { return info_; }

  // RegisterMr through this object (R4): `options.mr` is set to id().
  absl::StatusOr<Registration> Register(RegisterOptions options) const;

  // Posts a fast registration; returns the work-request id. The outcome and
  // the new rkey (F5) arrive on the session's CompletionStream with
  // options.request_context. Errors: INVALID_ARGUMENT, FAILED_PRECONDITION
  // (STATUS_CONNECTION_INVALID), PERMISSION_DENIED (STATUS_ACCESS_VIOLATION),
  // NOT_FOUND.
  absl::StatusOr<uint64_t> FastRegister(
      const FastRegisterOptions& options) const;
  // Posts an invalidation; returns the work-request id. The token stops
  // working when its completion is delivered.
  absl::StatusOr<uint64_t> Invalidate(uint64_t connection,
                                      uint64_t request_context = 0,
                                      uint32_t flags = 0) const;

  // CloseMr now; valid() is false afterwards whatever the outcome.
  absl::Status Close();
  v1::MrInfo Detach();

 private:
  Mr(std::shared_ptr<internal::SessionCore> core, v1::MrInfo info);

  std::shared_ptr<internal::SessionCore> core_;
  v1::MrInfo info_;
};

}  // namespace mrd::client

#endif  // MRD_CLIENT_LIB_MR_H_
