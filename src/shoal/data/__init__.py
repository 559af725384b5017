"""Prepared token datasets: `shoal data prepare` writes memory-mapped token shards with a
document index and a manifest (prepare.py); training reads them, alone or as a weighted
mixture, through memory maps with a sampler that is a pure function of (seed, step) (dataset.py).
"""
