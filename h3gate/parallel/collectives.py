"""What every parallel layout shares, below the layouts themselves: the row metadata a CP rank slices, the CP row
shards, and the byte-exact collectives (an all-gather of raw bytes in rank order: a copy, never arithmetic; gloo
ranks computing on a GPU stage the bytes through host memory)."""

from __future__ import annotations

import torch

from h3gate.kernels.row_merge import cp_row_bounds

ROW_META = ("adaln_indices", "rope_cos", "rope_sin", "timestep_indices")


def cp_bounds(seq_len: int, cp: int) -> tuple[int, ...]:
    """The ``cp + 1`` row boundaries of the CP shards: whole row segments (:func:`cp_row_bounds`)."""
    return cp_row_bounds(seq_len, cp)


def staged(t: torch.Tensor) -> bool:
    """Whether a collective on ``t`` goes through host memory: gloo ranks computing on a GPU (ranks sharing GPUs)."""
    import torch.distributed as dist

    return t.is_cuda and dist.get_backend() == "gloo"


def group_gather(group):
    """All-gather within ``group`` (rank order) as raw bytes: exact for every dtype, on gloo and NCCL alike (gloo
    ranks on GPUs stage the bytes through host memory: a copy, never arithmetic)."""
    import torch.distributed as dist

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        x = t.contiguous()
        host = staged(x)
        raw = (x.cpu() if host else x).reshape(-1).view(torch.uint8)
        parts = [torch.empty_like(raw) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, raw, group=group)
        return [(p.to(x.device) if host else p).view(x.dtype).reshape(x.shape) for p in parts]

    return gather
