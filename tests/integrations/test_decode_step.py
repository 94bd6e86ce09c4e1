"""The replayed decode step (hub_kernels/llm/.../decode_step.py): a decoder layer's decode token as one C
call, bit for bit the block's Python path, rebuilt when a weight or the cache buffer changes."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from kernelize.integrations.transformers import kernelize_model
from kernelize.runtime.replay import Program

transformers = pytest.importorskip("transformers")


def _llama(dtype: torch.dtype, quantize: str | None) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval().to(dtype)
    kernelize_model(model, quantize=quantize)
    return model


def _decode_step_module():
    (mod,) = {
        m for name, m in sys.modules.items() if name.endswith(".decode_step") and hasattr(m, "replayed")
    }
    return mod


def _record_runs(monkeypatch) -> list[tuple[str, ...]]:
    """From here on, the slots of every program run (a layer's has `key`; the model's chain of every layer's
    programs has `key0`, `key1`, ...)."""
    runs = []
    run_values = Program.run_values

    def spy(self, values):
        runs.append(self.slots)
        return run_values(self, values)

    monkeypatch.setattr(Program, "run_values", spy)
    return runs


def _layer_steps(runs: list[tuple[str, ...]], layers: int) -> int:
    """How many layer steps the recorded runs replayed (a chain's run: every layer's)."""
    return sum(layers if "key0" in slots else 1 for slots in runs if "key" in slots or "key0" in slots)


def _generate(model: nn.Module, new: int = 70):
    """70 new tokens: past the first cache buffer's room (64 positions), so the program is built again."""
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize(
    "dtype, quantize",
    [(torch.bfloat16, "q4_0"), (torch.float32, "q8_0"), (torch.bfloat16, None), (torch.float32, None)],
)
def test_replayed_decode_steps_equal_the_python_path(monkeypatch, dtype, quantize):
    model = _llama(dtype, quantize)
    step = _decode_step_module()
    runs = _record_runs(monkeypatch)
    tokens, logits = _generate(model)
    layers = model.model.layers
    assert _layer_steps(runs, 2) >= 2 * 60  # two layers, nearly every decode step replayed
    assert all(type(layer.__dict__["_kernelize_decode_step"][1]) is step._Step for layer in layers)
    monkeypatch.setattr(step, "ENABLED", False)
    runs.clear()
    want_tokens, want_logits = _generate(model)
    assert not runs
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


