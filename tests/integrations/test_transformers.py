"""`kernelize_model` on real transformers models (tiny configs built in code, random weights, no download).

Every family is compared with its own eager model (`attn_implementation="eager"`): logits on the real
(non-pad) positions of a left-padded batch within 1e-4 (f32), greedy and seeded-sampling `generate()`
tokens identical.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pytest
import torch

import kernelize
from kernelize import model_attention
from kernelize.integrations.transformers import kernelize_model

transformers = pytest.importorskip("transformers")

HAS_KERNEL = model_attention.attention_kernel() is not None
needs_kernel = pytest.mark.skipif(
    not HAS_KERNEL, reason="kernelize.attention (the attention kernel) is absent"
)

FAMILIES = {  # family -> (config class, model class, norm layer, MLP layer)
    "llama": ("LlamaConfig", "LlamaForCausalLM", "RMSNorm", "GatedMLP"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "RMSNorm", "GatedMLP"),
    "mistral": ("MistralConfig", "MistralForCausalLM", "RMSNorm", "GatedMLP"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", "GemmaRMSNorm", "GatedMLP"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "RMSNorm", "FusedGatedMLP"),
}
TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    pad_token_id=0,
)
SelfMixer = type("SelfMixer", (transformers.models.llama.modeling_llama.LlamaAttention,), {})
# the attention recogniser reads the rotary function from the module that defines the class: here
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402, F401

MARK_ATTRS = ("kernel_layer_name", "kernel_condition", "_kernelize_class_recognition")


def tiny_model(family: str = "llama", config_name: str | None = None, model_name: str | None = None, **extra):
    """An eager f32 model of `family` with non-trivial norm weights (Gemma's stored as offsets from 1)."""
    cfg_cls, model_cls = (config_name, model_name) if config_name else FAMILIES[family][:2]
    torch.manual_seed(0)
    config = getattr(transformers, cfg_cls)(**{**TINY, **extra})
    config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config).eval()
    for name, p in model.named_parameters():
        if "norm" in name:
            torch.nn.init.normal_(p, 0.5 if "gemma" in cfg_cls.lower() else 1.0, 0.2)
    return model


@contextlib.contextmanager
def restoring_marks(model: torch.nn.Module) -> Iterator[None]:
    """kernelize_model marks classes (process-wide): put every touched class back as it was."""
    classes = {type(m) for m in model.modules()}
    saved = {cls: {k: cls.__dict__[k] for k in MARK_ATTRS if k in cls.__dict__} for cls in classes}
    try:
        yield
    finally:
        for cls, attrs in saved.items():
            for k in MARK_ATTRS:
                if k in attrs:
                    setattr(cls, k, attrs[k])
                elif k in cls.__dict__:
                    delattr(cls, k)


@contextlib.contextmanager
def kernelized(model: torch.nn.Module, **kwargs) -> Iterator[torch.nn.Module]:
    """A kernelized deep copy of `model` (the original stays the eager reference)."""
    fast = copy.deepcopy(model)
    with restoring_marks(fast):
        yield kernelize_model(fast, **kwargs)


