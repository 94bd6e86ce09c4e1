"""What a code generator gives the runtime: a compiled kernel that launches on torch tensors.

Each backend (``triton``, ``cuda``, ``cpu``) implements :class:`Backend`: ``compile(kernel)`` turns one
:class:`~kernelize.autokernel.kernels.Kernel` it ``generates`` (never ``LIBRARY``: the runtime runs those
itself; ``CONV`` where the backend has a generated convolution) into a :class:`CompiledKernel`. The
runtime allocates every buffer, binds symbolic sizes from the inputs and calls ``launch(reads, writes,
sizes)`` with tensors in the order of ``kernel.reads`` / ``kernel.writes`` (all contiguous, on the
backend's device) and ``sizes`` holding one int per name of ``kernel.symbols``. A kernel that is one
library call allocating its own result (the CPU backend's oneDNN GEMMs) may also offer ``fresh(reads,
sizes)``, which returns its outputs (or None to fall back to ``launch``). A generated ``CONV`` kernel is
launched by the runtime's conv runner as ``launch([x, weight, bias, residual], [y], {})`` over
channels-last tensors (bias and residual None when its epilogue has none), or ``fresh`` without ``y``; it
packs the weight itself, on first use.
An ``ATTENTION`` kernel is launched on its node's operands instead (``q, k, v[, mask]``, in ``node.src``
order, with whatever strides their layout views give) and reads its sizes and strides from them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from kernelize.autokernel.kernels import ConvKernel, Kernel, LibraryKernel, dispatch

if TYPE_CHECKING:
    from kernelize.autokernel.plan import PlanSettings

Launch = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], Mapping[str, int]], None]


class KernelCompileError(RuntimeError):
    """A generated kernel failed to compile; the message holds the compiler log and numbered source."""

    def __init__(self, kernel_name: str, key: str, log: str, source: str, backend: str):
        numbered = "\n".join(f"{i + 1:4d} | {line}" for i, line in enumerate(source.splitlines()))
        super().__init__(
            f"{backend} kernel {kernel_name} (cache key {key[:16]}) failed to compile:\n{log}\n"
            f"--- source ---\n{numbered}"
        )
        self.kernel_name, self.key, self.log, self.source, self.backend = (
            kernel_name,
            key,
            log,
            source,
            backend,
        )


class CCall(NamedTuple):
    """One call of a compiled C function as ``kz_replay`` makes it (see :mod:`kernelize.runtime.replay`):
    its address and its integer arguments but the thread count, which goes last. ``error`` says what a
    non-zero return means; ``slots`` gives, for each of the kernel's reads then writes, the argument holding
    its data pointer (None: an argument derived from it, such as a packed weight), when that is not the
    identity; ``raises``: the exception type of that error (a gather index out of range: IndexError)."""

    fn: int
    args: tuple[int, ...]
    error: str
    slots: tuple[int | None, ...] | None = None
    raises: type[Exception] = RuntimeError
    keep: tuple = ()  # objects the arguments point into (a sizes array, a scratch buffer): held with the call


@dataclass(frozen=True)
class CompiledKernel:
    """A generated kernel ready to launch."""

    name: str
    backend: str
    source: str
    launch: Launch = field(repr=False)
    kernel: Kernel | None = field(default=None, repr=False, compare=False)
    # optional: ``fresh(reads, sizes)`` returns the kernel's outputs as new tensors (a library call that
    # allocates its own result), or None when ``launch`` into allocated buffers must run instead
    fresh: Callable[..., list[torch.Tensor] | None] | None = field(default=None, repr=False, compare=False)
    # optional: ``c_call(reads, writes, sizes)`` is the C call ``launch`` would make on those tensors (None
    # for an argument filled in later: its pointer is 0), for kernels that are one C function taking
    # ``reads``, ``writes`` (in that order, a tensor's data pointer each), then int sizes and the thread
    # count; it returns None when ``launch`` would not be one C call at these sizes
    c_call: Callable[..., CCall | None] | None = field(default=None, repr=False, compare=False)

    @property
    def source_hash(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()[:16]


def gpu_plan_settings(interpreted: bool = False) -> PlanSettings | None:
    """The planner settings of the GPU generators: on a real GPU, matmuls go to cuBLAS (torch) and their
    epilogues to generated POINTWISE kernels. Measured on an H200 (`make gpu-check`: the f32 demo decoder
    at 4 x 512 tokens, a bf16 0.85 B Llama), the generated matmul templates ran at about a quarter of
    cuBLAS's speed and made prefill and decode slower than eager. Without a GPU (the Triton interpreter,
    host emulation) the generated matmuls stay, so the test suite keeps checking them."""
    from kernelize.autokernel.plan import PlanSettings

    if interpreted or not torch.cuda.is_available():
        return None
    return PlanSettings(matmul="library")


class Backend(Protocol):
    """What the runtime, ``print_kernels`` and the attention API use of a code generator.

    The generators subclass it, so ``plan_settings`` and ``compile_many`` have defaults to inherit; a
    backend registered in ``BACKENDS`` that does not subclass it must still provide every member.
    """

    name: str

    @property
    def plan_settings(self) -> PlanSettings | None:
        """The planner settings this backend's kernels are written for (None: the planner's defaults)."""
        return None

    def device_ok(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` can be handed to this backend's kernels."""
        ...

    def generates(self, kernel: Kernel) -> bool:
        """Whether :meth:`compile` builds ``kernel``. ``LIBRARY`` kernels never (the runtime runs them with
        torch); a ``CONV`` kernel when the backend has a generated convolution for it (else the runtime
        runs the library's, with its epilogue as post-ops)."""
        return dispatch({LibraryKernel: False, ConvKernel: False, Kernel: True}, kernel, self.name)

    def render(self, kernel: Kernel) -> str:
        """The source :meth:`compile` builds for ``kernel``, without compiling it."""
        ...

    def compile(self, kernel: Kernel) -> CompiledKernel: ...

    def compile_many(
        self, kernels: Sequence[Kernel], progress: Callable[[int], None] | None = None
    ) -> list[CompiledKernel]:
        """Compile ``kernels`` in order, calling ``progress(n)`` as ``n`` more are done; a backend whose
        compiler has a large fixed cost per run overrides it to build them together."""
        out = []
        for k in kernels:
            out.append(self.compile(k))
            if progress is not None:
                progress(1)
        return out
