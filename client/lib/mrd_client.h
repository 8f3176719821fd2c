// The mrd client library in one include. See each header for ownership,
// thread safety and error codes. A registration, start to end:
//
//   namespace mc = mrd::client;
//   // unix:<runtime dir>/mrd.sock
//   auto client = mc::Client::Connect();
//   // An fd session lives as long as the object.
//   auto session = mc::Session::OpenFd(*client);
//   auto buffer = mc::Buffer::Create(*session, 1 << 20, "data");
//   auto reg = mc::Registration::Register(
//       *session, {.buffer = buffer->id(),
//                  .length = buffer->size(),
//                  .flags = mrd::v1::NDK_MR_FLAG_ALLOW_REMOTE_READ});
//   // reg->rkey(), reg->base_address(): hand them to the peer.
//   // Leaving scope deregisters, releases the buffer and closes the
//   // session.
#ifndef MRD_CLIENT_LIB_MRD_CLIENT_H_
#define MRD_CLIENT_LIB_MRD_CLIENT_H_

#include "client/lib/buffer.h"             // IWYU pragma: export
#include "client/lib/client.h"             // IWYU pragma: export
#include "client/lib/completion_stream.h"  // IWYU pragma: export
#include "client/lib/lam.h"                // IWYU pragma: export
#include "client/lib/memfd.h"              // IWYU pragma: export
#include "client/lib/mr.h"                 // IWYU pragma: export
#include "client/lib/name_watch.h"         // IWYU pragma: export
#include "client/lib/options.h"            // IWYU pragma: export
#include "client/lib/peer_ticket.h"        // IWYU pragma: export
#include "client/lib/registration.h"       // IWYU pragma: export
#include "client/lib/session.h"            // IWYU pragma: export
#include "client/lib/status.h"             // IWYU pragma: export

#endif  // MRD_CLIENT_LIB_MRD_CLIENT_H_