def test_packed_projections_with_query_key_norms_replay(monkeypatch):
    """Qwen3's per-head query / key norms in the packed block (the rotary graph norms them): the layers
    replay, bit for bit the Python path."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256,
    )  # fmt: skip
    model = transformers.Qwen3ForCausalLM(config).eval()
    kernelize_model(model, quantize="q4_0")
    runs = _record_runs(monkeypatch)
    tokens, logits = _generate(model, 12)
    assert _layer_steps(runs, 2) >= 2 * 10
    monkeypatch.setattr(_decode_step_module(), "ENABLED", False)
    want_tokens, want_logits = _generate(model, 12)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


def test_a_replaced_weight_builds_the_program_again(monkeypatch):
    model = _llama(torch.bfloat16, None)
    _generate(model, 4)
    down = model.model.layers[1].mlp.down_proj
    down.weight = nn.Parameter(down.weight.detach() * 2)  # a new tensor: the old program read the old one
    tokens, logits = _generate(model, 8)
    monkeypatch.setattr(_decode_step_module(), "ENABLED", False)
    want_tokens, want_logits = _generate(model, 8)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


def test_a_layer_whose_graphs_are_not_all_c_calls_keeps_why(monkeypatch):
    """A graph with a step that is not a C call (as a library GEMM past the few-row kernel's rows is): no
    program, the Python path runs, the reason kept on the layer (not an `inspect` note: the same kernels
    run, with Python between them)."""
    from kernelize.runtime.compiled import CompiledGraph

    model = _llama(torch.bfloat16, None)
    want_tokens, want_logits = _generate(model, 4)
    for layer in model.model.layers:
        layer.__dict__.pop("_kernelize_decode_step")
    monkeypatch.setattr(CompiledGraph, "fixed_call", lambda self, inputs, varying: None)
    runs = _record_runs(monkeypatch)
    tokens, logits = _generate(model, 4)
    assert not runs and torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)
    reason = model.model.layers[0].__dict__["_kernelize_decode_step"][1]
    assert isinstance(reason, str) and "pre_attention_math" in reason


@pytest.mark.parametrize("quantize", [None, "q8_0"])
def test_an_moe_layer_replays_with_its_router_and_experts(monkeypatch, quantize):
    """Qwen3-MoE: each layer's program runs the router graph and the experts kernel too (a probe showed
    they are all the sparse block computes; packed: the packed q|k|v with the query / key norms, and the
    packed experts' kernel); tokens and logits equal the Python path's. A hook on the experts sends the
    steps the Python way, which calls it."""
    from kernelize.models import zoo
    from kernelize.quant.experts import QuantizedExperts

    torch.manual_seed(0)
    model = zoo.tiny_causal_lm("qwen3_moe").to(torch.bfloat16)
    kernelize_model(model, quantize=quantize)
    assert isinstance(model.model.layers[0].mlp.experts, QuantizedExperts) == (quantize is not None)
    runs = _record_runs(monkeypatch)
    tokens, logits = _generate(model, 12)
    steps = [layer.__dict__.get("_kernelize_decode_step", (None, None))[1] for layer in model.model.layers]
    assert runs and all(s.moe and s.outputs == 1 for s in steps), steps  # router and experts in the program
    assert model.__dict__["_kernelize_model_step"].verdict is True  # `MoECausalLM`: the layers back to back
    with torch.inference_mode():  # the path's output is the model's own type
        cache = transformers.DynamicCache(config=model.config)
        ids = torch.tensor([[1, 2, 3]])
        for _ in range(3):
            out = model(ids, cache=cache, use_cache=True)
            ids = out.logits[:, -1:].argmax(-1)
    assert type(out).__name__ == "MoeCausalLMOutputWithPast" and out.cache is cache
    monkeypatch.setattr(_decode_step_module(), "ENABLED", False)
    want_tokens, want_logits = _generate(model, 12)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)
    monkeypatch.setattr(_decode_step_module(), "ENABLED", True)
    calls = []
    model.model.layers[0].mlp.experts.register_forward_hook(lambda *a: calls.append(1))
    runs.clear()
    hooked_tokens, _ = _generate(model, 12)
    assert calls and torch.equal(hooked_tokens, want_tokens)


def test_a_program_does_not_keep_a_finished_generations_cache():
    """The programs hold their own buffers and the weights, never the cache's (a generation's cache is
    freed with it)."""
    model = _llama(torch.bfloat16, "q8_0")
    cache = transformers.DynamicCache()
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        out = model(ids, past_key_values=cache, use_cache=True)
        for _ in range(3):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    assert (
        model.__dict__["_kernelize_model_step"].verdict is True
    )  # `past_key_values=` takes the model's step too
    for layer, cached in zip(model.model.layers, cache.layers, strict=True):
        step = layer.__dict__["_kernelize_decode_step"][1]
        held = {t.untyped_storage().data_ptr() for t in step.program._held if isinstance(t, torch.Tensor)}
        assert held and not held & {b.untyped_storage().data_ptr() for b in cached._kernelize_room[:2]}


def test_a_sliding_window_replays_while_the_keys_fit_in_it(monkeypatch):
    """While the keys fit in the window it cuts nothing and the program's attention is the Python path's;
    past it, steps go the Python way (which applies the window). Tokens and logits equal throughout."""
    model = _llama(torch.bfloat16, "q8_0")
    for layer in model.model.layers:
        layer.self_attn.sliding_window = 16  # what sliding_window_of reads, as the model's forward passes it
    runs = _record_runs(monkeypatch)
    tokens, logits = _generate(model, 24)
    layer_runs = _layer_steps(runs, 2)  # the layers' programs (the LM head's takes no cache row)
    # 5 prompt positions: decode steps with up to 16 keys replay (the first one builds the cache's room; the
    # step that checks the model's path runs them twice)
    assert 2 * 8 <= layer_runs <= 2 * 12, layer_runs
    monkeypatch.setattr(_decode_step_module(), "ENABLED", False)
    want_tokens, want_logits = _generate(model, 24)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


def test_a_program_busy_in_another_call_sends_the_step_the_python_way(monkeypatch):
    model = _llama(torch.bfloat16, "q4_0")
    want_tokens, want_logits = _generate(model, 6)
    step_module = _decode_step_module()
    build = step_module._build

    def busy(*args):  # every program built as if another thread were running it
        step = build(*args)
        if not isinstance(step, str):
            step.lock.acquire()
        return step

    monkeypatch.setattr(step_module, "_build", busy)
    for layer in model.model.layers:
        layer.__dict__.pop("_kernelize_decode_step")
    runs = _record_runs(monkeypatch)
    tokens, logits = _generate(model, 6)
    assert not runs and torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)
    assert all(layer.__dict__["_kernelize_decode_step"][1].lock.locked() for layer in model.model.layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt2_layers_replay_their_three_graphs(monkeypatch, dtype):
    """GPT-2's decoder layer (`FusedQKVDecoderLayer`: [ln_1] -> c_attn, the cache row and attention,
    c_proj + residual -> ln_2, the MLP + residual) as one call per decode step: tokens and logits equal
    the Python path's, across a cache reallocation."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128)
    model = transformers.GPT2LMHeadModel(config).eval().to(dtype)
    kernelize_model(model)
    runs = _record_runs(monkeypatch)
    tokens, logits = _generate(model)
    assert _layer_steps(runs, 2) >= 2 * 60
    monkeypatch.setattr(_decode_step_module(), "ENABLED", False)
    want_tokens, want_logits = _generate(model)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


