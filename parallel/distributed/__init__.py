"""Parallelism primitives: topology and context, communication regions, tensor- and sequence-parallel
layers, pipeline stages, seeds, the accelerator. Imports no model family and no training loop."""
