"""Mode flags and the mode fallback chain (kernelize.layer.mode)."""

from __future__ import annotations

import pytest

from kernelize import Mode
from kernelize.layer.mode import (
    MODE_FALLBACK_ORDER,
    REGISTRABLE_MODES,
    check_kernelize_mode,
    select_repository,
)

INF, TRAIN, TC, FB = Mode.INFERENCE, Mode.TRAINING, Mode.TORCH_COMPILE, Mode.FALLBACK


@pytest.mark.parametrize("a, b", [(INF, TRAIN), (TRAIN, INF), (INF | TC, TRAIN), (TRAIN, INF | TC)])
def test_inference_and_training_exclude_each_other(a: Mode, b: Mode) -> None:
    with pytest.raises(ValueError, match="mutually exclusive"):
        a | b


@pytest.mark.parametrize("other", [INF, TRAIN, TC, INF | TC])
def test_fallback_cannot_be_combined(other: Mode) -> None:
    with pytest.raises(ValueError, match="FALLBACK cannot be combined"):
        FB | other
    with pytest.raises(ValueError, match="FALLBACK cannot be combined"):
        other | FB


def test_valid_unions_and_str() -> None:
    assert (INF | TC) == (TC | INF)
    assert FB | FB == FB
    assert str(INF | TC) == "INFERENCE | TORCH_COMPILE"
    assert str(TRAIN) == "TRAINING"


def test_fallback_chains_are_the_documented_ones() -> None:
    # Verbatim from the seed text ("INFERENCE: INFERENCE -> INFERENCE | TORCH_COMPILE -> ...").
    assert dict(MODE_FALLBACK_ORDER) == {
        INF: (INF, INF | TC, TRAIN, TRAIN | TC, FB),
        INF | TC: (INF | TC, TRAIN | TC, FB),
        TRAIN: (TRAIN, TRAIN | TC, FB),
        TRAIN | TC: (TRAIN | TC, FB),
    }


@pytest.mark.parametrize("mode", list(MODE_FALLBACK_ORDER))
def test_select_walks_the_chain_in_order(mode: Mode) -> None:
    """With everything registered, removing each pick in turn must reveal exactly the documented chain."""
    registered = {m: f"repo for {m}" for m in REGISTRABLE_MODES}
    picks = []
    while (selected := select_repository(registered, mode)) is not None:
        repo, picked_mode = selected
        assert repo == f"repo for {picked_mode}"
        picks.append(picked_mode)
        del registered[picked_mode]
    assert tuple(picks) == MODE_FALLBACK_ORDER[mode]


def test_seed_example_torch_compile_modes_use_the_fallback_kernel() -> None:
    registered = {FB: "activation", INF: "inference-optimized", TRAIN: "training-optimized"}
    assert select_repository(registered, INF | TC) == ("activation", FB)
    assert select_repository(registered, TRAIN | TC) == ("activation", FB)
    assert select_repository(registered, INF) == ("inference-optimized", INF)
    assert select_repository(registered, TRAIN) == ("training-optimized", TRAIN)


def test_training_kernel_serves_inference_but_not_the_reverse() -> None:
    assert select_repository({TRAIN: "t"}, INF) == ("t", TRAIN)
    assert select_repository({INF: "i"}, TRAIN) is None


@pytest.mark.parametrize(
    "mode, error, message",
    [
        (FB, ValueError, "only be used to register"),
        (TC, ValueError, "must contain Mode.INFERENCE or Mode.TRAINING"),
        ("inference", TypeError, "must be a kernelize.Mode"),
    ],
)
def test_kernelize_modes_are_checked(mode: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        check_kernelize_mode(mode)
