"""kernelize.integrations.gguf: save / load round trips on a tiny Llama, and files that must be refused."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from kernelize.integrations import gguf as kg
from kernelize.quant.model import quantize_for_kernelize
from kernelize.quant.module import QuantizedLinear

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

VOCAB = 256
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
PROJECTIONS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _llama(hidden: int = 128) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, rope_theta=5e5,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    out = {}
    for fmt in ("q8_0", "q4_0", "q4_k"):
        model = _llama({"q8_0": 128, "q4_0": 64, "q4_k": 256}[fmt])
        if fmt == "q4_k":  # mixed as llama.cpp's Q4_K_M: a Q6_K down projection among Q4_K tensors
            down = model.model.layers[0].mlp.down_proj
            model.model.layers[0].mlp.down_proj = QuantizedLinear.from_linear(down, "q6_k")
        quantize_for_kernelize(model, fmt)
        path = tmp_path_factory.mktemp("gguf") / f"tiny-{fmt}.gguf"
        kg.save(model, path)  # already packed: written as it is, whatever `fmt` says
        out[fmt] = (model, path)
    return out


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k"])
def test_round_trip(saved: dict, fmt: str) -> None:
    model, path = saved[fmt]
    loaded = kg.load(path)
    for i, layer in enumerate(loaded.model.layers):
        for name in PROJECTIONS:
            got, want = layer.get_submodule(name), model.model.layers[i].get_submodule(name)
            assert isinstance(got, QuantizedLinear) and got.format == want.format
            mixed = fmt == "q4_k" and (i, name) == (0, "mlp.down_proj")
            assert got.format == ("q6_k" if mixed else fmt)
            assert torch.equal(got.qweight, want.qweight), name  # the same bytes (q/k un-permuted exactly)
    assert torch.equal(loaded.lm_head.qweight, model.lm_head.qweight)
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert loaded.config.rope_parameters["rope_theta"] == 5e5
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
        one = ids[:1, :1]  # decode rows: the packed few-row kernel
        torch.testing.assert_close(loaded(one).logits, model(one).logits, rtol=1e-5, atol=1e-5)
    assert loaded.generate(ids[:1, :3], max_new_tokens=4, do_sample=False).shape == (1, 7)
    if fmt == "q4_0":  # a loaded model takes the one call: norms, packed attention and MLP layers, verified
        from kernelize.integrations.transformers import kernelize_model
        from kernelize.layer.record import inspect

        kernelize_model(loaded)
        choices = inspect(loaded)
        assert choices["model.norm"].uses_kernel and choices["model.layers.0.mlp"].uses_kernel
        assert not any("withdrawn" in n for c in choices.values() for n in c.notes)
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["q8_0", "q6_k"])
def test_float_model_and_transformers_reader(tmp_path: Path, fmt: str) -> None:
    """A float model is quantized on save; transformers' own GGUF reader (llama.cpp's names and rotary
    permutation, dequantized) finds the same weights as the packed ones load() installs."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from kernelize.quant.formats import dequantize, quantize

    model = _llama(64 if fmt == "q8_0" else 256)
    path = tmp_path / "float.gguf"
    kg.save(model, path, fmt=fmt)
    loaded = kg.load(path)
    q = loaded.model.layers[1].self_attn.k_proj
    assert torch.equal(q.qweight, quantize(model.model.layers[1].self_attn.k_proj.weight, fmt).data)
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(loaded.config)
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "lm_head"):
        ref = torch.as_tensor(theirs[f"{name}.weight"]).float()
        assert torch.equal(dequantize(loaded.get_submodule(name).packed), ref), name
    import gguf

    fields = gguf.GGUFReader(path).fields  # the placeholder vocabulary: Llama's SentencePiece layout
    tokens, types = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == VOCAB and tokens[:3] == ["<unk>", "<s>", "</s>"] and tokens[13] == "<0x0A>"
    assert types[13] == gguf.TokenType.BYTE and tokens[-1] == "<0xFC>"  # as many byte tokens as fit
    assert fields["tokenizer.ggml.model"].contents() == "llama"


