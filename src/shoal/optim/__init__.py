"""Optimizers of `shoal train`: the config (config), the builder (builder), the learning-rate schedule (schedule),
and the large-batch optimizers LAMB, LARS (lamb_lars) and CowClip (cowclip), whose norms are whole parameters'
under every sharding (sharded_norms)."""
