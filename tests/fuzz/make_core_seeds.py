#!/usr/bin/env python3
"""Writes the seed inputs of core_fuzzer (tests/fuzz/corpus/core_fuzzer).

Each seed is a small, meaningful scenario in core_fuzzer's input format (see
Reader in fuzz_util.h and RunOne in core_fuzzer.cc): options, then per step
the RPC selector, the fix-up byte, the session pick and the step's own
fields. The preamble (not in the input) always opens fd session 0 with a
16-page memfd (buffer 0) and lease session 1 with file "a", 8 pages
(buffer 1).

    tests/fuzz/make_core_seeds.py [OUTPUT_DIR]
"""
import os
import sys

PAGE = 4096
FIX = 0x1F  # live session, live handles, ranges inside the buffer


def rng(lo, hi, value):
    """An integer in [lo, hi] the way Reader.ConsumeIntegralInRange reads it."""
    span = hi - lo
    width = 1 if span < 1 << 8 else 2 if span < 1 << 16 else 4 if span < 1 << 32 else 8
    return (value - lo).to_bytes(width, "little")


def varint(v):
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def field(number, value):
    return varint(number << 3) + varint(value)


def msg(body=b""):
    return bytes([len(body)]) + body  # ParseNext: a length byte, the bytes


class Script:
    def __init__(self, small_limits=False, warm=False):
        self.out = bytearray()
        self.out += bytes([1 if small_limits else 0])
        if small_limits:
            # sessions, buffers/session, buffer size, session/total pinned,
            # session/total registrations, LAMs, MRs, CQ depth, request ids
            self.out += rng(1, 4, 4) + rng(1, 4, 3) + rng(1, 128, 32)
            self.out += rng(1, 64, 24) + rng(1, 128, 40)
            self.out += rng(1, 8, 3) + rng(1, 16, 5) + rng(1, 4, 2)
            self.out += rng(1, 4, 2) + rng(1, 8, 2) + rng(1, 4, 2)
            # total buffers, LAMs, MR objects
            self.out += rng(1, 8, 8) + rng(1, 8, 8) + rng(1, 8, 8)
        # anonymous leases stand for this uid (an owner-only socket); no
        # tenant table
        self.out += rng(0, 2, 0) + bytes([0])
        self.out += bytes([1 if warm else 0])
        if warm:
            self.out += rng(1, 32, 8) + rng(1, 64, 16)
        self.sessions = 2
        self.buffers = [16 * PAGE, 8 * PAGE]
        self.regs = 0
        self.mrs = 0
        self.lams = []  # page counts
        self.conns = 0

    def step(self, op, session=0, fix=FIX):
        self.out += rng(0, 21, op) + bytes([fix])
        if self.sessions:
            self.out += rng(0, self.sessions - 1, session)

    def register(self, buffer, offset, length, flags_index, session=0):
        self.step(5, session)
        size = self.buffers[buffer]
        self.out += msg() + rng(0, len(self.buffers) - 1, buffer)
        self.out += rng(0, size - 1, offset) + rng(1, size - offset, length)
        self.out += rng(0, 3, 1)  # no MR object
        self.out += bytes([1]) + rng(0, 7, flags_index)
        self.regs += 1

    def deregister(self, index):
        self.step(8)
        self.out += msg() + bytes([1]) + rng(0, self.regs - 1, index)

    def build_lam(self, buffer, offset, length):
        self.step(9)
        size = self.buffers[buffer]
        self.out += msg() + rng(0, len(self.buffers) - 1, buffer)
        self.out += rng(0, size - 1, offset) + rng(1, size - offset, length)
        self.out += bytes([1])  # lam_capacity 0: no size check
        first = offset // PAGE
        last = (offset + length - 1) // PAGE
        self.lams.append(last - first + 1)

    def release_lam(self, index):
        self.step(11)
        self.out += msg() + rng(0, len(self.lams) - 1, index)

    def create_mr(self, fast, remote, session=0):
        self.step(12, session)
        self.out += msg(field(2, int(fast)) + field(3, int(remote)))
        self.mrs += 1

    def ticket_and_peer(self, session=0):
        self.step(17, session)
        self.out += msg()
        self.conns += 1

    def fast_register(self, mr, lam, pages, fbo, length, flags=0x38):
        self.step(14)
        self.out += msg(field(3, 7) + field(8, 0x10000 + fbo) + field(9, flags))
        self.out += rng(0, self.mrs - 1, mr)
        if self.conns:
            self.out += rng(0, self.conns - 1, 0)
        if self.lams:
            self.out += rng(0, len(self.lams) - 1, lam)
            self.out += rng(1, self.lams[lam], pages)
            self.out += rng(0, 4095, fbo)
            self.out += rng(1, pages * PAGE - fbo, length)

    def invalidate(self, mr, flags=0):
        self.step(16)
        self.out += msg(field(5, flags) if flags else b"")
        self.out += rng(0, self.mrs - 1, mr)
        if self.conns:
            self.out += rng(0, self.conns - 1, 0)

    def release_buffer(self, index):
        self.step(4)
        self.out += msg() + rng(0, len(self.buffers) - 1, index)

    def list(self, session=0):
        self.step(18, session)
        self.out += msg()

    def close(self, session, by_rpc=True):
        self.step(20, session)
        self.out += bytes([1 if by_rpc else 0])
        if by_rpc:
            self.out += msg()

    def time_passes(self, seconds):
        self.step(21)
        self.out += rng(0, 7200, seconds)


