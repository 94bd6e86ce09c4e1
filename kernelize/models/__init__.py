"""Models bundled with kernelize for the demo, tests and benchmarks."""

from kernelize.models.llama_demo import LlamaDemo, LlamaDemoConfig

__all__ = ["LlamaDemo", "LlamaDemoConfig"]
