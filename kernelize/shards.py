"""Tensor parallelism: the kernels of a Megatron-sharded attention or MLP run on each rank's local shards.

Under torch's `parallelize_module` (`ColwiseParallel` / `RowwiseParallel`) or transformers' `tp_plan="auto"`,
a Llama-style layer's weights are DTensors on a 1-D device mesh, split the Megatron way: q, k, v and gate,
up column-wise (`Shard(0)` of the weight: each rank holds whole heads, a slice of the intermediate size),
o and down row-wise (`Shard(1)`: each rank's product is a partial sum). The module's own forward sees plain
tensors at its edges (the linears' hooks convert: the input is replicated, the colwise outputs are the local
slices, the rowwise output is all-reduced), so a kernel forward may do the same by hand: read the weights'
local tensors, work on `heads / world` local heads, and all-reduce the row-parallel product once (then add
its bias, which is replicated). `shards_of(module)` says whether a module is laid out so:

* no DTensor parameter: None (the single-process kernels);
* q/k/v (gate/up) `Shard(0)`, o (down) `Shard(1)`, colwise biases `Shard(0)`, rowwise biases replicated, on
  one 1-D mesh, the linears' parallel styles taking and giving plain local tensors (torch's `ColwiseParallel`
  / `RowwiseParallel` defaults, transformers' "colwise" / "rowwise"), head counts and the intermediate size
  divisible by the ranks: a `Shards` (process group, world size);
* anything else (a fused q|k|v or gate|up, a 2-D mesh, sequence parallelism, gathered or DTensor outputs,
  uneven heads): the reason, and the module keeps its own forward.

Example:
    >>> shards = shards_of(model.model.layers[0].self_attn)  # doctest: +SKIP
    >>> y = shards.reduce(local_product)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["LAYOUTS", "Shards", "heads_of", "local", "require", "shards_of"]

_CACHE = "_kernelize_shards"  # on a module: (ids of its and its children's parameters, what shards_of found)


@dataclass(frozen=True)
class Shards:
    """One module's tensor-parallel layout: its process group and how many ranks split it."""

    group: Any  # torch.distributed.ProcessGroup of the weights' 1-D mesh
    world: int

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of each rank's `partial` (in place), as a row-parallel linear's hook does;
        through shared memory where all ranks share this host (`kernelize.shm_collective`)."""
        from kernelize.shm_collective import all_reduce

        return all_reduce(partial, self.group)


@dataclass(frozen=True)
class Layout:
    """A module kind's Megatron split: column-parallel linears, row-parallel ones, and the config sizes
    (attribute names) that must divide by the world."""

    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    sizes: tuple[str, ...]


# kind -> its split; a module is of the kind whose linears it has
LAYOUTS = {
    "attention": Layout(
        ("q_proj", "k_proj", "v_proj"), ("o_proj",), ("num_attention_heads", "num_key_value_heads")
    ),
    "mlp": Layout(("gate_proj", "up_proj"), ("down_proj",), ()),
}
# what each style's edges must be for the module's own forward to see plain local tensors
_EDGES = {
    "colwise": (("Replicate()",), ("Shard(dim=-1)",)),  # (input layouts, output layouts)
    "rowwise": (("Shard(dim=-1)",), ("Replicate()",)),
}


@functools.cache
def _dtensor() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed: no tensor is a DTensor
        return None
    return DTensor


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's shard of a DTensor (the tensor object the DTensor holds, so that `kernelize.merge` can
    make it a view of a merged weight); any other tensor as it is."""
    cls = _dtensor()
    return t._local_tensor if cls is not None and isinstance(t, cls) else t


def shards_of(module: nn.Module) -> Shards | str | None:
    """`module`'s tensor-parallel layout (see the module doc): None without DTensor parameters, a `Shards`
    for the Megatron split the kernels handle, else the reason it keeps its own forward. Cached per module
    on the identity of its and its children's parameters (a kernel forward asks on every call)."""
    if _dtensor() is None:
        return None
    key = tuple(
        id(p) for m in (module, *module._modules.values()) if m is not None for p in m._parameters.values()
    )
    cached = module.__dict__.get(_CACHE)
    if cached is None or cached[0] != key:
        params = list(module.named_parameters())
        found = _layout(module, params) if any(isinstance(p, _dtensor()) for _, p in params) else None
        cached = module.__dict__[_CACHE] = (key, found)
    return cached[1]


