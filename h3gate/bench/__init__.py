"""Benchmarks: strict kernels timed next to the provider in one run (median CUDA-event timings)."""
