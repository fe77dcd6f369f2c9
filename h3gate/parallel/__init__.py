"""Tensor / context / sequence parallelism, ``run ws2``: ranks that hold their shards (``tp``, ``ulysses``, ``sp``,
``shards``), run forward and backward (``ws2_scope``, ``ws2_rank``, launched by ``launch``) and compare every value
and gradient with TP1 byte for byte (``ws2``); ``ws2_partition`` the non-default partitions the ablation rows use.
It knows nothing about ablations (``h3gate.ablate.multirank`` decides which plan a row runs and what it means).
"""
