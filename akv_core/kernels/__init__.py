"""GPU kernels for the two hot paths of cache engineering, each with a torch fallback.

- `reposition`: move kept keys to new positions (Repos) and their values to new slots.
- `decode_attention`: one query per head against a gathered list of visible slots (Drop
  makes that list shorter, so attention cost follows the visible tokens, not the history).

Triton is used when it is installed and the tensors live on a GPU; otherwise the torch
reference runs. Tests run the Triton kernels on the CPU under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import os

import torch


def triton_usable(tensor: torch.Tensor) -> bool:
    """Whether the Triton path applies to tensors on this device (or the interpreter is on)."""
    if tensor.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
