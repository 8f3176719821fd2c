// FastRegistration: the LAMs and MR objects of sessions, and the fast
// registration and invalidation work posted on their peer connections
// (BuildLam, ReleaseLam, CreateMr, CloseMr, FastRegister, InvalidateMr).
//
// A LAM pins pages and names them by logical address; a fast-register MR
// object gets a remote token when a FastRegister on a connection maps LAM
// pages into it, and loses it on InvalidateMr. A normal MR object holds one
// registration of Registrations (registrations.h), which also reserves the
// pinned bytes of LAMs (so that warm pins give way for them too).
//
// Thread safety: thread-safe. No lock is held while calling the device; a
// session's `mu` is taken briefly around it.
#ifndef MRD_SERVER_CORE_FAST_REGISTRATION_H_
#define MRD_SERVER_CORE_FAST_REGISTRATION_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "mrd/v1/mrd.pb.h"
#include "server/common/progress.h"
#include "server/core/budgets.h"
#include "server/core/progress_reporter.h"
#include "server/core/registrations.h"
#include "server/core/session.h"
#include "server/device/device.h"

namespace mrd::core {

struct FastRegistrationLimits {
  uint64_t max_session_lams = 65536;
  uint64_t max_session_mrs = 65536;
  // Reports the progress of long BuildLams (not owned; null: none).
  ProgressReporter* progress = nullptr;
};

class FastRegistration {
 public:
  // Everything given must outlive this; `handles` numbers new LAMs and MR
  // objects (it is shared with the session's buffers). MR objects and LAMs
  // live on the device their request names (registrations->devices()).
  FastRegistration(Budgets* budgets, Registrations* registrations,
                   std::atomic<uint64_t>* handles,
                   const FastRegistrationLimits& limits);
  FastRegistration(const FastRegistration&) = delete;
  FastRegistration& operator=(const FastRegistration&) = delete;

  absl::Status CreateMr(const std::shared_ptr<Session>& session,
                        const v1::CreateMrRequest& req, v1::MrInfo* out);
  absl::Status CloseMr(const std::shared_ptr<Session>& session,
                       const v1::CloseMrRequest& req);
  // `cancelled` (optional): the caller gave up. A LAM of kProgressMinBytes
  // or more reports its progress and stops between steps, undone; one made
  // for a caller who has gone is released before the answer (CANCELLED).
  absl::Status BuildLam(const std::shared_ptr<Session>& session,
                        const v1::BuildLamRequest& req,
                        v1::BuildLamResponse* out,
                        const CancelCheck& cancelled = nullptr);
  absl::Status ReleaseLam(const std::shared_ptr<Session>& session,
                          const v1::ReleaseLamRequest& req);
  absl::Status FastRegister(const std::shared_ptr<Session>& session,
                            const v1::FastRegisterRequest& req,
                            v1::FastRegisterResponse* out);
  absl::Status InvalidateMr(const std::shared_ptr<Session>& session,
                            const v1::InvalidateMrRequest& req,
                            v1::InvalidateMrResponse* out);

  // W11: what goes with a released buffer, taken out of the session under
  // its lock (DetachLocked), then released outside it (Release).
  struct Detached {
    std::vector<LamRecord> lams;
    // Fast-registered MR objects mapping those LAMs: (MR, device MR).
    std::vector<std::pair<uint64_t, device::MrId>> fr_to_reset;
  };
  Detached DetachLocked(Session& session, uint64_t buffer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu);
  // Kills the tokens of the detached fast registrations: each MR object
  // gets a new device MR object, in the free state.
  void ResetFastRegistrations(Session& session, const Detached& detached);
  // The session's end: frees the device objects of its MR objects (taken
  // out of the session).
  void FreeMrs(Session& session, const std::map<uint64_t, MrObject>& mrs);
  // Releases LAMs taken out of the session: on the device, then their
  // pinned bytes and objects. `why` prefixes the warnings of a release the
  // device refused (its pages then stay mapped until the PD goes).
  void ReleaseLams(Session& session, const std::vector<const LamRecord*>& lams,
                   absl::string_view why);

 private:
  // Gives the MR object a new device MR object (the old key dies at once)
  // in the free state.
  void ResetFastRegistration(Session& session, uint64_t id,
                             device::MrId device_mr);
  // FastRegister's checks against the session: the MR object (F4) and the
  // pages (each a logical address of one of the session's LAMs, writable
  // when write access is asked for). Queues what the completion will need.
  absl::Status QueueFastRegisterLocked(Session& session,
                                       const v1::FastRegisterRequest& req,
                                       uint32_t access, device::MrId* mr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu);

  // The device a request names ("" the first), and its index.
  absl::StatusOr<uint32_t> DeviceOf(const std::string& name) const;

  const std::vector<device::Device*> devices_;
  Budgets* const budgets_;
  Registrations* const registrations_;
  std::atomic<uint64_t>* const handles_;
  const FastRegistrationLimits limits_;
  const uint64_t page_size_;
};

}  // namespace mrd::core

#endif  // MRD_SERVER_CORE_FAST_REGISTRATION_H_
