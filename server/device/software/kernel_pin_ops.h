// KernelPinOps: the PinOps the software device pins real memory with.
//
// mlock(2) of a sub-range splits the mapping's VMA, so pinning every other
// page of one buffer costs a VMA per pin and reaches vm.max_map_count
// (65,530 by default) after ~32,000 pins. KernelPinOps pins pages the way
// RDMA drivers do, without touching VMAs: it registers them as io_uring
// fixed buffers (pin_user_pages with FOLL_LONGTERM). Each pinned range is a
// slot of a ring that is never submitted to; a ring has up to 16,384 slots
// and more rings are created on demand. The kernel shows these pins in
// /proc/<pid>/status as VmPin, not VmLck.
//
// A slot never crosses a multiple of `slot_span` (16 MiB by default, at most
// the kernel's 1 GiB), so releasing a sub-range of an earlier Lock (the
// tracker unlocks exactly the pages whose count dropped to zero) re-pins at
// most two slot spans: the pieces that stay pinned are registered into new
// slots before the old slot is cleared, so no page is ever unpinned while
// counted. If that registration fails the old slot stays (its released
// pages stay pinned, counted by StaleBytes()) until its last piece goes.
//
// io_uring pins with FOLL_WRITE, so read-only mappings (and memory io_uring
// refuses, or every range when io_uring is unavailable: seccomp,
// kernel.io_uring_disabled, ENOSYS) fall back to mlock. mlock ranges are
// counted as VMA splits, two per maximal locked run (the most a run can
// cost), and a Lock that would take the count past `max_map_splits` fails
// with kErrMapBudget (the tracker refuses with LIMIT_MEMORY_MAPS) instead of
// letting the process reach vm.max_map_count. A run is held as one piece, or
// as several adjoining ones when it is longer than a piece can be
// (kMaxPiecePages pages: 16 TiB of 4 KiB pages).
//
// Thread-safe. A Lock's or Unlock's io_uring system calls are made outside
// the object's lock, the slots reserved under it first, so that one caller's
// long registration (16 MiB of pages pinned in the kernel) never holds up
// another's 4 KiB one. The kernel serializes the calls on one ring, so a
// Lock takes its slot from a ring no other call is using, adding one when
// every ring is busy (at most `parallel_rings` per class). Bulk Locks (of
// kBigLock or more, or made by a thread running bulk work at a lower CPU
// priority: FairScheduler::CurrentIsBulk) and the others use rings of their
// own, so that a small request's 4 KiB pin and its unpin never wait in the
// kernel for a big one, nor for a low-priority thread that holds a ring's
// lock while other threads have the CPU. mlock and the re-pinning of a
// slot's rest (a sub-range unpin) stay under the object's lock.
#ifndef MRD_SERVER_DEVICE_SOFTWARE_KERNEL_PIN_OPS_H_
#define MRD_SERVER_DEVICE_SOFTWARE_KERNEL_PIN_OPS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/device/software/pin_tracker.h"

