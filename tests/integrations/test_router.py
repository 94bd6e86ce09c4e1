"""Routers through the one call (`kernelize.model_router`): each family's router module runs its traced
graph as the projection plus one ROUTER kernel, with the model's own logits and greedy tokens; what cannot
be traced, probed or called that way keeps the module's forward, with the reason in `inspect`."""

from __future__ import annotations

import pytest
import torch

import kernelize
from kernelize import model_router
from kernelize.models import zoo

from .test_experts import family
from .test_transformers import kernelized

transformers = pytest.importorskip("transformers")

SERVED = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss")


def router_choices(model) -> dict:
    return {p: c for p, c in kernelize.inspect(model).items() if c.layer_name == model_router.ROUTER_LAYER}


def test_a_tiny_qwen3_moe_runs_the_router_kernel_with_eager_logits_and_tokens() -> None:
    eager = family("qwen3_moe")
    ids, mask = zoo.padded_batch(eager.config.vocab_size)
    want = zoo.logits(eager, ids, mask)
    with kernelized(eager) as fast:
        routers = model_router.router_modules(fast)
        served = [isinstance(m.__dict__.get("forward"), model_router.RouterForward) for m in routers.values()]
        assert served and all(served)
        got = zoo.logits(fast, ids, mask)
        real = mask.bool()
        torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)
        ran = router_choices(fast)
        assert ran and all(c.uses_kernel and c.backend == "cpu" and c.kernels for c in ran.values()), ran
        kinds = {k.kernel.kind for m in routers.values() for k in m.forward.compiled.kernels}
        assert "router" in kinds
        kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            assert torch.equal(fast.generate(ids, **kw), eager.generate(ids, **kw))


@pytest.mark.parametrize("model_type", SERVED)
def test_moe_families_routers_are_served_and_probed(model_type: str) -> None:
    model = family(model_type)
    from kernelize.integrations.transformers import kernelize_model

    kernelize_model(model)
    choices = router_choices(model)
    assert choices and all(c.uses_kernel for c in choices.values()), choices
    module = next(iter(model_router.router_modules(model).values()))
    x = torch.randn(5, module.weight.shape[1])
    with torch.no_grad():
        got, want = module(x), type(module).forward(module, x)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2], want[2])


def test_deepseek_v3_group_limited_routing_stays_eager_with_the_reason() -> None:
    from kernelize.integrations.transformers import kernelize_model

    model = kernelize_model(family("deepseek_v3"))
    choices = router_choices(model)
    assert choices and not any(c.uses_kernel for c in choices.values())
    assert all("scatter" in c.reason for c in choices.values()), choices


def test_other_calls_and_training_keep_the_routers_own_forward() -> None:
    from kernelize.integrations.transformers import kernelize_model
    from kernelize.layer.mode import Mode

    model = kernelize_model(family("qwen3_moe"))
    path, module = next(iter(model_router.router_modules(model).items()))
    x = torch.randn(2, 3, module.weight.shape[1])
    with torch.no_grad():
        got = module(x)  # 3-D: the module's own forward reshapes it
    assert torch.equal(got[2], type(module).forward(module, x)[2])
    assert any("eager router" in n for n in router_choices(model)[path].notes)
    status = model_router.use_router_kernels(family("qwen3_moe"), Mode.TRAINING)
    assert status.startswith("router kernels on 0")


def test_a_router_whose_kernel_differs_is_refused_by_the_probe(monkeypatch) -> None:
    from kernelize.passes import router

    pattern, fold = router.RULES[0]

    def sigmoid_instead(ctx, t, s):  # a wrong fold: the same choice (sigmoid is monotonic), other weights
        node = fold(ctx, t, s)
        a = node.arg
        dtype = "f32" if a.indices else node.dtype
        return ctx.g.route(node.src[0], a.k, score="sigmoid", dtype=dtype)[a.indices]

    monkeypatch.setattr(router, "RULES", [(pattern, sigmoid_instead), *router.RULES[1:]])
    module = next(iter(model_router.router_modules(family("mixtral")).values()))
    run, why = model_router.router_blocker(module)
    assert run is None and why.startswith("output 1 differs"), why
