"""Which kernel path runs a product of an operator family here: the selection tables the operators' manifests declare
(``paths:`` in ``manifests/operators/*.yaml``, :class:`h3gate.manifests.operators.PathTable`), read once a process.

A call is classified by its device class - ``cpu-interpreter`` (Triton's interpreter), ``cuda-sm90`` (a Hopper GPU,
where the Gluon kernels run) or ``cuda-other`` - and by its family's scope key (a GEMM's weight (N, K) and dtype, the
attention's head dim and dtype). The table whose scope is that key gives the path for the call's product and size;
every other call runs the family's ``otherwise`` path. The kernels dispatch on the path; none decides one itself.
"""

from __future__ import annotations

import functools

import torch

from h3gate.kernels.common import INTERPRET, hopper
from h3gate.manifests.operators import PathTable, load_operator_specs


def device_class(device: torch.device) -> str:
    """``cpu-interpreter`` under ``TRITON_INTERPRET=1`` (or off CUDA), ``cuda-sm90`` on a Hopper GPU, else
    ``cuda-other``."""
    if INTERPRET or device.type != "cuda":
        return "cpu-interpreter"
    return "cuda-sm90" if hopper(device.index) else "cuda-other"


@functools.cache
def tables(family: str) -> tuple[dict[tuple, PathTable], str | None]:
    """The family's declared tables by scope key, and its ``otherwise`` path (None: the family declares none)."""
    found: dict[tuple, PathTable] = {}
    otherwise = None
    for spec in load_operator_specs().values():
        if spec.family == family and spec.paths is not None:
            found[spec.paths.scope.key] = spec.paths
            otherwise = spec.paths.otherwise
    return found, otherwise


@functools.lru_cache(maxsize=4096)
def path(family: str, key: tuple, product: str, device: str, size: int, default: str) -> str | None:
    """The declared path of a ``product`` call of ``family`` with scope ``key`` on ``device`` at ``size``: its table's,
    or the family's ``otherwise`` (``default`` when the family declares no table). ``grouped`` calls no rule covers:
    None (one forward call a weight)."""
    found, otherwise = tables(family)
    table = found.get(key)
    if table is None:
        return None if product == "grouped" else otherwise or default
    return table.path(device, product, size)
