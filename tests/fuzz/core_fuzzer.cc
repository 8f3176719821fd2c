// Fuzzes the core's request handling (server/core/core.cc) with fuzzed
// protobuf requests: a real Core on a real SoftwareDevice, a shared-memory
// directory with files, real memfds and real peers on the device's TCP port;
// the core serves two software devices (the second, "software1", sharing
// the first's pins, as mrd's do), and the fix-ups choose devices for
// registrations, LAMs, MR objects and peers now and then.
//
// The input is a sequence of (RPC selector, serialized request, fix-ups).
// The request bytes are parsed as that RPC's message (whatever parses);
// the fix-ups then, most of the time, put a live session token and live
// handles (buffers, registrations, MR objects, LAMs and their pages, peer
// connections) into it, so the fuzzer gets past "unknown session" and
// reaches deep: limits, the registration cache, warm pins, fast
// registration, invalidation, leases expiring on a fake clock, sessions
// ending with everything in them. RegisterMr and DeregisterMr go in by each
// of their three ways: the worker's call, the quick form the gRPC thread
// tries first, and a batch. Limits are small in half of the runs, so
// that every limit is hit.
//
// Invariants, after every input: once every session is closed (fd sessions
// as their socket would, lease sessions with CloseSession), the core holds
// no session, buffer, registration, LAM, MR or connection and accounts no
// pinned byte; the device holds no PD, MR, LAM, key or ticket and pins no
// byte; and no fd is left open. Every failed call must carry a reason.
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "mrd/peer_frame.h"
#include "mrd/status.h"
#include "mrd/status_proto.h"
#include "mrd/unique_fd.h"
#include "mrd/v1/mrd.pb.h"
#include "mrd/v1/peer.pb.h"
#include "server/common/clock.h"
#include "server/core/core.h"
#include "server/device/software/software_device.h"
#include "tests/fuzz/fuzz_util.h"

namespace mrd::fuzz {
namespace {

constexpr uint64_t kPage = 4096;

struct Fixture {
  std::unique_ptr<device::SoftwareDevice> device;
  std::unique_ptr<device::SoftwareDevice> device2;  // "software1"
  std::string shm_dir;
  uint16_t port = 0;
  uint16_t port2 = 0;  // device2's peer path
};

// The port of `peer_address` (host:port).
uint16_t PortOf(const std::string& peer_address) {
  std::vector<std::string> host_port = absl::StrSplit(peer_address, ':');
  uint32_t port = 0;
  FUZZ_CHECK(host_port.size() == 2 && absl::SimpleAtoi(host_port[1], &port));
  return static_cast<uint16_t>(port);
}

void WriteFile(const std::string& path, uint64_t size, mode_t mode) {
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, mode));
  FUZZ_CHECK(fd.valid(), "create ", path, ": ", std::strerror(errno));
  FUZZ_CHECK(::ftruncate(fd.get(), static_cast<off_t>(size)) == 0);
}

Fixture* GetFixture() {
  static Fixture* fixture = [] {
    QuietLogs();
    auto* f = new Fixture;
    device::SoftwareDeviceOptions options;
    options.max_message_size = 64 * 1024;
    options.max_page_list_length = 64;
    absl::StatusOr<std::unique_ptr<device::SoftwareDevice>> dev =
        device::SoftwareDevice::Create(options);
    FUZZ_CHECK(dev.ok(), dev.status().ToString());
    f->device = *std::move(dev);
    FUZZ_CHECK(f->device->Start().ok());
    f->port = PortOf(f->device->Attributes().peer_address);
    options.name = "software1";
    options.share_pins_with = f->device.get();
    options.connection_id_base = uint64_t{1} << core::Session::kDeviceShift;
    dev = device::SoftwareDevice::Create(options);
    FUZZ_CHECK(dev.ok(), dev.status().ToString());
    f->device2 = *std::move(dev);
    FUZZ_CHECK(f->device2->Start().ok());
    f->port2 = PortOf(f->device2->Attributes().peer_address);
    f->shm_dir = MakeTempDir("/dev/shm", "mrd-fuzz-core-");
    WriteFile(f->shm_dir + "/a", 8 * kPage, 0600);
    WriteFile(f->shm_dir + "/b", 3 * kPage + 17, 0600);
    WriteFile(f->shm_dir + "/ro", 2 * kPage, 0400);
    FUZZ_CHECK(::mkdir((f->shm_dir + "/d").c_str(), 0755) == 0);
    WriteFile(f->shm_dir + "/d/c", 64 * kPage, 0600);
    FUZZ_CHECK(::symlink("a", (f->shm_dir + "/link").c_str()) == 0);
    std::atexit([] { RemoveTree(GetFixture()->shm_dir); });
    return f;
  }();
  return fixture;
}

