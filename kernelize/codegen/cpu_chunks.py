"""bf16 stores of the CPU backend's simd loops through float chunks converted with AVX512-BF16.

A simd loop storing bf16 values contiguously along its index is rendered twice: with AVX512-BF16
(``KZ_BF16_ROWS``, see the prelude) it runs in chunks of :data:`CHUNK` values whose stored values go to float
arrays on the stack, each converted into the output with one instruction per 32 values
(``kz_st_bf16_row``); the plain loop (``kz_st`` per value) covers the rest of the range, or all of it
without AVX512-BF16.

Example (a row kernel's write pass, as generated)::

    {
        int64_t kz_ch = 0;
    #if KZ_BF16_ROWS
        for (; kz_ch + 64 <= 2048; kz_ch += 64) {
            alignas(64) float kz_b0[64];
            #pragma omp simd
            for (int64_t i1 = kz_ch; i1 < kz_ch + 64; ++i1) { const float v2 = ...; kz_b0[i1 - kz_ch] = v2; }
            kz_st_bf16_row(kz_out0 + kz_s0 + kz_ch, kz_b0, 64);
        }
    #endif
        #pragma omp simd
        for (int64_t i1 = kz_ch; i1 < 2048; ++i1) { const float v2 = ...; kz_st(kz_out0, kz_s0 + i1, v2); }
    }
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kernelize.ir.dtypes import DType

# Values per chunk. Converting a whole bf16 row after its write pass was slower than storing each value
# (add+RMSNorm bf16 forward, 2048 x 2048, 1 thread: 1.65 -> 2.1 ms with its two rows as float rows, 1.34 ms
# in chunks of 64, 1.41 ms of 256, 1.80 ms of 1024): the float rows crowd the loads out of L1 and the
# converted row is stored in one burst.
CHUNK = 64


class Bf16Store(NamedTuple):
    """A bf16 store of a simd loop, contiguous along the loop index: ``dst`` is the address of the element
    at index 0 (``kz_out2 + kz_s2``), ``line`` the plain store, ``value`` the stored value's C name."""

    slot: int
    value: str
    dst: str
    line: str


def bf16_store(w, n: int, s, axis: int) -> Bf16Store | None:
    """Store ``n`` (``s``) of writer ``w``'s kernel as a :class:`Bf16Store` of a loop over ``axis``, or None
    when it is not a bf16 store with unit stride along that axis."""
    if s.buffer.dtype is not DType.BF16 or s.strides[axis] != 1:
        return None
    return Bf16Store(n, f"v{s.value}", f"{w.ptr[s.buffer]} + kz_s{n}", w.store(n, s, [axis]))


def chunked_loop(
    var: str, lo: str, hi: str, body: Sequence[str], stores: Sequence[Bf16Store], rest: Sequence[str]
) -> list[str]:
    """The simd loop ``for var in [lo, hi)`` computing ``body``, doing ``rest`` (the other stores and
    updates) and the bf16 ``stores``: in float chunks where AVX512-BF16 is there, plainly for the rest.
    Without bf16 stores, the plain loop alone."""

    def loop(start: str, end: str, lines: Sequence[str]) -> list[str]:
        head = f"for (int64_t {var} = {start}; {var} < {end}; ++{var}) {{"
        return ["#pragma omp simd", head, *("    " + b for b in lines), "}"]

    plain = [*body, *(s.line for s in stores), *rest]
    if not stores:
        return loop(lo, hi, plain)
    chunk = [*body, *(f"kz_b{s.slot}[{var} - kz_ch] = {s.value};" for s in stores), *rest]
    chunks = [
        f"for (; kz_ch + {CHUNK} <= {hi}; kz_ch += {CHUNK}) {{",
        *(f"    alignas(64) float kz_b{s.slot}[{CHUNK}];" for s in stores),
        *("    " + b for b in loop("kz_ch", f"kz_ch + {CHUNK}", chunk)),
        *(f"    kz_st_bf16_row({s.dst} + kz_ch, kz_b{s.slot}, {CHUNK});" for s in stores),
        "}",
    ]
    inner = [f"int64_t kz_ch = {lo};", "#if KZ_BF16_ROWS", *chunks, "#endif", *loop("kz_ch", hi, plain)]
    return ["{", *("    " + b for b in inner), "}"]  # a block: a tile may hold several such loops


__all__ = ["CHUNK", "Bf16Store", "bf16_store", "chunked_loop"]
