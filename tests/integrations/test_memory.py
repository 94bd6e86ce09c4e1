"""Do no harm to memory: resident memory after the one call and a first forward stays within 5% of eager's.

Measured as a user sees it (the process's RSS), each variant in a fresh process: tensor sizes alone miss
what the C heap keeps after the merges free the old q/k/v and gate/up storages. The model is Qwen2.5-0.5B's
shape, where the issue was seen (+0.44 GB); on much smaller models the fixed costs (generated libraries,
output pools) weigh more than 5%.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

SCRIPT = r"""
import gc, json, sys, warnings
warnings.filterwarnings("ignore")
import torch, transformers
torch.set_num_threads(1)

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024

# Qwen2.5-0.5B's shape (1.0 GB of bf16 weights)
config = transformers.Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
    max_position_embeddings=4096)
config._attn_implementation = "sdpa"
torch.manual_seed(0)
model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
if sys.argv[1] == "kernelize":
    from kernelize.integrations.transformers import kernelize_model
    kernelize_model(model)
ids = torch.randint(1, 1000, (1, 16))
with torch.no_grad():
    model(ids)
gc.collect()
print(json.dumps({"rss": rss(), "params": sum(p.numel() * p.element_size() for p in model.parameters())}))
"""


def measure(variant: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, variant], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two processes building a 0.5 B model: make test-slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_resident_memory_after_the_one_call_is_within_5_percent_of_eager() -> None:
    eager, fast = measure("eager"), measure("kernelize")
    assert fast["params"] == eager["params"]  # the merges make views: no second copy of any weight
    assert fast["rss"] <= 1.05 * eager["rss"], (fast["rss"] / 2**20, eager["rss"] / 2**20)
