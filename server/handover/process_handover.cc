#include "server/handover/process_handover.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "mrd/status.h"
#include "server/common/log.h"
#include "server/common/sd_notify.h"

namespace mrd::handover {
namespace {

uint64_t PeerConnectionsOf(const v1::HandoverSnapshot& snapshot) {
  uint64_t n = 0;
  for (const v1::HandedOverSession& s : snapshot.sessions()) {
    n += static_cast<uint64_t>(s.peer_connections_size());
  }
  return n;
}

}  // namespace

ProcessHandover::ProcessHandover(ProcessHandoverOptions options,
                                 std::vector<Participant*> participants)
    : options_(std::move(options)), participants_(std::move(participants)) {}

ProcessHandover::~ProcessHandover() { Shutdown(); }

absl::Status ProcessHandover::Fault(absl::string_view point) const {
  if (options_.fault != point) return absl::OkStatus();
  return MrdError(absl::StatusCode::kAborted, "HANDOVER_TEST_FAULT",
                  absl::StrCat("test fault point ", point));
}

void ProcessHandover::WriteStatus(absl::string_view state) {
  if (options_.status != nullptr) options_.status->Write(state);
}

// --- the new process ---------------------------------------------------------

absl::Status ProcessHandover::BeginTakeover(
    v1::HandoverHello hello,
    const std::function<absl::Status(std::vector<UniqueFd>)>& open_device) {
  hello.set_mrd_version(options_.mrd_version);
  hello.set_pid(static_cast<uint32_t>(getpid()));
  takeover_start_ = absl::Now();
  const absl::Time deadline = takeover_start_ + options_.timeout;
  absl::Duration backoff = absl::Milliseconds(100);
  for (;;) {
    absl::Status attempt = TryTakeover(hello, open_device);
    if (attempt.ok()) return attempt;
    if (GetErrorDetail(attempt).reason() != "HANDOVER_BUSY" ||
        absl::Now() + backoff > deadline) {
      return absl::InternalError(attempt.message());
    }
    LogWarning(attempt.message(), "; asking again in ",
               absl::FormatDuration(backoff));
    takeover_.reset();
    for (Participant* p : participants_) p->Unload();
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(2));
  }
}

absl::Status ProcessHandover::TryTakeover(
    const v1::HandoverHello& hello,
    const std::function<absl::Status(std::vector<UniqueFd>)>& open_device) {
  // The reason stays (BeginTakeover retries on it); the message says that
  // the running mrd serves on.
  auto annotate = [](absl::string_view what, const absl::Status& s) {
    return MrdError(
        s.code(), GetErrorDetail(s).reason(),
        absl::StrCat("takeover ", what,
                     ", the running mrd serves on: ", s.ToString()));
  };
  TakeoverOptions options;
  options.path = options_.socket;
  options.timeout = options_.timeout;
  options.version = options_.fault == "new.version" ? kHandoverVersion + 1000
                                                    : kHandoverVersion;
  absl::StatusOr<std::unique_ptr<Takeover>> takeover =
      Takeover::Begin(options, hello);
  if (!takeover.ok() &&
      GetErrorDetail(takeover.status()).reason() == "HANDOVER_NOBODY") {
    LogInfo("--takeover: no mrd serves ", options_.socket, "; starting fresh");
    for (Participant* p : participants_) p->StartFresh();
    return absl::OkStatus();
  }
  if (!takeover.ok()) return annotate("refused", takeover.status());
  takeover_ = std::move(*takeover);
  LogInfo("taking over from pid ", takeover_->accepted().pid(), " (mrd ",
          takeover_->accepted().mrd_version(), ")");
  // While the old process still serves: the device opens on its peer
  // listener (accepting only after commit), and what the prepare frame
  // names is mapped and pinned, so that adopting it in the pause only
  // takes those pins over.
  absl::StatusOr<HandoverChannel::Received> prepare =
      takeover_->ReceivePrepare();
  if (!prepare.ok()) return annotate("failed", prepare.status());
  // Each device's listener: device 0's, then the others'.
  std::vector<UniqueFd> listeners;
  listeners.push_back(
      TakeFd(prepare->fds, prepare->frame.prepare().peer_listener()));
  for (const v1::HandedOverDevice& device :
       prepare->frame.prepare().other_devices()) {
    listeners.push_back(TakeFd(prepare->fds, device.peer_listener()));
  }
  if (absl::Status s = open_device(std::move(listeners)); !s.ok()) {
    return annotate("failed", s);
  }
  for (Participant* p : participants_) {
    p->Preload(prepare->frame.prepare(), prepare->fds);
  }
  if (options_.fault == "new.prepare") _exit(3);
  if (absl::Status s = takeover_->Prepared(); !s.ok()) {
    return annotate("failed", s);
  }
  absl::StatusOr<HandoverChannel::Received> snapshot =
      takeover_->ReceiveSnapshot();
  if (!snapshot.ok()) return annotate("failed", snapshot.status());
  snapshot_ = std::move(*snapshot);
  LogInfo("snapshot received: ", snapshot_->frame.snapshot().sessions_size(),
          " sessions, ", snapshot_->fds.size(), " fds, ",
          absl::FormatDuration(absl::Now() - takeover_start_),
          " after the takeover began");
  return absl::OkStatus();
}

