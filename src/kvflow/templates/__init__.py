"""Chat templates shipped with kvflow (read with `template_text`)."""

from __future__ import annotations

import functools
from importlib import resources


@functools.cache
def template_text(name: str) -> str:
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
