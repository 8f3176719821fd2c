// mrd::client::Lam: a logical address mapping (BuildLam, L1-L8): the pinned
// adapter pages of a buffer range and its FBO. The destructor calls
// ReleaseLam (errors logged to stderr).
//
// Movable, not copyable. Thread-compatible. Invalidate fast registrations
// that use its pages before releasing it (FAILED_PRECONDITION otherwise).
#ifndef MRD_CLIENT_LIB_LAM_H_
#define MRD_CLIENT_LIB_LAM_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/lib/session.h"
#include "mrd/v1/mrd.pb.h"

namespace mrd::client {

struct BuildLamOptions {
  uint64_t buffer = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint32_t capacity = 0;  // L2: bytes of room for the mapping; 0 = no limit
  // The device whose logical address space maps it (GetDeviceInfo's
  // devices[].name; "": the first, whatever the session's default devices).
  // Its pages serve fast registrations of that device's MR objects only.
  std::string device = "";
};

class Lam {
 public:
  // Errors as RegisterMr (INVALID_ARGUMENT UNKNOWN_DEVICE for an unknown
  // `device`); OUT_OF_RANGE (STATUS_BUFFER_TOO_SMALL) with the
  // required size when `capacity` is too small (RequiredSizeOf()).
  static absl::StatusOr<Lam> Build(const Session& session,
                                   const BuildLamOptions& options);
  static Lam Adopt(const Session& session, const v1::BuildLamResponse& lam);

  Lam(Lam&& other) noexcept;
  Lam& operator=(Lam&& other) noexcept;
  Lam(const Lam&) = delete;
  Lam& operator=(const Lam&) = delete;
  ~Lam();

  bool valid() const { return core_ != nullptr; }
  uint64_t id() const { return response_.lam(); }
  // Logical addresses, PAGE_SIZE-aligned (L5).
  absl::Span<const uint64_t> pages() const {
    return absl::Span<const uint64_t>(
        response_.pages().data(), static_cast<size_t>(response_.pages_size()));
  }
  uint32_t fbo() const { return response_.fbo(); }
  // L9: the local-only privileged token of these logical addresses.
  uint32_t privileged_token() const { return response_.privileged_token(); }
  uint64_t length() const { return response_.length(); }
  uint32_t lam_size() const { return response_.lam_size(); }
  // The device it is mapped on, as mrd named it.
  const std::string& device() const { return response_.device(); }
  const v1::BuildLamResponse& response() const { return response_; }

  // ReleaseLam now; valid() is false afterwards whatever the outcome.
  // Errors: NOT_FOUND, FAILED_PRECONDITION (still fast-registered).
  absl::Status Release();
  v1::BuildLamResponse Detach();

 private:
  Lam(std::shared_ptr<internal::SessionCore> core,
      v1::BuildLamResponse response);

  std::shared_ptr<internal::SessionCore> core_;
  v1::BuildLamResponse response_;
};

}  // namespace mrd::client

#endif  // MRD_CLIENT_LIB_LAM_H_
