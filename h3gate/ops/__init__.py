"""Operators: the registry (name -> provider reference, strict kernel, contract) and the PyTorch references."""
