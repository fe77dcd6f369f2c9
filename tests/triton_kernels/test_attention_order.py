"""The strict attention's walk order (RFC numerical rule 7, H-C3): rows gathered into the canonical order, attended,
scattered back. A consistent permutation of the packed rows (the order permuted alike) gives byte-equal outputs and
dq/dk/dv after the inverse permutation; a wrong order does not; the references ignore the order; bad orders fail
closed with one line naming the operator and the argument."""

from __future__ import annotations

import pytest
import torch

from h3gate.errors import InputError
from h3gate.kernels import attention as attn
from h3gate.ops import golden, reference

BF16 = torch.bfloat16
# Many programs in every kernel (S = 70: 5 query blocks, 5 KV blocks, masked tails everywhere).
SMALL = attn.AttnConfig(16, 16, 4, 2, 16, 32, 4, 1, 32, 16, 4, 1)
S = 70


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


def _packed(canonical: list[torch.Tensor], perm: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Packed row ``p`` holds canonical row ``perm[p]``; the order is the packed row of canonical row ``i``."""
    return [t[:, perm].contiguous() for t in canonical], torch.argsort(perm)


def _run(q, k, v, grad, order, cfg) -> list[torch.Tensor]:
    """out, dq, dk, dv of one call, each put back in canonical row order (``t[:, order]``)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attn.attention(*leaves, order=order) if cfg is None else attn.attention_with(*leaves, cfg, order=order)
    out.backward(grad)
    return [t.index_select(1, order) for t in (out.detach(), *(x.grad for x in leaves))]


@pytest.mark.parametrize(("cfg", "b"), [(None, 2), (SMALL, 1)], ids=["default-b2", "small"])
def test_consistent_permutation_is_byte_equal_forward_and_backward(cfg, b) -> None:
    """Three packings of the same logical rows, each with its order: the canonical one (identity order: the plain
    kernel, no copies) and two seeded permutations; out and dq/dk/dv byte-equal after the inverse permutation."""
    canonical = [_randn(b, S, 2, 128, seed=i) for i in range(3)] + [_randn(b, S, 256, seed=3)]
    runs = []
    for perm in (torch.arange(S), *(torch.randperm(S, generator=torch.Generator().manual_seed(s)) for s in (1, 2))):
        (q, k, v, grad), order = _packed(canonical, perm)
        runs.append(_run(q, k, v, grad, order, cfg))
    for name, first, *others in zip(("out", "dq", "dk", "dv"), *runs, strict=True):
        assert all(torch.equal(first, other) for other in others), name


@pytest.mark.parametrize(
    ("dtype", "drifting"),
    [(BF16, ("out", "dq", "dk")), (torch.float32, ("out", "dq", "dk", "dv"))],
    ids=["bf16", "fp32"],
)
def test_a_wrong_order_changes_the_bytes(dtype, drifting) -> None:
    """Negative control: on a permuted packing, the identity order (a packed-order walk) drifts from the canonical
    walk (in BF16 the FP32 reordering of dV's sums over queries can round to the same bytes at this size)."""
    canonical = [_randn(1, S, 2, 128, seed=i).to(dtype) for i in range(3)] + [_randn(1, S, 256, seed=3).to(dtype)]
    (q, k, v, grad), order = _packed(canonical, torch.randperm(S, generator=torch.Generator().manual_seed(1)))
    right = _run(q, k, v, grad, order, SMALL)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attn.attention_with(*leaves, SMALL, order=torch.arange(S))
    out.backward(grad)
    wrong = [t.index_select(1, order) for t in (out.detach(), *(x.grad for x in leaves))]
    for name, a, b in zip(("out", "dq", "dk", "dv"), right, wrong, strict=True):
        assert name not in drifting or not torch.equal(a, b), name
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)  # the same maths, other roundings


def test_identity_order_skips_the_copies_and_is_decided_once_per_tensor(monkeypatch) -> None:
    calls = []
    real = attn._order_facts
    monkeypatch.setattr(attn, "_order_facts", lambda order: calls.append(1) or real(order))
    q = _randn(1, S, 2, 128, seed=0)
    identity, perm = torch.arange(S), torch.randperm(S, generator=torch.Generator().manual_seed(4))
    assert attn.walk_order(None, q) is None and attn.walk_order(identity, q) is None
    assert attn.walk_order(identity, q) is None and attn.walk_order(perm, q) is perm
    assert len(calls) == 2  # one host read per order tensor, not per call
    assert torch.equal(attn.attention(q, q, q, order=identity), attn.attention(q, q, q))


def test_references_accept_and_ignore_the_order() -> None:
    q, k, v = (torch.randn(1, 9, 2, 16, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
               for i in range(3))  # fmt: skip
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(2))
    plain = reference.attention(q, k, v)
    assert torch.equal(reference.attention(q, k, v, order=perm), plain)
    assert torch.equal(golden.attention_golden(q, k, v, order=perm), plain)
    assert torch.equal(golden.attention_fp64(q, k, v, order=perm), golden.attention_fp64(q, k, v))


@pytest.mark.parametrize(
    "order,message",
    [
        (torch.arange(S - 1), f"h3_full_attention: order: length {S - 1}, expected S = {S}"),
        (torch.arange(S, dtype=torch.int32), "h3_full_attention: order: dtype int32 not supported (expected int64)"),
        (torch.arange(S).view(2, -1), "h3_full_attention: order: expected 1 dims, got shape (2, 35)"),
        (torch.arange(S, device="meta"), "h3_full_attention: order: on meta, expected cpu (mixed devices)"),
        (torch.zeros(S, dtype=torch.int64), f"h3_full_attention: order: not a permutation of the {S} packed rows"),
        (torch.arange(1, S + 1), f"h3_full_attention: order: not a permutation of the {S} packed rows"),
    ],
    ids=["length", "dtype", "ndim", "device", "repeated", "out-of-range"],
)
def test_bad_orders_fail_closed_in_one_line(order, message) -> None:
    q = _randn(1, S, 2, 128, seed=0)
    with pytest.raises(InputError) as err:
        attn.attention(q, q, q, order=order)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_the_indexed_walk_is_the_gathered_copy_walk_byte_for_byte() -> None:
    """The kernels address canonical row i through order[i] in place: out and dq/dk/dv are the bytes of the plain
    kernels run on gathered copies (t[:, order]) and scattered back, signed zeros included (no addition anywhere)."""
    q, k, v = (_randn(1, S, 2, 128, seed=10 + i) for i in range(3))
    grad = _randn(1, S, 256, seed=13)
    q[0, ::3] = -0.0
    order = torch.randperm(S, generator=torch.Generator().manual_seed(6))
    indexed = _run(q, k, v, grad, order, SMALL)  # each put back in canonical order
    gathered = (t.index_select(1, order) for t in (q, k, v, grad))  # canonical rows: the plain, unindexed kernels
    copied = _run(*gathered, torch.arange(S), SMALL)
    for name, a, b in zip(("out", "dq", "dk", "dv"), indexed, copied, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name
