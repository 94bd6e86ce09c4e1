"""The launch plan the GPU grouped-expert kernels share (vLLM's ``moe_align_block_size``, in torch ops).

The ``T * K`` routed (token, slot) pairs are sorted by expert and each expert's segment is padded to a
multiple of ``block_m`` rows, so a program of the grouped GEMMs takes ``block_m`` sorted pairs that all use
one expert's weights. Everything stays on the tensors' device and nothing is read back to the host: the
grid is sized by an upper bound of the padded blocks, ``(S + min(E, S) * (block_m - 1)) // block_m`` for
``S`` pairs, and the blocks past the real ones (and the sentinel expert ``E``'s pairs) carry the expert id
``E``, which makes their programs return at once. A padding row holds the pair id ``S``, which the kernels
mask.

An index outside ``[0, E]`` cannot be raised on without a host sync: it is checked by an asynchronous
device assert (as the Triton and CUDA gathers do) and treated as the sentinel meanwhile, so no kernel
reads outside the weights.

Example:
    >>> plan = align_pairs(torch.tensor([[1, 0], [1, 4]]), experts=4, block_m=2)
    >>> plan.sorted_pair_ids.tolist(), plan.block_expert_ids.tolist()
    ([1, 4, 0, 2, 4, 4, 4, 4], [0, 1, 4, 4])
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class AlignedPairs(NamedTuple):
    """The pairs sorted by expert, each expert's segment padded to whole blocks.

    Attributes:
        sorted_pair_ids: ``[blocks * block_m]`` int32: the pair (``token * K + slot``) of each padded row,
            ``S`` (the pair count) for a padding row.
        block_expert_ids: ``[blocks]`` int32: the expert of each block, ``E`` for a block without work.
        blocks: the grid's block count (an upper bound of the real blocks, known on the host).
        block_m: rows per block.
    """

    sorted_pair_ids: torch.Tensor
    block_expert_ids: torch.Tensor
    blocks: int
    block_m: int


def max_blocks(pairs: int, experts: int, block_m: int) -> int:
    """The most blocks ``pairs`` routed pairs can fill: each expert with pairs wastes under one block."""
    return max(1, (pairs + min(experts, pairs) * (block_m - 1)) // block_m)


def align_pairs(index: torch.Tensor, experts: int, block_m: int) -> AlignedPairs:
    """Sort the pairs of ``index`` (``[T, K]``, integers in ``[0, experts]``) by expert and pad each
    expert's segment to a multiple of ``block_m`` (see the module docstring); no host synchronisation."""
    dev = index.device
    flat = index.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    bad = (flat < 0) | (flat > experts)
    torch._assert_async(
        ~bad.any(), f"experts: an expert index outside [0, {experts}] (the expert count is the sentinel)"
    )
    eid = torch.where(bad, experts, flat)
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, eid, torch.ones_like(eid))
    counts = counts[:experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts  # each expert's first position among the sorted pairs
    order = torch.argsort(eid, stable=True)
    sorted_e = eid[order]
    real = sorted_e < experts
    e_safe = torch.where(real, sorted_e, 0)
    rank = torch.arange(pairs, device=dev) - first[e_safe]
    blocks = max_blocks(pairs, experts, block_m)
    rows = blocks * block_m
    dest = torch.where(real, padded_end[e_safe] - padded[e_safe] + rank, rows)  # the sentinel's: a dump slot
    ids = torch.full((rows + 1,), pairs, dtype=torch.int32, device=dev)
    ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(blocks, device=dev) * block_m
    block_e = torch.searchsorted(padded_end, starts, right=True).clamp_(max=experts).to(torch.int32)
    return AlignedPairs(ids[:rows], block_e, blocks, block_m)


__all__ = ["AlignedPairs", "align_pairs", "max_blocks"]
