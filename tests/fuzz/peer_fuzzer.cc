// Fuzzes the software device's peer path: the frame decoder
// (client/peer/frame.cc ReadFrame, as the device runs it) and the device's
// request handling (hello, READ, WRITE: keys, protection domains, bounds,
// rights), through its stable front door, a real TCP connection to a real
// SoftwareDevice's peer listener.
//
// The device holds two protection domains with real memfds registered in
// several shapes: A has a read-write region, a read-only one, a write-only
// one, a local-only one, a LAM (whose privileged key is local-only) and a
// fast-registered MR over the LAM's pages; B has one read-write region. A
// third ticket belongs to a PD that was deallocated. Each input is one
// connection: a sequence of well-formed requests (hello with one of the
// tickets or garbage, READ/WRITE with any of the keys or garbage, at
// addresses near the regions) checked against a model of what a NIC allows,
// optionally followed by raw bytes (any framing at all).
//
// Invariants:
//   * every well-formed request gets the response the model predicts:
//     success exactly when allowed, the connection closed exactly when an RC
//     queue pair would fail, the request's id echoed;
//   * a READ returns exactly the bytes of the memory, a WRITE lands exactly
//     where it was aimed (the harness keeps a shadow copy of every buffer);
//   * whatever the bytes, memory that no remote-writable region covers never
//     changes, and the device ends every connection once the peer is gone,
//     leaving its objects and pinned bytes as they were.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "fuzzer/FuzzedDataProvider.h"
#include "mrd/peer_frame.h"
#include "mrd/unique_fd.h"
#include "mrd/v1/peer.pb.h"
#include "server/device/software/software_device.h"
#include "tests/fuzz/fuzz_util.h"

namespace mrd::fuzz {
namespace {

using device::kAccessLocalWrite;
using device::kAccessRemoteRead;
using device::kAccessRemoteWrite;

constexpr uint64_t kPage = 4096;
constexpr uint64_t kBufferSize = 16 * kPage;
constexpr uint64_t kMaxMessage = 32 * 1024;  // the device's max_message_size
constexpr uint64_t kHelloFrameLimit = 4096;  // frames before hello

class Sink final : public device::PdEventSink {
 public:
  void OnCompletion(const device::WorkCompletion& completion) override {
    absl::MutexLock lock(&mu_);
    completions_.push_back(completion);
  }
  void OnPeerConnected(device::ConnectionId connection,
                       const std::string&) override {
    absl::MutexLock lock(&mu_);
    connected_.push_back(connection);
  }
  void OnPeerDisconnected(device::ConnectionId) override {}

  device::WorkCompletion WaitCompletion() {
    absl::MutexLock lock(&mu_);
    auto any = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !completions_.empty();
    };
    FUZZ_CHECK(mu_.AwaitWithTimeout(absl::Condition(&any), absl::Seconds(10)));
    device::WorkCompletion c = completions_.front();
    completions_.erase(completions_.begin());
    return c;
  }
  device::ConnectionId WaitConnected() {
    absl::MutexLock lock(&mu_);
    auto any = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !connected_.empty();
    };
    FUZZ_CHECK(mu_.AwaitWithTimeout(absl::Condition(&any), absl::Seconds(10)));
    return connected_.front();
  }

 private:
  absl::Mutex mu_;
  std::vector<device::WorkCompletion> completions_ ABSL_GUARDED_BY(mu_);
  std::vector<device::ConnectionId> connected_ ABSL_GUARDED_BY(mu_);
};

// One client buffer: a memfd mapped like mrd maps it, and its shadow.
struct Buffer {
  UniqueFd fd;
  char* address = nullptr;
  std::string shadow;
  // Bytes some remote-writable region covers: only these may ever change.
  std::vector<bool> writable;
};

// A key a peer may present, and what it grants (empty length: nothing).
struct Region {
  uint32_t rkey = 0;
  int pd = 0;  // 0 = A, 1 = B
  int buffer = 0;
  uint64_t base = 0;    // virtual address of the first byte
  uint64_t offset = 0;  // of that byte in the buffer
  uint64_t length = 0;
  bool read = false;
  bool write = false;
};

struct Fixture {
  std::unique_ptr<device::SoftwareDevice> device;
  Sink sinks[2];
  Sink dead_sink;
  device::PdId pds[2] = {0, 0};
  std::string tickets[3];  // A, B, a dead PD's
  Buffer buffers[2];
  std::vector<Region> regions;
  uint16_t port = 0;
  UniqueFd held_connection;  // PD A's connection used to fast-register
  device::SoftwareDevice::ResourceCounts baseline;
  uint64_t pinned = 0;
};

