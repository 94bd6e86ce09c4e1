"""GGUF files (llama.cpp's format) in and out of transformers Llama, Qwen2, Qwen3 and Qwen3-MoE models with
packed weights.

* :func:`save` writes a ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` or
  ``Qwen3MoeForCausalLM`` as a GGUF file llama.cpp loads: architecture ``llama`` / ``qwen2`` / ``qwen3`` /
  ``qwen3moe`` (:data:`ARCHITECTURES`), its hyper-parameters, llama.cpp's tensor names, q/k rows permuted
  where llama.cpp's convert script permutes them for its rotary layout (Llama's), Qwen2's q/k/v biases and
  Qwen3's q/k norms as F32, projections and the LM head as ``Q8_0`` / ``Q4_0`` / ``Q5_0`` / ``Q4_K`` /
  ``Q6_K`` blocks (a :class:`~kernelize.quant.module.QuantizedLinear` is written as its bytes are, a float
  layer is quantized first), an MoE layer's router as F32 and its experts as the stacked ``ffn_gate_exps`` /
  ``ffn_up_exps`` / ``ffn_down_exps`` of a :class:`~kernelize.quant.experts.QuantizedExperts`, norms as F32,
  the token embedding in its float type, and a placeholder vocabulary.
* :func:`load` builds the model back from a file: the config from the metadata, the model on the meta
  device, then ``QuantizedLinear`` modules whose packed bytes are the file's tensor bytes as stored (memory
  mapped, never dequantized; q/k rows un-permuted by moving whole rows of blocks, which is exact since the
  blocks run along K) and float norms / embeddings.

A file is checked before anything in it is trusted: the whole header is walked with every length and count
held against the file's size (a 2**60-element array or string is refused before it is read), every tensor's
type, shape and byte range checked, then the names and shapes held against the config. Any problem is a
:class:`GGUFError` naming the file, the tensor or key, and what is wrong.

Example:
    >>> import transformers  # doctest: +SKIP
    >>> save(model, "tiny.gguf", fmt="q8_0")  # doctest: +SKIP
    >>> model = load("tiny.gguf")  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from kernelize.quant.formats import PackedWeight, dequantize, get_format, quantize
from kernelize.quant.module import QuantizedLinear

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Architecture:
    """What a GGUF architecture adds to Llama's layout: its name in the file (``general.architecture``, the
    prefix of its metadata keys), the transformers classes, whether llama.cpp's convert permutes the q/k
    rows (Llama's interleaved rotary; the others keep transformers' rotate-half order), the layer tensors
    that carry a bias (``blk.N.<name>.bias``, F32) and the extra per-layer norms (submodule, tensor name)."""

    gguf: str
    model: str
    config: str
    permuted: bool
    biases: tuple[str, ...] = ()
    norms: tuple[tuple[str, str], ...] = ()
    moe: bool = False  # every layer's MLP is a router and experts (MOE_TENSORS), not LAYER_TENSORS' MLP


# transformers class -> its GGUF architecture (as llama.cpp's convert_hf_to_gguf writes and reads them)
ARCHITECTURES = {
    a.model: a
    for a in (
        Architecture("llama", "LlamaForCausalLM", "LlamaConfig", permuted=True),
        Architecture("qwen2", "Qwen2ForCausalLM", "Qwen2Config", False, ("attn_q", "attn_k", "attn_v")),
        Architecture(
            "qwen3",
            "Qwen3ForCausalLM",
            "Qwen3Config",
            False,
            norms=(("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm")),
        ),
        Architecture(
            "qwen3moe",
            "Qwen3MoeForCausalLM",
            "Qwen3MoeConfig",
            False,
            norms=(("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm")),
            moe=True,
        ),
    )
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
_BY_GGUF = {a.gguf: a for a in ARCHITECTURES.values()}
# our format -> GGMLQuantizationType name, and the file type (llama_ftype) of a file whose layers are all it
PACKED_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q5_0": "Q5_0", "q4_k": "Q4_K", "q6_k": "Q6_K"}
FILE_TYPES = {
    "q8_0": "MOSTLY_Q8_0",
    "q4_0": "MOSTLY_Q4_0",
    "q5_0": "MOSTLY_Q5_0",
    "q4_k": "MOSTLY_Q4_K_S",
    "q6_k": "MOSTLY_Q6_K",
}
FLOAT_TYPES = ("F32", "F16", "BF16")

# decoder layer submodule -> llama.cpp tensor name (blk.N.<name>.weight)
LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_NORMS = ("attn_norm", "ffn_norm")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# an MoE layer's MLP: the router's weight (float) and the experts' stacked gate, up and down weights
MOE_TENSORS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# <arch>.<key> -> config attribute, for MoE architectures
MOE_CONFIG_KEYS = {
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}

# <arch>.<key> -> config attribute (transformers' GGUF_CONFIG_MAPPING: the same for each architecture here)
CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}
_REQUIRED = ("embedding_length", "block_count", "feed_forward_length", "attention.head_count")


class GGUFError(ValueError):
    """A GGUF file that cannot be loaded: the message names the file, and the key or tensor at fault."""


# ---- saving ---------------------------------------------------------------------------------------------
def permute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``permute`` of a q/k weight's rows (any trailing layout: floats or rows of blocks): per
    head, the two rotary halves become interleaved pairs.

    Example:
        >>> permute_rows(torch.arange(8)[:, None], 1).flatten().tolist()
        [0, 4, 1, 5, 2, 6, 3, 7]
    """
    n = w.shape[0]
    return w.reshape(n_head, 2, n // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of :func:`permute_rows`.

    Example:
        >>> unpermute_rows(permute_rows(torch.arange(8)[:, None], 2), 2).flatten().tolist()
        [0, 1, 2, 3, 4, 5, 6, 7]
    """
    n = w.shape[0]
    return w.reshape(n_head, n // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _check_saveable(model: nn.Module, fmt: str) -> tuple[Any, Architecture]:
    arch = ARCHITECTURES.get(type(model).__name__)
    if arch is None:
        raise ValueError(
            f"gguf.save: {type(model).__name__} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if fmt not in PACKED_TYPES:
        raise ValueError(
            f"gguf.save: fmt must be one of {sorted(PACKED_TYPES)} (GGUF block types), got {fmt!r}"
        )
    config = model.config
    # (Qwen2's q/k/v biases are not a config option: written as its architecture's bias tensors)
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError("gguf.save: projections with biases (attention_bias / mlp_bias) are not written yet")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"gguf.save: rope_type {rope.get('rope_type')!r} is not written yet; only the default rotary"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(
            f"gguf.save: llama.cpp's {arch.gguf} runs SiLU, the model's hidden_act is {config.hidden_act!r}"
        )
    if arch.moe and not (
        config.norm_topk_prob and config.decoder_sparse_step == 1 and not config.mlp_only_layers
    ):
        raise ValueError(
            f"gguf.save: llama.cpp's {arch.gguf} has experts in every layer and renormalises the top-k "
            "weights (norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])"
        )
    return config, arch


def _rope_theta(config: Any) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0))


def _packed_of(module: nn.Module, fmt: str, name: str, bias: bool = False) -> PackedWeight:
    """The packed weight GGUF stores for ``module`` (``bias``: the architecture has a bias tensor for it)."""
    if getattr(module, "bias", None) is not None and not bias:
        raise ValueError(f"gguf.save: {name} has a bias, which llama.cpp's layout has no tensor for")
    if isinstance(module, QuantizedLinear):
        if module.format not in PACKED_TYPES:
            raise ValueError(
                f"gguf.save: {name} is packed as {module.format}, which GGUF has no type for; quantize the "
                f"model to one of {sorted(PACKED_TYPES)}"
            )
        return module.packed
    if not isinstance(module, nn.Linear):
        raise ValueError(
            f"gguf.save: {name} is a {type(module).__name__}, expected nn.Linear or QuantizedLinear"
        )
    return quantize(module.weight.detach(), fmt)


def _packed_experts(module: nn.Module, fmt: str, name: str) -> Any:
    """The QuantizedExperts GGUF stores for an experts module (a float one quantized to `fmt` first)."""
    from kernelize.quant.experts import QuantizedExperts

    q = module if isinstance(module, QuantizedExperts) else QuantizedExperts.from_experts(module, fmt)
    if q.form or q.gate_up_bias.numel() or q.act != "silu":
        raise ValueError(f"gguf.save: {name} is not llama.cpp's qwen3moe experts (silu gate, no biases)")
    for f in (q.format, q.down_format):
        if f not in PACKED_TYPES:
            raise ValueError(f"gguf.save: {name} is packed as {f}, which GGUF has no type for")
    return q


def _placeholder_vocab(writer: Any, gguf: Any, vocab: int, config: Any) -> None:
    """A "llama" vocabulary of `vocab` placeholder tokens so the file is complete (no tokenizer is attached
    to a transformers model), laid out as Llama's SentencePiece vocabularies are: `<unk>`, `<s>`, `</s>`,
    the byte tokens `<0x00>`..`<0xFF>` (as many as fit: llama.cpp looks up `<0x0A>`), then `<tok_N>`."""
    special = {0: ("<unk>", gguf.TokenType.UNKNOWN), 1: ("<s>", gguf.TokenType.CONTROL)}
    special[2] = ("</s>", gguf.TokenType.CONTROL)
    special |= {3 + b: (f"<0x{b:02X}>", gguf.TokenType.BYTE) for b in range(min(256, max(vocab - 3, 0)))}
    tokens = [special[i][0] if i in special else f"<tok_{i}>" for i in range(vocab)]
    types = [int(special[i][1] if i in special else gguf.TokenType.NORMAL) for i in range(vocab)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types(types)
    for add, attr, default in (
        (writer.add_unk_token_id, None, 0),
        (writer.add_bos_token_id, "bos_token_id", 1),
        (writer.add_eos_token_id, "eos_token_id", 2),
    ):
        value = getattr(config, attr, None) if attr else None
        value = value if isinstance(value, int) and 0 <= value < vocab else default
        if value < vocab:
            add(value)


def _float_array(t: torch.Tensor) -> tuple[np.ndarray, Any]:
    """(array, raw_dtype or None) of a float tensor as GGUF stores it: F32 / F16 as is, BF16 as int16."""
    import gguf

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy(), gguf.GGMLQuantizationType.BF16
    if t.dtype == torch.float16:
        return t.numpy(), None
    return t.float().numpy(), None


def save(model: nn.Module, path: str | os.PathLike[str], fmt: str = "q8_0") -> None:
    """Write ``model`` (a ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM``, float or
    quantized) as a GGUF file llama.cpp can load.

    Args:
        model: the model; its ``QuantizedLinear`` layers are written as they are, float projections are
            quantized to ``fmt`` (llama.cpp's rounding).
        path: the file to write.
        fmt: ``"q8_0"``, ``"q4_0"``, ``"q5_0"``, ``"q4_k"`` or ``"q6_k"``, for the float projections and the
            file type (the k-quants take layers whose K is a multiple of 256).

    Example:
        >>> save(model, "model-q4_0.gguf", fmt="q4_0")  # doctest: +SKIP
    """
    import gguf

    config, arch = _check_saveable(model, fmt)
    writer = gguf.GGUFWriter(os.fspath(path), arch.gguf)
    _add_metadata(writer, gguf, config, model.get_input_embeddings().weight.shape[0], fmt, arch)
    _add_tensors(writer, gguf, model, fmt, arch)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    logger.info(
        "gguf.save: %s (%s, %d layers) -> %s", type(model).__name__, fmt, len(model.model.layers), path
    )


def _add_metadata(
    writer: Any,
    gguf: Any,
    config: Any,
    vocab: int,
    fmt: str,
    arch: Architecture = ARCHITECTURES["LlamaForCausalLM"],
) -> None:
    """The hyper-parameters llama.cpp reads (under the writer's architecture), the file type and the
    placeholder vocabulary."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_name(getattr(config, "name_or_path", "") or "kernelize-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(vocab)
    if head_dim * heads != config.hidden_size:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch.moe:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_file_type(int(getattr(gguf.LlamaFileType, FILE_TYPES[fmt])))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _placeholder_vocab(writer, gguf, vocab, config)


def _add_tensors(writer: Any, gguf: Any, model: nn.Module, fmt: str, arch: Architecture) -> None:
    """Every tensor under llama.cpp's name: packed blocks (q/k rows permuted where `arch` permutes them), F32
    norms and biases, the embedding."""
    heads = {"attn_q": model.config.num_attention_heads, "attn_k": model.config.num_key_value_heads}
    heads = heads if arch.permuted else {}

    def add_float(name: str, t: torch.Tensor, as_f32: bool = False) -> None:
        array, raw = _float_array(t.float() if as_f32 else t)
        writer.add_tensor(name, array, raw_dtype=raw)

    def add_packed(name: str, packed: PackedWeight, n_head: int | None = None) -> None:
        data = packed.data if n_head is None else permute_rows(packed.data, n_head)
        raw = getattr(gguf.GGMLQuantizationType, PACKED_TYPES[packed.format.name])
        writer.add_tensor(name, data.contiguous().numpy(), raw_dtype=raw)

    def add_experts(i: int, module: nn.Module) -> None:  # gate, up and down as [E, rows, bytes] each
        q = _packed_experts(module, fmt, f"model.layers.{i}.mlp.experts")
        e, n, h = q.num_experts, q.intermediate_dim, q.hidden_dim
        gate_up = q.gate_up_qweight.view(e, 2, n, -1)
        parts = (
            (gate_up[:, 0], q.format),
            (gate_up[:, 1], q.format),
            (q.down_qweight.view(e, h, -1), q.down_format),
        )
        for short, (data, f) in zip(MOE_TENSORS[1:], parts):
            raw = getattr(gguf.GGMLQuantizationType, PACKED_TYPES[f])
            writer.add_tensor(f"blk.{i}.{short}.weight", data.contiguous().numpy(), raw_dtype=raw)

    add_float("token_embd.weight", model.get_input_embeddings().weight)
    for i, layer in enumerate(model.model.layers):
        if arch.moe:
            add_float(f"blk.{i}.ffn_gate_inp.weight", layer.mlp.gate.weight, as_f32=True)
            add_experts(i, layer.mlp.experts)
        for sub, short in (*LAYER_TENSORS.items(), *arch.norms):
            if arch.moe and sub in _MLP:
                continue
            module = layer.get_submodule(sub)
            name = f"blk.{i}.{short}.weight"
            if short in _NORMS or (sub, short) in arch.norms:
                add_float(name, module.weight, as_f32=True)
                continue
            biased = short in arch.biases
            add_packed(name, _packed_of(module, fmt, f"model.layers.{i}.{sub}", biased), heads.get(short))
            if biased:  # (llama.cpp requires it: a layer without one gets zeros)
                bias = module.bias if module.bias is not None else torch.zeros(module.out_features)
                add_float(f"blk.{i}.{short}.bias", bias, as_f32=True)
    add_float("output_norm.weight", model.model.norm.weight, as_f32=True)
    add_packed("output.weight", _packed_of(model.lm_head, fmt, "lm_head"))


# ---- checking a file before trusting it ------------------------------------------------------------------
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry as checked: name, ggml type name, shape (numpy order: rows first), and the byte
    range of its data in the file."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    start: int
    nbytes: int


class _Cursor:
    """Reads the header of a GGUF file, every read and every declared length held against the file's size."""

    def __init__(self, buf: Any, path: str) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}")

    def take(self, n: int, what: str) -> bytes:
        if n > self.size - self.pos:
            raise self.fail(
                f"truncated file: {what} needs {n} bytes at offset {self.pos}, the file has "
                f"{self.size - self.pos} left (size {self.size})"
            )
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, code: str, what: str) -> Any:
        return struct.unpack("<" + code, self.take(struct.calcsize(code), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("Q", f"{what}'s length")
        if n > self.size - self.pos:
            raise self.fail(
                f"truncated file or metadata bomb: {what}: a string of {n} bytes declared at offset "
                f"{self.pos}, past the end of the file"
            )
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what}: not UTF-8 ({exc})") from None

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        """The value of `key` (arrays of scalars are skipped over, returned as None)."""
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], f"metadata {key!r}")
        if vtype == _STRING:
            return self.string(f"metadata {key!r}")
        if vtype != _ARRAY or depth > 1:
            raise self.fail(f"metadata {key!r}: unknown value type {vtype}")
        itype = self.scalar("I", f"metadata {key!r}'s array type")
        count = self.scalar("Q", f"metadata {key!r}'s array length")
        if itype in _SCALARS:
            self.take(count * struct.calcsize(_SCALARS[itype]), f"metadata {key!r}'s array of {count}")
            return None
        least = {_STRING: 8, _ARRAY: 12}.get(itype)
        if least is None:
            raise self.fail(f"metadata {key!r}: unknown array element type {itype}")
        if count * least > self.size - self.pos:
            raise self.fail(
                f"truncated file or metadata bomb: metadata {key!r}: an array of {count} elements declared "
                f"at offset {self.pos}, more than the {self.size - self.pos} bytes left in the file can hold"
            )
        for _ in range(count):
            self.value(itype, key, depth + 1)
        return None


