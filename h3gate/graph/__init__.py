"""Graphs of named nodes (block 0 = 17 nodes; the model = refiner + N blocks + heads) and their executions."""
