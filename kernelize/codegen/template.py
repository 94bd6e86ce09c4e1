"""Kernel skeletons live in real source files under ``templates/`` with ``$NAME$`` holes.

Example:
    >>> fill("int $A$ = $B$;", A="x", B="1")
    'int x = 1;'
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_HOLE = re.compile(r"\$([A-Z][A-Z0-9_]*)\$")


class TemplateError(KeyError):
    """A template hole was not filled, or a value had no hole."""


def fill(template: str, **values: str) -> str:
    """Replace every ``$NAME$`` hole; a missing value or an unused value is an error."""
    holes = set(_HOLE.findall(template))
    missing, leftover = holes - values.keys(), values.keys() - holes
    if missing or leftover:
        raise TemplateError(
            f"template holes missing values: {sorted(missing)}; values without a hole: {sorted(leftover)}"
        )
    return _HOLE.sub(lambda m: str(values[m.group(1)]), template)


@cache
def load_template(name: str) -> str:
    """The text of ``kernelize/codegen/templates/<name>``."""
    return resources.files("kernelize.codegen").joinpath("templates", name).read_text()
