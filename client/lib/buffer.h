// mrd::client::Buffer: a buffer imported into a session (BufferInfo), and
// for Create() the local memfd and mapping behind it. The destructor calls
// ReleaseBuffer (errors are logged to stderr, never thrown or fatal); mrd
// then invalidates registrations and LAMs still on it (W11).
//
// Movable, not copyable. Thread-compatible: const methods may run
// concurrently; Release() and destruction need exclusive access.
#ifndef MRD_CLIENT_LIB_BUFFER_H_
#define MRD_CLIENT_LIB_BUFFER_H_

#include <cstdint>
#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/lib/memfd.h"
#include "client/lib/session.h"
#include "mrd/v1/mrd.pb.h"

namespace mrd::client {

class Buffer {
 public:
  // A new memfd of `size` bytes (MappedMemfd::Create: MFD_CLOEXEC |
  // MFD_ALLOW_SEALING, sealed F_SEAL_SHRINK | F_SEAL_GROW, mapped here; with
  // `huge_pages`, on hugetlbfs in 2 MiB pages), imported over the fd socket
  // with expected_size = size. Fd sessions only. Errors: those of
  // MappedMemfd::Create and Session::ImportMemfd.
  static absl::StatusOr<Buffer> Create(const Session& session, uint64_t size,
                                       absl::string_view name = "mrd-buffer",
                                       bool writable = true,
                                       bool huge_pages = false);
  // ImportFile (lease path): `relative_path` under the server's shared-memory
  // directory. No local mapping (data() is null). Errors: INVALID_ARGUMENT,
  // NOT_FOUND, PERMISSION_DENIED, RESOURCE_EXHAUSTED, FAILED_PRECONDITION
  // (WSAENOTCONN).
  static absl::StatusOr<Buffer> ImportFile(const Session& session,
                                           absl::string_view relative_path,
                                           bool writable);
  // Takes ownership of a buffer already imported in `session` (e.g. by
  // Session::ImportMemfd or another process of the same lease session).
  static Buffer Adopt(const Session& session, const v1::BufferInfo& info);

  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  // False once released or moved from.
  bool valid() const { return core_ != nullptr; }
  uint64_t id() const { return info_.buffer(); }
  uint64_t size() const { return info_.size(); }
  bool writable() const { return info_.writable(); }
  // Where mrd mapped it: the default base address of registrations.
  uint64_t address() const { return info_.address(); }
  const v1::BufferInfo& info() const { return info_; }

  // The local mapping (Create only; null otherwise).
  void* data() const { return memfd_.data(); }
  // The local memfd (Create only; -1 otherwise).
  int fd() const { return memfd_.fd(); }

  // ReleaseBuffer now. Afterwards valid() is false whatever the outcome.
  // Errors: NOT_FOUND, FAILED_PRECONDITION (WSAENOTCONN). A session already
  // ended counts as released (OK).
  absl::StatusOr<v1::ReleaseBufferResponse> Release();
  // Gives up ownership without releasing: the buffer stays in the session
  // (until released by id or the session ends); the local mapping goes.
  v1::BufferInfo Detach();

 private:
  Buffer(std::shared_ptr<internal::SessionCore> core, v1::BufferInfo info,
         MappedMemfd memfd);

  std::shared_ptr<internal::SessionCore> core_;
  v1::BufferInfo info_;
  MappedMemfd memfd_;
};

}  // namespace mrd::client

#endif  // MRD_CLIENT_LIB_BUFFER_H_
