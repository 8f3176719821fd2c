#include "server/common/checked_thread.h"

#include <pthread.h>

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/common/status.h"

namespace mrd {
namespace {

struct Start {
  absl::AnyInvocable<void() &&> body;
};

void* Trampoline(void* arg) {
  std::unique_ptr<Start> start(static_cast<Start*>(arg));
  std::move(start->body)();
  return nullptr;
}

}  // namespace

CheckedThread::~CheckedThread() { Join(); }

CheckedThread::CheckedThread(CheckedThread&& other) noexcept
    : thread_(other.thread_), running_(other.running_) {
  other.running_ = false;
}

CheckedThread& CheckedThread::operator=(CheckedThread&& other) noexcept {
  if (this != &other) {
    Join();
    thread_ = other.thread_;
    running_ = other.running_;
    other.running_ = false;
  }
  return *this;
}

absl::StatusOr<CheckedThread> CheckedThread::Start(
    absl::string_view name, absl::AnyInvocable<void() &&> body) {
  auto start = std::make_unique<struct Start>();
  start->body = std::move(body);
  CheckedThread thread;
  int err = pthread_create(&thread.thread_, nullptr, &Trampoline, start.get());
  if (err != 0) {
    return ErrnoError(err, absl::StrCat("pthread_create(", name, ")"),
                      "THREAD_CREATE_FAILED");
  }
  start.release();  // the thread owns it now
  thread.running_ = true;
  std::string short_name(name.substr(0, 15));
  (void)pthread_setname_np(thread.thread_, short_name.c_str());
  return thread;
}

void CheckedThread::Join() {
  if (!running_) return;
  (void)pthread_join(thread_, nullptr);
  running_ = false;
}

}  // namespace mrd