namespace mrd::device {

enum class PinMethod {
  kAuto,     // io_uring where it works, else mlock (per range)
  kIoUring,  // io_uring only: a range it refuses fails
  kMlock,    // mlock only (VMA budget applies)
};

// "auto", "io_uring", "mlock"; INVALID_ARGUMENT "BAD_OPTION" otherwise.
absl::StatusOr<PinMethod> ParsePinMethod(absl::string_view name);

struct KernelPinOptions {
  PinMethod method = PinMethod::kAuto;
  // Largest slot, and the alignment no slot crosses: a power of two between
  // the page size and 1 GiB (the kernel's limit per fixed buffer).
  uint64_t slot_span = uint64_t{16} << 20;
  // Slots per ring, at most kMaxSlotsPerRing (tests use fewer).
  uint32_t slots_per_ring = 16384;
  // VMA splits mlock may cause; 0 = half of what vm.max_map_count leaves
  // above the process's map count at creation (the rest is the reserve for
  // gRPC, libraries, thread stacks and buffer mappings).
  uint64_t max_map_splits = 0;
  // Pages of the longest mlocked piece (a longer run is held as several);
  // 0 = KernelPinOps::kMaxPiecePages. For tests, which cannot mlock 16 TiB.
  uint32_t max_piece_pages = 0;
  // Rings of each class (bulk or not) with free slots that Lock keeps
  // so that concurrent callers each find one no other system call is
  // using; past it a Lock waits for a busy ring in the kernel. At least 1
  // (more rings are always added when every slot is taken).
  uint32_t parallel_rings = 4;
  // Tests only: called before each io_uring slot update of a Lock, outside
  // the object's lock, with the slot's range and ring (an index).
  void (*before_update)(void* arg, uint64_t address, uint64_t length,
                        uint32_t ring) = nullptr;
  void* before_update_arg = nullptr;
};

class KernelPinOps final : public PinOps {
 public:
  static constexpr uint32_t kMaxSlotsPerRing = 16384;
  static constexpr uint64_t kMaxSlotSpan = uint64_t{1} << 30;
  // Pages of the longest piece (its length is a uint32_t count of pages).
  static constexpr uint32_t kMaxPiecePages = ~uint32_t{0};
  // A Lock of at least this many bytes takes its slots from the bulk rings.
  static constexpr uint64_t kBigLock = uint64_t{1} << 20;
  // Slots are emptied at most this many adjacent ones, and at most this
  // many bytes (or one slot), per system call: the kernel unpins them in
  // one go, holding their ring, and on a kernel without preemption (a
  // server's usual build) holding the CPU too, until the call returns.
  static constexpr uint32_t kMaxClearRun = 64;
  static constexpr uint64_t kMaxClearRunBytes = uint64_t{4} << 20;
  // A Lock registers at most this many bytes of adjacent slots per system
  // call (LockInPieces's small slots go many to a call).
  static constexpr uint64_t kMaxUpdateRunBytes = uint64_t{4} << 20;

  // INVALID_ARGUMENT "BAD_OPTION" for bad options; with kIoUring,
  // FAILED_PRECONDITION "IO_URING_UNAVAILABLE" when no ring can be created.
  // `log` logs the method chosen (once, at start).
  static absl::StatusOr<std::unique_ptr<KernelPinOps>> Create(
      const KernelPinOptions& options, bool log = false);
  // Closes the rings (the kernel unpins their slots) and munlocks what is
  // still mlocked.
  ~KernelPinOps() override;
  KernelPinOps(const KernelPinOps&) = delete;
  KernelPinOps& operator=(const KernelPinOps&) = delete;

  int Lock(uint64_t address, uint64_t length) override;
  // mlock first (io_uring when mlock is refused, or with --pin_method=
  // io_uring): io_uring's accounting of compound pages walks every slot of
  // the ring for each huge page, while hugetlbfs pages never leave memory
  // anyway (the kernel neither swaps nor reclaims them, and so counts no
  // VmLck for an mlock of them: it only faults them in).
  int LockHugePages(uint64_t address, uint64_t length) override;
  // Lock in io_uring slots that never cross a multiple of `piece_bytes`
  // (rounded up to a power of two; at least a page, at most slot_span),
  // registered up to kMaxUpdateRunBytes per system call: a batch's
  // adjacent 4 KiB ranges pinned together cost a few slots instead of one
  // each, and unlocking one of them re-pins at most its slot's rest (or,
  // within a ClearBatch, nothing until the batch ends).
  int LockInPieces(uint64_t address, uint64_t length,
                   uint64_t piece_bytes) override;
  int Unlock(uint64_t address, uint64_t length) override;

  // While a ClearBatch of this object lives on a thread, the io_uring slots
  // that this thread's Unlocks empty are emptied together: when the batch
  // ends, or every kClearBatchSlots slots, with one system call per run of
  // adjacent slots of a ring instead of one per slot (DeregisterMrBatch's
  // items each empty a slot of their own, and a session's end empties all
  // of its). An Unlock of a part of a slot re-pins nothing then: the rest
  // stays in the old slot until the batch ends, when the rest that is still
  // pinned (if any) moves to new slots and the old one is emptied, so a
  // batch that releases every page of a slot one item at a time costs one
  // emptied slot. Until then such a slot keeps its pages pinned, but
  // nothing counts the released ones any more: their pieces are gone (a new
  // Lock of those pages takes a new slot) and IoUringBytes no longer
  // includes them, StaleBytes does. A batch on a thread that has one of
  // this object already, or of a null object, does nothing. Not movable;
  // destroy it on its thread.
  class ClearBatch {
   public:
    explicit ClearBatch(KernelPinOps* ops);
    ~ClearBatch();
    ClearBatch(const ClearBatch&) = delete;
    ClearBatch& operator=(const ClearBatch&) = delete;

