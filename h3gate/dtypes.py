"""The one spelling of a torch dtype in messages and evidence: ``torch.bfloat16`` -> ``bfloat16``."""

from __future__ import annotations

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``str(dtype)`` without the ``torch.`` prefix (``bfloat16``, ``float32``, ``int64``)."""
    return str(dtype).replace("torch.", "")
