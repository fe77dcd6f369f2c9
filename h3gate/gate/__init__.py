"""Comparisons, invariance probes, first drift and tolerance evaluation (torch only; no graph or run knowledge)."""
