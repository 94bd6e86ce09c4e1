"""Breadth: small transformers models outside the benchmark corpus, exported to ONNX by torch, run by
`kernelize.onnx.InferenceSession` against onnxruntime on the same file and input. The quick set (in `make
test`) holds the models whose exports carry ops the corpus does not (BEiT's ScatterND relative position bias,
wav2vec2's grouped positional conv and group norm, T5's bucketed relative bias, Swin v2's log-spaced
continuous position bias); the slow set (`make test-slow`) the rest of what was checked."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kernelize.onnx import InferenceSession

ort = pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128)
AUDIO = dict(SMALL, conv_dim=(32,) * 7, num_conv_pos_embeddings=16)


def _image() -> torch.Tensor:
    return torch.randn(1, 3, 224, 224)


def _text() -> torch.Tensor:
    return torch.randint(3, 1000, (1, 32))


def _audio() -> torch.Tensor:
    return torch.randn(1, 16000)


def _build(cls: str, cfg: str, **kw) -> Callable[[], torch.nn.Module]:
    return lambda: getattr(transformers, cls)(getattr(transformers, cfg)(**kw))


# name -> (model builder, input)
QUICK = {
    "beit": (
        _build("BeitForImageClassification", "BeitConfig", **SMALL, use_relative_position_bias=True),
        _image,
    ),
    "wav2vec2": (_build("Wav2Vec2Model", "Wav2Vec2Config", **AUDIO), _audio),
    "t5_encoder": (
        _build("T5EncoderModel", "T5Config", d_model=64, d_ff=128, num_layers=2, num_heads=2, d_kv=32),
        _text,
    ),
    "swinv2": (
        _build(
            "Swinv2ForImageClassification",
            "Swinv2Config",
            depths=[1, 1, 2, 1],
            embed_dim=32,
            num_heads=[2, 2, 4, 8],
        ),  # fmt: skip
        _image,
    ),
}
SLOW = {
    "dinov2": (_build("Dinov2Model", "Dinov2Config", **SMALL, patch_size=14), _image),
    "convnextv2": (
        _build(
            "ConvNextV2ForImageClassification",
            "ConvNextV2Config",
            depths=[1, 1, 2, 1],
            hidden_sizes=[16, 32, 64, 128],
        ),
        _image,
    ),  # fmt: skip
    "levit": (_build("LevitForImageClassification", "LevitConfig"), _image),
    "poolformer": (
        _build("PoolFormerForImageClassification", "PoolFormerConfig", depths=[1, 1, 2, 1]),
        _image,
    ),
    "segformer": (_build("SegformerForImageClassification", "SegformerConfig", depths=[1, 1, 1, 1]), _image),
    "focalnet": (
        _build("FocalNetForImageClassification", "FocalNetConfig", depths=[1, 1, 2, 1], embed_dim=32),
        _image,
    ),
    "clip_vision": (_build("CLIPVisionModel", "CLIPVisionConfig", **SMALL), _image),
    "yolos": (
        _build(
            "YolosForObjectDetection", "YolosConfig", **SMALL, image_size=[224, 224], num_detection_tokens=10
        ),
        _image,
    ),
    "deberta_v2": (_build("DebertaV2Model", "DebertaV2Config", **SMALL), _text),
    "albert": (_build("AlbertModel", "AlbertConfig", **SMALL, embedding_size=32), _text),
    "squeezebert": (_build("SqueezeBertModel", "SqueezeBertConfig", **SMALL, embedding_size=64), _text),
    "convbert": (_build("ConvBertModel", "ConvBertConfig", **SMALL, embedding_size=64), _text),
    "funnel": (
        _build(
            "FunnelModel", "FunnelConfig", block_sizes=[1, 1], d_model=64, n_head=2, d_head=32, d_inner=128
        ),
        _text,
    ),
    "wavlm": (_build("WavLMModel", "WavLMConfig", **AUDIO), _audio),
    "ast": (
        _build("ASTForAudioClassification", "ASTConfig", **SMALL, max_length=256),
        lambda: torch.randn(1, 256, 128),
    ),
}


class _Output(torch.nn.Module):
    """The model's logits, or its last hidden state."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        logits = getattr(out, "logits", None)
        return logits if logits is not None else out.last_hidden_state


def _check(name: str, build: Callable, make_input: Callable, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = _Output(build().eval()), make_input()
    path = tmp_path / f"{name}.onnx"
    with torch.no_grad():
        torch.onnx.export(model, (x,), str(path), input_names=["x"], output_names=["y"], opset_version=17,
                          dynamo=False)  # fmt: skip
    feed = {"x": x.numpy()}
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    got = InferenceSession(str(path)).run(None, feed)[0]
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), name


@pytest.mark.parametrize("name", sorted(QUICK))
def test_exported_model_matches_onnxruntime(name: str, tmp_path: Path) -> None:
    _check(name, *QUICK[name], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_more_exported_models_match_onnxruntime(name: str, tmp_path: Path) -> None:
    _check(name, *SLOW[name], tmp_path)
