// mrd::client::Registration: one reference to a memory registration
// (RegisterMr). Each successful RegisterMr holds one reference, even when mrd
// returns a cached descriptor (W5: same id, references+1); the destructor or
// Deregister() gives exactly that reference back (DeregisterMr). Through an
// explicit MR object (RegisterOptions::mr) the reference is the MR's
// registration and DeregisterMr names the MR.
//
// Movable, not copyable. Thread-compatible. Destroy registrations before the
// Buffer/Mr they are on: releasing the buffer invalidates them first (W11),
// and their own deregistration then fails with NOT_FOUND (logged).
#ifndef MRD_CLIENT_LIB_REGISTRATION_H_
#define MRD_CLIENT_LIB_REGISTRATION_H_

#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "client/lib/session.h"
#include "mrd/v1/mrd.pb.h"

namespace mrd::client {

// RegisterMrRequest without the session (which the Session supplies).
struct RegisterOptions {
  uint64_t buffer = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint32_t flags = 0;      // MrFlag bits (R3)
  uint32_t mem_flags = 0;  // MemFlag (W6), the alternative to flags
  // Unset: mrd's mapping address of buffer+offset (R7). Zero is refused (R8).
  std::optional<uint64_t> base_address = std::nullopt;
  uint64_t mr = 0;  // an Mr created with fast_register=false (R4); 0: implicit
  uint32_t descriptor_capacity = 0;  // W2; 0 = no limit
  std::string request_id = {};       // idempotency key
  // The devices to register on, by name (GetDeviceInfo's devices), or all
  // of mrd's; neither: the first device. The registration is on all of
  // them or on none; its tokens() give one token per device.
  std::vector<std::string> devices = {};
  bool all_devices = false;
  // The devices on the NUMA node of the memory (every device when none is).
  bool nearest_devices = false;
};

v1::RegisterMrRequest ToRequest(const std::string& session,
                                const RegisterOptions& options);

class Registration;
using RegistrationCallback =
    absl::AnyInvocable<void(absl::StatusOr<Registration>) &&>;

class Registration {
 public:
  // Synchronous: returns when the memory is pinned and registered. Errors:
  // see RegisterMr in mrd.proto (INVALID_ARGUMENT, OUT_OF_RANGE with the
  // required size, RESOURCE_EXHAUSTED, NOT_FOUND, FAILED_PRECONDITION).
  static absl::StatusOr<Registration> Register(const Session& session,
                                               const RegisterOptions& options);
  // Asynchronous (PENDING work): returns at once; `done` runs once on a gRPC
  // callback thread when mrd answers. Any number may be in flight. `done`
  // must not block; if it drops a successful Registration, the resulting
  // DeregisterMr blocks that thread for one round trip.
  static void RegisterAsync(const Session& session, RegisterOptions options,
                            RegistrationCallback done);
  // RegisterAsync with a future (get() blocks until mrd answers).
  static std::future<absl::StatusOr<Registration>> RegisterFuture(
      const Session& session, RegisterOptions options);
  // Many registrations in one round trip (RegisterMrBatch): one result per
  // option, in order, each what Register would have returned for it. The
  // outer status is the call's: WSAENOTCONN, INVALID_ARGUMENT
  // "BATCH_TOO_LARGE" (more than the server's --max_batch_items), or a
  // transport error (then none of the items is known to be registered:
  // ListRegistrations tells).
  static absl::StatusOr<std::vector<absl::StatusOr<Registration>>>
  RegisterBatch(const Session& session,
                const std::vector<RegisterOptions>& options);
  // Deregisters many in one round trip (DeregisterMrBatch): one result per
  // registration, in order, as Deregister() would return it. Every
  // registration given is invalid afterwards (as after Deregister()); they
  // must all belong to one session. Invalid ones get FAILED_PRECONDITION.
  static absl::StatusOr<std::vector<absl::StatusOr<uint32_t>>> DeregisterBatch(
      std::vector<Registration>& registrations);

  // Takes ownership of one reference already held in `session`; with
  // `via_mr` it is the registration of MR object response.mr().
  static Registration Adopt(const Session& session,
                            const v1::RegisterMrResponse& response,
                            bool via_mr = false);

  Registration(Registration&& other) noexcept;
  Registration& operator=(Registration&& other) noexcept;
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;
  ~Registration();

  bool valid() const { return core_ != nullptr; }
  uint64_t id() const { return response_.registration(); }
  uint32_t rkey() const { return response_.rkey(); }
  // One token per device it is on (device name, rkey, lkey, peer address).
  const google::protobuf::RepeatedPtrField<v1::DeviceToken>& tokens() const {
    return response_.tokens();
  }
  uint32_t lkey() const { return response_.lkey(); }
  uint64_t base_address() const { return response_.base_address(); }
  uint64_t length() const { return response_.length(); }
  // References right after this registration was made.
  uint32_t references() const { return response_.references(); }
  bool cache_hit() const { return response_.cache_hit(); }
  uint64_t mr() const { return response_.mr(); }
  // The opaque W2 descriptor (rkey|base|length).
  const std::string& descriptor() const { return response_.rdma_descriptor(); }
  const v1::RegisterMrResponse& response() const { return response_; }

  // DeregisterMr now: the references left (0 = released). Afterwards valid()
  // is false whatever the outcome. Errors: NOT_FOUND, FAILED_PRECONDITION.
  // A session already ended counts as released (0).
  absl::StatusOr<uint32_t> Deregister();
  // Gives up the reference without deregistering.
  v1::RegisterMrResponse Detach();

 private:
  friend class Mr;
  Registration(std::shared_ptr<internal::SessionCore> core,
               v1::RegisterMrResponse response, uint64_t mr_object);

  std::shared_ptr<internal::SessionCore> core_;
  v1::RegisterMrResponse response_;
  // Non-zero: the registration of this MR object; DeregisterMr names it.
  uint64_t mr_object_ = 0;
};

}  // namespace mrd::client

#endif  // MRD_CLIENT_LIB_REGISTRATION_H_