absl::Status ProcessHandover::AdoptAndCommit() {
  const v1::HandoverSnapshot& snap = snapshot();
  absl::Status adopted = absl::OkStatus();
  for (Participant* p : participants_) {
    adopted = p->Adopt(snap, snapshot_->fds);
    if (!adopted.ok()) break;
  }
  if (adopted.ok()) adopted = Fault("new.adopt");
  if (options_.fault == "new.crash") _exit(3);
  AdoptedCounts counts;
  if (adopted.ok()) {
    for (const Participant* p : participants_) p->Count(&counts);
    v1::HandoverReady ready;
    ready.set_sessions(counts.sessions);
    ready.set_buffers(counts.buffers);
    ready.set_registrations(counts.registrations);
    ready.set_pinned_bytes(counts.pinned_bytes);
    adopted = takeover_->Ready(ready);
  } else {
    takeover_->Refuse(adopted);
  }
  if (!adopted.ok()) {
    for (auto p = participants_.rbegin(); p != participants_.rend(); ++p) {
      (*p)->Abandon();
    }
    return absl::InternalError(absl::StrCat(
        "takeover failed, the running mrd serves on: ", adopted.ToString()));
  }
  for (Participant* p : participants_) p->Commit();
  // What the metrics say was taken over, before they serve.
  absl::MutexLock lock(&mu_);
  took_over_.takeover_seconds =
      absl::ToDoubleSeconds(absl::Now() - takeover_start_);
  took_over_.adopted = counts;
  took_over_.fd_connections = static_cast<uint64_t>(snap.fd_connections_size());
  took_over_.peer_connections = PeerConnectionsOf(snap);
  return absl::OkStatus();
}

void ProcessHandover::EndTakeover() {
  if (takeover_ != nullptr) {
    const v1::HandoverSnapshot& snap = snapshot();
    AdoptedCounts now;
    for (const Participant* p : participants_) p->Count(&now);
    LogInfo("took over from pid ", takeover_->accepted().pid(), " (mrd ",
            takeover_->accepted().mrd_version(), "): ", now.sessions,
            " sessions, ", now.buffers, " buffers, ", now.registrations,
            " registrations, ", snap.fd_connections_size(), " fd connections, ",
            PeerConnectionsOf(snap), " peer connections in ",
            absl::FormatDuration(absl::Now() - takeover_start_));
  }
  takeover_.reset();
  snapshot_.reset();
}

// --- the old process ---------------------------------------------------------

void ProcessHandover::Listen() {
  HandoverServerOptions options;
  options.path = options_.socket;
  options.mrd_version = options_.mrd_version;
  options.timeout = options_.timeout;
  UniqueFd inherited;
  if (snapshot_.has_value()) {
    inherited = TakeFd(snapshot_->fds, snapshot().handover_listener());
  }
  absl::StatusOr<std::unique_ptr<HandoverServer>> server =
      HandoverServer::Start(options, this, std::move(inherited));
  if (!server.ok()) {
    LogError("handover socket ", options_.socket, ": ",
             server.status().ToString(),
             "; this mrd cannot hand over (mrd --takeover will not find it)");
    return;
  }
  absl::MutexLock lock(&mu_);
  server_ = std::move(*server);
}

bool ProcessHandover::listening() const {
  absl::MutexLock lock(&mu_);
  return server_ != nullptr;
}

void ProcessHandover::Shutdown() {
  absl::MutexLock lock(&mu_);
  if (server_ != nullptr) server_->Shutdown();
}

HandoverCounts ProcessHandover::counts() const {
  absl::MutexLock lock(&mu_);
  HandoverCounts counts = took_over_;
  if (server_ != nullptr) {
    const HandoverServer::Stats stats = server_->stats();
    counts.attempts = stats.attempts;
    counts.refusals = stats.refusals;
  }
  return counts;
}

