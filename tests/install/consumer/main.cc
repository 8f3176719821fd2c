// A client developer's first program against an installed mrd: connect,
// open an fd session, hand mrd a memfd, register it for remote read, list,
// deregister. Prints "rkey=<n> registrations=<n>" and exits 0 when every step
// worked.
//   consumer GRPC_SOCKET FD_SOCKET
#include <cstdio>
#include <cstring>

#include "client/lib/mrd_client.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: consumer GRPC_SOCKET FD_SOCKET\n");
    return 2;
  }
  mrd::client::ClientOptions options;
  options.socket_path = argv[1];
  options.fd_socket_path = argv[2];
  auto client = mrd::client::Client::Connect(options);
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  auto session = mrd::client::Session::OpenFd(*client);
  if (!session.ok()) {
    std::fprintf(stderr, "session: %s\n", session.status().ToString().c_str());
    return 1;
  }
  auto buffer = mrd::client::Buffer::Create(*session, 8192, "consumer");
  if (!buffer.ok()) {
    std::fprintf(stderr, "buffer: %s\n", buffer.status().ToString().c_str());
    return 1;
  }
  std::memcpy(buffer->data(), "installed", 9);
  mrd::client::RegisterOptions reg;
  reg.buffer = buffer->id();
  reg.length = 8192;
  reg.flags = mrd::v1::NDK_MR_FLAG_ALLOW_REMOTE_READ;
  auto registration = mrd::client::Registration::Register(*session, reg);
  if (!registration.ok()) {
    std::fprintf(stderr, "register: %s (reason %s)\n",
                 registration.status().ToString().c_str(),
                 mrd::GetErrorDetail(registration.status()).reason().c_str());
    return 1;
  }
  auto listed = session->List();
  if (!listed.ok()) {
    std::fprintf(stderr, "list: %s\n", listed.status().ToString().c_str());
    return 1;
  }
  std::printf("rkey=%u registrations=%d\n", registration->rkey(),
              listed->registrations_size());
  auto left = registration->Deregister();
  if (!left.ok() || *left != 0) {
    std::fprintf(
        stderr, "deregister: %s\n",
        left.ok() ? "references left" : left.status().ToString().c_str());
    return 1;
  }
  return 0;
}