def _qwen(kind: str) -> torch.nn.Module:
    """A tiny Qwen2 (q/k/v biases, made non-zero) or Qwen3 (q/k norms, made non-unit; head size 128)."""
    torch.manual_seed(0)
    common = dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB,
    )  # fmt: skip
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, rope_theta=1e6))
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.data.normal_(0, 0.5)
    else:
        config = transformers.Qwen3Config(**common, head_dim=128, rope_theta=1e6)
        model = transformers.Qwen3ForCausalLM(config)
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.data.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.data.uniform_(0.5, 1.5)
    return model.eval()


@pytest.mark.parametrize("kind,fmt", [("qwen2", "q8_0"), ("qwen2", "q5_0"), ("qwen3", "q4_k")])
def test_other_architectures(tmp_path: Path, kind: str, fmt: str) -> None:
    """Qwen2 and Qwen3 files: q/k rows as stored (no rotary permutation), Qwen2's biases and Qwen3's q/k norms
    as F32 tensors; transformers' own GGUF reader finds the weights load() installs; the loaded model gives
    the packed model's logits, and the one call's kernels run it."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from kernelize.integrations.transformers import kernelize_model
    from kernelize.layer.record import inspect
    from kernelize.quant.formats import dequantize

    model = _qwen(kind)
    quantize_for_kernelize(model, fmt)
    path = tmp_path / f"{kind}.gguf"
    kg.save(model, path)
    loaded = kg.load(path)
    assert type(loaded) is type(model) and kg.ARCHITECTURES[type(model).__name__].gguf == kind
    with torch.device("meta"):
        skeleton = type(model)(loaded.config)
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.k_proj"):
        got = loaded.get_submodule(name)
        assert torch.equal(got.qweight, model.get_submodule(name).qweight), name
        assert torch.equal(dequantize(got.packed), torch.as_tensor(theirs[f"{name}.weight"]).float()), name
        if kind == "qwen2":
            assert torch.equal(got.bias, torch.as_tensor(theirs[f"{name}.bias"]).float()), name
    if kind == "qwen3":
        norm = "model.layers.1.self_attn.k_norm.weight"
        assert torch.equal(loaded.get_parameter(norm), torch.as_tensor(theirs[norm]).float())
    tokenizer = kg.load_tokenizer(path)  # transformers' GGUF conversion of the placeholder vocabulary
    assert len(tokenizer) == VOCAB and tokenizer.convert_ids_to_tokens([1, 13]) == ["<s>", "<0x0A>"]
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
        torch.testing.assert_close(loaded(ids).logits, want, rtol=0, atol=0)
        kernelize_model(loaded)
        assert inspect(loaded)["model.layers.0.self_attn"].uses_kernel
        assert (loaded(ids).logits - want).abs().max() < 0.03 * want.abs().max()  # x rounded to int8 apart


@pytest.mark.parametrize("fmt,down_fmt", [("q8_0", "q8_0"), ("q4_k", "q6_k")])
def test_qwen3_moe_experts_stay_packed(tmp_path: Path, fmt: str, down_fmt: str) -> None:
    """A Qwen3-MoE file (architecture qwen3moe): each layer's router as F32, its experts as llama.cpp's
    stacked ffn_gate_exps / ffn_up_exps / ffn_down_exps (down in another type, as Q4_K_M files mix them); the
    loaded experts are a QuantizedExperts on the file's bytes, transformers' own GGUF reader dequantizes them
    to the same values, and the loaded model gives the packed model's logits, under the one call too."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from kernelize.integrations.transformers import kernelize_model
    from kernelize.quant.experts import QuantizedExperts
    from kernelize.quant.formats import dequantize

    torch.manual_seed(0)
    hidden = 256 if fmt.endswith("_k") else 64
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden,
        num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, norm_topk_prob=True, rope_theta=1e6,
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    for layer in model.model.layers:
        layer.mlp.gate.weight.data.normal_(0, 0.5)  # routing that is no tie between experts
        layer.mlp.experts = QuantizedExperts.from_experts(layer.mlp.experts, fmt, down_fmt)
    quantize_for_kernelize(model, fmt)
    path = tmp_path / "moe.gguf"
    kg.save(model, path)
    loaded = kg.load(path)
    experts = loaded.model.layers[1].mlp.experts
    assert isinstance(experts, QuantizedExperts) and (experts.format, experts.down_format) == (fmt, down_fmt)
    want = model.model.layers[1].mlp.experts
    assert torch.equal(experts.gate_up_qweight, want.gate_up_qweight)
    assert torch.equal(experts.down_qweight, want.down_qweight)
    with torch.device("meta"):
        skeleton = transformers.Qwen3MoeForCausalLM(loaded.config)
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    prefix = "model.layers.1.mlp.experts"
    for name, i in (("gate_up_proj", 0), ("down_proj", 1)):
        ours = torch.stack([dequantize(experts.expert(e)[i]) for e in range(8)])
        assert torch.equal(torch.as_tensor(theirs[f"{prefix}.{name}"]).float(), ours), name
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        packed = model(ids).logits
        torch.testing.assert_close(loaded(ids).logits, packed, rtol=0, atol=0)
        kernelize_model(loaded)
        assert (loaded(ids).logits - packed).abs().max() < 1e-4 * packed.abs().max()
        assert loaded.generate(ids[:, :3], max_new_tokens=4, do_sample=False).shape == (1, 7)


