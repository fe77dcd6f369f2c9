"""One operator case: the protocol shared by ws1-ops, the op bench and the kernel tests (:mod:`h3gate.ops.cases`
holds the builders, one per operator).

A case builder ``(rows, cfg, device, seed) -> OpCase`` makes the inputs one operator sees at ``rows`` packed rows and
``cfg``'s real widths and dtypes, seeded (a CPU ``torch.Generator`` so the bytes do not depend on the device). Both
the provider reference and the strict kernel are called as ``fn(*case.args, **case.kwargs)``; the float64 golden is
the reference on :meth:`OpCase.golden_call`'s arguments.

Invariance probes need to know which dimensions are rows:

* ``batch_dims`` - argument position -> its batch (pure replication) dimension; ``out_batch_dim`` the output's.
  Base cases have batch size 1 there; probes place the row inside batches of 2 and 3 at every position, next to
  fresh random rows, and compare bytes.
* ``row_dims`` - argument position -> its packed-row dimension, for operators that are *row-local* (input row r
  only influences output row r along ``out_row_dim``). Probes mutate every other row and compare the kept rows;
  with ``prefix_rows`` they also run the first rows alone (a smaller M) and compare them.
  Operators that are not row-local (gathers, scatters, attention) give a ``mutate`` function instead, or nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from h3gate.manifests.model_config import ModelConfig

# mutate(args, keep_rows, generator) -> new args in which nothing that output rows ``keep_rows`` depend on changed.
Mutator = Callable[[tuple, Sequence[int], torch.Generator], tuple]


@dataclass(frozen=True)
class OpCase:
    """The inputs of one operator call, and what invariance probes and the bench need to know about them."""

    op: str
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)
    grad_args: tuple[int, ...] = ()  # positions of floating args whose gradients are checked
    batch_dims: dict[int, int] = field(default_factory=dict)
    out_batch_dim: int | None = None
    row_dims: dict[int, int] = field(default_factory=dict)
    out_row_dim: int | None = None
    mutate: Mutator | None = None
    # Row-local operators whose only per-row arguments are those in ``row_dims`` may declare prefix rows: the
    # probe calls the operator on just the first ``prefix_rows`` rows and compares them with the full call's (a
    # different M: for the GEMM, a different M bucket of its tiling when the layout has >= 512 rows).
    prefix_rows: int = 0
    golden_kwargs: dict[str, Any] = field(default_factory=dict)  # kwargs replaced for the float64 golden
    # A float64 implementation of the reference's maths to use as the golden instead of the reference itself, for
    # references whose float64 run does not fit in memory (e.g. attention at 768p); same signature.
    golden_fn: Callable | None = None
    # Extra kernel calls the op bench times next to the kernel in the same run (recorded, not gated): label ->
    # keyword arguments replacing ``kwargs`` (attention: an identity and a permuted walk order).
    bench_variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    bytes_moved: int = 0  # forward HBM bytes the operator must read + write (bench roofline)
    flops: int = 0  # forward floating-point operations (bench)
    shape: str = ""  # human-readable shape summary for evidence

    def call(self, fn: Callable) -> Any:
        return fn(*self.args, **self.kwargs)

    def golden_call(self, fn: Callable) -> Any:
        """``golden_fn`` (else ``fn``) on float64 copies of every floating tensor argument (integer tensors and
        scalars unchanged)."""
        args = tuple(to_float64(a) for a in self.args)
        kwargs = {k: to_float64(v) for k, v in self.kwargs.items()} | self.golden_kwargs
        return (self.golden_fn or fn)(*args, **kwargs)

    def with_args(self, args: tuple) -> OpCase:
        return replace(self, args=tuple(args))


def to_float64(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().double()
    return value


def randn(shape: Sequence[int], dtype: torch.dtype, device: str | torch.device, gen: torch.Generator, scale=1.0):
    """Seeded normal values in float32, scaled, then cast. A CPU generator draws on the CPU and moves the result
    (case inputs: the same bytes on every device); a device generator draws on its device (probe noise at 768p
    sizes, where CPU generation would dominate the run). On the meta device: the shape alone (memory estimates)."""
    if torch.device(device).type == "meta":
        return torch.empty(tuple(shape), dtype=dtype, device="meta")
    if gen.device.type != "cpu":
        return (torch.randn(tuple(shape), generator=gen, device=gen.device, dtype=torch.float32) * scale).to(dtype)
    return (torch.randn(tuple(shape), generator=gen, dtype=torch.float32) * scale).to(dtype).to(device)


def randint(high: int, shape: Sequence[int], device: str | torch.device, gen: torch.Generator) -> torch.Tensor:
    if torch.device(device).type == "meta":
        return torch.empty(tuple(shape), dtype=torch.int64, device="meta")
    return torch.randint(0, high, tuple(shape), generator=gen, dtype=torch.int64).to(device)


def mutate_rows(case: OpCase, args: tuple, keep: Sequence[int], gen: torch.Generator) -> tuple:
    """Default mutator for row-local operators: fresh random values in every row not in ``keep``."""
    if case.mutate is not None:
        return case.mutate(args, keep, gen)
    out = list(args)
    for pos, dim in case.row_dims.items():
        a = args[pos]
        if not (isinstance(a, torch.Tensor) and a.is_floating_point()):
            continue
        fresh = randn(a.shape, a.dtype, a.device, gen, scale=float(a.detach().float().std()) or 1.0)
        mask_shape = [1] * a.ndim
        mask_shape[dim] = a.shape[dim]
        mask = torch.ones(a.shape[dim], dtype=torch.bool, device=a.device)
        mask[torch.as_tensor(list(keep), device=a.device)] = False
        out[pos] = torch.where(mask.view(mask_shape), fresh, a.detach())
    return tuple(out)


def in_batch(case: OpCase, args: tuple, size: int, position: int, gen: torch.Generator) -> tuple:
    """``args`` with every batch-dim argument widened to ``size`` items, the original at ``position``."""
    out = list(args)
    for pos, dim in case.batch_dims.items():
        a = args[pos].detach()
        parts = []
        for i in range(size):
            if i == position:
                parts.append(a)
            else:
                scale = float(a.float().std()) if a.numel() > 1 else 1.0
                parts.append(randn(a.shape, a.dtype, a.device, gen, scale=scale or 1.0))
        out[pos] = torch.cat(parts, dim=dim)
    return tuple(out)


CaseBuilder = Callable[[int, ModelConfig, "str | torch.device", int], OpCase]