    // A slot an Unlock of this batch left partly released: its pieces
    // lie within [start, end), the piece that the first such Unlock cut.
    struct Split {
      uint32_t slot = 0;
      uint64_t start = 0;
      uint64_t end = 0;
    };

   private:
    KernelPinOps* ops_ = nullptr;  // null: this batch does nothing
    // Touched by its own thread only.
    std::vector<uint32_t> slots_;
    std::vector<Split> splits_;
  };
  static constexpr size_t kClearBatchSlots = 1024;

  // What the object uses: "io_uring", "mlock", or "io_uring+mlock" (auto)
  // and why io_uring is not used when it is not.
  std::string Describe() const;
  // The options it was made with.
  const KernelPinOptions& options() const { return options_; }
  bool io_uring_available() const { return io_uring_ok_; }
  uint64_t max_map_splits() const { return max_map_splits_; }

  // Introspection (tests, metrics).
  size_t Rings() const;
  // The ring (an index) of the slot pinning the page at `address`, or -1
  // (not pinned through io_uring).
  int RingOf(uint64_t address) const;
  // Whether ring `ring` takes bulk Locks.
  bool BulkRing(size_t ring) const;
  // Slots in use.
  size_t Slots() const;
  // Bytes pinned through io_uring slots that are still counted.
  uint64_t IoUringBytes() const;
  // Bytes mlocked.
  uint64_t MlockedBytes() const;
  // Bytes released by Unlock that stay pinned because a split failed.
  uint64_t StaleBytes() const;
  // VMA splits mlock may have caused (two per maximal mlocked run).
  uint64_t MapSplits() const;
  // System calls made to empty slots so far (one per slot, or one per run
  // of adjacent slots within a ClearBatch).
  uint64_t ClearCalls() const;
  // Entries of the piece map: a piece per io_uring slot reference, and one
  // or more per maximal mlocked run.
  size_t Pieces() const;

 private:
  // 8 bytes: one per io_uring-pinned registration (the range itself is in
  // the pieces that point here).
  struct Slot {
    uint32_t length = 0;  // bytes registered (<= kMaxSlotSpan)
    uint32_t pieces = 0;  // pieces_ entries that point here; 0 = free
  };
  static_assert(kMaxSlotSpan <= uint64_t{1} << 31);
  // The slot of an mlocked piece; never a slot's id (AddRingLocked).
  static constexpr uint32_t kMlocked = ~uint32_t{0};
  // 8 bytes, so that a B-tree entry (start and piece) is 16. Pieces are
  // page-aligned: a piece ends `pages` pages after its start (End).
  struct Piece {
    uint32_t pages = 0;        // 1 to kMaxPiecePages (an io_uring piece is
                               // within a slot span: at most 1 GiB)
    uint32_t slot = kMlocked;  // the io_uring slot, or kMlocked
    bool mlocked() const { return slot == kMlocked; }
  };
  static_assert(sizeof(Piece) == 8);
  static_assert(kMaxSlotSpan <= kMaxPiecePages);  // at any page size
  using PieceMap = absl::btree_map<uint64_t, Piece>;

  // The end of the piece of `entry` (start, piece).
  uint64_t End(const PieceMap::value_type& entry) const {
    return entry.first + uint64_t{entry.second.pages} * page_size_;
  }

  KernelPinOps(const KernelPinOptions& options, uint64_t page_size);

  // One io_uring ring: its fd, its free slots (handed out lowest first),
  // the system calls on it in flight, and its size class.
  struct Ring {
    int fd = -1;
    bool bulk = false;
    uint32_t calls = 0;
    std::vector<uint32_t> free;  // slot ids, highest first
  };
  // A slot update to make outside the lock: [start, end) into `slot`, or
  // emptied (start == end == 0), on ring `ring` (fd `fd`).
  struct Update {
    uint64_t start = 0;
    uint64_t end = 0;
    uint32_t slot = 0;
    uint32_t ring = 0;
    int fd = -1;
  };