def test_bad_moe_metadata_and_experts_are_named(tmp_path: Path) -> None:
    """A qwen3moe file whose expert metadata is missing or inconsistent, or whose experts' gate and up types
    differ: a GGUFError naming the key or tensors, before any model is built."""
    from dataclasses import replace

    from kernelize.quant.experts import QuantizedExperts

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, norm_topk_prob=True,
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    model.model.layers[0].mlp.experts = QuantizedExperts.from_experts(
        model.model.layers[0].mlp.experts, "q8_0"
    )
    path = tmp_path / "moe.gguf"
    kg.save(model, path)
    meta, infos = kg.scan(path)
    tensors = {t.name: t for t in infos}
    arch = kg.ARCHITECTURES["Qwen3MoeForCausalLM"]
    for key, value, why in (
        ("qwen3moe.expert_count", None, "expert_count = None is not a positive integer"),
        ("qwen3moe.expert_used_count", 9, "expert_used_count is more than qwen3moe.expert_count"),
        ("qwen3moe.expert_feed_forward_length", 0, "expert_feed_forward_length = 0 is not a positive"),
    ):
        with pytest.raises(kg.GGUFError, match=why):
            kg._config(str(path), {**meta, key: value}, tensors, arch)
    config = kg._config(str(path), meta, tensors, arch)
    up = tensors["blk.0.ffn_up_exps.weight"]
    odd = {**tensors, up.name: replace(up, type_name="Q4_0")}
    get = lambda name: torch.zeros(1)  # noqa: E731 (never read: the types are checked first)
    with pytest.raises(
        kg.GGUFError, match="ffn_gate_exps.weight' .Q8_0. and 'blk.0.ffn_up_exps.weight' .Q4_0."
    ):
        kg._experts(get, odd, 0)
    wrong = {**tensors, up.name: replace(up, shape=(4, 32, 64))}
    with pytest.raises(
        kg.GGUFError, match="ffn_up_exps.weight' has shape .4, 32, 64., the config says .4, 64, 64."
    ):
        kg._check_tensors(str(path), config, wrong, arch)