# ---- the model's whole decode step (decode_model.py) --------------------------------------------------
def _decode_model_module():
    (mod,) = {m for name, m in sys.modules.items() if name.endswith(".decode_model")}
    return mod


def _count_layer_calls(monkeypatch, model: nn.Module) -> list[int]:
    """Per layer, how many times its (kernelized) forward runs from here on."""
    (layers_module,) = {
        m for name, m in sys.modules.items() if name.endswith(".layers") and hasattr(m, "decoder_forward")
    }
    index = {id(layer): i for i, layer in enumerate(model.model.layers)}
    calls = [0] * len(index)
    forward = layers_module.decoder_forward

    def counted(layer, *args):
        calls[index[id(layer)]] += 1
        return forward(layer, *args)

    monkeypatch.setattr(layers_module, "decoder_forward", counted)
    return calls


@pytest.mark.parametrize("dtype, quantize", [(torch.bfloat16, "q4_0"), (torch.float32, None)])
def test_the_model_step_runs_decode_tokens_without_the_layers_forwards(monkeypatch, dtype, quantize):
    """After one checked step, a decode token calls no layer's forward (each layer's program runs from the
    model's step); tokens and logits equal the layers' Python path's, across a cache reallocation."""
    model = _llama(dtype, quantize)
    calls = _count_layer_calls(monkeypatch, model)
    tokens, logits = _generate(model)
    assert model.__dict__["_kernelize_model_step"].verdict is True
    tail = model.lm_head.__dict__["_kernelize_decode_tail"]  # norm -> packed head: one call
    assert isinstance(tail, _decode_model_module()._Tail) if quantize else isinstance(tail, str)
    # the prompt, the first decode step (no cache room yet), the checked step, the reallocation's step
    assert max(calls) <= 5, calls
    monkeypatch.setattr(_decode_step_module(), "ENABLED", False)
    want_tokens, want_logits = _generate(model)
    assert max(calls) >= 70
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


def test_a_base_model_that_computes_more_keeps_its_own_decode_step(monkeypatch):
    """The check compares the logits of the model's own step with the path's: a base model that scales its
    embeddings (as Gemma's does) differs, keeps its own forward, and says why in `inspect`."""

    class Scaled(transformers.LlamaModel):
        def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
            return super().forward(inputs_embeds=self.embed_tokens(input_ids) * 2, **kwargs)

    model = _llama(torch.float32, None)
    model.model.__class__ = Scaled
    calls = _count_layer_calls(monkeypatch, model)
    tokens, logits = _generate(model, 8)
    verdict = model.__dict__["_kernelize_model_step"].verdict
    assert verdict == _decode_model_module()._DIFFERS and min(calls) >= 8
    assert any("decode steps run the model's own forward" in n for n in model._kernelize_choice.notes)
    monkeypatch.setattr(_decode_step_module(), "ENABLED", False)
    want_tokens, want_logits = _generate(model, 8)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


