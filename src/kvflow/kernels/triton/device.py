"""Facts about the device the Triton kernels run on."""

from __future__ import annotations

import functools
import os

import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter on the CPU (tests)


@functools.cache
def sm_count(device: torch.device) -> int:
    """The card's SMs; 4 under the interpreter (so that tests walk several tiles a program)."""
    return (
        4
        if device.type != "cuda"
        else torch.cuda.get_device_properties(device).multi_processor_count
    )
