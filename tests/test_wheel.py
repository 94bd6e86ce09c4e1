"""The wheel: built, installed into a plain folder and used outside the checkout, bundled hub included."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Run in a fresh interpreter whose only kernelize is the installed wheel (torch comes from the venv).
KERNELIZE_A_MODEL = textwrap.dedent(
    """
    import copy, sys
    from pathlib import Path

    import torch
    from torch import nn

    import kernelize
    from kernelize import Mode, inspect, use_kernel_forward_from_hub, use_kernel_mapping
    from kernelize.hub import default_mapping
    from kernelize.layer.hub import bundled_hub_dir

    target = Path(sys.argv[1]).resolve()
    assert Path(kernelize.__file__).resolve().is_relative_to(target), kernelize.__file__
    assert bundled_hub_dir().resolve() == target / "kernelize" / "hub_kernels", bundled_hub_dir()

    @use_kernel_forward_from_hub("RMSNorm")
    class RMSNorm(nn.Module):
        def __init__(self, hidden, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.rand(hidden) + 0.5)
            self.variance_epsilon = eps

        def forward(self, x):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * h.to(x.dtype)

    @use_kernel_forward_from_hub("SiluAndMul")
    class SiluAndMul(nn.Module):
        def forward(self, x):
            d = x.shape[-1] // 2
            return nn.functional.silu(x[..., :d]) * x[..., d:]

    model = nn.Sequential(nn.Linear(16, 64), SiluAndMul(), RMSNorm(32)).eval()
    eager = copy.deepcopy(model)
    with use_kernel_mapping(default_mapping()):
        kernelize.kernelize(model, mode=Mode.INFERENCE, device="cpu", use_fallback=False)
    choices = inspect(model)
    assert [c.kernel_layer for c in choices.values()] == ["SiluAndMul", "RMSNorm"], choices
    x = torch.randn(3, 7, 16)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-5)
    assert all(c.backend == "cpu" for c in inspect(model).values()), inspect(model)
    print("kernelized from the wheel:", ", ".join(str(c.repository) for c in choices.values()))
    """
)


def _readme_first_example() -> str:
    """The Python blocks of the README's walk-through up to step 3 (mark, kernelize, inspect)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## From a marked layer to a measured speedup", 1)[1].split("**3. Measure**", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert len(blocks) == 2, "the README walk-through changed: update this test"
    return "\n".join(blocks)


def _source_copy(dest: Path) -> Path:
    """The files a wheel is built from, copied so the build leaves nothing in the checkout."""
    dest.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    for name in ("kernelize", "hub_kernels"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    return dest


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done


def test_the_package_list_matches_the_packages_on_disk() -> None:
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kernelize").rglob("__init__.py")}
    assert set(config["packages"]) == on_disk | {"kernelize.hub_kernels"}
    assert config["package-dir"] == {"kernelize.hub_kernels": "hub_kernels"}


def test_the_installed_wheel_ships_the_hub_and_kernelizes_outside_the_checkout(tmp_path: Path) -> None:
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    source = _source_copy(tmp_path / "src")
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)])
    (wheel,) = (tmp_path / "dist").glob("kernelize-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("kernelize/hub_kernels/")}
    expected = {
        "kernelize/hub_kernels/" + p.relative_to(ROOT / "hub_kernels").as_posix()
        for p in (ROOT / "hub_kernels").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert shipped == expected
    target = tmp_path / "site"
    _run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)])

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("KERNELIZE_HUB_DIR", "LOCAL_KERNELS")}
    env["PYTHONPATH"] = str(target)
    (outside / "model.py").write_text(KERNELIZE_A_MODEL)
    done = _run([sys.executable, "model.py", str(target)], cwd=outside, env=env)
    assert "kernelized from the wheel: `kernelize/activation` (version 1)" in done.stdout
    (outside / "readme.py").write_text(_readme_first_example())
    done = _run([sys.executable, "readme.py"], cwd=outside, env=env)
    assert re.search(
        r"1 `1` \(RMSNorm, layer `RMSNorm`\) -> kernel layer `RMSNorm` from `kernelize/layer_norm` "
        r"\(version 1\), layer `RMSNorm` \(registered for FALLBACK\) ran on cpu: k0#[0-9a-f]{8}",
        done.stdout,
    ), done.stdout
