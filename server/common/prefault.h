// Prefaulting: filling mrd's page tables for memory about to be pinned, from
// several threads at once.
//
// mrd maps every imported memfd itself, and the client's writes filled only
// the client's page tables. Pinning then faults every page of mrd's mapping
// in, one at a time and for writing (io_uring's and the verbs driver's
// pin_user_pages take FOLL_WRITE), which costs more than pinning itself:
// bench/big_bench registers 4 x 2 GiB of written memfds just imported in
// 1.41 s that way, and in 0.32 s when the page tables were filled first
// with read faults from two threads (docs/PERFORMANCE.md). Prefault runs
// MADV_POPULATE_READ (Linux 5.14) over disjoint chunks of the range on
// helper threads and the caller's, so the pin that follows walks filled
// page tables.
//
// Helper threads come from a process-wide allowance (the configured threads,
// at most the online CPUs, minus one): concurrent registrations share it
// instead of each starting its own set, and a thread that cannot be started
// (the system is out of threads) only means fewer helpers. The allowance is
// shared between tenants as the workers are (fair_scheduler.h: the tenant is
// the key of the worker calling): while several tenants prefault, each takes
// at most its share of the helpers, and a helper of a tenant over its share
// stops between 16 MiB steps while another tenant got fewer than its share
// (its caller fills the rest of that part itself). Prefault never
// fails: a kernel without MADV_POPULATE_READ, a hole or a range past the end of
// the file just leaves the faulting to the pin, which reports what is wrong.
//
// Thread-safe.
#ifndef MRD_SERVER_COMMON_PREFAULT_H_
#define MRD_SERVER_COMMON_PREFAULT_H_

#include <cstdint>

#include "server/common/progress.h"

namespace mrd {

// Ranges shorter than this are left to the pin: below it, starting a thread
// costs more than it saves.
inline constexpr uint64_t kPrefaultMinBytes = uint64_t{32} << 20;

// The threads prefaulting may use in all, callers included (mrd's
// --prefault_threads): at most the online CPUs; 0 turns prefaulting off
// (the pin faults the pages in itself). Call before the first Prefault;
// the default is kDefaultPrefaultThreads.
inline constexpr uint32_t kDefaultPrefaultThreads = 8;
void ConfigurePrefault(uint32_t threads);

// Fills the page tables of [address, address + length) with read faults,
// on up to `max_threads` threads in all (the caller's included; 0 = as many
// as the allowance gives). Returns the number of threads that worked on it
// (0 when the range is below kPrefaultMinBytes). With `progress`, every
// thread adds the bytes it filled, 16 MiB at a time, and stops early once
// progress->Cancelled() (then part of the range is left unfilled).
// Each madvise call covers 2 MiB (it holds the address space's lock for
// its length), or with `huge_pages` (hugetlbfs memory: one fault a 2 MiB
// page, so a call of 16 MiB holds the lock no longer) a whole 16 MiB step.
uint32_t Prefault(const void* address, uint64_t length,
                  uint32_t max_threads = 0, WorkProgress* progress = nullptr,
                  bool huge_pages = false);

}  // namespace mrd

#endif  // MRD_SERVER_COMMON_PREFAULT_H_
