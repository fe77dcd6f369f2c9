"""The merge orders a strict run can sum its split reductions in, and the one default every verb and API shares.

* ``seg8`` (the default) - every operator whose reduction a parallel layout can split runs its declared
  ``<name>_seg8`` twin: 8 fixed segments per reduction (4 for a GEMM's weight gradient over packed rows), each the
  single walk in FP32, added in one fixed tree, one rounding. TP 1/2/4/8, CP 1/2/4 and SP give the same bytes as one
  device (``docs/concepts/merge-orders.md``).
* ``single`` - the one-walk kernels: one accumulator per output element over the whole reduction. The O and
  FFN-down forwards are then bitwise cuBLAS on Hopper, but no TP, CP or SP layout can reproduce the bytes.
"""

from __future__ import annotations

MERGE_ORDERS: tuple[str, ...] = ("single", "seg8")
DEFAULT_MERGE_ORDER = "seg8"
