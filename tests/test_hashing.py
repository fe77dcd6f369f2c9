"""sha256_later: the hash of a tensor's bytes at the call, whatever happens to the tensor before a worker hashes it."""

from __future__ import annotations

import hashlib
import threading

import torch

from h3gate import hashing
from h3gate.hashing import resolved, sha256_later, tensor_sha256


def test_tensor_sha256_is_the_row_major_bytes():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert tensor_sha256(t.t()) == hashlib.sha256(t.t().contiguous().numpy().tobytes()).hexdigest()
    assert tensor_sha256(t.to(torch.bfloat16)) != tensor_sha256(t)


def test_background_hash_is_of_the_bytes_at_the_call():
    t = torch.randn(64, 33)
    before = tensor_sha256(t)
    gate = threading.Event()
    blockers = [hashing._workers().submit(gate.wait) for _ in range(hashing._WORKERS)]  # every worker busy
    later = sha256_later(t, background=True)
    t.add_(1.0)  # changed before any worker can hash
    assert not later.done()
    gate.set()
    assert all(b.result(timeout=30) for b in blockers)
    assert later.result(timeout=30) == before != tensor_sha256(t)


def test_host_tensor_is_hashed_at_once_and_resolved_nests():
    t = torch.ones(5, dtype=torch.bfloat16)
    now = sha256_later(t)
    assert now.done() and now.result() == tensor_sha256(t)
    record = {"x": {"provider": now, "candidate": sha256_later(t * 2, background=True)}, "n": 3}
    assert resolved(record) == {"x": {"provider": tensor_sha256(t), "candidate": tensor_sha256(t * 2)}, "n": 3}