def test_packed_embedding_without_output(saved: dict, tmp_path: Path) -> None:
    """A file whose token embedding is Q8_0 and which has no `output.weight` (llama.cpp's tied head): the
    embedding is dequantized, the head is a QuantizedLinear on the embedding's own bytes."""
    import gguf

    from kernelize.quant.formats import dequantize, quantize

    model, src = saved["q8_0"]
    packed = quantize(model.model.embed_tokens.weight, "q8_0")
    writer = gguf.GGUFWriter(str(tmp_path / "tied.gguf"), "llama")
    kg._add_metadata(writer, gguf, model.config, VOCAB, "q8_0")
    for t in gguf.GGUFReader(src).tensors:
        if t.name == "token_embd.weight":
            writer.add_tensor(t.name, packed.data.numpy(), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif t.name != "output.weight":
            raw = None if t.tensor_type == gguf.GGMLQuantizationType.F32 else t.tensor_type
            writer.add_tensor(t.name, t.data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    loaded = kg.load(tmp_path / "tied.gguf")
    assert torch.equal(loaded.lm_head.qweight, packed.data) and not loaded.config.tie_word_embeddings
    assert torch.equal(loaded.model.embed_tokens.weight, dequantize(packed))
    assert torch.equal(
        loaded.model.layers[1].mlp.down_proj.qweight, model.model.layers[1].mlp.down_proj.qweight
    )
    assert loaded.generate(torch.tensor([[1, 2]]), max_new_tokens=3, do_sample=False).shape == (1, 5)


_RSS_SCRIPT = """
import sys
import gguf, transformers.models.llama.modeling_llama  # imports are not the load's
from kernelize.integrations import gguf as kg

def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))

before = rss()
model = kg.load(sys.argv[1])
print(rss() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="RSS read from /proc")
def test_load_rss(tmp_path: Path) -> None:
    """gguf.load maps the file: the memory it adds stays under 1.2x the file's size (a copy of the weights
    alone would be 1x more)."""
    import os
    import subprocess
    import sys

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=8000,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    quantize_for_kernelize(model, "q8_0")
    path = tmp_path / "rss.gguf"
    kg.save(model, path)
    del model
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(path)], capture_output=True, text=True, env=env, check=True
    )
    added, size = int(done.stdout.split()[-1]), path.stat().st_size
    assert added <= 1.2 * size, f"load added {added / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB file"


def test_save_refuses() -> None:
    with pytest.raises(ValueError, match="supported architectures: LlamaForCausalLM"):
        kg.save(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)), "x")
    with pytest.raises(ValueError, match="fmt must be one of"):
        kg.save(_llama(64), "x", fmt="int8")
    with pytest.raises(ValueError, match=r"shape \(64, 64\).*q4_k's block of 256"):
        kg.save(_llama(64), "x", fmt="q4_k")


def test_permute_inverse() -> None:
    w = torch.arange(4 * 16 * 3).reshape(64, 3)
    assert torch.equal(kg.unpermute_rows(kg.permute_rows(w, 4), 4), w)


# ---- bad files ---------------------------------------------------------------------------------------------
def _info_offset(buf: bytes, name: str) -> int:
    """The offset of tensor `name`'s dimension count in the header."""
    raw = name.encode()
    at = buf.index(struct.pack("<Q", len(raw)) + raw)
    return at + 8 + len(raw)


def _patched(src: Path, dst: Path, name: str, field: str, value: int) -> Path:
    buf = bytearray(src.read_bytes())
    at = _info_offset(bytes(buf), name)
    n_dims = struct.unpack_from("<I", buf, at)[0]
    pos = {"dim1": at + 4 + 8, "type": at + 4 + 8 * n_dims, "offset": at + 4 + 8 * n_dims + 4}[field]
    struct.pack_into("<Q" if field != "type" else "<I", buf, pos, value)
    dst.write_bytes(bytes(buf))
    return dst


def _raw(dst: Path, body: bytes, n_tensors: int = 0, n_kv: int = 1) -> Path:
    dst.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + body)
    return dst


def _key(key: str) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode()


