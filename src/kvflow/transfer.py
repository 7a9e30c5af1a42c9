"""Host -> device copies that queue behind the device's work instead of waiting for it."""

from __future__ import annotations

import numpy as np
import torch


def to_device(
    values: np.ndarray | list, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """`values` as a `dtype` tensor on `device`.

    A plain copy to a CUDA device returns only when every kernel queued before it has run
    (PyTorch synchronises the stream after copying from pageable memory), which would stall a
    host that prepares step N+1 while step N runs. Staged in pinned memory and copied
    non_blocking, the copy is queued instead; PyTorch's pinned-memory cache keeps the staging
    buffer until the copy has run. On the CPU the tensor may share `values`' memory.
    """
    tensor = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
