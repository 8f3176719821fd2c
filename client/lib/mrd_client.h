// The mrd client library in one include. See each header for ownership,
// thread safety and error codes.
//
//   auto client = mrd::client::Client::Connect();          //
//   unix:<runtime>/mrd.sock auto session =
//   mrd::client::Session::OpenFd(*client);  // lives with the object auto
//   buffer = mrd::client::Buffer::Create(*session, 1 << 20, "data"); auto reg =
//   mrd::client::Registration::Register(
//       *session, {.buffer = buffer->id(), .length = buffer->size(),
//                  .flags = mrd::v1::NDK_MR_FLAG_ALLOW_REMOTE_READ});
//   // reg->rkey(), reg->base_address(): hand them to the peer.
//   // Leaving scope deregisters, releases the buffer and closes the session.
#ifndef MRD_CLIENT_LIB_MRD_CLIENT_H_
#define MRD_CLIENT_LIB_MRD_CLIENT_H_

#include "client/lib/buffer.h"             // IWYU pragma: export
#include "client/lib/client.h"             // IWYU pragma: export
#include "client/lib/completion_stream.h"  // IWYU pragma: export
#include "client/lib/lam.h"                // IWYU pragma: export
#include "client/lib/memfd.h"              // IWYU pragma: export
#include "client/lib/mr.h"                 // IWYU pragma: export
#include "client/lib/options.h"            // IWYU pragma: export
#include "client/lib/peer_ticket.h"        // IWYU pragma: export
#include "client/lib/registration.h"       // IWYU pragma: export
#include "client/lib/session.h"            // IWYU pragma: export
#include "client/lib/status.h"             // IWYU pragma: export

#endif  // MRD_CLIENT_LIB_MRD_CLIENT_H_
