"""A model's tokenizer from its directory's files, as the engine's loader chose its class, and
`--chat-template`; no torch.

The engine loads its tokenizer with transformers' AutoTokenizer (`model.loader`), whose import
brings in transformers' model configuration code and with it torch. An API server over the
engine process serves text and has no model: it loads the class the engine named
(`EngineInfo.tokenizer_class`, "module:qualname") from the same files, so both processes
tokenize alike and the API server never maps libtorch.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any


def class_path(tokenizer: Any) -> str:
    """`tokenizer`'s class as "module:qualname", for `load_as`."""
    cls = type(tokenizer)
    return f"{cls.__module__}:{cls.__qualname__}"


def load_as(path: str | os.PathLike[str], tokenizer_class: str) -> Any:
    """The tokenizer saved in the local model directory `path`, of the class `class_path` named.
    Never fetches from a hub."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    module, _, name = tokenizer_class.partition(":")
    cls: Any = importlib.import_module(module)
    for part in name.split("."):
        cls = getattr(cls, part)
    return cls.from_pretrained(str(path), local_files_only=True)


def load_chat_template(tokenizer: Any, chat_template: str | None) -> None:
    """`--chat-template`: a file's text, or the template itself; None keeps the model's."""
    if chat_template is None:
        return
    path = Path(chat_template)
    tokenizer.chat_template = path.read_text() if path.is_file() else chat_template


def import_tokenizers() -> None:
    """Import transformers' tokenizer base classes (seconds on a small CPU), to overlap it with
    the engine's start-up."""
    importlib.import_module("transformers.tokenization_utils_tokenizers")
