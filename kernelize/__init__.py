"""kernelize: swap the forward of marked PyTorch layers for fused kernels.

Layer substitution is compatible with Hugging Face `kernels`: change `from kernels import ...` to
`from kernelize import ...`. The graph IR and compiler live in `kernelize.ir`, `kernelize.autokernel`,
`kernelize.codegen` and `kernelize.runtime`.
"""

from __future__ import annotations

from kernelize import layer

# the mapping from common layer names to the bundled kernel repositories
from kernelize.hub import default_mapping

# the layer substitution API (`kernelize.layer`), re-exported whole: it is what `kernels` users import
from kernelize.layer import *  # noqa: F403

__all__ = [*layer.__all__, "default_mapping"]
