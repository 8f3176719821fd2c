#include "client/lib/buffer.h"

#include <utility>

#include "client/lib/session_core.h"
#include "mrd/status.h"

namespace mrd::client {

Buffer::Buffer(std::shared_ptr<internal::SessionCore> core, v1::BufferInfo info,
               MappedMemfd memfd)
    : core_(std::move(core)),
      info_(std::move(info)),
      memfd_(std::move(memfd)) {}

absl::StatusOr<Buffer> Buffer::Create(const Session& session, uint64_t size,
                                      absl::string_view name, bool writable,
                                      bool huge_pages) {
  if (session.core() == nullptr) {
    return absl::FailedPreconditionError("use of a moved-from Session");
  }
  MRD_ASSIGN_OR_RETURN(MappedMemfd memfd,
                       MappedMemfd::Create(size, name, huge_pages));
  MRD_ASSIGN_OR_RETURN(Buffer buffer,
                       session.ImportMemfd(memfd.fd(), writable, size));
  buffer.memfd_ = std::move(memfd);
  return buffer;
}

absl::StatusOr<Buffer> Buffer::ImportFile(const Session& session,
                                          absl::string_view relative_path,
                                          bool writable) {
  if (session.core() == nullptr) {
    return absl::FailedPreconditionError("use of a moved-from Session");
  }
  v1::ImportFileRequest request;
  request.set_session(session.token());
  request.set_path(std::string(relative_path));
  request.set_writable(writable);
  MRD_ASSIGN_OR_RETURN(v1::BufferInfo info,
                       session.client().ImportFile(request));
  return Adopt(session, info);
}

Buffer Buffer::Adopt(const Session& session, const v1::BufferInfo& info) {
  return Buffer(session.core(), info, MappedMemfd());
}

Buffer::Buffer(Buffer&& other) noexcept
    : core_(std::move(other.core_)),
      info_(std::move(other.info_)),
      memfd_(std::move(other.memfd_)) {
  other.info_.Clear();
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    if (valid()) {
      if (auto released = Release(); !released.ok()) {
        internal::LogReleaseError("buffer", id(), released.status());
      }
    }
    core_ = std::move(other.core_);
    info_ = std::move(other.info_);
    other.info_.Clear();
    memfd_ = std::move(other.memfd_);
  }
  return *this;
}

Buffer::~Buffer() {
  if (!valid()) return;
  uint64_t buffer_id = id();
  if (auto released = Release(); !released.ok()) {
    internal::LogReleaseError("buffer", buffer_id, released.status());
  }
}

absl::StatusOr<v1::ReleaseBufferResponse> Buffer::Release() {
  if (!valid()) {
    return absl::FailedPreconditionError("buffer already released");
  }
  std::shared_ptr<internal::SessionCore> core = std::move(core_);
  core_.reset();
  // The local mapping goes whatever mrd says: mrd keeps its own mapping.
  memfd_ = MappedMemfd();
  if (core->Ended()) return v1::ReleaseBufferResponse();
  v1::ReleaseBufferRequest request;
  request.set_session(core->token);
  request.set_buffer(info_.buffer());
  absl::StatusOr<v1::ReleaseBufferResponse> response =
      core->client.ReleaseBuffer(request);
  if (!response.ok() && internal::EndedElsewhere(*core, response.status())) {
    return v1::ReleaseBufferResponse();
  }
  return response;
}

v1::BufferInfo Buffer::Detach() {
  core_.reset();
  memfd_ = MappedMemfd();
  v1::BufferInfo info = std::move(info_);
  info_.Clear();
  return info;
}

}  // namespace mrd::client
