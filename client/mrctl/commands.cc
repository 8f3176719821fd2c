#include "client/mrctl/commands.h"

#include <grpcpp/grpcpp.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/lib/mrd_client.h"
#include "client/lib/options.h"
#include "client/lib/status.h"
#include "client/mrctl/output.h"
#include "mrd/status.h"
#include "mrd/status_proto.h"
#include "mrd/v1/mrd.grpc.pb.h"

namespace mrd::mrctl {
namespace {

using google::protobuf::Message;

volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void OnStopSignal(int signal_number) {
  g_stop_signal = signal_number;
}

// Installs SIGINT/SIGTERM handlers without SA_RESTART (so poll returns).
void InstallStopHandlers() {
  struct sigaction action {};
  action.sa_handler = OnStopSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = 0;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

bool StopRequested() { return g_stop_signal != 0; }

// What a command has at hand.
struct Context {
  const Invocation& inv;
  FlagValues flags;
  std::FILE* out;
  std::FILE* err;
  bool json() const { return inv.global.json; }
  const std::string& token() const { return inv.global.session; }
};

// `message` as one line of JSON, flushed: what a script reads line by line.
absl::Status EmitJsonLine(Context& ctx, const Message& message) {
  MRD_ASSIGN_OR_RETURN(std::string json, JsonForm(message));
  std::fprintf(ctx.out, "%s\n", json.c_str());
  std::fflush(ctx.out);
  return absl::OkStatus();
}

absl::Status Emit(Context& ctx, const Message& message) {
  if (ctx.json()) return EmitJsonLine(ctx, message);
  std::string text = HumanForm(message);
  std::fwrite(text.data(), 1, text.size(), ctx.out);
  std::fflush(ctx.out);
  return absl::OkStatus();
}

// The end of a waiting command's whole wait (completions, watch): --timeout
// from now, or never.
absl::Time WaitDeadline(const Context& ctx) {
  return ctx.inv.global.timeout.has_value()
             ? absl::Now() + *ctx.inv.global.timeout
             : absl::InfiniteFuture();
}

// Wraps a flag parse error as a usage error naming the flag.
absl::Status FlagError(absl::string_view flag, const absl::Status& status) {
  if (IsUsageError(status)) {
    return UsageError(absl::StrCat("--", flag, ": ", status.message()));
  }
  return status;
}

absl::StatusOr<uint32_t> MrFlagsOf(const FlagValues& flags) {
  std::optional<std::string> text = flags.String("flags");
  if (!text.has_value()) return 0u;
  absl::StatusOr<uint32_t> bits = ParseMrFlags(*text);
  if (!bits.ok()) return FlagError("flags", bits.status());
  return bits;
}

absl::StatusOr<uint32_t> OpFlagsOf(const FlagValues& flags) {
  std::optional<std::string> text = flags.String("flags");
  if (!text.has_value()) return 0u;
  absl::StatusOr<uint32_t> bits = ParseOpFlags(*text);
  if (!bits.ok()) return FlagError("flags", bits.status());
  return bits;
}

absl::StatusOr<uint32_t> MemFlagsOf(const FlagValues& flags) {
  std::optional<std::string> text = flags.String("mem");
  if (!text.has_value()) return 0u;
  return ParseMemFlags(*text);
}

// --devices into `options`: absent, the first device.
absl::Status DevicesOf(const FlagValues& flags,
                       client::RegisterOptions& options) {
  std::optional<std::string> text = flags.String("devices");
  if (!text.has_value()) return absl::OkStatus();
  absl::StatusOr<DeviceChoice> choice = ParseDevices(*text);
  if (!choice.ok()) return FlagError("devices", choice.status());
  options.devices = std::move(choice->names);
  options.all_devices = choice->all;
  options.nearest_devices = choice->nearest;
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> PositionalId(const Context& ctx) {
  absl::StatusOr<uint64_t> id = ParseUint64(ctx.inv.positional[0]);
  if (!id.ok()) {
    return UsageError(
        absl::StrCat(ctx.inv.command->positional, ": ", id.status().message()));
  }
  return id;
}

// ---- Commands -------------------------------------------------------------

absl::Status Info(Context& ctx) {
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  MRD_ASSIGN_OR_RETURN(v1::DeviceInfo info, c.GetDeviceInfo());
  return Emit(ctx, info);
}

absl::Status Health(Context& ctx) {
  std::string service = ctx.flags.String("service").value_or("");
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  MRD_ASSIGN_OR_RETURN(client::ServingStatus status, c.Health(service));
  std::string name(client::ServingStatusName(status));
  if (ctx.json()) {
    std::fprintf(ctx.out, "{\"status\":\"%s\"}\n", name.c_str());
  } else {
    std::fprintf(ctx.out, "status=%s\n", name.c_str());
  }
  std::fflush(ctx.out);
  if (status != client::ServingStatus::kServing) {
    return absl::UnavailableError(
        absl::StrCat(service.empty() ? "mrd" : service, " is ", name));
  }
  return absl::OkStatus();
}

absl::Status LeaseOpen(Context& ctx) {
  v1::OpenLeaseSessionRequest request;
  if (std::optional<std::string> ttl = ctx.flags.String("ttl")) {
    absl::StatusOr<absl::Duration> d = ParseDurationFlag(*ttl);
    if (!d.ok()) return FlagError("ttl", d.status());
    int64_t seconds = absl::ToInt64Seconds(*d);
    if (*d == absl::InfiniteDuration() || seconds > UINT32_MAX) {
      return UsageError("--ttl is too large");
    }
    if (*d > absl::ZeroDuration() && seconds == 0) seconds = 1;
    request.set_ttl_seconds(static_cast<uint32_t>(seconds));
  }
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  // The lease carries our identity when an fd session (whose uid the server
  // checks with SO_PEERCRED) vouches for it; it outlives that session.
  std::optional<client::Session> voucher;
  absl::StatusOr<bool> anonymous = ctx.flags.Bool("anonymous");
  if (!anonymous.ok()) return FlagError("anonymous", anonymous.status());
  if (!*anonymous) {
    absl::StatusOr<client::Session> fd = client::Session::OpenFd(c);
    if (fd.ok()) {
      voucher.emplace(std::move(*fd));
      request.set_vouching_session(voucher->token());
    } else if (!ctx.inv.global.quiet) {
      std::fprintf(ctx.err,
                   "mrctl: the fd socket cannot vouch for this lease (%s); "
                   "it is anonymous\n",
                   std::string(fd.status().message()).c_str());
    }
  }
  MRD_ASSIGN_OR_RETURN(v1::SessionInfo info, c.OpenLeaseSession(request));
  if (ctx.inv.global.quiet && !ctx.json()) {
    std::fprintf(ctx.out, "%s\n", info.session().c_str());
    std::fflush(ctx.out);
    return absl::OkStatus();
  }
  return Emit(ctx, info);
}

absl::Status LeaseClose(Context& ctx) {
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  v1::CloseSessionRequest request;
  request.set_session(ctx.token());
  MRD_ASSIGN_OR_RETURN(v1::CloseSessionResponse response,
                       c.CloseSession(request));
  if (!ctx.inv.global.quiet) {
    std::fprintf(ctx.err, "mrctl: session closed\n");
  }
  return ctx.json() ? Emit(ctx, response) : absl::OkStatus();
}

absl::Status SessionCmd(Context& ctx) {
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  v1::GetSessionRequest request;
  request.set_session(ctx.token());
  MRD_ASSIGN_OR_RETURN(v1::SessionInfo info, c.GetSession(request));
  return Emit(ctx, info);
}

absl::Status ImportFile(Context& ctx) {
  MRD_ASSIGN_OR_RETURN(bool writable, ctx.flags.Bool("writable"));
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  v1::ImportFileRequest request;
  request.set_session(ctx.token());
  request.set_path(ctx.inv.positional[0]);
  request.set_writable(writable);
  MRD_ASSIGN_OR_RETURN(v1::BufferInfo info, c.ImportFile(request));
  return Emit(ctx, info);
}

absl::Status ReleaseBuffer(Context& ctx) {
  MRD_ASSIGN_OR_RETURN(uint64_t id, PositionalId(ctx));
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  v1::ReleaseBufferRequest request;
  request.set_session(ctx.token());
  request.set_buffer(id);
  MRD_ASSIGN_OR_RETURN(v1::ReleaseBufferResponse response,
                       c.ReleaseBuffer(request));
  return Emit(ctx, response);
}

absl::Status CreateMr(Context& ctx) {
  MRD_ASSIGN_OR_RETURN(bool fast, ctx.flags.Bool("fast-register"));
  MRD_ASSIGN_OR_RETURN(bool remote, ctx.flags.Bool("allow-remote"));
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  v1::CreateMrRequest request;
  request.set_session(ctx.token());
  request.set_fast_register(fast);
  request.set_allow_remote_access(remote);
  request.set_device(ctx.flags.String("device").value_or(""));
  MRD_ASSIGN_OR_RETURN(v1::MrInfo info, c.CreateMr(request));
  return Emit(ctx, info);
}

absl::Status CloseMr(Context& ctx) {
  MRD_ASSIGN_OR_RETURN(uint64_t id, PositionalId(ctx));
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  v1::CloseMrRequest request;
  request.set_session(ctx.token());
  request.set_mr(id);
  MRD_ASSIGN_OR_RETURN(v1::CloseMrResponse response, c.CloseMr(request));
  return ctx.json() ? Emit(ctx, response) : absl::OkStatus();
}

// One line for a REGISTRATION_PROGRESS report.
std::string ProgressLine(const v1::Completion& c) {
  auto mib = [](uint64_t bytes) {
    return absl::StrFormat("%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  };
  return absl::StrCat("mrctl: buffer ", c.buffer(), " +", c.offset(), ": ",
                      mib(c.bytes_pinned()), " of ", mib(c.length()),
                      " pinned, ", mib(c.bytes_populated()), " prefaulted, ",
                      absl::FormatDuration(absl::Milliseconds(c.elapsed_ms())));
}

// --progress: reads the session's completion stream until `answered`
// is ready, printing its progress reports (and any other completion, so
// that none read here is lost) to stderr.
template <typename Future>
void ShowProgressUntil(Context& ctx, const client::Session& session,
                       Future& answered) {
  client::CompletionStream stream = client::CompletionStream::Open(session);
  while (answered.wait_for(std::chrono::seconds(0)) !=
         std::future_status::ready) {
    absl::StatusOr<v1::Completion> c = stream.Next(absl::Milliseconds(50));
    if (absl::IsDeadlineExceeded(c.status())) continue;
    if (!c.ok()) {
      std::fprintf(ctx.err, "mrctl: no progress shown: %s\n",
                   ErrorLine(c.status()).c_str());
      break;
    }
    std::string line =
        c->kind() == v1::Completion::REGISTRATION_PROGRESS
            ? ProgressLine(*c)
            : absl::StrCat("mrctl: completion: ", c->ShortDebugString());
    std::fprintf(ctx.err, "%s\n", line.c_str());
    std::fflush(ctx.err);
  }
  answered.wait();
}

// --progress for a call of the session's: `start` begins it asynchronously
// (`done` runs once with the answer); progress is shown until it answers.
template <typename Response>
absl::StatusOr<Response> CallShowingProgress(
    Context& ctx, const client::Client& c,
    absl::FunctionRef<void(client::ResponseCallback<Response>)> start) {
  std::promise<absl::StatusOr<Response>> promise;
  std::future<absl::StatusOr<Response>> answered = promise.get_future();
  start([&promise](absl::StatusOr<Response> response) {
    promise.set_value(std::move(response));
  });
  ShowProgressUntil(ctx, client::Session::Attach(c, ctx.token()), answered);
  return answered.get();
}

absl::Status Register(Context& ctx) {
  client::RegisterOptions options;
  MRD_ASSIGN_OR_RETURN(options.buffer, ctx.flags.Uint64("buffer"));
  MRD_ASSIGN_OR_RETURN(options.offset, ctx.flags.SizeOr("offset", 0));
  MRD_ASSIGN_OR_RETURN(options.length, ctx.flags.Size("length"));
  MRD_ASSIGN_OR_RETURN(options.flags, MrFlagsOf(ctx.flags));
  MRD_ASSIGN_OR_RETURN(options.mem_flags, MemFlagsOf(ctx.flags));
  MRD_ASSIGN_OR_RETURN(options.base_address, ctx.flags.OptionalUint64("base"));
  MRD_ASSIGN_OR_RETURN(options.mr, ctx.flags.Uint64Or("mr", 0));
  MRD_ASSIGN_OR_RETURN(options.descriptor_capacity,
                       ctx.flags.Uint32Or("capacity", 0));
  options.request_id = ctx.flags.String("request-id").value_or("");
  MRD_RETURN_IF_ERROR(DevicesOf(ctx.flags, options));
  MRD_ASSIGN_OR_RETURN(bool progress, ctx.flags.Bool("progress"));
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  if (!progress) {
    MRD_ASSIGN_OR_RETURN(v1::RegisterMrResponse response,
                         c.RegisterMr(client::ToRequest(ctx.token(), options)));
    return Emit(ctx, response);
  }
  MRD_ASSIGN_OR_RETURN(
      v1::RegisterMrResponse response,
      CallShowingProgress<v1::RegisterMrResponse>(
          ctx, c, [&](client::ResponseCallback<v1::RegisterMrResponse> done) {
            c.RegisterMrAsync(client::ToRequest(ctx.token(), options),
                              std::move(done));
          }));
  return Emit(ctx, response);
}

// Exactly one of --registration and --mr, into `request`'s target.
template <typename Request>
absl::Status SetRegistrationOrMr(Context& ctx, Request* request) {
  const bool by_registration = ctx.flags.Has("registration");
  if (by_registration == ctx.flags.Has("mr")) {
    return UsageError("give exactly one of --registration and --mr");
  }
  if (by_registration) {
    MRD_ASSIGN_OR_RETURN(uint64_t id, ctx.flags.Uint64("registration"));
    request->set_registration(id);
  } else {
    MRD_ASSIGN_OR_RETURN(uint64_t id, ctx.flags.Uint64("mr"));
    request->set_mr(id);
  }
  return absl::OkStatus();
}

absl::Status Deregister(Context& ctx) {
  v1::DeregisterMrRequest request;
  request.set_session(ctx.token());
  MRD_RETURN_IF_ERROR(SetRegistrationOrMr(ctx, &request));
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  MRD_ASSIGN_OR_RETURN(v1::DeregisterMrResponse response,
                       c.DeregisterMr(request));
  return Emit(ctx, response);
}

// The first failed item of a batch (anything with a status()), as the
// command's status: its output has every item's result already.
template <typename Items>
absl::Status FirstItemFailure(const Items& items) {
  for (int i = 0; i < items.size(); ++i) {
    absl::Status status = ItemStatusFromProto(items[i].status());
    if (!status.ok()) {
      absl::Status out(status.code(),
                       absl::StrCat("item ", i, ": ", status.message()));
      SetErrorDetail(&out, GetErrorDetail(status));
      return out;
    }
  }
  return absl::OkStatus();
}

absl::Status RegisterBatch(Context& ctx) {
  client::RegisterOptions options;
  MRD_ASSIGN_OR_RETURN(options.buffer, ctx.flags.Uint64("buffer"));
  MRD_ASSIGN_OR_RETURN(uint64_t offset, ctx.flags.SizeOr("offset", 0));
  MRD_ASSIGN_OR_RETURN(options.length, ctx.flags.Size("length"));
  MRD_ASSIGN_OR_RETURN(uint64_t count, ctx.flags.Uint64("count"));
  MRD_ASSIGN_OR_RETURN(uint64_t stride,
                       ctx.flags.SizeOr("stride", options.length));
  MRD_ASSIGN_OR_RETURN(options.flags, MrFlagsOf(ctx.flags));
  MRD_ASSIGN_OR_RETURN(options.mem_flags, MemFlagsOf(ctx.flags));
  MRD_RETURN_IF_ERROR(DevicesOf(ctx.flags, options));
  // The server refuses more than its --max_batch_items; this bound only
  // keeps mrctl from building a request it could never send.
  constexpr uint64_t kMaxCount = uint64_t{1} << 20;
  if (count == 0 || count > kMaxCount) {
    return UsageError(absl::StrCat("--count must be 1 to ", kMaxCount));
  }
  v1::RegisterMrBatchRequest request;
  request.set_session(ctx.token());
  for (uint64_t i = 0; i < count; ++i) {
    options.offset = offset + i * stride;
    *request.add_items() = client::ToRequest("", options);
  }
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  MRD_ASSIGN_OR_RETURN(v1::RegisterMrBatchResponse response,
                       c.RegisterMrBatch(request));
  MRD_RETURN_IF_ERROR(Emit(ctx, response));
  return FirstItemFailure(response.items());
}

absl::Status DeregisterBatch(Context& ctx) {
  MRD_ASSIGN_OR_RETURN(std::string text,
                       ctx.flags.RequiredString("registrations"));
  absl::StatusOr<std::vector<uint64_t>> ids = ParseUint64List(text);
  if (!ids.ok()) return FlagError("registrations", ids.status());
  v1::DeregisterMrBatchRequest request;
  request.set_session(ctx.token());
  for (uint64_t id : *ids) request.add_items()->set_registration(id);
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  MRD_ASSIGN_OR_RETURN(v1::DeregisterMrBatchResponse response,
                       c.DeregisterMrBatch(request));
  MRD_RETURN_IF_ERROR(Emit(ctx, response));
  return FirstItemFailure(response.items());
}

absl::Status BuildLam(Context& ctx) {
  v1::BuildLamRequest request;
  request.set_session(ctx.token());
  MRD_ASSIGN_OR_RETURN(uint64_t buffer, ctx.flags.Uint64("buffer"));
  MRD_ASSIGN_OR_RETURN(uint64_t offset, ctx.flags.SizeOr("offset", 0));
  MRD_ASSIGN_OR_RETURN(uint64_t length, ctx.flags.Size("length"));
  MRD_ASSIGN_OR_RETURN(uint32_t capacity, ctx.flags.Uint32Or("capacity", 0));
  request.set_buffer(buffer);
  request.set_offset(offset);
  request.set_length(length);
  request.set_lam_capacity(capacity);
  request.set_device(ctx.flags.String("device").value_or(""));
  MRD_ASSIGN_OR_RETURN(bool progress, ctx.flags.Bool("progress"));
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  if (!progress) {
    MRD_ASSIGN_OR_RETURN(v1::BuildLamResponse response, c.BuildLam(request));
    return Emit(ctx, response);
  }
  MRD_ASSIGN_OR_RETURN(
      v1::BuildLamResponse response,
      CallShowingProgress<v1::BuildLamResponse>(
          ctx, c, [&](client::ResponseCallback<v1::BuildLamResponse> done) {
            c.BuildLamAsync(request, std::move(done));
          }));
  return Emit(ctx, response);
}

absl::Status ReleaseLam(Context& ctx) {
  MRD_ASSIGN_OR_RETURN(uint64_t id, PositionalId(ctx));
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  v1::ReleaseLamRequest request;
  request.set_session(ctx.token());
  request.set_lam(id);
  MRD_ASSIGN_OR_RETURN(v1::ReleaseLamResponse response, c.ReleaseLam(request));
  return ctx.json() ? Emit(ctx, response) : absl::OkStatus();
}

absl::Status FastRegister(Context& ctx) {
  v1::FastRegisterRequest request;
  request.set_session(ctx.token());
  MRD_ASSIGN_OR_RETURN(uint64_t connection, ctx.flags.Uint64("connection"));
  MRD_ASSIGN_OR_RETURN(uint64_t mr, ctx.flags.Uint64("mr"));
  MRD_ASSIGN_OR_RETURN(std::string pages_text,
                       ctx.flags.RequiredString("pages"));
  absl::StatusOr<std::vector<uint64_t>> pages = ParseUint64List(pages_text);
  if (!pages.ok()) return FlagError("pages", pages.status());
  MRD_ASSIGN_OR_RETURN(uint32_t fbo, ctx.flags.Uint32Or("fbo", 0));
  MRD_ASSIGN_OR_RETURN(uint64_t length, ctx.flags.Size("length"));
  MRD_ASSIGN_OR_RETURN(uint64_t base, ctx.flags.Uint64("base"));
  MRD_ASSIGN_OR_RETURN(uint32_t flags, OpFlagsOf(ctx.flags));
  MRD_ASSIGN_OR_RETURN(uint64_t context, ctx.flags.Uint64Or("context", 0));
  request.set_connection(connection);
  request.set_mr(mr);
  for (uint64_t page : *pages) request.add_pages(page);
  request.set_fbo(fbo);
  request.set_length(length);
  request.set_base_address(base);
  request.set_flags(flags);
  request.set_request_context(context);
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  MRD_ASSIGN_OR_RETURN(v1::FastRegisterResponse response,
                       c.FastRegister(request));
  return Emit(ctx, response);
}

absl::Status Invalidate(Context& ctx) {
  v1::InvalidateMrRequest request;
  request.set_session(ctx.token());
  MRD_ASSIGN_OR_RETURN(uint64_t connection, ctx.flags.Uint64("connection"));
  MRD_ASSIGN_OR_RETURN(uint64_t mr, ctx.flags.Uint64("mr"));
  MRD_ASSIGN_OR_RETURN(uint32_t flags, OpFlagsOf(ctx.flags));
  MRD_ASSIGN_OR_RETURN(uint64_t context, ctx.flags.Uint64Or("context", 0));
  request.set_connection(connection);
  request.set_mr(mr);
  request.set_flags(flags);
  request.set_request_context(context);
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  MRD_ASSIGN_OR_RETURN(v1::InvalidateMrResponse response,
                       c.InvalidateMr(request));
  return Emit(ctx, response);
}

absl::Status Completions(Context& ctx) {
  MRD_ASSIGN_OR_RETURN(uint64_t count, ctx.flags.Uint64Or("count", 0));
  const absl::Time deadline = WaitDeadline(ctx);
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  client::Session session = client::Session::Attach(c, ctx.token());
  InstallStopHandlers();
  client::CompletionStream stream = client::CompletionStream::Open(session);
  uint64_t seen = 0;
  while (count == 0 || seen < count) {
    if (StopRequested()) return absl::OkStatus();
    absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      if (count == 0) return absl::OkStatus();
      return absl::DeadlineExceededError(absl::StrCat(
          "got ", seen, " of ", count, " completions before the timeout"));
    }
    absl::StatusOr<v1::Completion> next =
        stream.Next(std::min(left, absl::Milliseconds(200)));
    if (absl::IsDeadlineExceeded(next.status())) continue;
    if (absl::IsOutOfRange(next.status())) {
      if (count == 0) return absl::OkStatus();
      return absl::FailedPreconditionError(absl::StrCat(
          "the session ended after ", seen, " of ", count, " completions"));
    }
    if (!next.ok()) return next.status();
    if (!ctx.json() && seen > 0) std::fputc('\n', ctx.out);
    MRD_RETURN_IF_ERROR(Emit(ctx, *next));
    ++seen;
  }
  return absl::OkStatus();
}

absl::Status PeerTicketCmd(Context& ctx) {
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  v1::CreatePeerTicketRequest request;
  request.set_session(ctx.token());
  request.set_device(ctx.flags.String("device").value_or(""));
  MRD_ASSIGN_OR_RETURN(v1::PeerTicket ticket, c.CreatePeerTicket(request));
  return Emit(ctx, ticket);
}

absl::Status List(Context& ctx) {
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  v1::ListRegistrationsRequest request;
  request.set_session(ctx.token());
  MRD_ASSIGN_OR_RETURN(v1::ListRegistrationsResponse response,
                       c.ListRegistrations(request));
  return Emit(ctx, response);
}

absl::Status Publish(Context& ctx) {
  v1::PublishRequest request;
  request.set_session(ctx.token());
  request.set_name(ctx.inv.positional[0]);
  MRD_RETURN_IF_ERROR(SetRegistrationOrMr(ctx, &request));
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  MRD_ASSIGN_OR_RETURN(v1::PublishedEntry entry, c.Publish(request));
  return Emit(ctx, entry);
}

absl::Status Unpublish(Context& ctx) {
  v1::UnpublishRequest request;
  request.set_session(ctx.token());
  request.set_name(ctx.inv.positional[0]);
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  MRD_ASSIGN_OR_RETURN(v1::UnpublishResponse response, c.Unpublish(request));
  return Emit(ctx, response);
}

absl::Status Published(Context& ctx) {
  v1::ListPublishedRequest request;
  request.set_session(ctx.token());
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  MRD_ASSIGN_OR_RETURN(v1::ListPublishedResponse response,
                       c.ListPublished(request));
  return Emit(ctx, response);
}

// NAME and --tenant of `resolve` and `watch`.
v1::ResolveRequest ResolveRequestOf(const Context& ctx) {
  v1::ResolveRequest request;
  request.set_session(ctx.token());
  request.set_name(ctx.inv.positional[0]);
  request.set_tenant(ctx.flags.String("tenant").value_or(""));
  return request;
}

absl::Status Resolve(Context& ctx) {
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  MRD_ASSIGN_OR_RETURN(v1::PublishedEntry entry,
                       c.Resolve(ResolveRequestOf(ctx)));
  return Emit(ctx, entry);
}

// Prints the events of `watch` until `count` were printed (0: no limit) or
// the stream ends. A stream cancelled (by a stop signal, or by --timeout
// passing) ends well, unless --timeout passed before `count` was reached.
absl::Status PrintNameEvents(Context& ctx, client::NameWatch& watch,
                             uint64_t count) {
  for (uint64_t seen = 0; count == 0 || seen < count; ++seen) {
    absl::StatusOr<v1::NameEvent> event = watch.Next();
    if (absl::IsCancelled(event.status())) {
      if (StopRequested() || count == 0) return absl::OkStatus();
      return absl::DeadlineExceededError(absl::StrCat(
          "got ", seen, " of ", count, " events before the timeout"));
    }
    if (absl::IsOutOfRange(event.status()) && count == 0) {
      return absl::OkStatus();
    }
    if (!event.ok()) return event.status();
    MRD_RETURN_IF_ERROR(EmitJsonLine(ctx, *event));
  }
  return absl::OkStatus();
}

absl::Status Watch(Context& ctx) {
  MRD_ASSIGN_OR_RETURN(uint64_t count, ctx.flags.Uint64Or("count", 0));
  const absl::Time deadline = WaitDeadline(ctx);
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  InstallStopHandlers();
  client::NameWatch watch = c.WatchName(ResolveRequestOf(ctx));
  // The stream has no deadline and a signal does not interrupt its Read:
  // this thread cancels it on a stop signal or once --timeout passed.
  absl::Notification printed;
  std::thread canceller([&watch, &printed, deadline] {
    while (!printed.WaitForNotificationWithTimeout(absl::Milliseconds(50))) {
      if (StopRequested() || absl::Now() >= deadline) {
        watch.Cancel();
        return;
      }
    }
  });
  absl::Status status = PrintNameEvents(ctx, watch, count);
  printed.Notify();
  canceller.join();
  return status;
}

// Waits until stdin reaches EOF (not watched with `written`), a stop signal,
// `deadline`, `written` (checked every 100 ms) turns true, or the fd
// session's socket shows that mrd ended it (FAILED_PRECONDITION).
absl::Status WaitForRelease(const client::Session& session, absl::Time deadline,
                            const std::function<bool()>& written,
                            std::FILE* err) {
  // Waiting for a write, stdin does not matter (a container's is closed).
  bool watch_stdin = !written;
  char sink[4096];
  while (true) {
    if (written && written()) return absl::OkStatus();
    if (StopRequested()) {
      std::fprintf(err, "mrctl: %s, releasing\n",
                   g_stop_signal == SIGINT ? "interrupted" : "terminated");
      return absl::OkStatus();
    }
    absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      std::fprintf(err, "mrctl: --duration passed, releasing\n");
      return absl::OkStatus();
    }
    pollfd fds[2] = {{session.fd_socket(), POLLIN, 0},
                     {watch_stdin ? STDIN_FILENO : -1, POLLIN, 0}};
    int timeout_ms = static_cast<int>(absl::ToInt64Milliseconds(
        std::min(left, absl::Milliseconds(written ? 100 : 500))));
    int ready = ::poll(fds, 2, std::max(timeout_ms, 1));
    if (ready < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "poll", "HOLD_WAIT");
    }
    if (written && written()) return absl::OkStatus();  // before any release
    if (fds[0].revents != 0) {
      return SeedError(WSAENOTCONN, "SESSION_ENDED",
                       "mrd ended the fd session");
    }
    if (fds[1].revents & POLLNVAL) {
      watch_stdin = false;  // no stdin at all: wait for a signal
    } else if (fds[1].revents != 0) {
      ssize_t n = ::read(STDIN_FILENO, sink, sizeof(sink));
      if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) {
        std::fprintf(err, "mrctl: stdin closed, releasing\n");
        return absl::OkStatus();
      }
    }
  }
}

absl::Status Hold(Context& ctx) {
  const FlagValues& f = ctx.flags;
  MRD_ASSIGN_OR_RETURN(uint64_t size, f.Size("size"));
  if (size == 0) return UsageError("--size must be positive");
  std::string fill = f.String("fill").value_or("");
  MRD_ASSIGN_OR_RETURN(bool repeat, f.Bool("repeat"));
  std::string name = f.String("name").value_or("mrctl-hold");
  client::RegisterOptions options;
  MRD_ASSIGN_OR_RETURN(options.offset, f.SizeOr("offset", 0));
  if (options.offset >= size) return UsageError("--offset is past --size");
  MRD_ASSIGN_OR_RETURN(options.length,
                       f.SizeOr("length", size - options.offset));
  MRD_ASSIGN_OR_RETURN(options.flags, MrFlagsOf(f));
  MRD_ASSIGN_OR_RETURN(options.mem_flags, MemFlagsOf(f));
  MRD_ASSIGN_OR_RETURN(options.base_address, f.OptionalUint64("base"));
  MRD_RETURN_IF_ERROR(DevicesOf(f, options));
  if (f.String("until-written").value_or("").size() > options.length) {
    return UsageError("--until-written is longer than the registered range");
  }
  // Local write and RDMA read sink both mean the device writes into it.
  bool writable = (options.flags & (v1::NDK_MR_FLAG_ALLOW_LOCAL_WRITE |
                                    v1::NDK_MR_FLAG_RDMA_READ_SINK)) != 0 ||
                  (options.mem_flags & v1::MEM_WRITE) != 0;
  if (f.Has("writable")) {
    MRD_ASSIGN_OR_RETURN(writable, f.Bool("writable"));
  }
  absl::Time deadline = absl::InfiniteFuture();
  if (std::optional<std::string> d = f.String("duration")) {
    absl::StatusOr<absl::Duration> duration = ParseDurationFlag(*d);
    if (!duration.ok()) return FlagError("duration", duration.status());
    deadline = absl::Now() + *duration;
  }

  InstallStopHandlers();
  MRD_ASSIGN_OR_RETURN(client::Client c, ConnectClient(ctx.inv.global));
  MRD_ASSIGN_OR_RETURN(client::Session session, client::Session::OpenFd(c));
  MRD_ASSIGN_OR_RETURN(bool huge_pages, f.Bool("huge-pages"));
  MRD_ASSIGN_OR_RETURN(
      client::Buffer buffer,
      client::Buffer::Create(session, size, name, writable, huge_pages));
  if (!fill.empty()) {
    char* data = static_cast<char*>(buffer.data());
    uint64_t pos = 0;
    do {
      uint64_t n = std::min<uint64_t>(fill.size(), size - pos);
      std::memcpy(data + pos, fill.data(), n);
      pos += n;
    } while (repeat && pos < size);
  }
  options.buffer = buffer.id();
  MRD_ASSIGN_OR_RETURN(bool progress, f.Bool("progress"));
  std::future<absl::StatusOr<client::Registration>> answered =
      client::Registration::RegisterFuture(session, options);
  if (progress) ShowProgressUntil(ctx, session, answered);
  MRD_ASSIGN_OR_RETURN(client::Registration registration, answered.get());
  MRD_ASSIGN_OR_RETURN(v1::SessionInfo info, session.Info());

  if (ctx.json()) {
    MRD_ASSIGN_OR_RETURN(std::string s, JsonForm(info));
    MRD_ASSIGN_OR_RETURN(std::string b, JsonForm(buffer.info()));
    MRD_ASSIGN_OR_RETURN(std::string r, JsonForm(registration.response()));
    std::fprintf(ctx.out,
                 "{\"session\":%s,\"buffer\":%s,\"registration\":%s}\n",
                 s.c_str(), b.c_str(), r.c_str());
  } else {
    std::string text = absl::StrCat(
        HumanForm(info, "session."), HumanForm(buffer.info(), "buffer."),
        HumanForm(registration.response(), "registration."));
    std::fwrite(text.data(), 1, text.size(), ctx.out);
  }
  std::fflush(ctx.out);
  if (!ctx.inv.global.quiet) {
    std::fprintf(ctx.err,
                 "mrctl: holding rkey=%u; close stdin or press Ctrl-C to "
                 "release\n",
                 registration.rkey());
  }
  // --until-written: a peer's WRITE landing in the registered range ends
  // the hold (what it wrote is printed).
  std::function<bool()> written;
  const std::string expect = f.String("until-written").value_or("");
  if (!expect.empty()) {
    const char* at = static_cast<const char*>(buffer.data()) + options.offset;
    written = [at, &expect, &ctx] {
      if (std::memcmp(at, expect.data(), expect.size()) != 0) return false;
      std::fprintf(ctx.out, "written=%s\n", expect.c_str());
      std::fflush(ctx.out);
      return true;
    };
  }
  absl::Status waited = WaitForRelease(session, deadline, written, ctx.err);
  // Release in order, reporting errors; the destructors would do the same
  // silently on the error paths above.
  if (absl::StatusOr<uint32_t> left = registration.Deregister();
      !left.ok() && waited.ok()) {
    waited = left.status();
  }
  if (absl::StatusOr<v1::ReleaseBufferResponse> released = buffer.Release();
      !released.ok() && waited.ok()) {
    waited = released.status();
  }
  if (absl::Status closed = session.Close(); !closed.ok() && waited.ok()) {
    waited = closed;
  }
  return waited;
}

using Handler = absl::Status (*)(Context&);

absl::Status PeerReadHandler(Context& ctx) {
  return PeerRead(ctx.inv, ctx.out, ctx.err);
}
absl::Status PeerWriteHandler(Context& ctx) {
  return PeerWrite(ctx.inv, ctx.out, ctx.err);
}

// The administrative service on mrd's admin socket.
absl::StatusOr<std::unique_ptr<v1::TenantAdmin::Stub>> AdminStub(
    const Context& ctx) {
  std::string path = ctx.flags.String("admin-socket").value_or("");
  if (path.empty()) {
    const std::string dir = ctx.inv.global.runtime_dir.empty()
                                ? client::DefaultRuntimeDir()
                                : ctx.inv.global.runtime_dir;
    path = absl::StrCat(dir, "/admin.sock");
  }
  std::shared_ptr<grpc::Channel> channel = grpc::CreateChannel(
      absl::StrCat("unix:", path), grpc::InsecureChannelCredentials());
  return v1::TenantAdmin::NewStub(channel);
}

template <typename Request, typename Response, typename Call>
absl::Status CallAdmin(Context& ctx, const Request& request, Call call,
                       Response* response) {
  MRD_ASSIGN_OR_RETURN(std::unique_ptr<v1::TenantAdmin::Stub> stub,
                       AdminStub(ctx));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
  grpc::Status status = ((*stub).*call)(&context, request, response);
  return client::StatusFromGrpc(status, context);
}

absl::Status TenantList(Context& ctx) {
  v1::ListTenantsResponse response;
  MRD_RETURN_IF_ERROR(CallAdmin(ctx, v1::ListTenantsRequest(),
                                &v1::TenantAdmin::Stub::ListTenants,
                                &response));
  return Emit(ctx, response);
}

absl::Status TenantSet(Context& ctx) {
  v1::SetTenantRequest request;
  request.set_tenant(ctx.inv.positional[0]);
  for (const char* flag :
       {"sessions", "buffers", "registrations", "lams", "mrs",
        "peer-connections", "memory-maps", "pinned-bytes"}) {
    if (!ctx.flags.Has(flag)) continue;
    absl::StatusOr<uint64_t> amount = ctx.flags.Size(flag);
    if (!amount.ok()) return FlagError(flag, amount.status());
    v1::TenantQuotaValue* quota = request.add_quotas();
    std::string resource = flag;
    std::replace(resource.begin(), resource.end(), '-', '_');
    quota->set_resource(resource);
    quota->set_amount(*amount);
  }
  MRD_ASSIGN_OR_RETURN(const uint32_t weight, ctx.flags.Uint32Or("weight", 0));
  request.set_weight(weight);
  if (request.quotas().empty() && weight == 0) {
    return UsageError("give at least one quota or --weight");
  }
  v1::TenantInfo response;
  MRD_RETURN_IF_ERROR(
      CallAdmin(ctx, request, &v1::TenantAdmin::Stub::SetTenant, &response));
  return Emit(ctx, response);
}

absl::Status TenantClear(Context& ctx) {
  v1::ClearTenantRequest request;
  request.set_tenant(ctx.inv.positional[0]);
  v1::TenantInfo response;
  MRD_RETURN_IF_ERROR(
      CallAdmin(ctx, request, &v1::TenantAdmin::Stub::ClearTenant, &response));
  return Emit(ctx, response);
}

const std::map<std::string, Handler>& Handlers() {
  static const auto* const kHandlers = new std::map<std::string, Handler>{
      {"info", Info},
      {"health", Health},
      {"lease open", LeaseOpen},
      {"lease close", LeaseClose},
      {"session", SessionCmd},
      {"import-file", ImportFile},
      {"release-buffer", ReleaseBuffer},
      {"create-mr", CreateMr},
      {"close-mr", CloseMr},
      {"register", Register},
      {"deregister", Deregister},
      {"register-batch", RegisterBatch},
      {"deregister-batch", DeregisterBatch},
      {"build-lam", BuildLam},
      {"release-lam", ReleaseLam},
      {"fast-register", FastRegister},
      {"invalidate", Invalidate},
      {"completions", Completions},
      {"peer-ticket", PeerTicketCmd},
      {"list", List},
      {"publish", Publish},
      {"unpublish", Unpublish},
      {"published", Published},
      {"resolve", Resolve},
      {"watch", Watch},
      {"peer read", PeerReadHandler},
      {"peer write", PeerWriteHandler},
      {"hold", Hold},
      {"tenant list", TenantList},
      {"tenant set", TenantSet},
      {"tenant clear", TenantClear},
  };
  return *kHandlers;
}

}  // namespace

client::ClientOptions ClientOptionsFor(const GlobalOptions& global) {
  client::ClientOptions options;
  options.target = global.target;
  options.socket_path = global.socket;
  options.fd_socket_path = global.fd_socket;
  if (!global.runtime_dir.empty()) {
    if (options.socket_path.empty()) {
      options.socket_path = absl::StrCat(global.runtime_dir, "/mrd.sock");
    }
    if (options.fd_socket_path.empty()) {
      options.fd_socket_path = absl::StrCat(global.runtime_dir, "/fd.sock");
    }
  }
  if (global.timeout.has_value() && *global.timeout > absl::ZeroDuration()) {
    options.rpc_timeout = *global.timeout;
    options.connect_timeout = std::min(*global.timeout, absl::Seconds(30));
  }
  return options;
}

absl::StatusOr<client::Client> ConnectClient(const GlobalOptions& global) {
  return client::Client::Connect(ClientOptionsFor(global));
}

absl::Status Execute(const Invocation& invocation, std::FILE* out,
                     std::FILE* err) {
  auto it = Handlers().find(invocation.command->name);
  if (it == Handlers().end()) {
    return absl::InternalError(
        absl::StrCat("no handler for ", invocation.command->name));
  }
  Context ctx{invocation, FlagValues(invocation), out, err};
  return it->second(ctx);
}

int Run(const std::vector<std::string>& args, const Environment& env,
        std::FILE* out, std::FILE* err) {
  if (args.empty()) {
    std::fputs(OverviewHelp().c_str(), err);
    return kExitUsage;
  }
  absl::StatusOr<Invocation> invocation = ParseArgs(args, env);
  if (!invocation.ok()) {
    std::fprintf(err, "%s\n", ErrorLine(invocation.status()).c_str());
    return kExitUsage;
  }
  if (invocation->help) {
    if (invocation->command != nullptr) {
      std::fputs(CommandHelp(*invocation->command).c_str(), out);
    } else if (!invocation->help_group.empty()) {
      std::fputs(GroupHelp(invocation->help_group).c_str(), out);
    } else {
      std::fputs(OverviewHelp().c_str(), out);
    }
    return kExitOk;
  }
  const absl::Time start = absl::Now();
  absl::Status status = Execute(*invocation, out, err);
  const absl::Duration took = absl::Now() - start;
  std::fflush(out);
  const std::string& name = invocation->command->name;
  if (!status.ok()) {
    std::fprintf(err, "%s\n", ErrorLine(status).c_str());
    if (IsUsageError(status)) {
      std::fprintf(err, "(see mrctl help %s)\n", name.c_str());
    }
    if (status.code() == absl::StatusCode::kDeadlineExceeded &&
        !invocation->global.timeout.has_value()) {
      std::fprintf(
          err,
          "(mrctl's default deadline is %s; registering many GiB pins page "
          "by page and can take longer: pass --timeout=5m, or --timeout=inf "
          "for none)\n",
          absl::FormatDuration(client::ClientOptions().rpc_timeout).c_str());
    }
  }
  // A call that took seconds (a large registration) says how long; hold,
  // completions and watch wait on purpose.
  if (took >= absl::Seconds(1) && name != "hold" && name != "completions" &&
      name != "watch") {
    std::fprintf(err, "mrctl: %s took %s\n", name.c_str(),
                 absl::FormatDuration(absl::Trunc(took, absl::Milliseconds(10)))
                     .c_str());
  }
  return ExitCodeFor(status);
}

}  // namespace mrd::mrctl