// Everything the input has seen so far, to aim requests at.
struct Live {
  std::vector<std::string> sessions;  // fd and lease
  std::vector<std::string> fd_sessions;
  std::vector<uint64_t> buffers;
  std::vector<uint64_t> buffer_sizes;
  std::vector<uint64_t> registrations;
  std::vector<uint64_t> mrs;
  std::vector<uint64_t> lams;
  std::vector<std::vector<uint64_t>> lam_pages;
  std::vector<uint64_t> connections;
  std::vector<std::string> tickets;
  std::vector<UniqueFd> peers;  // open peer connections
  // The session each handle was made in, by kind: a request aimed at a
  // handle is sent in its session (with the session fix-up).
  std::map<uint64_t, std::string> buffer_owner, registration_owner, mr_owner,
      lam_owner, connection_owner;
};

// The session of `handle` in `owners`, or `otherwise`.
std::string OwnerOf(const std::map<uint64_t, std::string>& owners,
                    uint64_t handle, const std::string& otherwise) {
  auto it = owners.find(handle);
  return it == owners.end() ? otherwise : it->second;
}

// The handles of `all` made in `session`.
std::vector<uint64_t> Owned(const std::vector<uint64_t>& all,
                            const std::map<uint64_t, std::string>& owners,
                            const std::string& session) {
  std::vector<uint64_t> out;
  for (uint64_t h : all) {
    if (OwnerOf(owners, h, "") == session) out.push_back(h);
  }
  return out;
}

template <typename T>
T Pick(Reader& in, const std::vector<T>& from, T otherwise) {
  if (from.empty()) return otherwise;
  return from[in.ConsumeIntegralInRange<size_t>(0, from.size() - 1)];
}

// MRD_FUZZ_DEBUG=1: print each call's outcome (to see how deep inputs go).
bool Debug() {
  static const bool debug = std::getenv("MRD_FUZZ_DEBUG") != nullptr;
  return debug;
}

// A failed call must say why.
void CheckStatus(const absl::Status& status) {
  if (status.ok()) return;
  FUZZ_CHECK(!GetErrorDetail(status).reason().empty(),
             "an error without a reason: ", status.ToString());
}