def seeds():
    s = Script()
    s.register(0, 0, 16 * PAGE, 3)  # local write + remote read/write
    s.register(0, 0, 16 * PAGE, 3)  # a cache hit
    s.register(0, PAGE + 10, 100, 4, )
    s.deregister(0)
    s.deregister(1)
    s.list()
    yield "register_deregister", s

    s = Script(warm=True)
    s.register(0, 0, 8 * PAGE, 3)
    s.deregister(0)  # kept warm
    s.register(0, 0, 8 * PAGE, 3)  # from the warm pin
    s.register(1, 0, 4 * PAGE, 1, session=1)
    s.release_buffer(0)
    yield "warm_pins", s

    s = Script()
    s.build_lam(0, 0, 4 * PAGE)
    s.create_mr(fast=True, remote=True)
    s.ticket_and_peer()
    s.fast_register(0, 0, 3, 512, 2 * PAGE)
    s.invalidate(0)
    s.fast_register(0, 0, 4, 0, 4 * PAGE)
    s.invalidate(0, flags=0x1)
    s.list()
    s.release_lam(0)
    yield "lam_fast_register_invalidate", s

    s = Script(small_limits=True)
    for _ in range(4):
        s.register(0, 0, 16 * PAGE, 3)
        s.register(0, PAGE, PAGE, 0)
    s.build_lam(0, 0, 16 * PAGE)
    s.build_lam(0, 0, PAGE)
    s.build_lam(0, 0, PAGE)
    s.create_mr(fast=False, remote=True)
    s.create_mr(fast=True, remote=False)
    s.create_mr(fast=True, remote=True)
    yield "limits", s

    s = Script()
    s.register(1, 0, 8 * PAGE, 3, session=1)
    s.build_lam(1, 0, 8 * PAGE)
    s.time_passes(601)  # the lease expires with everything in it
    s.list(session=1)
    yield "lease_expiry", s

    s = Script()
    s.register(0, 0, PAGE, 3)
    s.build_lam(0, 0, 2 * PAGE)
    s.create_mr(fast=True, remote=True)
    s.ticket_and_peer()
    s.fast_register(0, 0, 2, 0, 2 * PAGE)
    s.close(0, by_rpc=False)  # the fd socket closes mid-flight
    yield "session_end_with_everything", s


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "corpus", "core_fuzzer")
    os.makedirs(out, exist_ok=True)
    for name, script in seeds():
        with open(os.path.join(out, name), "wb") as f:
            f.write(bytes(script.out))


if __name__ == "__main__":
    main()
