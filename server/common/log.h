// Minimal leveled logging to stderr (absl 20220623 has no absl/log). One line
// per call, with a UTC timestamp and the level; safe from any thread.
#ifndef MRD_SERVER_COMMON_LOG_H_
#define MRD_SERVER_COMMON_LOG_H_

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace mrd {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

void SetMinLogLevel(LogLevel level);
void LogLine(LogLevel level, absl::string_view message);

template <typename... Args>
void LogInfo(const Args&... args) {
  LogLine(LogLevel::kInfo, absl::StrCat(args...));
}
template <typename... Args>
void LogWarning(const Args&... args) {
  LogLine(LogLevel::kWarning, absl::StrCat(args...));
}
template <typename... Args>
void LogError(const Args&... args) {
  LogLine(LogLevel::kError, absl::StrCat(args...));
}
template <typename... Args>
void LogDebug(const Args&... args) {
  LogLine(LogLevel::kDebug, absl::StrCat(args...));
}

// "Cannot happen": logs and aborts. Never used for bad input.
[[noreturn]] void Fatal(absl::string_view message);

}  // namespace mrd

#define MRD_CHECK(cond)                                                     \
  do {                                                                      \
    if (!(cond))                                                            \
      ::mrd::Fatal(                                                         \
          absl::StrCat(__FILE__, ":", __LINE__, ": check failed: " #cond)); \
  } while (0)

#endif  // MRD_SERVER_COMMON_LOG_H_
