"""Loop fission for the long sums of a pointwise CPU kernel: one simd loop per term, added into a chunk.

A sum over a small non-last axis is unrolled into adds of slices (:mod:`kernelize.autokernel.canon`):
rotary's cos / sin gradients add 16 heads, a grouped-query attention's key / value gradients add the
heads that share a key. Rendered as one loop body, each vector of the inner axis loads one line from each
term (rotary's two sums: 32 lines, 512 bytes apart), in an order the prefetchers do not follow. Measured
in C on 2048 rows of rotary f32 (2 threads): 1.05-1.2 ms that way, 0.48-0.56 ms with one loop per term
adding into a float row, 0.39-0.49 ms for one plain pass over the same bytes. Here each term's loop
covers the whole inner range (every inner piece, so a row is read in order), adding into a float chunk
(``kz_acc0``); the terms of several sums share their loops (term ``k`` of each sum in loop ``k``), so a
value both read (rotary's upstream gradient) is loaded once per loop. In the generated rotary backward
the cos / sin gradient kernel went from 2.4x the time of the input-gradient kernel (which moves as many
bytes) to 1.0x (``perf``, 3000 steps).

A sum qualifies as a left-deep chain of adds (``((t0 + t1) + t2) + ...``) of at least
:data:`MIN_TERMS` terms, each link read only by the next, at least that many of whose terms load the
same buffer (a sum of as many different tensors reads each in order and stays one loop); the values
after the chain (a cast, a mean's scale) and the stores run in a last loop reading the chunks.

Example (two sums of 16 terms, inner pieces of 64)::

    alignas(64) float kz_acc0[128], kz_acc1[128];
    for (i2 ...) { ... kz_acc0[i2 - kz_f] = v3; kz_acc1[i2 - kz_f] = v5; }        // term 0
    for (i2 ...) { ... kz_acc0[i2 - kz_f] = (kz_acc0[i2 - kz_f] + v9); ... }      // terms 1 .. 15
    for (i2 ...) { const float v110 = kz_acc0[i2 - kz_f]; ... kz_st(...); }      // the stores
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kernelize.autokernel.kernels import Compute, Kernel, Load
from kernelize.codegen.render import deps
from kernelize.ir.graph import Op

MIN_TERMS = 4  # fewer terms load few enough lines per vector for the prefetchers
FISSION_CHUNK = 256  # inner elements per chunk: the accumulators stay in L1
MAX_ROW = 8192  # over inner pieces the accumulators hold the whole static row: at most this many elements


@dataclass(frozen=True)
class Chain:
    """A left-deep sum in a kernel body: ``links[j] = add(links[j - 1], terms[j + 1])``, ``links[0] =
    add(terms[0], terms[1])``; ``links[-1]`` is the sum."""

    links: tuple[int, ...]
    terms: tuple[int, ...]


def _readers(k: Kernel) -> dict[int, int]:
    count: dict[int, int] = {}
    for e in k.body:
        for d in deps(e):
            count[d] = count.get(d, 0) + 1
    for s in k.stores:
        count[s.value] = count.get(s.value, 0) + 1
    return count


def _is_add(k: Kernel, i: int) -> bool:
    e = k.body[i]
    return isinstance(e, Compute) and e.op is Op.ADD and e.dtype.is_float


def sum_chains(k: Kernel, whole_row: bool = False) -> list[Chain]:
    """The kernel's left-deep sums of at least :data:`MIN_TERMS` terms, none of whose terms reads a link
    of any of them; ``whole_row`` (inner pieces: the accumulators hold the whole static row): none when
    those would exceed :data:`MAX_ROW` elements (the stack)."""
    readers = _readers(k)
    below = {  # links with a next link: the first operand of a float add, read by it alone
        k.body[i].src[0] for i in range(len(k.body)) if _is_add(k, i) and _is_add(k, k.body[i].src[0])
    }
    below = {i for i in below if readers.get(i) == 1}
    chains = []
    for top in range(len(k.body)):
        if not _is_add(k, top) or top in below:
            continue
        links = [top]
        while k.body[links[-1]].src[0] in below:
            links.append(k.body[links[-1]].src[0])
        links.reverse()
        first = k.body[links[0]]
        terms = (first.src[0], first.src[1], *(k.body[i].src[1] for i in links[1:]))
        if len(terms) >= MIN_TERMS and _strided_terms(k, terms):
            chains.append(Chain(tuple(links), terms))
    every = {i for c in chains for i in c.links}
    chains = [c for c in chains if not every & needed(k, c.terms, set())]
    return [] if whole_row and len(chains) * k.domain[-1] > MAX_ROW else chains


def _strided_terms(k: Kernel, terms: Sequence[int]) -> bool:
    """Whether one buffer is loaded by at least :data:`MIN_TERMS` of the terms: slices of one tensor (an
    unrolled sum), whose lines one loop body reads far apart. A sum of as many different tensors reads
    each in order and stays one loop."""
    count: dict = {}
    for t in terms:
        for b in {k.body[i].buffer for i in needed(k, [t], set()) if isinstance(k.body[i], Load)}:
            count[b] = count.get(b, 0) + 1
    return max(count.values(), default=0) >= MIN_TERMS


def needed(k: Kernel, roots: Sequence[int], stop: set[int], pick: Callable | None = None) -> set[int]:
    """Body entries computing ``roots``, not descending below ``stop`` (kept themselves); ``pick(e)``: the
    operands of an entry to follow (default :func:`~kernelize.codegen.render.deps`; within an inner piece
    a concat follows one, see ``cpu.piece_operands``)."""
    need: set[int] = set()
    stack = list(roots)
    while stack:
        i = stack.pop()
        if i in need:
            continue
        need.add(i)
        if i not in stop:
            stack += (pick or deps)(k.body[i])
    return need


def render_fissioned(w, segments: Sequence[tuple], chains: Sequence[Chain]) -> list[str]:
    """Lines of the inner axis of writer ``w``'s pointwise kernel with ``chains`` fissioned: one loop per
    term (the first two together), then the loop of the stores. ``segments``: ``(lo, hi, piece, pick)``
    per inner piece (static bounds; each term's loop runs over every piece, so a row is read in order) or
    one range ``(lo, hi, None, None)`` cut into chunks of :data:`FISSION_CHUNK`."""
    last, k = w.rank - 1, w.k
    var = f"i{last}"
    accs = [f"kz_acc{n}[{var} - kz_f]" for n in range(len(chains))]
    pieces = len(segments) > 1

    def loop(roots: Sequence[int], tail: Sequence[str], stop: dict | None = None) -> list[str]:
        out = []
        for lo, hi, piece, pick in segments:
            values = sorted(needed(k, roots, set(stop or {}), pick))
            body = [w.value(i, [last], stop or {}, piece) for i in values]
            bounds = (lo, hi) if pieces else ("kz_f", "kz_fe")
            head = f"for (int64_t {var} = {bounds[0]}; {var} < {bounds[1]}; ++{var}) {{"
            out += ["#pragma omp simd", head, *("    " + b for b in [*body, *tail]), "}"]
        return out

    lo, hi = segments[0][0], segments[-1][1]
    size = int(hi) - int(lo) if pieces else FISSION_CHUNK
    lines = [
        f"alignas(64) {w.r.ctype(k.body[c.links[-1]].dtype)} kz_acc{n}[{size}];" for n, c in enumerate(chains)
    ]
    for t in range(1, max(len(c.terms) for c in chains)):
        live = [(acc, c) for acc, c in zip(accs, chains) if t < len(c.terms)]
        roots = [c.terms[t] for _, c in live] + ([c.terms[0] for _, c in live] if t == 1 else [])
        tail = []
        for acc, c in live:
            prev = f"v{c.terms[0]}" if t == 1 else acc  # the first link adds terms 0 and 1
            tail.append(f"{acc} = {w.r.expr(k.body[c.links[t - 1]], [prev, f'v{c.terms[t]}'])};")
        lines += loop(roots, tail)
    tops = {c.links[-1]: acc for acc, c in zip(accs, chains)}
    lines += loop([s.value for s in k.stores], [w.store(n, s, [last]) for n, s in enumerate(k.stores)], tops)
    if pieces:
        return ["{", f"    const int64_t kz_f = {lo};", *("    " + x for x in lines), "}"]
    head = f"for (int64_t kz_f = {lo}; kz_f < {hi}; kz_f += {FISSION_CHUNK}) {{"
    fe = f"const int64_t kz_fe = kz_f + {FISSION_CHUNK} < {hi} ? kz_f + {FISSION_CHUNK} : {hi};"
    return [head, "    " + fe, *("    " + x for x in lines), "}"]