def test_hooks_and_padding_send_decode_steps_through_the_model(monkeypatch):
    """A forward hook on a layer sees every step (the model's own forward runs them), one on the LM head
    too (the path calls the head's module); a padded prompt's mask goes the model's own way."""
    model = _llama(torch.bfloat16, "q8_0")
    _generate(model, 4)  # the path checked, without hooks
    seen = []
    handle = model.lm_head.register_forward_hook(lambda *args: seen.append(1))
    calls = _count_layer_calls(monkeypatch, model)
    _generate(model, 8)
    assert len(seen) == 8 and max(calls) < 8  # the layers' programs ran from the model's step
    handle.remove()
    seen.clear()
    handle = model.model.layers[1].register_forward_hook(lambda *args: seen.append(1))
    _generate(model, 8)
    assert len(seen) == 8
    handle.remove()
    monkeypatch.undo()
    calls = _count_layer_calls(monkeypatch, model)
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[0, 1, 1, 1, 1]])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert min(calls) == 6
    monkeypatch.setattr(_decode_step_module(), "ENABLED", False)
    with torch.inference_mode():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, want)


def test_a_window_of_zero_cuts_nothing_and_replays(monkeypatch):
    """Qwen2-MoE's attention has no `sliding_window` and its config says 0 on full-attention layers: no
    window, as the attention reads it; its layers replay (the shared expert runs its own forward after)."""
    from kernelize.models import zoo

    torch.manual_seed(0)
    model = zoo.tiny_causal_lm("qwen2_moe")
    kernelize_model(model)
    tokens, logits = _generate(model, 8)
    steps = [layer.__dict__["_kernelize_decode_step"][1] for layer in model.model.layers]
    assert all(s.window is None and s.outputs == 2 for s in steps)
    assert model.__dict__["_kernelize_model_step"].verdict is True
    monkeypatch.setattr(_decode_step_module(), "ENABLED", False)
    want_tokens, want_logits = _generate(model, 8)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


def test_a_path_that_raises_on_the_checked_step_keeps_the_models_forward(monkeypatch):
    """OLMo3's rotary takes the layer type, which the path does not pass: the checked step's error rolls
    the cache back, the model's own forward runs that step and every later one, and `inspect` says why."""
    from kernelize.models import zoo

    torch.manual_seed(0)
    model = zoo.tiny_causal_lm("olmo3")
    kernelize_model(model)
    tokens, logits = _generate(model, 6)
    verdict = model.__dict__["_kernelize_model_step"].verdict
    assert isinstance(verdict, str) and verdict.startswith("the path raised TypeError")
    monkeypatch.setattr(_decode_step_module(), "ENABLED", False)
    want_tokens, want_logits = _generate(model, 6)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


def test_a_layer_given_another_forward_takes_the_model_off_the_path():
    """After the path is checked, a layer whose forward is replaced (here: a counting wrapper of its class's
    own forward) runs at every step: the model's forward runs them."""
    model = _llama(torch.float32, None)
    _generate(model, 4)
    assert model.__dict__["_kernelize_model_step"].verdict is True
    layer = model.model.layers[1]
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return type(layer).forward(layer, *args, **kwargs)

    layer.forward = counted
    _generate(model, 6)
    assert len(calls) == 6  # the prompt and five decode steps
    assert "kernelize's decoder layer" in model.__dict__["_kernelize_model_step"].verdict


def test_every_layer_runs_in_one_call_and_a_new_or_grown_cache_builds_nothing(monkeypatch):
    """After the checked step, a decode token is one call of every layer's program and the head's (the
    chain); a second generation (a new cache) and the cache's move to larger buffers past 64 positions
    build no program again, and the tokens and logits equal the layers' Python path's."""
    model = _llama(torch.bfloat16, "q4_0")
    _generate(model, 4)
    builds = []
    step_module = _decode_step_module()
    build = step_module._build
    monkeypatch.setattr(step_module, "_build", lambda *args: (builds.append(1), build(*args))[1])
    runs = _record_runs(monkeypatch)
    tokens, logits = _generate(model)
    assert not builds
    chained = [slots for slots in runs if "key0" in slots]
    assert len(chained) >= 68 and all("logits" in slots for slots in chained), len(chained)
    monkeypatch.setattr(step_module, "ENABLED", False)
    want_tokens, want_logits = _generate(model)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


def _generate_changing(model: nn.Module, change, at: int = 4, new: int = 10):
    """Greedy tokens and logits of `new` tokens, ``change()`` made between two decode steps (before the
    forward of token ``at + 1``)."""

    class Change(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] == 5 + at - 1:
                change()
            return scores

    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True,
                             logits_processor=transformers.LogitsProcessorList([Change()]))  # fmt: skip
    return out.sequences, torch.stack(out.logits)