UniqueFd ConnectTcp(uint16_t port) {
  UniqueFd sock(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  FUZZ_CHECK(sock.valid());
  struct sockaddr_in addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const int connect_err = ConnectRetrying(sock.get(), &addr, sizeof(addr));
  FUZZ_CHECK(connect_err == 0, "connect: ", std::strerror(connect_err));
  int one = 1;
  ::setsockopt(sock.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  struct timeval tv = {10, 0};
  ::setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return sock;
}

device::MemorySpan SpanOf(const Buffer& b, uint64_t offset, uint64_t length) {
  device::MemorySpan span;
  span.host_address = b.address + offset;
  span.length = length;
  span.fd = b.fd.get();
  span.file_offset = offset;
  return span;
}

void AddRegion(Fixture& f, int pd, int buffer, uint64_t offset, uint64_t length,
               uint64_t base, uint32_t access) {
  absl::StatusOr<device::MrKeys> keys = f.device->RegisterMr(
      f.pds[pd], SpanOf(f.buffers[buffer], offset, length), base, access);
  FUZZ_CHECK(keys.ok(), keys.status().ToString());
  Region r;
  r.rkey = keys->rkey;
  r.pd = pd;
  r.buffer = buffer;
  r.base = base;
  r.offset = offset;
  r.length = length;
  r.read = (access & kAccessRemoteRead) != 0;
  r.write = (access & kAccessRemoteWrite) != 0;
  f.regions.push_back(r);
}

Fixture* GetFixture() {
  static Fixture* fixture = [] {
    QuietLogs();
    auto* f = new Fixture;
    device::SoftwareDeviceOptions options;
    options.peer_listen_address = "127.0.0.1:0";
    options.max_message_size = kMaxMessage;
    absl::StatusOr<std::unique_ptr<device::SoftwareDevice>> dev =
        device::SoftwareDevice::Create(options);
    FUZZ_CHECK(dev.ok(), dev.status().ToString());
    f->device = *std::move(dev);
    FUZZ_CHECK(f->device->Start().ok());
    std::vector<std::string> host_port =
        absl::StrSplit(f->device->Attributes().peer_address, ':');
    uint32_t port = 0;
    FUZZ_CHECK(host_port.size() == 2 && absl::SimpleAtoi(host_port[1], &port));
    f->port = static_cast<uint16_t>(port);

    for (int i = 0; i < 2; ++i) {
      Buffer& b = f->buffers[i];
      b.fd = MakeMemfd(kBufferSize, i == 0 ? "A-buffer" : "buffer-B");
      void* addr = ::mmap(nullptr, kBufferSize, PROT_READ | PROT_WRITE,
                          MAP_SHARED, b.fd.get(), 0);
      FUZZ_CHECK(addr != MAP_FAILED);
      b.address = static_cast<char*>(addr);
      b.shadow.assign(b.address, kBufferSize);
      b.writable.assign(kBufferSize, false);
      absl::StatusOr<device::PdId> pd = f->device->AllocatePd(&f->sinks[i]);
      FUZZ_CHECK(pd.ok());
      f->pds[i] = *pd;
      absl::StatusOr<std::string> ticket = f->device->CreatePeerTicket(*pd);
      FUZZ_CHECK(ticket.ok());
      f->tickets[i] = *ticket;
    }
    {  // a ticket whose PD is gone
      absl::StatusOr<device::PdId> pd = f->device->AllocatePd(&f->dead_sink);
      FUZZ_CHECK(pd.ok());
      absl::StatusOr<std::string> ticket = f->device->CreatePeerTicket(*pd);
      FUZZ_CHECK(ticket.ok());
      f->tickets[2] = *ticket;
      FUZZ_CHECK(f->device->DeallocatePd(*pd).ok());
    }
    const uint32_t rw =
        kAccessLocalWrite | kAccessRemoteRead | kAccessRemoteWrite;
    // PD A: [0, 8 pages) read-write at a high base; pages 2-5 again
    // read-only and write-only at other bases; page 6 local-only. Pages
    // 8-11 are reached only through the fast-registered MR below; 12-15 by
    // nothing remote at all.
    AddRegion(*f, 0, 0, 0, 8 * kPage, 0x7f0000000000, rw);
    AddRegion(*f, 0, 0, 2 * kPage + 100, 3 * kPage, 0x1000, kAccessRemoteRead);
    AddRegion(*f, 0, 0, 4 * kPage, 2 * kPage - 1, 0xffffffffffff0000,
              kAccessLocalWrite | kAccessRemoteWrite);
    AddRegion(*f, 0, 0, 6 * kPage, kPage, 0x5000, kAccessLocalWrite);
    // PD B: its middle read-write.
    AddRegion(*f, 1, 1, 4 * kPage, 8 * kPage, 0x7f0000000000, rw);

    // A LAM over pages 8-11 of A; its privileged key must never work
    // remotely.
    absl::StatusOr<device::LogicalMapping> lam = f->device->BuildLam(
        f->pds[0], SpanOf(f->buffers[0], 8 * kPage, 4 * kPage));
    FUZZ_CHECK(lam.ok(), lam.status().ToString());
    Region privileged;
    privileged.rkey = lam->privileged_key;
    privileged.base = lam->pages[0];
    privileged.length = 4 * kPage;  // grants nothing: read/write false
    f->regions.push_back(privileged);

    // A fast-registered MR over the LAM's pages, posted on a connection of
    // PD A that stays open.
    f->held_connection = ConnectTcp(f->port);
    v1::PeerRequest hello;
    hello.set_id(1);
    hello.mutable_hello()->set_ticket(f->tickets[0]);
    FUZZ_CHECK(peer::WriteFrame(f->held_connection.get(), hello).ok());
    v1::PeerResponse welcome;
    FUZZ_CHECK(
        peer::ReadFrame(f->held_connection.get(), 1 << 20, &welcome).ok());
    FUZZ_CHECK(welcome.status() == v1::PEER_SUCCESS);
    const device::ConnectionId connection = f->sinks[0].WaitConnected();
    absl::StatusOr<device::MrKeys> fr =
        f->device->AllocateFastRegisterMr(f->pds[0], true, 16);
    FUZZ_CHECK(fr.ok());
    device::FastRegisterWork work;
    work.mr = fr->mr;
    work.pages = lam->pages;
    work.fbo = 512;
    work.length = 3 * kPage;
    work.base_address = 0x40000200;
    work.access = rw;
    FUZZ_CHECK(f->device->PostFastRegister(connection, work).ok());
    device::WorkCompletion done = f->sinks[0].WaitCompletion();
    FUZZ_CHECK(done.status.ok(), done.status.ToString());
    Region fast;
    fast.rkey = done.rkey;
    fast.pd = 0;
    fast.buffer = 0;
    fast.base = work.base_address;
    fast.offset = 8 * kPage + 512;
    fast.length = work.length;
    fast.read = fast.write = true;
    f->regions.push_back(fast);

    for (const Region& r : f->regions) {
      if (!r.write) continue;
      for (uint64_t i = 0; i < r.length; ++i) {
        f->buffers[r.buffer].writable[r.offset + i] = true;
      }
    }
    f->device->WaitForWorkerIdle();
    f->baseline = f->device->CountResources();
    f->pinned = f->device->PinnedBytes();
    return f;
  }();
  return fixture;
}

// The model of one connection.
struct Model {
  int bound = -1;  // PD index after a good hello
  bool closed = false;
};

// What the device must answer to a well-formed request.
struct Expected {
  v1::PeerStatus status = v1::PEER_SUCCESS;
  bool close = false;
  const Region* region = nullptr;  // READ/WRITE success
  bool frame_error = false;        // refused as a frame: no id echoed
};

Expected Predict(Fixture& f, Model& m, const v1::PeerRequest& request,
                 size_t frame_bytes) {
  Expected e;
  v1::PeerRequest reparsed;
  if ((m.bound < 0 && frame_bytes > kHelloFrameLimit) ||
      !reparsed.ParseFromString(request.SerializeAsString())) {
    // Too large before hello, or unparsable (a ticket that is not UTF-8):
    // refused and closed.
    e.status = v1::PEER_REMOTE_INVALID_REQUEST;
    e.close = true;
    e.frame_error = true;
    return e;
  }
  if (m.bound < 0) {
    if (!request.has_hello()) {
      e.status = v1::PEER_REMOTE_INVALID_REQUEST;
      e.close = true;
      return e;
    }
    const std::string& t = request.hello().ticket();
    if (t == f.tickets[0] || t == f.tickets[1]) {
      m.bound = t == f.tickets[0] ? 0 : 1;
      return e;
    }
    e.status = v1::PEER_BAD_TICKET;
    e.close = true;
    return e;
  }
  if (!request.has_read() && !request.has_write()) {
    e.status = v1::PEER_REMOTE_INVALID_REQUEST;  // a second hello, or no op
    return e;
  }
  const bool is_read = request.has_read();
  const uint32_t rkey =
      is_read ? request.read().rkey() : request.write().rkey();
  const uint64_t address =
      is_read ? request.read().address() : request.write().address();
  const uint64_t length =
      is_read ? request.read().length() : request.write().data().size();
  if (length == 0 || length > kMaxMessage) {
    e.status = v1::PEER_REMOTE_INVALID_REQUEST;
    return e;
  }
  for (const Region& r : f.regions) {
    if (r.rkey != rkey || r.pd != m.bound || r.length == 0) continue;
    const bool in_bounds = address >= r.base && length <= r.length &&
                           address - r.base <= r.length - length;
    if (in_bounds && (is_read ? r.read : r.write)) {
      e.region = &r;
      return e;
    }
  }
  e.status = v1::PEER_REMOTE_ACCESS_ERROR;
  e.close = true;
  return e;
}

uint32_t PickKey(FuzzedDataProvider& in, const Fixture& f) {
  if (in.ConsumeIntegralInRange<int>(0, 7) == 0) {
    return in.ConsumeIntegral<uint32_t>();
  }
  uint32_t key =
      f.regions[in.ConsumeIntegralInRange<size_t>(0, f.regions.size() - 1)]
          .rkey;
  // Sometimes the right slot with a wrong key byte, or the next slot.
  switch (in.ConsumeIntegralInRange<int>(0, 7)) {
    case 0:
      return key ^ (1u + in.ConsumeIntegral<uint8_t>() % 255);
    case 1:
      return key + 0x100;
    default:
      return key;
  }
}

uint64_t PickAddress(FuzzedDataProvider& in, const Fixture& f) {
  if (in.ConsumeIntegralInRange<int>(0, 7) == 0) {
    return in.ConsumeIntegral<uint64_t>();
  }
  const Region& r =
      f.regions[in.ConsumeIntegralInRange<size_t>(0, f.regions.size() - 1)];
  const int64_t delta = in.ConsumeIntegralInRange<int64_t>(
      -2 * static_cast<int64_t>(kPage), static_cast<int64_t>(r.length + kPage));
  return r.base + static_cast<uint64_t>(delta);
}

uint64_t PickLength(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 5)) {
    case 0:
      return in.ConsumeIntegral<uint64_t>();
    case 1:
      return in.PickValueInArray<uint64_t>(
          {0, 1, kPage - 1, kPage, kPage + 1, kMaxMessage, kMaxMessage + 1});
    default:
      return in.ConsumeIntegralInRange<uint64_t>(1, 3 * kPage);
  }
}

