"""Strict Triton kernels, one module per operator family. See DESIGN.md and manifests/operators/."""