def test_a_weight_whose_storage_changes_is_read_anew(monkeypatch):
    """`weight.data = ...` (as `module.to(...)` does) gives a parameter new storage without assigning a
    parameter: the next step (here within one generation) sees the new address, builds the program again
    and reads the new values."""

    def change(model):
        down = model.model.layers[0].mlp.down_proj
        down.weight.data = down.weight.data * 2

    _assert_a_change_takes_effect(monkeypatch, change)


def _assert_a_change_takes_effect(monkeypatch, change) -> None:
    """``change(model)`` made between two decode steps of a generation (after one that checked the path):
    tokens and logits equal the layers' Python path's with the same change on a fresh model."""
    model = _llama(torch.float32, None)
    _generate(model, 4)
    tokens, logits = _generate_changing(model, lambda: change(model))
    monkeypatch.setattr(_decode_step_module(), "ENABLED", False)
    fresh = _llama(torch.float32, None)
    want_tokens, want_logits = _generate_changing(fresh, lambda: change(fresh))
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


def test_a_hook_registered_during_a_generation_sees_the_later_steps():
    """A hook registered between two decode steps of one generation sees every later forward (the fifth
    token's to the tenth): the chain's check counts the hooks registered anywhere."""
    model = _llama(torch.bfloat16, "q8_0")
    _generate(model, 4)
    seen, handles = [], []
    layer = model.model.layers[1]
    _generate_changing(
        model, lambda: handles.append(layer.mlp.register_forward_hook(lambda *a: seen.append(1)))
    )
    handles[0].remove()
    assert len(seen) == 10 - 4


def test_a_layer_deleted_during_a_generation_takes_effect(monkeypatch):
    """`del layers[i]` assigns nothing (no registration to count): the chain's check sees the layer list's
    new dict, and the next step runs the model as it now is."""

    def change(model):
        del model.model.layers[1]
        model.config.num_hidden_layers = 1

    _assert_a_change_takes_effect(monkeypatch, change)


def test_a_dynamic_rope_gets_no_rotary_tables_made_ahead(monkeypatch):
    """A dynamic RoPE's frequencies change with the positions it has seen: the chain calls the module at
    every step instead of making its tables ahead; past its original length the tokens still match."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=32,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    kernelize_model(model)
    tokens, logits = _generate(model, 40)
    chain = model.__dict__["_kernelize_model_step"].chain
    assert chain is not None and not chain.static_rotary
    monkeypatch.setattr(_decode_step_module(), "ENABLED", False)
    want_tokens, want_logits = _generate(model, 40)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


def test_a_sliding_window_cache_replays_until_its_window_fills(monkeypatch):
    """Mistral's cache has sliding-window layers: below the window they hold every position and the steps
    replay (the model's step included); once a step would drop a position, the model's forward runs it.
    Tokens and logits equal the Python path's on both sides of the window."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, sliding_window=16,
    )  # fmt: skip
    model = transformers.MistralForCausalLM(config).eval()
    kernelize_model(model)
    runs = _record_runs(monkeypatch)
    tokens, logits = _generate(model, 24)
    assert model.__dict__["_kernelize_model_step"].verdict is True
    assert 2 * 6 <= _layer_steps(runs, 2) <= 2 * 12, _layer_steps(runs, 2)  # 5 prompt positions, window 16
    monkeypatch.setattr(_decode_step_module(), "ENABLED", False)
    want_tokens, want_logits = _generate(model, 24)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


def test_hooks_on_the_embedding_and_the_rotary_module_see_each_step(monkeypatch):
    """The chain copies the embedding's row and makes rotary tables ahead only while nothing hooks those
    modules: hooked, each sees one call per decode step (the rotary one with the step's own position), and
    the tokens and logits equal the Python path's."""
    model = _llama(torch.bfloat16, "q4_0")
    _generate(model, 4)  # the path checked, the chain built
    embeds, positions = [], []
    handles = [
        model.model.embed_tokens.register_forward_hook(lambda m, args, out: embeds.append(args[0].shape)),
        model.model.rotary_emb.register_forward_hook(
            lambda m, args, kwargs, out: positions.append(kwargs["position_ids"].flatten().tolist()),
            with_kwargs=True,
        ),
    ]
    tokens, logits = _generate(model, 8)
    for handle in handles:
        handle.remove()
    assert len(embeds) == 8 and embeds[1:] == [(1, 1)] * 7
    assert positions[1:] == [[p] for p in range(5, 12)]
    monkeypatch.setattr(_decode_step_module(), "ENABLED", False)
    want_tokens, want_logits = _generate(model, 8)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)