// Reads the next response; nullopt at end of stream.
std::optional<v1::PeerResponse> Receive(int sock) {
  v1::PeerResponse response;
  absl::Status status = peer::ReadFrame(sock, 1 << 26, &response);
  if (status.ok()) return response;
  FUZZ_CHECK(status.code() == absl::StatusCode::kUnavailable,
             "the device sent a bad frame: ", status.ToString());
  FUZZ_CHECK(status.message().find(std::strerror(EAGAIN)) == std::string::npos,
             "no response from the device within 10 s");
  return std::nullopt;
}

void SendRaw(int sock, const std::string& bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    ssize_t n =
        ::send(sock, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return;  // the device closed; fine
    sent += static_cast<size_t>(n);
  }
}

void RunOne(FuzzedDataProvider& in, Fixture& f) {
  UniqueFd sock = ConnectTcp(f.port);
  Model m;
  uint64_t next_id = 1;
  int requests = 0;
  while (!m.closed && in.remaining_bytes() > 0 && requests < 64) {
    ++requests;
    const int op = in.ConsumeIntegralInRange<int>(0, 9);
    if (op == 0) break;  // raw bytes follow
    v1::PeerRequest request;
    request.set_id(in.ConsumeBool() ? next_id++
                                    : in.ConsumeIntegral<uint64_t>());
    switch (op) {
      case 1:
      case 2: {
        std::string ticket;
        switch (in.ConsumeIntegralInRange<int>(0, 5)) {
          case 0:
            ticket = in.ConsumeRandomLengthString(5000);
            break;
          case 1:
            ticket = f.tickets[2];
            break;
          case 2:
            ticket = f.tickets[1];
            break;
          case 3:
            ticket = f.tickets[0].substr(0, f.tickets[0].size() - 1);
            break;
          default:
            ticket = f.tickets[0];
        }
        request.mutable_hello()->set_ticket(ticket);
        break;
      }
      case 3:
        break;  // no operation
      case 4:
      case 5:
      case 6: {
        v1::PeerRead* read = request.mutable_read();
        read->set_rkey(PickKey(in, f));
        read->set_address(PickAddress(in, f));
        read->set_length(PickLength(in));
        break;
      }
      default: {
        v1::PeerWrite* write = request.mutable_write();
        write->set_rkey(PickKey(in, f));
        write->set_address(PickAddress(in, f));
        uint64_t length = PickLength(in);
        if (length > kMaxMessage + 1) length = kMaxMessage + 1;
        std::string data =
            in.ConsumeBytesAsString(in.ConsumeIntegralInRange<size_t>(0, 64));
        if (data.empty() && length > 0) data = "w";
        std::string full;
        full.reserve(length);
        while (full.size() < length) full += data;
        full.resize(length);
        write->set_data(full);
        break;
      }
    }
    const size_t frame = request.ByteSizeLong();
    const Expected e = Predict(f, m, request, frame);
    FUZZ_CHECK(peer::WriteFrame(sock.get(), request).ok() || e.close);
    std::optional<v1::PeerResponse> response = Receive(sock.get());
    if (!response.has_value() && m.bound < 0 && frame > kHelloFrameLimit) {
      // Refused unread: the device's close with our bytes unread resets the
      // connection, which may overtake its answer.
      m.closed = true;
      break;
    }
    FUZZ_CHECK(response.has_value(),
               "the device closed the connection instead of answering ",
               request.ShortDebugString().substr(0, 200));
    FUZZ_CHECK(response->status() == e.status, "status ",
               v1::PeerStatus_Name(response->status()), " (",
               response->message(), "), expected ",
               v1::PeerStatus_Name(e.status), " for ",
               request.ShortDebugString().substr(0, 300));
    if (!e.frame_error) {
      FUZZ_CHECK(response->id() == request.id(), "id ", response->id(),
                 " for request ", request.id());
    }
    if (e.region != nullptr) {
      const Region& r = *e.region;
      Buffer& b = f.buffers[r.buffer];
      const bool is_read = request.has_read();
      const uint64_t address =
          is_read ? request.read().address() : request.write().address();
      const uint64_t at = r.offset + (address - r.base);
      if (is_read) {
        FUZZ_CHECK(
            response->data() == b.shadow.substr(at, request.read().length()),
            "READ returned other bytes than the memory holds");
      } else {
        FUZZ_CHECK(response->data().empty());
        const std::string& data = request.write().data();
        b.shadow.replace(at, data.size(), data);
      }
    }
    if (e.close) {
      m.closed = true;
      FUZZ_CHECK(!Receive(sock.get()).has_value(),
                 "the connection stayed open after ",
                 v1::PeerStatus_Name(e.status));
    }
  }
  if (!m.closed && in.remaining_bytes() > 0) {
    // Raw bytes: any framing at all. No model from here; the memory checks
    // below still hold.
    std::string raw = in.ConsumeRemainingBytesAsString();
    SendRaw(sock.get(), raw);
    ::shutdown(sock.get(), SHUT_WR);
    while (Receive(sock.get()).has_value()) {
    }
    // Anything may have been written through the writable regions.
    for (Buffer& b : f.buffers) {
      if (std::memcmp(b.address, b.shadow.data(), kBufferSize) == 0) continue;
      for (uint64_t i = 0; i < kBufferSize; ++i) {
        if (b.writable[i]) b.shadow[i] = b.address[i];
      }
    }
  }
  sock.Reset();
}

}  // namespace
}  // namespace mrd::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mrd::fuzz;  // NOLINT(build/namespaces)
  Fixture* f = GetFixture();
  FuzzedDataProvider in(data, size);
  RunOne(in, *f);
  for (const Buffer& b : f->buffers) {
    if (std::memcmp(b.address, b.shadow.data(), kBufferSize) == 0) continue;
    for (uint64_t i = 0; i < kBufferSize; ++i) {
      FUZZ_CHECK(b.address[i] == b.shadow[i], "byte ", i, " of buffer ",
                 &b == &f->buffers[0] ? "A" : "B",
                 b.writable[i] ? "" : " (no remote-writable region covers it)",
                 " changed");
    }
  }
  // The connection's end reaches the device: no connection is left but the
  // held one, and nothing else changed.
  f->device->WaitForWorkerIdle();
  const auto counts = f->device->CountResources();
  FUZZ_CHECK(counts.mrs == f->baseline.mrs && counts.lams == f->baseline.lams &&
                 counts.keys == f->baseline.keys &&
                 counts.tickets == f->baseline.tickets &&
                 counts.valid_mrs == f->baseline.valid_mrs,
             "device objects changed");
  FUZZ_CHECK(f->device->PinnedBytes() == f->pinned, "pinned bytes changed");
  return 0;
}
