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

from kernelize.autokernel.kernels import Load
from kernelize.ir.dtypes import DType

# Values per chunk. Converting a whole bf16 row after its write pass was slower than storing each value
# (add+RMSNorm bf16 forward, 2048 x 2048, 1 thread: 1.65 -> 2.1 ms with its two rows as float rows, 1.34 ms
# in chunks of 64, 1.41 ms of 256, 1.80 ms of 1024): the float rows crowd the loads out of L1 and the
# converted row is stored in one burst.
CHUNK = 64


class ChunkStore(NamedTuple):
    """An f32 or bf16 store of a simd loop, contiguous along the loop index: ``dst`` is the address of the
    element at index 0 (``kz_out2 + kz_s2``), ``line`` the plain store, ``value`` the stored value's name."""

    slot: int
    value: str
    dst: str
    line: str
    bf16: bool


def chunk_store(w, n: int, s, axis: int) -> ChunkStore | None:
    """Store ``n`` (``s``) of writer ``w``'s kernel as a :class:`ChunkStore` of a loop over ``axis``, or None
    when it is not an f32 or bf16 store with unit stride along that axis."""
    if s.buffer.dtype not in (DType.F32, DType.BF16) or s.strides[axis] != 1:
        return None
    line = w.store(n, s, [axis])
    return ChunkStore(n, f"v{s.value}", f"{w.ptr[s.buffer]} + kz_s{n}", line, s.buffer.dtype is DType.BF16)


def stream_bytes(stores: Sequence[ChunkStore]) -> int:
    """Bytes the streamable ``stores`` write per element of the loop."""
    return sum(2 if s.bf16 else 4 for s in stores)


def moved_bytes(kernel, stores: Sequence[ChunkStore]) -> int:
    """Bytes per domain element a kernel with streamable ``stores`` moves (what ``kz_streams`` is asked
    about; 0 without such stores): what they write plus one read of every input loaded at full size (a
    stride on each axis of the domain longer than 1; a norm's weight or a broadcast operand is not). A
    kernel whose inputs and outputs together exceed the threshold leaves nothing in cache for the next op
    either way, and a regular store first reads its line: a bf16 2048 x 2048 LayerNorm (8 MiB out, 16 MiB
    moved forward, 24 MiB backward), 2 threads, forward + backward, medians of 15 in a shuffled order:
    2.17 -> 1.94 ms against storing plainly."""
    if not stores:
        return 0
    full = {
        e.buffer
        for e in kernel.body
        if isinstance(e, Load) and all(st != 0 for st, d in zip(e.strides, kernel.domain) if d != 1)
    }
    return stream_bytes(stores) + sum(b.dtype.itemsize for b in full)


def chunked_loop(
    var: str,
    lo: str,
    hi: str,
    body: Sequence[str],
    stores: Sequence[ChunkStore],
    rest: Sequence[str],
    bf16_chunks: bool = True,
    stream: bool = False,
    prefetch: Sequence[str] = (),
) -> list[str]:
    """The simd loop ``for var in [lo, hi)`` computing ``body``, doing ``rest`` (the other stores and
    updates) and the contiguous ``stores``: when ``stream`` and the kernel streams its outputs
    (``kz_stream``), every one of them through float chunks written with non-temporal stores; else the bf16
    ones in float chunks where AVX512-BF16 is there (and ``bf16_chunks``); plainly for the rest of the
    range. ``prefetch``: lines each streamed chunk starts with (a row kernel's prefetch of the next row)."""

    def loop(start: str, end: str, lines: Sequence[str]) -> list[str]:
        head = f"for (int64_t {var} = {start}; {var} < {end}; ++{var}) {{"
        return ["#pragma omp simd", head, *("    " + b for b in lines), "}"]

    def chunks(chunked: Sequence[ChunkStore], write: str, first: Sequence[str] = ()) -> list[str]:
        kept = {s.slot for s in chunked}
        lines = [s.line for s in stores if s.slot not in kept]
        chunk = [*body, *(f"kz_b{s.slot}[{var} - kz_ch] = {s.value};" for s in chunked), *lines, *rest]
        return [
            f"for (; kz_ch + {CHUNK} <= {hi}; kz_ch += {CHUNK}) {{",
            *("    " + b for b in first),
            *(f"    alignas(64) float kz_b{s.slot}[{CHUNK}];" for s in chunked),
            *("    " + b for b in loop("kz_ch", f"kz_ch + {CHUNK}", chunk)),
            *(f"    {write}({s.dst} + kz_ch, kz_b{s.slot}, {CHUNK});" for s in chunked),
            "}",
        ]

    plain = [*body, *(s.line for s in stores), *rest]
    if not stores:
        return loop(lo, hi, plain)
    inner = [f"int64_t kz_ch = {lo};"]
    if stream:
        inner += ["if (kz_stream) {", *("    " + b for b in chunks(stores, "kz_stream_row", prefetch)), "}"]
    bf16 = [s for s in stores if s.bf16]
    if bf16 and bf16_chunks:
        inner += ["#if KZ_BF16_ROWS", *chunks(bf16, "kz_st_bf16_row"), "#endif"]
    inner += loop("kz_ch", hi, plain)
    return ["{", *("    " + b for b in inner), "}"]  # a block: a tile may hold several such loops


__all__ = ["CHUNK", "ChunkStore", "chunk_store", "chunked_loop", "moved_bytes", "stream_bytes"]
