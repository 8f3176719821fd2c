# Project-wide compile options: warnings and sanitizers, applied to our own
# targets through mrd_options (generated proto code gets no -W flags).
add_library(mrd_options INTERFACE)
target_compile_options(mrd_options INTERFACE
  -Wall -Wextra -Wshadow -Wnon-virtual-dtor -Wold-style-cast -Woverloaded-virtual
  -Wimplicit-fallthrough -fno-exceptions)
if(MRD_WERROR)
  target_compile_options(mrd_options INTERFACE -Werror)
endif()
if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  # Clang checks every ABSL_GUARDED_BY / ABSL_*_LOCKS_REQUIRED annotation;
  # make test's TSan build is clang's, so with MRD_WERROR an unguarded access
  # fails the build there.
  target_compile_options(mrd_options INTERFACE -Wthread-safety)
endif()

if(MRD_SANITIZE STREQUAL "address")
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    # clang's dynamic-type check (-fsanitize=vptr) reads each object's
    # memory through a pipe before it trusts the vtable: at the open-file
    # limit, which the fd-exhaustion tests hold on purpose, it gets no pipe
    # and calls every valid object "invalid vptr". make test's ASan build is
    # clang's (a third of GCC's build time); the check is left out there.
    add_compile_options(-fno-sanitize=vptr)
  endif()
elseif(MRD_SANITIZE STREQUAL "thread")
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer)
  add_link_options(-fsanitize=thread)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    # gRPC's header code stays uninstrumented, like Debian's libgrpc behind
    # it (see the list).
    add_compile_options(
      -fsanitize-ignorelist=${PROJECT_SOURCE_DIR}/tests/support/tsan_ignorelist.txt)
  else()
    # gRPC's headers use atomic_thread_fence, which GCC flags under TSan; the
    # fence is in gRPC's code, not ours.
    add_compile_options(-Wno-tsan)
  endif()
elseif(NOT MRD_SANITIZE STREQUAL "")
  message(FATAL_ERROR "MRD_SANITIZE must be '', 'address' or 'thread'")
endif()

# The plain build of RelWithDebInfo keeps line tables only unless
# MRD_FULL_DEBUG_INFO is on: what perf, backtraces and addr2line need (file,
# line and function of every frame, inlined ones too), in about four fifths
# of -O2 -g's compile time; gdb's view of locals needs the option.
option(MRD_FULL_DEBUG_INFO "RelWithDebInfo with full debug info (-g), not line tables only" OFF)
if(MRD_SANITIZE STREQUAL "" AND NOT MRD_FUZZ AND NOT MRD_FULL_DEBUG_INFO AND
   CMAKE_BUILD_TYPE STREQUAL "RelWithDebInfo" AND
   CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  set(CMAKE_C_FLAGS_RELWITHDEBINFO "-O2 -gline-tables-only -DNDEBUG")
  set(CMAKE_CXX_FLAGS_RELWITHDEBINFO "-O2 -gline-tables-only -DNDEBUG")
endif()

# Sanitizer and fuzz builds of RelWithDebInfo compile at -O1 with line
# tables only: what their reports need (file and line of every frame), in
# about four fifths of -O2 -g's compile time and far smaller objects to link.
# make test builds three of them on two cores (scripts/test-all.sh).
if((NOT MRD_SANITIZE STREQUAL "" OR MRD_FUZZ) AND
   CMAKE_BUILD_TYPE STREQUAL "RelWithDebInfo")
  set(CMAKE_C_FLAGS_RELWITHDEBINFO "-O1 -gline-tables-only -DNDEBUG")
  set(CMAKE_CXX_FLAGS_RELWITHDEBINFO "-O1 -gline-tables-only -DNDEBUG")
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    set(CMAKE_C_FLAGS_RELWITHDEBINFO "-O1 -g1 -DNDEBUG")
    set(CMAKE_CXX_FLAGS_RELWITHDEBINFO "-O1 -g1 -DNDEBUG")
  endif()
endif()

# The fuzz targets (tests/fuzz, scripts/fuzz.sh): clang only. Everything is
# compiled with ASan+UBSan and libFuzzer's coverage instrumentation, so the
# fuzzers see the coverage of the server libraries; only the fuzz targets
# link libFuzzer itself (-fsanitize=fuzzer). Alone (make fuzz's build-fuzz),
# MRD_FUZZ brings the ASan+UBSan flags; with MRD_SANITIZE=address (make
# test's ASan build, which then needs no fuzz build of its own) it adds the
# coverage instrumentation to that build's, and its tests run instrumented.
if(MRD_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "MRD_FUZZ needs clang (CXX=clang++-14)")
  endif()
  if(MRD_SANITIZE STREQUAL "address")
    add_compile_options(-fsanitize=fuzzer-no-link)
  elseif(MRD_SANITIZE STREQUAL "")
    add_compile_options(-fsanitize=fuzzer-no-link,address,undefined
      -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
    add_link_options(-fsanitize=address,undefined)
  else()
    message(FATAL_ERROR "MRD_FUZZ goes with MRD_SANITIZE empty or 'address'")
  endif()
endif()

# TSan with Debian's Abseil and gRPC: neither is built with
# -fsanitize=thread, so every executable gets
# tests/support/tsan_absl_annotations.cc, which tells TSan about
# absl::Mutex/CondVar/Notification synchronization, and
# tests/support/tsan_grpc_handoff.cc, which tells it about gRPC handing a
# call from the thread that started a batch to the thread that completes it
# (see there).
if(MRD_SANITIZE STREQUAL "thread")
  add_library(mrd_tsan_absl OBJECT
    ${PROJECT_SOURCE_DIR}/tests/support/tsan_absl_annotations.cc
    ${PROJECT_SOURCE_DIR}/tests/support/tsan_grpc_handoff.cc)
  target_link_libraries(mrd_tsan_absl PRIVATE absl::synchronization absl::time
    gRPC::grpc)
  set(MRD_TSAN_WRAPPED
    _ZN4absl7debian35Mutex4LockEv
    _ZN4absl7debian35Mutex6UnlockEv
    _ZN4absl7debian35Mutex7TryLockEv
    _ZN4absl7debian35Mutex10ReaderLockEv
    _ZN4absl7debian35Mutex12ReaderUnlockEv
    _ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE
    _ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE
    _ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE
    _ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE
    _ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE
    _ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE
    _ZN4absl7debian37CondVar4WaitEPNS0_5MutexE
    _ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE
    _ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE
    _ZN4absl7debian312Notification6NotifyEv
    _ZNK4absl7debian312Notification19WaitForNotificationEv
    _ZNK4absl7debian312Notification30WaitForNotificationWithTimeoutENS0_8DurationE)
  set(_is_exe "$<STREQUAL:$<TARGET_PROPERTY:TYPE>,EXECUTABLE>")
  target_link_libraries(mrd_options INTERFACE
    "$<${_is_exe}:$<TARGET_OBJECTS:mrd_tsan_absl>>")
  foreach(sym ${MRD_TSAN_WRAPPED})
    target_link_options(mrd_options INTERFACE "$<${_is_exe}:LINKER:--wrap=${sym}>")
  endforeach()
endif()