absl::Status ProcessHandover::Check(const v1::HandoverHello& hello) {
  MRD_RETURN_IF_ERROR(Fault("old.hello"));
  taker_pid_ = static_cast<pid_t>(hello.pid());
  for (Participant* p : participants_) MRD_RETURN_IF_ERROR(p->Check(hello));
  return absl::OkStatus();
}

absl::Status ProcessHandover::Prepare(v1::HandoverSnapshot* snapshot,
                                      std::vector<UniqueFd>* fds) {
  for (Participant* p : participants_) {
    MRD_RETURN_IF_ERROR(p->Prepare(snapshot, fds));
  }
  return absl::OkStatus();
}

// Freezes the participants in order. One that fails is left as it was and
// the ones before it thaw: with none frozen yet (the call gate did not
// drain) this process merely serves on.
absl::Status ProcessHandover::Pause() {
  MRD_RETURN_IF_ERROR(Fault("old.pause"));
  WriteStatus("handing-over");
  frozen_ = 0;
  for (Participant* p : participants_) {
    if (absl::Status s = p->Freeze(); !s.ok()) {
      if (frozen_ == 0) {
        WriteStatus("serving");
      } else {
        Resume();
      }
      return s;
    }
    ++frozen_;
  }
  return absl::OkStatus();
}

absl::Status ProcessHandover::Export(v1::HandoverSnapshot* snapshot,
                                     std::vector<UniqueFd>* fds) {
  MRD_RETURN_IF_ERROR(Fault("old.export"));
  for (Participant* p : participants_) {
    MRD_RETURN_IF_ERROR(p->Export(snapshot, fds));
  }
  return absl::OkStatus();
}

absl::Status ProcessHandover::Release() {
  MRD_RETURN_IF_ERROR(Fault("old.commit"));
  for (Participant* p : participants_) MRD_RETURN_IF_ERROR(p->Release());
  return absl::OkStatus();
}

void ProcessHandover::Resume() {
  for (size_t i = frozen_; i > 0; --i) participants_[i - 1]->Thaw();
  frozen_ = 0;
  WriteStatus("serving");
  LogInfo("handover failed: serving again as before");
}

void ProcessHandover::Finish(const v1::HandoverReady& ready,
                             absl::Duration paused) {
  committed_ = true;
  // systemd follows the new main process from here; said before this one
  // exits, so that systemd never sees its main process gone (it reads
  // notifications before exits).
  if (absl::Status s = SdNotify(absl::StrCat("MAINPID=", taker_pid_));
      !s.ok()) {
    LogWarning("sd_notify: ", s.ToString());
  }
  const bool wait = options_.stay;
  LogInfo("handed over to the new mrd (", ready.sessions(), " sessions, ",
          ready.buffers(), " buffers, ", ready.registrations(),
          " registrations, ", ready.pinned_bytes(),
          " bytes pinned there); requests were paused for ",
          absl::FormatDuration(paused), wait ? "" : "; exiting");
  // Held calls are answered HANDED_OVER, completion streams end, clients'
  // channels hear GOAWAY and reconnect, to the new process.
  for (Participant* p : participants_) p->Retire();
  if (!wait) {
    // This process's own copies of the registrations, pins and mappings
    // (the new process holds its own) go with it: the kernel drops them at
    // exit in bulk, sooner than releasing them one by one would (100,000
    // registrations: docs/PERFORMANCE.md). Nothing of what clients use is
    // touched: the sockets, their connections and the memfds are the new
    // process's too, and exiting only closes this process's fds of them.
    LogInfo("mrd handed over; exiting, the kernel releases this process's ",
            options_.pinned_bytes(),
            " pinned bytes (pinned by the new mrd as "
            "well) and its mappings");
    WriteStatus("handed-over");
    std::fflush(nullptr);
    _exit(0);
  }
  // --after_handover=wait: this process's own copies go now, the same way
  // a stop releases them, and it holds nothing while it waits.
  for (Participant* p : participants_) p->Discard();
  LogInfo("mrd handed over; device pinned bytes: ", options_.pinned_bytes());
  WriteStatus("handed-over");
  handed_over_.Notify();
  if (!exit_requested_.HasBeenNotified()) {
    // Nothing is held any more; the process stays until SIGTERM or SIGINT
    // (the main thread's RequestExit wakes this thread, which exits).
    LogInfo(
        "--after_handover=wait: holding nothing, NOT_SERVING, until "
        "SIGTERM");
    std::fflush(nullptr);
    exit_requested_.WaitForNotification();
    LogInfo("handed over before; exiting");
  }
  std::fflush(nullptr);
  _exit(0);
}

}  // namespace mrd::handover