  // Whether a Lock of `length` bytes by the calling thread is bulk.
  static bool BulkLock(uint64_t length);
  // Creates a ring with sparse slots of class `bulk`; 0 or the errno.
  int AddRingLocked(bool bulk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes a free slot for a Lock of class `bulk`: from an idle ring of that
  // class, else from a new one (up to parallel_rings with free slots), else
  // from the least busy ring with a free slot; 0 or the errno. From ring
  // `same` instead while it has a free slot (a Lock's next slot: its
  // calls are the caller's own, one after the other).
  int TakeSlotLocked(bool bulk, uint32_t* slot, size_t same = ~size_t{0})
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Registers [start, end) (within one slot span) into a free slot, with
  // the system call under the lock (a split's rest).
  int RegisterLocked(uint64_t start, uint64_t end, uint32_t* slot)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Empties a slot (the kernel unpins its pages) and frees it; within a
  // ClearBatch of this thread, queues it there instead, and within an
  // Unlock, queues it for that Unlock to empty after letting the lock go.
  void ClearLocked(uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Empties a slot now and frees it (a slot that cannot be emptied, which
  // happens only if its ring is gone, is logged and kept out of use).
  void ClearNowLocked(uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Empties `slots` (taken slots no piece points to) and frees them, one
  // system call per run of adjacent slots of a ring (at most kMaxClearRun
  // slots and kMaxClearRunBytes), made without the lock; a run the kernel
  // empties only in part goes on a slot at a time.
  void ClearSlots(std::vector<uint32_t> slots) ABSL_LOCKS_EXCLUDED(mu_);
  // Frees an emptied slot.
  void FreeSlotLocked(uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds [start, end) (page-aligned, at most kMaxPiecePages pages, and no
  // piece overlaps it) as a piece of `slot` (kMlocked: an mlocked piece).
  void AddPieceLocked(uint64_t start, uint64_t end, uint32_t slot)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops one piece's reference on `slot`, clearing it at zero.
  void ReleaseSlotLocked(uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Pins [start, end) into io_uring slots, reserved under the lock and
  // registered outside it; 0 or the errno, with nothing left pinned.
  // Slots never cross a multiple of `span`.
  int LockIoUring(uint64_t start, uint64_t end, uint64_t span)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Moves the pieces still pinned through each of `splits`' slots (slots a
  // ClearBatch's Unlocks released in part) to new slots, so that the old
  // ones, emptied, unpin the pages released meanwhile.
  void RepinSplitsLocked(const std::vector<ClearBatch::Split>& splits)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Empties the slots a ClearBatch of this thread gathered and moves its
  // splits' rest, leaving the batch open and empty.
  void FlushClearBatch() ABSL_LOCKS_EXCLUDED(mu_);
  int LockMlockLocked(uint64_t start, uint64_t end)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds [start, end), which no piece overlaps, as mlocked pieces of at most
  // max_piece_bytes_ each.
  void AddMlockedLocked(uint64_t start, uint64_t end)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int LockAny(uint64_t address, uint64_t length, bool huge_pages, uint64_t span)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Unpins [from, to) of the piece at `it`, keeping the rest pinned.
  int UnlockPieceLocked(PieceMap::iterator it, uint64_t from, uint64_t to)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Number of maximal mlocked runs that adjoin [start, end), which no piece
  // overlaps: 0, 1 or 2 (an mlocked piece ending at `start`, one starting
  // at `end`).
  uint64_t MlockNeighboursLocked(uint64_t start, uint64_t end) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const KernelPinOptions options_;
  const uint64_t page_size_;
  const uint64_t max_piece_bytes_;  // of an mlocked piece
  bool io_uring_ok_ = false;
  std::string io_uring_error_;
  uint64_t max_map_splits_ = 0;

  mutable absl::Mutex mu_;
  std::vector<Ring> rings_ ABSL_GUARDED_BY(mu_);
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);  // ring i: [i*n, (i+1)*n)
  uint64_t free_slots_ ABSL_GUARDED_BY(mu_) = 0;  // over every ring
  // Disjoint, by start; a B-tree, at about 18 bytes a piece filled in
  // address order (21 in random order) where a std::map node costs 64 (one
  // piece per io_uring-pinned registration). Iterators do not survive an
  // insert or erase: every loop looks up again after one.
  PieceMap pieces_ ABSL_GUARDED_BY(mu_);
  uint64_t io_uring_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t registered_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // sum of live slots
  uint64_t clear_calls_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t mlocked_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t mlock_runs_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace mrd::device

#endif  // MRD_SERVER_DEVICE_SOFTWARE_KERNEL_PIN_OPS_H_