def _layout(module: nn.Module, params: list[tuple[str, nn.Parameter]]) -> Shards | str:
    kind = next((k for k, lay in LAYOUTS.items() if all(hasattr(module, n) for n in lay.colwise)), None)
    if kind is None:
        name, p = next((n, p) for n, p in params if isinstance(p, _dtensor()))
        return (
            f"its parameter `{name}` is a DTensor (tensor parallelism, placements {_placements(p)}): only "
            "the Megatron split of q/k/v/o and gate/up/down runs kernels on the local shards, so the module "
            "keeps its own forward and the collectives torch.distributed places"
        )
    lay = LAYOUTS[kind]
    wanted = {f"{n}.{w}": ("Shard(dim=0)",) for n in lay.colwise for w in ("weight", "bias")}
    wanted |= {f"{n}.weight": ("Shard(dim=1)",) for n in lay.rowwise}
    wanted |= {f"{n}.bias": ("Replicate()",) for n in lay.rowwise}
    for name, p in params:
        got = _placements(p) if isinstance(p, _dtensor()) else "a plain tensor"
        if got != ", ".join(wanted.get(name, ("not sharded",))):
            want = ", ".join(wanted.get(name, ("not a DTensor",)))
            return f"its parameter `{name}` has placements {got}, the Megatron split wants {want}" + _EAGER
    meshes = {p.device_mesh for _, p in params if isinstance(p, _dtensor())}
    mesh = next(iter(meshes))
    if len(meshes) != 1 or mesh.ndim != 1:
        return f"its DTensor parameters lie on {len(meshes)} meshes of {mesh.ndim} dims, not one 1-D{_EAGER}"
    why = _edges_blocker(module, lay) or _sizes_blocker(module, lay, mesh.size())
    return why or Shards(mesh.get_group(), mesh.size())


_EAGER = ": the module keeps its own forward (tensor parallelism through torch.distributed)"


def _placements(p: Any) -> str:
    return ", ".join(map(repr, p.placements))


def _edges_blocker(module: nn.Module, lay: Layout) -> str | None:
    """Why the linears' parallel styles (torch's hooks, transformers' forwards) do not hand the module's own
    forward plain local tensors (replicated input, local colwise outputs, reduced rowwise output)."""
    for style_name, names in (("colwise", lay.colwise), ("rowwise", lay.rowwise)):
        for name in names:
            edges = _edges(getattr(module, name))
            if edges is None:
                return f"`{name}` has no parallel style (torch's or transformers') whose layouts show{_EAGER}"
            if edges != (*_EDGES[style_name], True):
                return (
                    f"`{name}` takes {edges[0]} and gives {edges[1]} (local output {edges[2]}); the kernels "
                    f"of a {style_name} linear take {_EDGES[style_name]}{_EAGER}"
                )
    return None


def _as_tuple(layouts: Any) -> tuple[str, ...]:
    return tuple(map(repr, layouts if isinstance(layouts, tuple | list) else (layouts,)))


def _edges(linear: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...], bool] | None:
    """(input layouts, output layouts, local output) of a linear's parallel style, found in what its hooks
    (torch's `distribute_module`: partials of the style's `_prepare_input_fn(input_layouts, ...)` and
    `_prepare_output_fn(output_layouts, use_local_output, ...)`) or its instance forward (transformers'
    `install_forward`: a closure over the style object) hold; None when neither shows."""
    stack: list[Any] = [*linear._forward_pre_hooks.values(), *linear._forward_hooks.values()]
    stack.append(linear.__dict__.get("forward"))
    seen, found = set(), {}
    while stack and len(seen) < 200:
        obj = stack.pop()
        if obj is None or id(obj) in seen or isinstance(obj, nn.Module | torch.Tensor):
            continue
        seen.add(id(obj))
        if all(hasattr(obj, a) for a in ("input_layouts", "output_layouts", "use_local_output")):
            found |= {"input": obj.input_layouts, "output": obj.output_layouts, "local": obj.use_local_output}
        elif isinstance(obj, functools.partial):
            role = getattr(obj.func, "__name__", "")
            if role == "_prepare_input_fn" and obj.args:
                found["input"] = obj.args[0]
            elif role == "_prepare_output_fn" and len(obj.args) == 2:
                found["output"], found["local"] = obj.args
        elif inspect.ismethod(obj):
            stack.append(obj.__self__)
        else:
            stack += [_contents(c) for c in getattr(obj, "__closure__", None) or ()]
    if found.keys() != {"input", "output", "local"}:
        return None
    return _as_tuple(found["input"]), _as_tuple(found["output"]), bool(found["local"])


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _sizes_blocker(module: nn.Module, lay: Layout, world: int) -> str | None:
    config = getattr(module, "config", None)
    sizes = {n: getattr(config, n, None) for n in lay.sizes}
    sizes |= {f"{n}.out_features": getattr(module, n).weight.shape[0] for n in lay.colwise}
    uneven = {n: s for n, s in sizes.items() if not isinstance(s, int) or s % world}
    if uneven:
        what = ", ".join(f"{n} {s}" for n, s in uneven.items())
        return f"{what} do not divide by the {world} ranks (each needs whole heads, equal slices){_EAGER}"
    return None


def heads_of(module: nn.Module, shards: Shards | None) -> tuple[int, int]:
    """(query heads, key/value heads) this rank computes: the config's, divided by the ranks when sharded.
    The config is read once per module: a transformers config's attribute reads go through its
    `__getattribute__` (a few microseconds each, several per layer and token)."""
    world = 1 if shards is None else shards.world
    held = module.__dict__.get("_kernelize_heads")
    if held is None:
        config = module.config
        held = module.__dict__["_kernelize_heads"] = (config.num_attention_heads, config.num_key_value_heads)
    return held[0] // world, held[1] // world


def require(module: nn.Module) -> Shards | None:
    """`shards_of(module)`, raising `ValueError` with the reason where the kernels cannot run on its shards
    (the probe of `kernelize_model` then keeps the module's own forward, the reason in `inspect`)."""
    shards = shards_of(module)
    if isinstance(shards, str):
        raise ValueError(f"{type(module).__name__}: {shards}")
    return shards