def scan(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[TensorInfo]]:
    """Walk a GGUF file's header, checking it against the file: (scalar and string metadata, tensors).

    Raises:
        GGUFError: not a GGUF file, a truncated one, a length or count larger than the file, an unknown
            value or tensor type, a tensor whose data lies outside the file.
    """
    import gguf

    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if size == 0:
                raise GGUFError(f"{path}: truncated file: empty")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _scan(_Cursor(buf, path), gguf)
    except OSError as exc:
        raise GGUFError(f"{path}: cannot read: {exc}") from exc


def _scan(c: _Cursor, gguf: Any) -> tuple[dict[str, Any], list[TensorInfo]]:
    magic = c.take(4, "the magic")
    if magic != b"GGUF":
        raise c.fail(f"not a GGUF file: its first bytes are {bytes(magic)!r}, not b'GGUF'")
    version = c.scalar("I", "the version")
    if version not in (2, 3):
        raise c.fail(f"GGUF version {version} is not supported (2 or 3, little-endian)")
    n_tensors, n_kv = c.scalar("Q", "the tensor count"), c.scalar("Q", "the metadata count")
    if n_kv * 12 + n_tensors * 24 > c.size - c.pos:
        raise c.fail(
            f"truncated file or bad counts: {n_kv} metadata entries and {n_tensors} tensors declared, more "
            f"than the {c.size - c.pos} bytes left can hold"
        )
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string("a metadata key")
        vtype = c.scalar("I", f"metadata {key!r}'s type")
        if key in meta:
            raise c.fail(f"metadata {key!r} appears twice")
        meta[key] = c.value(vtype, key)
    infos = []
    for _ in range(n_tensors):
        name = c.string("a tensor name")
        n_dims = c.scalar("I", f"tensor {name!r}'s dimension count")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise c.fail(f"tensor {name!r}: {n_dims} dimensions (1 to {_MAX_DIMS})")
        dims = [c.scalar("Q", f"tensor {name!r}'s dimensions") for _ in range(n_dims)]
        raw = c.scalar("I", f"tensor {name!r}'s type")
        offset = c.scalar("Q", f"tensor {name!r}'s offset")
        try:
            qtype = gguf.GGMLQuantizationType(raw)
        except ValueError:
            raise c.fail(f"tensor {name!r}: unknown ggml type {raw}") from None
        infos.append((name, dims, qtype, offset))
    alignment = meta.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise c.fail(f"general.alignment {alignment!r} is not a power of two")
    data = -(-c.pos // alignment) * alignment
    tensors, names = [], set()
    for name, dims, qtype, offset in infos:
        if name in names:
            raise c.fail(f"tensor {name!r} appears twice")
        names.add(name)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise c.fail(
                f"tensor {name!r}: {dims[0]} elements per row, not a multiple of {qtype.name}'s {block}"
            )
        nbytes = int(np.prod(dims, dtype=object)) // block * type_size
        start = data + offset
        if offset % alignment or start + nbytes > c.size:
            raise c.fail(
                f"tensor {name!r}: data at [{start}, {start + nbytes}) lies outside the file (size {c.size}) "
                f"or is not aligned to {alignment}"
            )
        tensors.append(TensorInfo(name, qtype.name, tuple(reversed(dims)), start, nbytes))
    return meta, tensors


# ---- loading --------------------------------------------------------------------------------------------
def _architecture(path: str, meta: dict[str, Any]) -> Architecture:
    name = meta.get("general.architecture")
    arch = _BY_GGUF.get(name) if isinstance(name, str) else None
    if arch is None:
        supported = ", ".join(f"{a.gguf!r} ({a.model})" for a in ARCHITECTURES.values())
        raise GGUFError(f"{path}: general.architecture is {name!r}; supported: {supported}")
    return arch


def _config(path: str, meta: dict[str, Any], tensors: dict[str, TensorInfo], arch: Architecture) -> Any:
    import transformers

    prefix = arch.gguf  # the metadata keys' prefix
    kwargs: dict[str, Any] = {}
    for key, attr in CONFIG_KEYS.items():
        value = meta.get(f"{prefix}.{key}")
        if value is None:
            if key in _REQUIRED:
                raise GGUFError(f"{path}: metadata {prefix}.{key} is missing")
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise GGUFError(f"{path}: metadata {prefix}.{key} = {value!r} is not a positive number")
        kwargs[attr] = value
    kwargs.setdefault("num_key_value_heads", kwargs["num_attention_heads"])
    for attr in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads"):
        if not isinstance(kwargs.get(attr, 1), int):
            raise GGUFError(f"{path}: metadata for {attr} is {kwargs[attr]!r}, not an integer")
    layers = kwargs["num_hidden_layers"]
    if layers * (len(LAYER_TENSORS) - len(_MLP) * arch.moe + len(arch.norms)) > len(tensors):  # before sizing
        raise GGUFError(
            f"{path}: {prefix}.block_count = {layers}, but the file has only {len(tensors)} tensors"
        )
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFError(f"{path}: tensor 'token_embd.weight' is missing")
    vocab = meta.get(f"{prefix}.vocab_size", embd.shape[0])
    hidden, heads, kv = kwargs["hidden_size"], kwargs["num_attention_heads"], kwargs["num_key_value_heads"]
    head_dim = meta.get(f"{prefix}.attention.key_length") or hidden // heads
    for key, value in (("vocab_size", vocab), ("attention.key_length", head_dim), ("head_count_kv", kv)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise GGUFError(f"{path}: metadata {prefix}.{key} = {value!r} is not an integer")
    if heads % kv or head_dim % 2 or head_dim * heads == 0:
        raise GGUFError(
            f"{path}: {heads} attention heads, {kv} key/value heads, head size {head_dim}: not {arch.model}'s"
        )
    if arch.moe:  # llama.cpp's qwen3moe: every layer sparse, the top-k weights renormalised
        for key, attr in MOE_CONFIG_KEYS.items():
            value = meta.get(f"{prefix}.{key}")
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise GGUFError(f"{path}: metadata {prefix}.{key} = {value!r} is not a positive integer")
            kwargs[attr] = value
        if kwargs["num_experts_per_tok"] > kwargs["num_experts"]:
            raise GGUFError(f"{path}: {prefix}.expert_used_count is more than {prefix}.expert_count")
        kwargs |= {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    rope = {"rope_type": "default", "rope_theta": float(kwargs.pop("rope_theta", 10000.0))}
    special = {
        k: meta[f"tokenizer.ggml.{k}"]
        for k in ("bos_token_id", "eos_token_id")
        if isinstance(meta.get(f"tokenizer.ggml.{k}"), int)
    }
    plain = {"attention_bias": False, "mlp_bias": False} if arch.gguf == "llama" else {}
    return getattr(transformers, arch.config)(
        vocab_size=int(vocab), head_dim=int(head_dim), rope_parameters=rope,
        tie_word_embeddings="output.weight" not in tensors and embd.type_name in FLOAT_TYPES,
        hidden_act="silu", **plain, **special, **kwargs,
    )  # fmt: skip


def _expected(config: Any, arch: Architecture) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape (rows first) a file of `config` holds."""
    h, hd, f = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    per_layer = {
        "attn_q.weight": (q, h), "attn_k.weight": (kv, h), "attn_v.weight": (kv, h),
        "attn_output.weight": (h, q), "ffn_gate.weight": (f, h), "ffn_up.weight": (f, h),
        "ffn_down.weight": (h, f), "attn_norm.weight": (h,), "ffn_norm.weight": (h,),
    }  # fmt: skip
    per_layer |= {f"{b}.bias": per_layer[f"{b}.weight"][:1] for b in arch.biases}
    per_layer |= {f"{n}.weight": (hd,) for _, n in arch.norms}
    if arch.moe:
        e, i = config.num_experts, config.moe_intermediate_size
        for name in ("ffn_gate", "ffn_up", "ffn_down"):
            del per_layer[f"{name}.weight"]
        per_layer |= {
            "ffn_gate_inp.weight": (e, h), "ffn_gate_exps.weight": (e, i, h), "ffn_up_exps.weight": (e, i, h),
            "ffn_down_exps.weight": (e, h, i),
        }  # fmt: skip
    want = {"token_embd.weight": (config.vocab_size, h), "output_norm.weight": (h,)}
    want["output.weight"] = (config.vocab_size, h)  # optional: without it the head is the embedding
    for i in range(config.num_hidden_layers):
        want |= {f"blk.{i}.{k}": shape for k, shape in per_layer.items()}
    return want


def _check_tensors(path: str, config: Any, tensors: dict[str, TensorInfo], arch: Architecture) -> None:
    want = _expected(config, arch)
    missing = [n for n in want if n not in tensors and n != "output.weight"]
    if missing:
        raise GGUFError(f"{path}: tensors missing for the config: {', '.join(missing[:5])}")
    extra = [n for n in tensors if n not in want]
    if extra:
        raise GGUFError(
            f"{path}: tensors a {arch.model} of this config has no place for: {', '.join(extra[:5])}"
        )
    packed = tuple(PACKED_TYPES.values())
    for name, shape in want.items():
        info = tensors.get(name)
        if info is None:
            continue
        if info.shape != shape:
            raise GGUFError(
                f"{path}: tensor {name!r} has shape {list(info.shape)}, the config says {list(shape)}"
            )
        norm = len(shape) == 1 or name.endswith("ffn_gate_inp.weight")  # norms and routers: float
        allowed = FLOAT_TYPES if norm else (*FLOAT_TYPES, *packed) if name == "token_embd.weight" else packed
        if info.type_name not in allowed:
            raise GGUFError(
                f"{path}: tensor {name!r} is {info.type_name}, which is not supported here; supported: "
                f"{', '.join(allowed)}"
            )


def _tensor(reader_tensor: Any, info: TensorInfo) -> torch.Tensor:
    """The file's data of one tensor, memory mapped: floats as their dtype, packed types as uint8 rows."""
    data = torch.from_numpy(reader_tensor.data)
    if info.type_name == "BF16":
        return data.view(torch.bfloat16).reshape(info.shape)
    return data


def _float_param(t: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(t.to(dtype), requires_grad=False)


def _quantized(
    data: torch.Tensor, type_name: str, n: int, k: int, bias: torch.Tensor | None = None
) -> QuantizedLinear:
    fmt = {v: k for k, v in PACKED_TYPES.items()}[type_name]
    with torch.device("meta"):
        q = QuantizedLinear(k, n, fmt, bias=False)
    q.set_packed(PackedWeight(data.reshape(n, -1), get_format(fmt), (n, k)))
    if bias is not None:  # f32, as QuantizedLinear keeps its bias
        q.bias = nn.Parameter(bias.float().clone(), requires_grad=False)
    return q


def _experts(get: Any, tensors: dict[str, TensorInfo], i: int) -> nn.Module:
    """Layer `i`'s experts as a QuantizedExperts on the file's bytes: each expert's gate rows then its up rows
    (one copy of those bytes: llama.cpp stores them as two tensors) and the down rows as stored."""
    from kernelize.quant.experts import QuantizedExperts

    gate, up, down = (tensors[f"blk.{i}.{n}.weight"] for n in MOE_TENSORS[1:])
    if gate.type_name != up.type_name:
        raise GGUFError(
            f"tensors {gate.name!r} ({gate.type_name}) and {up.name!r} ({up.type_name}): the packed experts "
            "take gate and up rows in one type"
        )
    fmt = {v: k for k, v in PACKED_TYPES.items()}
    (e, n, _), hidden = gate.shape, down.shape[1]
    with torch.device("meta"):
        q = QuantizedExperts(e, hidden, n, fmt[gate.type_name], down_fmt=fmt[down.type_name])
    g, u = get(gate.name).reshape(e, n, -1), get(up.name).reshape(e, n, -1)
    q.gate_up_qweight = torch.cat((g, u), dim=1).reshape(e * 2 * n, -1)
    q.down_qweight = get(down.name).reshape(e * hidden, -1)
    for name in ("gate_up_qscales", "down_qscales", "gate_up_bias", "down_bias"):  # empty for GGUF types
        setattr(q, name, torch.zeros(0))
    return q.eval()


def load(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> nn.Module:
    """A ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` from a
    GGUF file, with ``QuantizedLinear`` projections (and ``QuantizedExperts``) on the file's bytes.

    Args:
        path: a GGUF file of architecture ``llama``, ``qwen2``, ``qwen3`` or ``qwen3moe``
            (:data:`ARCHITECTURES`) whose projections (and experts) and output are ``Q8_0``, ``Q4_0``,
            ``Q5_0``, ``Q4_K`` or ``Q6_K`` (mixed as llama.cpp's ``Q4_K_M`` mixes them) and whose norms (and
            routers) are float (the token embedding may be float or one of those: dequantized).
        dtype: the float type of the embedding and the norms.

    Returns:
        The model in eval mode; its packed weights are views of the memory-mapped file.

    Raises:
        GGUFError: the file is not one this can load (the message says which tensor or key, and why).

    Example:
        >>> model = load("model-q8_0.gguf")  # doctest: +SKIP
    """
    import gguf
    import transformers

    path = os.fspath(path)
    meta, infos = scan(path)
    tensors = {t.name: t for t in infos}
    arch = _architecture(path, meta)
    config = _config(path, meta, tensors, arch)
    _check_tensors(path, config, tensors, arch)
    try:
        reader = gguf.GGUFReader(path, "c")  # copy-on-write: writable arrays for torch, the file untouched
    except Exception as exc:  # the header was checked; whatever the reader still refuses, name the file
        raise GGUFError(f"{path}: gguf.GGUFReader refused it: {type(exc).__name__}: {exc}") from exc
    data = {t.name: t for t in reader.tensors}
    with torch.device("meta"):
        model = getattr(transformers, arch.model)(config)
    _install(model, lambda name: _tensor(data[name], tensors[name]), tensors, dtype, arch)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its buffers, on the CPU
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    assert not left, f"gguf.load left tensors on the meta device: {left}"
    logger.info("gguf.load: %s -> %s (%d layers)", path, arch.model, config.num_hidden_layers)
    return model.eval()


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The tokenizer of a GGUF file (its ``tokenizer.ggml.*`` vocabulary, merges and special tokens), built by
    transformers' own GGUF conversion (``AutoTokenizer.from_pretrained(folder, gguf_file=name)``).

    Raises:
        GGUFError: transformers could not build one from the file (the message names the file and why).

    Example:
        >>> tokenizer = load_tokenizer("model-q4_k.gguf")  # doctest: +SKIP
        >>> model = load("model-q4_k.gguf")  # doctest: +SKIP
        >>> model.generate(**tokenizer("Hello", return_tensors="pt"), max_new_tokens=8)  # doctest: +SKIP
    """
    import transformers

    path = os.path.abspath(os.fspath(path))
    scan(path)  # the header checked first: a bad file gets the same errors as load()'s
    folder, name = os.path.split(path)
    try:
        return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
        raise GGUFError(f"{path}: transformers could not build its tokenizer: {why}") from exc


def _install(
    model: nn.Module, get: Any, tensors: dict[str, TensorInfo], dtype: torch.dtype, arch: Architecture
) -> None:
    """Put the file's tensors (`get(name)`: memory mapped) into the meta-device `model`: `QuantizedLinear`
    projections on the packed bytes (q/k rows un-permuted where `arch` permutes them) with their biases,
    float norms and embedding. Without an `output.weight` the head is the embedding: packed on its bytes
    when the embedding is packed."""
    config = model.config
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    heads = heads if arch.permuted else {}
    embd = tensors["token_embd.weight"]
    if embd.type_name in FLOAT_TYPES:
        weight = get(embd.name)
    else:
        fmt = get_format({v: k for k, v in PACKED_TYPES.items()}[embd.type_name])
        weight = dequantize(PackedWeight(get(embd.name).reshape(embd.shape[0], -1), fmt, embd.shape))
    model.model.embed_tokens.weight = _float_param(weight, dtype)
    for i, layer in enumerate(model.model.layers):
        for sub, short in (*LAYER_TENSORS.items(), *arch.norms):
            if arch.moe and sub in _MLP:
                continue
            name = f"blk.{i}.{short}.weight"
            parent, _, leaf = sub.rpartition(".")
            owner = layer.get_submodule(parent) if parent else layer
            if short in _NORMS or (sub, short) in arch.norms:
                getattr(owner, leaf).weight = _float_param(get(name), dtype)
                continue
            t = get(name)
            if short in heads:
                t = unpermute_rows(t.reshape(tensors[name].shape[0], -1), heads[short]).contiguous()
            bias = get(f"blk.{i}.{short}.bias") if short in arch.biases else None
            setattr(owner, leaf, _quantized(t, tensors[name].type_name, *tensors[name].shape, bias))
        if arch.moe:
            layer.mlp.gate.weight = _float_param(get(f"blk.{i}.ffn_gate_inp.weight"), dtype)
            layer.mlp.experts = _experts(get, tensors, i)
    model.model.norm.weight = _float_param(get("output_norm.weight"), dtype)
    head = tensors.get("output.weight", embd)
    if head.type_name in FLOAT_TYPES:  # a float embedding as the head: tied, as transformers ties it
        model.lm_head.weight = model.model.embed_tokens.weight
    else:
        model.lm_head = _quantized(get(head.name), head.type_name, *head.shape)


__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "GGUFError",
    "SUPPORTED_ARCHITECTURES",
    "TensorInfo",
    "load",
    "load_tokenizer",
    "permute_rows",
    "save",
    "scan",
    "unpermute_rows",
]
