// What the verbs device's files share: the definitions of its private
// structs and the eventfd and poll helpers of its two threads. Only the
// verbs device's own .cc files include this.
//   verbs_device.cc    creation, lifecycle, PDs, registration, LAMs, fast
//                      registration (the provider hooks of the model)
//   verbs_peer_path.cc the connection manager: rdma_cm events, admitting
//                      connect requests, queue pairs, closing connections
//   verbs_events.cc    async events (QP and port errors) and device loss
#ifndef MRD_SERVER_DEVICE_VERBS_VERBS_INTERNAL_H_
#define MRD_SERVER_DEVICE_VERBS_VERBS_INTERNAL_H_

#include <infiniband/verbs.h>
#include <poll.h>
#include <rdma/rdma_cma.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <string>

#include "server/device/verbs/verbs_device.h"

namespace mrd::device {

// The opened device. Owned by the VerbsDevice; the cm thread destroys
// listen_id on its way out, ReleaseDevice after a loss, or the destructor
// when the device never started.
struct VerbsDevice::Adapter {
  ~Adapter() {
    if (listen_id != nullptr) rdma_destroy_id(listen_id);
    if (channel != nullptr) rdma_destroy_event_channel(channel);
  }
  // librdmacm's context of the device (listen_id->verbs); closed by
  // librdmacm once every id on it is gone (and, after a loss, the device is
  // noticed to be gone).
  ibv_context* context = nullptr;
  rdma_event_channel* channel = nullptr;
  rdma_cm_id* listen_id = nullptr;
  DeviceAttributes attributes;
  uint64_t max_mr_size = 0;
  uint32_t max_page_list_length = 0;
  uint64_t max_message_size = 0;
  uint32_t max_responder_resources = 0;  // device max_qp_rd_atom
  uint32_t max_initiator_depth = 0;      // device max_qp_init_rd_atom
  uint8_t port_num = 1;
  std::string port_problem;  // non-empty: the port was not active
};

struct VerbsDevice::VerbsPd final : ProviderState {
  explicit VerbsPd(ibv_pd* p) : pd(p) {}
  ibv_pd* pd;
};

// One verbs registration: the MR, and the view of the file mrd mapped for
// it when it did not register the caller's mapping (fast-registration
// remaps, writable views of read-only memory).
struct VerbsDevice::Memory final : ProviderState {
  ibv_mr* mr = nullptr;
  void* view = nullptr;
  uint64_t view_length = 0;
  uint64_t pinned = 0;  // page-rounded bytes the registration pins
};

struct VerbsDevice::CmEvent {
  rdma_cm_event_type type = RDMA_CM_EVENT_ADDR_ERROR;
  rdma_cm_id* id = nullptr;
  int status = 0;
  std::string private_data;
  uint8_t responder_resources = 0;
  uint8_t initiator_depth = 0;
};

namespace verbs_internal {

// "host:port" ("[host]:port" for IPv6) of a socket address.
std::string FormatSockaddr(const sockaddr* addr);
// A GID's 16 bytes as two lower-case hex digits each, joined by ':'.
std::string FormatGid(const uint8_t (&raw)[16]);

// Wakes the thread waiting on eventfd `fd`.
inline void Wake(int fd) {
  uint64_t one = 1;
  // An eventfd write fails only when the counter would overflow, in which
  // case the reader is woken anyway.
  while (::write(fd, &one, sizeof(one)) < 0 && errno == EINTR) {
  }
}

inline void DrainWake(int fd) {
  uint64_t value = 0;
  while (::read(fd, &value, sizeof(value)) > 0) {
  }
}

// Waits until `fd` (or `wake`) is readable. `fd` < 0 waits on `wake` only.
inline void WaitReadable(int fd, int wake) {
  pollfd fds[2] = {{fd, POLLIN, 0}, {wake, POLLIN, 0}};
  while (::poll(fds, 2, -1) < 0 && errno == EINTR) {
  }
}

}  // namespace verbs_internal
}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_VERBS_VERBS_INTERNAL_H_