def graphs_run(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, monkeypatch) -> list[str]:
    """The names of the graph functions one forward of `model` runs through `hub.run`, in order."""
    from kernelize import hub

    names, run = [], hub.run

    def counting(owner, fn, *args, **kwargs):
        names.append(fn.__name__)
        return run(owner, fn, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(hub, "run", counting)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    return names


def padded_batch(batch: int = 2, seq: int = 11, pad: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask: the first row starts with `pad` pad tokens."""
    ids = torch.randint(1, TINY["vocab_size"], (batch, seq))
    mask = torch.ones_like(ids)
    ids[0, :pad], mask[0, :pad] = 0, 0
    return ids, mask


def assert_same_logits_and_tokens(eager, fast, ids, mask, new_tokens: int = 5) -> None:
    with torch.no_grad():
        want, got = eager(ids, attention_mask=mask).logits, fast(ids, attention_mask=mask).logits
        real = mask.bool()
        torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)
        kw = dict(attention_mask=mask, max_new_tokens=new_tokens, pad_token_id=0)
        assert torch.equal(
            fast.generate(ids, do_sample=False, **kw), eager.generate(ids, do_sample=False, **kw)
        )


def layers_used(model) -> dict[str, str]:
    return {path: c.layer_name for path, c in kernelize.inspect(model).items() if c.uses_kernel}


@pytest.fixture
def kernel_calls(monkeypatch) -> list[tuple]:
    """Shapes of every call that reached the attention kernel (the real kernel runs each call)."""
    calls: list[tuple] = []
    found = model_attention.attention_kernel()
    if found is not None:
        sdpa, unsupported = found

        def counted(query, key, *args, **kwargs):
            calls.append((tuple(query.shape), tuple(key.shape)))
            return sdpa(query, key, *args, **kwargs)

        monkeypatch.setattr(model_attention, "attention_kernel", lambda: (counted, unsupported))
    return calls


@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_call_replaces_norms_mlp_and_attention(family: str, kernel_calls: list[tuple]) -> None:
    eager = tiny_model(family)
    ids, mask = padded_batch()
    with kernelized(eager) as fast:
        kernel_calls.clear()  # the one call's own probe (8 tokens) ran the kernel too
        used = layers_used(fast)
        _, _, norm, mlp = FAMILIES[family]
        assert used["model.layers.0.input_layernorm"] == norm
        assert used["model.norm"] == norm
        assert used["model.layers.1.mlp"] == mlp
        # the head alone is marked (its class becomes an nn.Linear subclass); parameters and keys unchanged
        assert used["lm_head"] == "Linear" and isinstance(fast.lm_head, torch.nn.Linear)
        assert (
            type(eager.lm_head) is torch.nn.Linear and fast.state_dict().keys() == eager.state_dict().keys()
        )
        attention = kernelize.inspect(fast)["model.layers.0.self_attn"]
        if HAS_KERNEL:
            assert attention.layer_name == "CausalSelfAttention" and attention.uses_kernel, str(attention)
            assert fast.config._attn_implementation == "kernelize"
        else:
            assert not attention.uses_kernel and attention.reason == model_attention.KERNEL_UNAVAILABLE
        assert_same_logits_and_tokens(eager, fast, ids, mask)
        ran = kernelize.inspect(fast)["model.layers.0.self_attn"]
        assert not any(note.startswith("eager attention") for note in ran.notes), str(ran)
        if HAS_KERNEL:  # rotary kernels recorded; prefill (11 queries) and decode (1 query) hit the kernel
            assert ran.backend == "cpu" and ran.kernels, str(ran)
            assert {q[2] for q, _ in kernel_calls} == {1, 11}, kernel_calls


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "phi3"])
def test_decoder_layers_run_as_three_kernel_graphs(family: str, monkeypatch) -> None:
    """In inference each decoder layer makes three compiled-graph calls (input norm + q|k|v + rotary;
    o_proj + residual + norm; the MLP + residual) around the attention kernel, with eager's results."""
    from kernelize import hub

    eager = tiny_model(family)
    ids, mask = padded_batch()
    calls: list[str] = []
    real = hub.run

    def counted(owner, fn, *args, **kwargs):
        calls.append(fn.__name__)
        return real(owner, fn, *args, **kwargs)

    with kernelized(eager) as fast:
        monkeypatch.setattr(hub, "run", counted)
        assert_same_logits_and_tokens(eager, fast, ids, mask, new_tokens=2)
        assert_same_logits_and_tokens(eager, fast, ids[1:], mask[1:], new_tokens=3)  # batch 1
        calls.clear()
        with torch.no_grad():
            fast(ids[:, :1])  # one token: two layers, then the final norm and the LM head
        norm = "gemma_rms_norm_math" if family == "gemma" else "rms_norm_math"
        want = ["pre_attention_math", "post_attention_math", "mlp_math"] * 2 + [norm, "linear_nobias_math"]
        assert calls == want, calls
        layer = kernelize.inspect(fast)["model.layers.1"]
        assert layer.kernels and not layer.notes, str(layer)
        assert "mlp_math" in hub.kernels_ran(fast.model.layers[1].mlp).signature


@needs_kernel
def test_prompt_longer_than_a_key_block_and_seeded_sampling() -> None:
    eager = tiny_model("llama")
    ids, mask = padded_batch(batch=2, seq=150, pad=20)
    with kernelized(eager) as fast:
        assert_same_logits_and_tokens(eager, fast, ids, mask, new_tokens=3)
        kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=True, top_k=20, pad_token_id=0)
        with torch.no_grad():
            torch.manual_seed(7)
            want = eager.generate(ids, **kw)
            torch.manual_seed(7)
            got = fast.generate(ids, **kw)
        assert torch.equal(got, want)


HIDDEN = 32


class OffsetNorm(torch.nn.Module):
    """Gemma's norm under another name: `(1 + w) * rmsnorm(x)`."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(HIDDEN) * 0.2)
        self.eps = 1e-6

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)).to(
            x.dtype
        )


class Feedforward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(HIDDEN, 48), torch.nn.Linear(HIDDEN, 48)
        self.down_proj, self.hidden_act = torch.nn.Linear(48, HIDDEN), "silu"

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Renamed(torch.nn.Module):
    """A decoder block whose classes carry none of the transformers names."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.models.llama import modeling_llama

        config = transformers.LlamaConfig(**{**TINY, "hidden_size": HIDDEN, "head_dim": 8})
        config._attn_implementation = "sdpa"  # without a mask, sdpa is causal (eager attention would not be)
        self.norm, self.mlp = OffsetNorm(), Feedforward()
        self.attn = SelfMixer(config, layer_idx=0)
        self.rope = modeling_llama.LlamaRotaryEmbedding(config)

    def forward(self, x):
        h = self.norm(x)
        positions = torch.arange(x.shape[1])[None]
        out, _ = self.attn(h, position_embeddings=self.rope(h, positions), attention_mask=None)
        return self.mlp(x + out)


def test_structure_not_class_names_decides() -> None:
    """Renamed classes (a norm with Gemma's `1 + w`, a Llama-style attention) are recognised by probes."""
    eager = Renamed().eval()
    with kernelized(eager) as fast:
        choices = kernelize.inspect(fast)
        assert choices["norm"].layer_name == "GemmaRMSNorm" and choices["norm"].uses_kernel
        assert choices["mlp"].layer_name == "GatedMLP" and choices["mlp"].uses_kernel
        attention = choices["attn"]
        assert attention.uses_kernel == HAS_KERNEL, str(attention)
        x = torch.randn(2, 5, HIDDEN)
        with torch.no_grad():
            torch.testing.assert_close(fast(x), eager(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", [kernelize.Mode.INFERENCE, kernelize.Mode.TRAINING])
def test_a_later_instance_of_a_marked_class_gets_the_decision_and_its_attributes(mode) -> None:
    """kernelize_model marks classes process-wide; a model of the same classes it never saw, kernelized
    later with a plain `kernelize`, runs the same layers (the decoder layer reads its norm style)."""
    eager = tiny_model("llama")
    with kernelized(eager, mode=mode):
        other = copy.deepcopy(eager)
        with kernelize.use_kernel_mapping(kernelize.hub.default_mapping()):
            kernelize.kernelize(other, device="cpu", mode=mode)
        assert layers_used(other)["model.layers.0"] == "PreNormDecoderLayer"
        ids = torch.randint(1, TINY["vocab_size"], (2, 7))
        with torch.set_grad_enabled(mode == kernelize.Mode.TRAINING):
            torch.testing.assert_close(other(ids).logits, eager(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
def test_training_with_labels_uses_the_fused_loss_without_logits(family: str) -> None:
    eager = tiny_model(family).train()
    ids = torch.randint(1, TINY["vocab_size"], (2, 9))
    labels = ids.clone()
    labels[0, :4] = -100
    with kernelized(eager, mode=kernelize.Mode.TRAINING) as fast:
        assert layers_used(fast)[""] == "CausalLMWithLoss"
        for kw in ({}, {"num_items_in_batch": torch.tensor(11)}):
            want, got = eager(input_ids=ids, labels=labels, **kw), fast(input_ids=ids, labels=labels, **kw)
            assert got.logits is None  # never materialised
            torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
            eager.zero_grad(), fast.zero_grad()
            want.loss.backward(), got.loss.backward()
            for (name, p), q in zip(eager.named_parameters(), fast.parameters(), strict=True):
                torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
        fast.eval()  # evaluation keeps the logits (and the loss)
        with torch.no_grad():
            out = fast(input_ids=ids, labels=labels)
        assert out.logits.shape == (2, 9, TINY["vocab_size"])


def test_the_fused_loss_step_trains_the_projections_through_onednn() -> None:
    """With labels, the attention and MLP projections train through `kernelize.hub.project` (forward and
    input gradient in oneDNN), the token embedding through `kernelize.hub.train_embedding`; gradients equal
    eager's."""
    eager = tiny_model("llama").train()
    ids = torch.randint(1, TINY["vocab_size"], (2, 9))
    with kernelized(eager, mode=kernelize.Mode.TRAINING) as fast:
        want, got = eager(input_ids=ids, labels=ids), fast(input_ids=ids, labels=ids)
        assert {"_LinearBackward", "_EmbeddingBackward"} <= _autograd_nodes(got.loss)
        assert type(fast.model.embed_tokens).__name__ == "TokenEmbedding"
        assert layers_used(fast)["model.embed_tokens"] == "Embedding"
        want.loss.backward(), got.loss.backward()
        for (name, p), q in zip(eager.named_parameters(), fast.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)


def _autograd_nodes(t: torch.Tensor) -> set[str]:
    """The names of the autograd nodes `t` was computed through."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions)
    return {n.name() for n in seen}


def test_a_causal_lm_with_another_loss_is_left_eager_with_the_reason() -> None:
    eager = tiny_model("llama")
    eager.loss_function = lambda logits, labels, **kw: logits.mean()
    with kernelized(eager, mode=kernelize.Mode.TRAINING) as fast:
        choice = kernelize.inspect(fast)[""]
        assert not choice.uses_kernel and "not ForCausalLMLoss" in choice.reason, str(choice)


def test_a_cache_passed_by_its_old_keyword_reaches_the_model() -> None:
    """`past_key_values=` (the name before transformers 5.24, still accepted) goes through the causal LM
    layer as a keyword, never as a second value of its positional `cache` parameter."""
    eager = tiny_model("llama")
    ids = torch.randint(1, TINY["vocab_size"], (2, 9))
    with kernelized(eager) as fast, torch.no_grad():
        logits = []
        for model in (eager, fast):
            cache = transformers.DynamicCache(config=model.config)
            model(ids[:, :8], past_key_values=cache, use_cache=True)
            logits.append(model(ids[:, 8:], past_key_values=cache, use_cache=True).logits)
        torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


@needs_kernel
@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
             original_max_position_embeddings=16),
        dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16),
        dict(rope_type="linear", rope_theta=1e4, factor=2.0),
    ],
    ids=lambda rope: rope["rope_type"],
)  # fmt: skip
def test_scaled_rotary_tables_from_the_model_feed_the_kernel(rope: dict) -> None:
    """YaRN, llama3 and linear scaling: the model computes cos / sin, the rotary kernel consumes them."""
    eager = tiny_model("llama", rope_parameters=rope)
    ids, mask = padded_batch(seq=40)  # past original_max_position_embeddings, where the scalings differ
    with kernelized(eager) as fast:
        assert kernelize.inspect(fast)["model.layers.0.self_attn"].uses_kernel
        assert_same_logits_and_tokens(eager, fast, ids, mask)


def test_the_mlp_activation_is_the_closest_one_not_the_first_close_one() -> None:
    """GPT-2's MLP module has no config: erf GELU, first in the table, is within the probe's tolerance of
    its gelu_new; the layer takes gelu_new and the model keeps the kernel (it was withdrawn by 1e-4)."""
    from kernelize.models import zoo

    eager = zoo.tiny_causal_lm("gpt2")
    with kernelized(eager) as fast:
        mlp = fast.transformer.h[0].mlp
        assert mlp.kernelize_dense_mlp[2] in ("gelu_new", "gelu_pytorch_tanh")
        assert kernelize.inspect(fast)["transformer.h.0.mlp"].uses_kernel