def _bad_files(good: Path, tmp: Path) -> dict[str, tuple[Path, str]]:
    data = good.read_bytes()
    (tmp / "truncated_header.gguf").write_bytes(data[:200])
    (tmp / "truncated_tokens.gguf").write_bytes(data[:2000])
    (tmp / "truncated_data.gguf").write_bytes(data[:-100])
    (tmp / "magic.gguf").write_bytes(b"GGML" + data[4:])
    (tmp / "empty.gguf").write_bytes(b"")
    return {
        "truncated header": (tmp / "truncated_header.gguf", "truncated file or bad counts"),
        "truncated tokens": (
            tmp / "truncated_tokens.gguf",
            "truncated file or metadata bomb: metadata 'tokenizer.ggml.tokens'",
        ),
        "truncated data": (tmp / "truncated_data.gguf", "'output.weight': data at .* lies outside the file"),
        "bad magic": (tmp / "magic.gguf", "not a GGUF file: its first bytes are b'GGML'"),
        "empty": (tmp / "empty.gguf", "truncated file: empty"),
        "unknown type": (
            _patched(good, tmp / "type.gguf", "blk.0.attn_v.weight", "type", 999),
            "tensor 'blk.0.attn_v.weight': unknown ggml type 999",
        ),
        "unsupported type": (
            _patched(good, tmp / "q4_1.gguf", "blk.1.ffn_up.weight", "type", 3),
            "tensor 'blk.1.ffn_up.weight' is Q4_1, which is not supported here; supported: Q8_0, Q4_0",
        ),
        "offset outside": (
            _patched(good, tmp / "offset.gguf", "blk.0.ffn_down.weight", "offset", 1 << 40),
            "tensor 'blk.0.ffn_down.weight': data at .* lies outside the file",
        ),
        "shape vs config": (
            _patched(good, tmp / "shape.gguf", "blk.0.ffn_up.weight", "dim1", 64),
            r"tensor 'blk.0.ffn_up.weight' has shape \[64, 128\], the config says \[256, 128\]",
        ),
        "array bomb": (
            _raw(tmp / "array.gguf", _key("x") + struct.pack("<IIQ", 9, 0, 1 << 60)),
            "truncated file: metadata 'x'",
        ),
        "string array bomb": (
            _raw(tmp / "strings.gguf", _key("tokens") + struct.pack("<IIQ", 9, 8, 1 << 40) + b"\0" * 64),
            "metadata 'tokens': an array of 1099511627776 elements declared",
        ),
        "string bomb": (
            _raw(tmp / "string.gguf", _key("name") + struct.pack("<IQ", 8, 1 << 62) + b"abc"),
            "metadata 'name': a string of 4611686018427387904 bytes declared",
        ),
        "count bomb": (_raw(tmp / "count.gguf", b"", n_tensors=1 << 50), "1125899906842624 tensors declared"),
        "layer count bomb": (
            _raw(
                tmp / "layers.gguf",
                _key("general.architecture")
                + struct.pack("<IQ", 8, 5)
                + b"llama"
                + b"".join(
                    _key(f"llama.{k}") + struct.pack("<II", 4, v)
                    for k, v in (
                        ("embedding_length", 64),
                        ("block_count", 10**9),
                        ("feed_forward_length", 64),
                        ("attention.head_count", 4),
                    )
                ),
                n_kv=5,
            ),
            "llama.block_count = 1000000000, but the file has only 0 tensors",
        ),
        "not llama": (
            _raw(tmp / "arch.gguf", _key("general.architecture") + struct.pack("<IQ", 8, 4) + b"gpt2"),
            r"general.architecture is 'gpt2'; supported: 'llama' \(LlamaForCausalLM\), 'qwen2'",
        ),
    }


def test_bad_files(saved: dict, tmp_path: Path) -> None:
    for case, (path, message) in _bad_files(saved["q8_0"][1], tmp_path).items():
        with pytest.raises(kg.GGUFError, match=message) as err:
            kg.load(path)
        assert str(path) in str(err.value), case