core::CoreOptions MakeOptions(Reader& in, const Fixture& f) {
  core::CoreOptions o;
  o.shm_dir = f.shm_dir;
  if (in.ConsumeBool()) {
    // Small limits, so that the fuzzer hits each of them.
    o.max_sessions = in.ConsumeIntegralInRange<uint64_t>(1, 4);
    o.max_buffers_per_session = in.ConsumeIntegralInRange<uint64_t>(1, 4);
    o.max_buffer_size = in.ConsumeIntegralInRange<uint64_t>(1, 128) * kPage;
    o.max_session_pinned_bytes =
        in.ConsumeIntegralInRange<uint64_t>(1, 64) * kPage;
    o.max_total_pinned_bytes =
        in.ConsumeIntegralInRange<uint64_t>(1, 128) * kPage;
    o.max_session_registrations = in.ConsumeIntegralInRange<uint64_t>(1, 8);
    o.max_total_registrations = in.ConsumeIntegralInRange<uint64_t>(1, 16);
    o.max_session_lams = in.ConsumeIntegralInRange<uint64_t>(1, 4);
    o.max_session_mrs = in.ConsumeIntegralInRange<uint64_t>(1, 4);
    o.completion_queue_depth = in.ConsumeIntegralInRange<size_t>(1, 8);
    o.request_id_memory = in.ConsumeIntegralInRange<size_t>(1, 4);
    o.max_total_buffers = in.ConsumeIntegralInRange<uint64_t>(1, 8);
    o.max_total_lams = in.ConsumeIntegralInRange<uint64_t>(1, 8);
    o.max_total_mrs = in.ConsumeIntegralInRange<uint64_t>(1, 8);
  }
  // Who an anonymous lease stands for (the files are this uid's, 0600).
  switch (in.ConsumeIntegralInRange<int>(0, 2)) {
    case 0:
      o.anonymous_reach = core::CoreOptions::Reach::kUser;
      o.anonymous_id = static_cast<uint32_t>(::geteuid());
      break;
    case 1:
      o.anonymous_reach = core::CoreOptions::Reach::kGroupMember;
      o.anonymous_id = static_cast<uint32_t>(::getegid());
      break;
    default:
      o.anonymous_reach = core::CoreOptions::Reach::kAnyone;
      break;
  }
  if (in.ConsumeBool()) {
    // Tenants with small shares of small totals.
    core::TenantTableOptions t;
    t.default_percent = in.ConsumeIntegralInRange<uint32_t>(1, 100);
    for (uint64_t& total : t.totals) {
      total = in.ConsumeIntegralInRange<uint64_t>(1, 16);
    }
    t.totals[static_cast<int>(core::TenantResource::kPinnedBytes)] *= 4 * kPage;
    absl::StatusOr<std::unique_ptr<core::TenantTable>> table =
        core::TenantTable::Create(t);
    if (table.ok()) o.tenants = std::move(*table);
  }
  if (in.ConsumeBool()) {
    o.warm_pin_bytes_per_session =
        in.ConsumeIntegralInRange<uint64_t>(1, 32) * kPage;
    o.warm_pin_bytes_total = in.ConsumeIntegralInRange<uint64_t>(1, 64) * kPage;
  }
  return o;
}

// Parses the next request bytes into `message` (a failed parse leaves
// whatever was read; that is a request too).
void ParseNext(Reader& in, google::protobuf::MessageLite* message) {
  const std::string bytes = in.ConsumeRandomLengthString(256);
  (void)message->ParseFromString(bytes);
}

// A peer connected with `ticket`, or an invalid fd with the device's answer
// to its hello in `refusal`.
UniqueFd ConnectPeer(uint16_t port, const std::string& ticket,
                     std::string* refusal) {
  UniqueFd sock(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  FUZZ_CHECK(sock.valid());
  struct sockaddr_in addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const int connect_err = ConnectRetrying(sock.get(), &addr, sizeof(addr));
  FUZZ_CHECK(connect_err == 0, "connect: ", std::strerror(connect_err));
  struct timeval tv = {10, 0};
  ::setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  v1::PeerRequest hello;
  hello.set_id(1);
  hello.mutable_hello()->set_ticket(ticket);
  FUZZ_CHECK(peer::WriteFrame(sock.get(), hello).ok());
  v1::PeerResponse response;
  absl::Status status = peer::ReadFrame(sock.get(), 1 << 20, &response);
  FUZZ_CHECK(status.ok(), "no hello reply: ", status.ToString());
  if (response.status() != v1::PEER_SUCCESS) {
    *refusal = response.message();
    return UniqueFd();
  }
  return sock;
}

// Opens an fd session with a memfd buffer and a lease session with a file
// buffer (when the limits allow), so that even a short input reaches deep.
void Preamble(core::Core& core, Live& live) {
  fd_socket::PeerCredentials creds;
  creds.pid = 4242;
  creds.uid = 1000;
  absl::StatusOr<std::string> token = core.OnConnect(creds);
  if (token.ok()) {
    live.sessions.push_back(*token);
    live.fd_sessions.push_back(*token);
    UniqueFd fd = MakeMemfd(16 * kPage);
    FUZZ_CHECK(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK) == 0);
    v1::ImportMemfd req;
    req.set_writable(true);
    absl::StatusOr<v1::BufferInfo> buffer =
        core.OnImport(*token, std::move(fd), req);
    if (buffer.ok()) {
      live.buffers.push_back(buffer->buffer());
      live.buffer_sizes.push_back(buffer->size());
      live.buffer_owner[buffer->buffer()] = *token;
    }
  }
  v1::OpenLeaseSessionRequest open;
  open.set_ttl_seconds(600);
  v1::SessionInfo info;
  if (core.OpenLeaseSession(open, &info).ok()) {
    live.sessions.push_back(info.session());
    v1::ImportFileRequest req;
    req.set_session(info.session());
    req.set_path("a");
    req.set_writable(true);
    v1::BufferInfo buffer;
    if (core.ImportFile(req, &buffer).ok()) {
      live.buffers.push_back(buffer.buffer());
      live.buffer_sizes.push_back(buffer.size());
      live.buffer_owner[buffer.buffer()] = info.session();
    }
  }
}

