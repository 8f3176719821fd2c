#include "client/lib/mr.h"

#include <utility>

#include "client/lib/lam.h"
#include "client/lib/session_core.h"
#include "mrd/status.h"

namespace mrd::client {
namespace {

absl::Status Invalid() {
  return absl::FailedPreconditionError("MR object closed or moved from");
}

}  // namespace

FastRegisterOptions FastRegisterOptions::FromLam(const Lam& lam) {
  FastRegisterOptions options;
  options.pages.assign(lam.pages().begin(), lam.pages().end());
  options.fbo = lam.fbo();
  options.length = lam.length();
  return options;
}

Mr::Mr(std::shared_ptr<internal::SessionCore> core, v1::MrInfo info)
    : core_(std::move(core)), info_(std::move(info)) {}

absl::StatusOr<Mr> Mr::Create(const Session& session, bool fast_register,
                              bool allow_remote_access,
                              const std::string& device) {
  if (session.core() == nullptr) {
    return absl::FailedPreconditionError("use of a moved-from Session");
  }
  v1::CreateMrRequest request;
  request.set_session(session.token());
  request.set_fast_register(fast_register);
  request.set_allow_remote_access(allow_remote_access);
  request.set_device(device);
  MRD_ASSIGN_OR_RETURN(v1::MrInfo info, session.client().CreateMr(request));
  return Mr(session.core(), std::move(info));
}

Mr Mr::Adopt(const Session& session, const v1::MrInfo& info) {
  return Mr(session.core(), info);
}

Mr::Mr(Mr&& other) noexcept
    : core_(std::move(other.core_)), info_(std::move(other.info_)) {
  other.info_.Clear();
}

Mr& Mr::operator=(Mr&& other) noexcept {
  if (this != &other) {
    if (valid()) {
      if (absl::Status s = Close(); !s.ok()) {
        internal::LogReleaseError("MR", id(), s);
      }
    }
    core_ = std::move(other.core_);
    info_ = std::move(other.info_);
    other.info_.Clear();
  }
  return *this;
}

Mr::~Mr() {
  if (!valid()) return;
  if (absl::Status s = Close(); !s.ok()) {
    internal::LogReleaseError("MR", id(), s);
  }
}

absl::StatusOr<Registration> Mr::Register(RegisterOptions options) const {
  if (!valid()) return Invalid();
  options.mr = id();
  MRD_ASSIGN_OR_RETURN(
      v1::RegisterMrResponse response,
      core_->client.RegisterMr(ToRequest(core_->token, options)));
  if (response.mr() == 0) response.set_mr(id());
  return Registration(core_, std::move(response), id());
}

absl::StatusOr<uint64_t> Mr::FastRegister(
    const FastRegisterOptions& options) const {
  if (!valid()) return Invalid();
  v1::FastRegisterRequest request;
  request.set_session(core_->token);
  request.set_connection(options.connection);
  request.set_request_context(options.request_context);
  request.set_mr(id());
  for (uint64_t page : options.pages) request.add_pages(page);
  request.set_fbo(options.fbo);
  request.set_length(options.length);
  request.set_base_address(options.base_address);
  request.set_flags(options.flags);
  MRD_ASSIGN_OR_RETURN(v1::FastRegisterResponse response,
                       core_->client.FastRegister(request));
  return response.work_request();
}

absl::StatusOr<uint64_t> Mr::Invalidate(uint64_t connection,
                                        uint64_t request_context,
                                        uint32_t flags) const {
  if (!valid()) return Invalid();
  v1::InvalidateMrRequest request;
  request.set_session(core_->token);
  request.set_connection(connection);
  request.set_request_context(request_context);
  request.set_mr(id());
  request.set_flags(flags);
  MRD_ASSIGN_OR_RETURN(v1::InvalidateMrResponse response,
                       core_->client.InvalidateMr(request));
  return response.work_request();
}

absl::Status Mr::Close() {
  if (!valid()) return Invalid();
  std::shared_ptr<internal::SessionCore> core = std::move(core_);
  core_.reset();
  if (core->Ended()) return absl::OkStatus();
  v1::CloseMrRequest request;
  request.set_session(core->token);
  request.set_mr(info_.mr());
  absl::Status status = core->client.CloseMr(request).status();
  if (internal::EndedElsewhere(*core, status)) return absl::OkStatus();
  return status;
}

v1::MrInfo Mr::Detach() {
  core_.reset();
  return info_;
}

}  // namespace mrd::client
