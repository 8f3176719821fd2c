// The victim of crash_test: opens an fd session on mrd, registers a 64 KiB
// memfd for remote read and write, prints "rkey base ticket peer_address" on
// stdout and waits to be killed.
//
//   crash_client <grpc socket> <fd socket>

#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/lib/mrd_client.h"

int main(int argc, char** argv) {
  if (argc != 3) return 1;
  mrd::client::ClientOptions options;
  options.socket_path = argv[1];
  options.fd_socket_path = argv[2];
  auto client = mrd::client::Client::Connect(options);
  if (!client.ok()) return 2;
  auto session = mrd::client::Session::OpenFd(*client);
  if (!session.ok()) return 3;
  auto buffer = mrd::client::Buffer::Create(*session, 16 * 4096);
  if (!buffer.ok()) return 4;
  std::memcpy(buffer->data(), "child data", 10);
  mrd::client::RegisterOptions o;
  o.buffer = buffer->id();
  o.length = 16 * 4096;
  o.flags = 0x2 | 0x5;  // REMOTE_READ | REMOTE_WRITE
  auto reg = mrd::client::Registration::Register(*session, o);
  if (!reg.ok()) return 5;
  auto ticket = mrd::client::PeerTicket::Create(*session);
  if (!ticket.ok()) return 6;
  std::string line =
      absl::StrCat(reg->rkey(), " ", reg->base_address(), " ", ticket->ticket(),
                   " ", ticket->peer_address(), "\n");
  if (write(STDOUT_FILENO, line.data(), line.size()) < 0) return 7;
  while (true) pause();
}