// A device name for a request: mostly one of the core's, now and then
// whatever the input said.
std::string PickDevice(Reader& in, const std::string& fuzzed) {
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0:
      return "";
    case 1:
      return "software";
    case 2:
      return "software1";
    default:
      return fuzzed;
  }
}

// A registration's devices: none, one, both, all, nearest, or the input's.
void FixDevices(Reader& in, v1::DeviceSelection* devices) {
  switch (in.ConsumeIntegralInRange<int>(0, 5)) {
    case 0:
      devices->Clear();
      break;
    case 1:
      devices->Clear();
      devices->add_names(in.ConsumeBool() ? "software" : "software1");
      break;
    case 2:
      devices->Clear();
      devices->add_names("software1");
      devices->add_names("software");
      break;
    case 3:
      devices->Clear();
      devices->set_all(true);
      break;
    case 4:
      devices->Clear();
      devices->set_nearest(true);
      break;
    default:
      break;  // as fuzzed
  }
}

void RunOne(Reader& in, Fixture& f, core::Core& core, FakeClock& clock,
            Live& live) {
  Preamble(core, live);
  int steps = 0;
  while (in.remaining_bytes() > 0 && steps < 48) {
    ++steps;
    const int op = in.ConsumeIntegralInRange<int>(0, 21);
    // Fix-ups: a live session and live handles, most of the time.
    const uint8_t fix = in.ConsumeIntegral<uint8_t>();
    const bool fix_session = (fix & 0x7) != 0;
    const bool fix_handles = (fix & 0x18) != 0;
    const bool fix_range = (fix & 0x20) == 0;
    const std::string session = Pick(in, live.sessions, std::string());
    absl::Status status;
    switch (op) {
      case 0: {  // an fd session, as the fd socket opens it
        fd_socket::PeerCredentials creds;
        creds.pid = 1000 + steps;
        creds.uid = in.ConsumeIntegral<uint16_t>();
        absl::StatusOr<std::string> token = core.OnConnect(creds);
        status = token.status();
        if (token.ok()) {
          live.sessions.push_back(*token);
          live.fd_sessions.push_back(*token);
        }
        break;
      }
      case 1: {
        v1::OpenLeaseSessionRequest req;
        ParseNext(in, &req);
        v1::SessionInfo out;
        status = core.OpenLeaseSession(req, &out);
        if (status.ok()) live.sessions.push_back(out.session());
        break;
      }
      case 2: {  // a memfd through the fd socket
        const uint64_t size =
            in.ConsumeBool()
                ? in.ConsumeIntegralInRange<uint64_t>(1, 16) * kPage
                : in.ConsumeIntegralInRange<uint64_t>(0, 80 * kPage);
        UniqueFd fd = MakeMemfd(size);
        if (in.ConsumeIntegralInRange<int>(0, 7) != 0) {
          FUZZ_CHECK(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK) == 0);
        }
        v1::ImportMemfd req;
        ParseNext(in, &req);
        if (fix_range) req.set_expected_size(0);
        const std::string token =
            fix_session ? Pick(in, live.fd_sessions, session) : session;
        absl::StatusOr<v1::BufferInfo> buffer =
            core.OnImport(token, std::move(fd), req);
        status = buffer.status();
        if (buffer.ok()) {
          live.buffers.push_back(buffer->buffer());
          live.buffer_sizes.push_back(buffer->size());
          live.buffer_owner[buffer->buffer()] = token;
        }
        break;
      }
      case 3: {
        v1::ImportFileRequest req;
        ParseNext(in, &req);
        if (fix_session) req.set_session(session);
        if (fix_handles) {
          req.set_path(in.PickValueInArray<const char*>(
              {"a", "b", "ro", "d/c", "link", "d", "missing", "../x"}));
        }
        v1::BufferInfo out;
        status = core.ImportFile(req, &out);
        if (status.ok()) {
          live.buffers.push_back(out.buffer());
          live.buffer_sizes.push_back(out.size());
          live.buffer_owner[out.buffer()] = req.session();
        }
        break;
      }
      case 4: {
        v1::ReleaseBufferRequest req;
        ParseNext(in, &req);
        if (fix_session) req.set_session(session);
        if (fix_handles) {
          req.set_buffer(Pick(in, live.buffers, uint64_t{0}));
          if (fix_session) {
            req.set_session(OwnerOf(live.buffer_owner, req.buffer(), session));
          }
        }
        v1::ReleaseBufferResponse out;
        status = core.ReleaseBuffer(req, &out);
        break;
      }
      case 5:
      case 6:
      case 7: {
        v1::RegisterMrRequest req;
        ParseNext(in, &req);
        if (fix_session) req.set_session(session);
        if (fix_handles) {
          const size_t i = live.buffers.empty()
                               ? 0
                               : in.ConsumeIntegralInRange<size_t>(
                                     0, live.buffers.size() - 1);
          if (!live.buffers.empty()) {
            req.set_buffer(live.buffers[i]);
            if (fix_session) {
              req.set_session(
                  OwnerOf(live.buffer_owner, req.buffer(), session));
            }
            if (fix_range) {
              const uint64_t size = live.buffer_sizes[i];
              const uint64_t offset =
                  in.ConsumeIntegralInRange<uint64_t>(0, size - 1);
              req.set_offset(offset);
              req.set_length(
                  in.ConsumeIntegralInRange<uint64_t>(1, size - offset));
            }
          }
          if (req.mr() != 0 || in.ConsumeIntegralInRange<int>(0, 3) == 0) {
            req.set_mr(Pick(in, live.mrs, req.mr()));
          }
        }
        if (in.ConsumeBool()) {
          req.set_flags(in.PickValueInArray<uint32_t>(
              {0x1, 0x3, 0x5, 0x7, 0xf, 0x2, 0x13, 0x10}));
          req.clear_mem_flags();
        }
        if (fix_handles) FixDevices(in, req.mutable_devices());
        // The three ways in: the worker's call, the gRPC thread's quick
        // form (then the worker's when it declines, as the service does),
        // and a batch of this item and a copy of it.
        const int via = in.ConsumeIntegralInRange<int>(0, 2);
        if (via == 2) {
          v1::RegisterMrBatchRequest batch;
          batch.set_session(req.session());
          if (in.ConsumeBool()) req.clear_session();
          *batch.add_items() = req;
          if (in.ConsumeBool()) *batch.add_items() = req;
          v1::RegisterMrBatchResponse out;
          status = core.RegisterMrBatch(batch, &out);
          for (const v1::RegisterMrBatchResult& item : out.items()) {
            absl::Status item_status = ItemStatusFromProto(item.status());
            CheckStatus(item_status);
            if (!item_status.ok()) continue;
            live.registrations.push_back(item.registration().registration());
            live.registration_owner[item.registration().registration()] =
                batch.session();
          }
          break;
        }
        v1::RegisterMrResponse out;
        std::optional<absl::Status> quick;
        if (via == 1) quick = core.TryRegisterMrHit(req, &out);
        status = quick.has_value() ? *quick : core.RegisterMr(req, &out);
        if (status.ok()) {
          live.registrations.push_back(out.registration());
          live.registration_owner[out.registration()] = req.session();
        }
        break;
      }
      case 8: {
        v1::DeregisterMrRequest req;
        ParseNext(in, &req);
        if (fix_session) req.set_session(session);
        if (fix_handles) {
          if (in.ConsumeBool()) {
            req.set_registration(Pick(in, live.registrations, uint64_t{0}));
            if (fix_session) {
              req.set_session(OwnerOf(live.registration_owner,
                                      req.registration(), session));
            }
          } else {
            req.set_mr(Pick(in, live.mrs, uint64_t{0}));
            if (fix_session) {
              req.set_session(OwnerOf(live.mr_owner, req.mr(), session));
            }
          }
        }
        const int via = in.ConsumeIntegralInRange<int>(0, 2);
        if (via == 2) {
          v1::DeregisterMrBatchRequest batch;
          batch.set_session(req.session());
          if (in.ConsumeBool()) req.clear_session();
          *batch.add_items() = req;
          if (in.ConsumeBool()) *batch.add_items() = req;
          v1::DeregisterMrBatchResponse out;
          status = core.DeregisterMrBatch(batch, &out);
          for (const v1::DeregisterMrBatchResult& item : out.items()) {
            CheckStatus(ItemStatusFromProto(item.status()));
          }
          break;
        }
        v1::DeregisterMrResponse out;
        std::optional<absl::Status> quick;
        if (via == 1) quick = core.TryDeregisterMrNotLast(req, &out);
        status = quick.has_value() ? *quick : core.DeregisterMr(req, &out);
        break;
      }
      case 9:
      case 10: {
        v1::BuildLamRequest req;
        ParseNext(in, &req);
        if (fix_session) req.set_session(session);
        if (fix_handles && !live.buffers.empty()) {
          const size_t i =
              in.ConsumeIntegralInRange<size_t>(0, live.buffers.size() - 1);
          req.set_buffer(live.buffers[i]);
          if (fix_session) {
            req.set_session(OwnerOf(live.buffer_owner, req.buffer(), session));
          }
          if (fix_range) {
            const uint64_t size = live.buffer_sizes[i];
            const uint64_t offset =
                in.ConsumeIntegralInRange<uint64_t>(0, size - 1);
            req.set_offset(offset);
            req.set_length(
                in.ConsumeIntegralInRange<uint64_t>(1, size - offset));
            if (in.ConsumeBool()) req.set_lam_capacity(0);
          }
        }
        if (fix_handles) req.set_device(PickDevice(in, req.device()));
        v1::BuildLamResponse out;
        status = core.BuildLam(req, &out);
        if (status.ok()) {
          live.lams.push_back(out.lam());
          live.lam_owner[out.lam()] = req.session();
          live.lam_pages.emplace_back(out.pages().begin(), out.pages().end());
        }
        break;
      }
      case 11: {
        v1::ReleaseLamRequest req;
        ParseNext(in, &req);
        if (fix_session) req.set_session(session);
        if (fix_handles) {
          req.set_lam(Pick(in, live.lams, uint64_t{0}));
          if (fix_session) {
            req.set_session(OwnerOf(live.lam_owner, req.lam(), session));
          }
        }
        status = core.ReleaseLam(req);
        break;
      }
      case 12: {
        v1::CreateMrRequest req;
        ParseNext(in, &req);
        if (fix_session) req.set_session(session);
        if (fix_handles) req.set_device(PickDevice(in, req.device()));
        v1::MrInfo out;
        status = core.CreateMr(req, &out);
        if (status.ok()) {
          live.mrs.push_back(out.mr());
          live.mr_owner[out.mr()] = req.session();
        }
        break;
      }
      case 13: {
        v1::CloseMrRequest req;
        ParseNext(in, &req);
        if (fix_session) req.set_session(session);
        if (fix_handles) {
          req.set_mr(Pick(in, live.mrs, uint64_t{0}));
          if (fix_session) {
            req.set_session(OwnerOf(live.mr_owner, req.mr(), session));
          }
        }
        status = core.CloseMr(req);
        break;
      }
      case 14:
      case 15: {
        v1::FastRegisterRequest req;
        ParseNext(in, &req);
        if (fix_session) req.set_session(session);
        if (fix_handles) {
          req.set_mr(Pick(in, live.mrs, uint64_t{0}));
          const std::string owner = OwnerOf(live.mr_owner, req.mr(), session);
          if (fix_session) req.set_session(owner);
          req.set_connection(
              Pick(in, Owned(live.connections, live.connection_owner, owner),
                   uint64_t{0}));
          std::vector<size_t> lam_index;
          for (size_t k = 0; k < live.lams.size(); ++k) {
            if (OwnerOf(live.lam_owner, live.lams[k], "") == owner) {
              lam_index.push_back(k);
            }
          }
          if (!lam_index.empty() && fix_range) {
            const std::vector<uint64_t>& pages =
                live.lam_pages[lam_index[in.ConsumeIntegralInRange<size_t>(
                    0, lam_index.size() - 1)]];
            req.clear_pages();
            const size_t n = in.ConsumeIntegralInRange<size_t>(1, pages.size());
            for (size_t k = 0; k < n; ++k) req.add_pages(pages[k]);
            req.set_fbo(in.ConsumeIntegralInRange<uint32_t>(0, 4095));
            req.set_length(
                in.ConsumeIntegralInRange<uint64_t>(1, n * kPage - req.fbo()));
          }
        }
        v1::FastRegisterResponse out;
        status = core.FastRegister(req, &out);
        break;
      }
      case 16: {
        v1::InvalidateMrRequest req;
        ParseNext(in, &req);
        if (fix_session) req.set_session(session);
        if (fix_handles) {
          req.set_mr(Pick(in, live.mrs, uint64_t{0}));
          const std::string owner = OwnerOf(live.mr_owner, req.mr(), session);
          if (fix_session) req.set_session(owner);
          req.set_connection(
              Pick(in, Owned(live.connections, live.connection_owner, owner),
                   uint64_t{0}));
        }
        v1::InvalidateMrResponse out;
        status = core.InvalidateMr(req, &out);
        break;
      }
      case 17: {  // a ticket, and a peer connecting with it
        v1::CreatePeerTicketRequest req;
        ParseNext(in, &req);
        if (fix_session) req.set_session(session);
        if (fix_handles) req.set_device(PickDevice(in, req.device()));
        v1::PeerTicket out;
        status = core.CreatePeerTicket(req, &out);
        if (status.ok() && live.peers.size() < 4) {
          std::string refusal;
          UniqueFd peer =
              ConnectPeer(out.device() == "software1" ? f.port2 : f.port,
                          out.ticket(), &refusal);
          // A fresh ticket gets in unless the session's tenant holds its
          // quota of peer connections already.
          FUZZ_CHECK(
              peer.valid() ||
                  absl::StartsWith(refusal, "LIMIT_TENANT_PEER_CONNECTIONS"),
              "a fresh ticket was refused: ", refusal);
          if (!peer.valid()) break;
          live.peers.push_back(std::move(peer));
          // The core learns of the connection from the device's worker.
          f.device->WaitForWorkerIdle();
          f.device2->WaitForWorkerIdle();
          v1::ListRegistrationsRequest list;
          list.set_session(req.session());
          v1::ListRegistrationsResponse listed;
          FUZZ_CHECK(core.ListRegistrations(list, &listed).ok());
          for (const v1::ConnectionInfo& c : listed.connections()) {
            live.connections.push_back(c.connection());
            live.connection_owner[c.connection()] = req.session();
          }
        }
        break;
      }
      case 18: {
        v1::ListRegistrationsRequest req;
        ParseNext(in, &req);
        if (fix_session) req.set_session(session);
        v1::ListRegistrationsResponse out;
        status = core.ListRegistrations(req, &out);
        break;
      }
      case 19: {
        v1::GetSessionRequest req;
        ParseNext(in, &req);
        if (fix_session) req.set_session(session);
        v1::SessionInfo out;
        status = core.GetSession(req, &out);
        break;
      }
      case 20: {
        if (in.ConsumeBool()) {  // the session's end, either way
          v1::CloseSessionRequest req;
          ParseNext(in, &req);
          if (fix_session) req.set_session(session);
          status = core.CloseSession(req);
        } else {
          core.OnDisconnect(session);
        }
        break;
      }
      default: {  // time passes; leases expire
        clock.Advance(absl::Seconds(in.ConsumeIntegralInRange<int>(0, 7200)));
        core.ReapExpiredLeases();
        f.device->WaitForWorkerIdle();
        f.device2->WaitForWorkerIdle();
        break;
      }
    }
    CheckStatus(status);
    if (Debug()) {
      std::fprintf(stderr, "op %d: %s\n", op, status.ToString().c_str());
    }
  }
}

}  // namespace
}  // namespace mrd::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mrd::fuzz;  // NOLINT(build/namespaces)
  Fixture* f = GetFixture();
  const int fds_before = CountOpenFds();
  Reader in(data, size);
  {
    mrd::FakeClock clock;
    mrd::core::Core core(
        std::vector<mrd::device::Device*>{f->device.get(), f->device2.get()},
        &clock, MakeOptions(in, *f));
    Live live;
    RunOne(in, *f, core, clock, live);
    // Every session ends the way it would in mrd.
    for (const std::string& token : live.sessions) {
      if (std::find(live.fd_sessions.begin(), live.fd_sessions.end(), token) !=
          live.fd_sessions.end()) {
        core.OnDisconnect(token);
      } else {
        mrd::v1::CloseSessionRequest req;
        req.set_session(token);
        (void)core.CloseSession(req);  // may have expired already
      }
    }
    f->device->WaitForWorkerIdle();
    f->device2->WaitForWorkerIdle();
    const mrd::core::CoreStats stats = core.Stats();
    FUZZ_CHECK(stats.sessions == 0 && stats.buffers == 0 &&
                   stats.registrations == 0 && stats.lams == 0 &&
                   stats.mrs == 0 && stats.connections == 0,
               "the core holds objects of closed sessions: sessions ",
               stats.sessions, " buffers ", stats.buffers, " registrations ",
               stats.registrations, " lams ", stats.lams, " mrs ", stats.mrs,
               " connections ", stats.connections);
    FUZZ_CHECK(stats.accounted_pinned_bytes == 0, "accounted pinned bytes ",
               stats.accounted_pinned_bytes);
    FUZZ_CHECK(f->device->PinnedBytes() == 0, "the device still pins ",
               f->device->PinnedBytes(), " bytes");
    for (const mrd::device::SoftwareDevice* device :
         {f->device.get(), f->device2.get()}) {
      const auto counts = device->CountResources();
      FUZZ_CHECK(counts.pds == 0 && counts.mrs == 0 && counts.lams == 0 &&
                     counts.keys == 0 && counts.tickets == 0 &&
                     counts.iova_ranges == 0,
                 device->Attributes().name, " holds objects: pds ", counts.pds,
                 " mrs ", counts.mrs, " lams ", counts.lams, " keys ",
                 counts.keys, " tickets ", counts.tickets, " iova ",
                 counts.iova_ranges);
    }
    // The peers' connections were closed by the device with their PDs; ours
    // see the end of stream.
    for (mrd::UniqueFd& peer : live.peers) {
      mrd::v1::PeerResponse response;
      const absl::Status status =
          mrd::peer::ReadFrame(peer.get(), 1 << 20, &response);
      FUZZ_CHECK(
          !status.ok() &&
              status.message().find(std::strerror(EAGAIN)) == std::string::npos,
          "a peer of a closed session is still served: ", status.ToString());
    }
  }
  // The device's connection threads close their sockets as they finish.
  int fds_after = CountOpenFds();
  for (int i = 0; i < 1000 && fds_after != fds_before; ++i) {
    ::usleep(1000);
    fds_after = CountOpenFds();
  }
  FUZZ_CHECK(fds_after == fds_before, "open fds ", fds_before, " -> ",
             fds_after);
  return 0;
}
