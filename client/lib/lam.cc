#include "client/lib/lam.h"

#include <utility>

#include "client/lib/session_core.h"
#include "mrd/status.h"

namespace mrd::client {

Lam::Lam(std::shared_ptr<internal::SessionCore> core,
         v1::BuildLamResponse response)
    : core_(std::move(core)), response_(std::move(response)) {}

absl::StatusOr<Lam> Lam::Build(const Session& session,
                               const BuildLamOptions& options) {
  if (session.core() == nullptr) {
    return absl::FailedPreconditionError("use of a moved-from Session");
  }
  v1::BuildLamRequest request;
  request.set_session(session.token());
  request.set_buffer(options.buffer);
  request.set_offset(options.offset);
  request.set_length(options.length);
  request.set_lam_capacity(options.capacity);
  request.set_device(options.device);
  MRD_ASSIGN_OR_RETURN(v1::BuildLamResponse response,
                       session.client().BuildLam(request));
  return Lam(session.core(), std::move(response));
}

Lam Lam::Adopt(const Session& session, const v1::BuildLamResponse& lam) {
  return Lam(session.core(), lam);
}

Lam::Lam(Lam&& other) noexcept
    : core_(std::move(other.core_)), response_(std::move(other.response_)) {
  other.response_.Clear();
}

Lam& Lam::operator=(Lam&& other) noexcept {
  if (this != &other) {
    if (valid()) {
      if (absl::Status s = Release(); !s.ok()) {
        internal::LogReleaseError("LAM", id(), s);
      }
    }
    core_ = std::move(other.core_);
    response_ = std::move(other.response_);
    other.response_.Clear();
  }
  return *this;
}

Lam::~Lam() {
  if (!valid()) return;
  if (absl::Status s = Release(); !s.ok()) {
    internal::LogReleaseError("LAM", id(), s);
  }
}

absl::Status Lam::Release() {
  if (!valid()) return absl::FailedPreconditionError("LAM already released");
  std::shared_ptr<internal::SessionCore> core = std::move(core_);
  core_.reset();
  if (core->Ended()) return absl::OkStatus();
  v1::ReleaseLamRequest request;
  request.set_session(core->token);
  request.set_lam(response_.lam());
  absl::Status status = core->client.ReleaseLam(request).status();
  if (internal::EndedElsewhere(*core, status)) return absl::OkStatus();
  return status;
}

v1::BuildLamResponse Lam::Detach() {
  core_.reset();
  return response_;
}

}  // namespace mrd::client
