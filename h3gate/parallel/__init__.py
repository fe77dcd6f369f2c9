"""The parallel harness: run a graph under tensor/context-parallel plans on spawned ranks and return what rank 0
gathered. It knows nothing about ablations (``h3gate.ablate.multirank`` decides which plan a row runs and what the
result means): ``plans`` (TP/CP ownership and its check), ``overrides`` (rank-local node functions and the gathers
that report full tensors), ``harness`` (the parent: spawn, exchange, collect), ``worker`` (one rank; gloo today).
"""
