"""Optimizers of `shoal train`: the builder and learning-rate schedule (builder), and the large-batch
optimizers LAMB, LARS and CowClip that stay correct on sharded parameters (large_batch)."""
