"""Mixture-of-Experts feed-forward layer: router, dispatcher, experts. No distributed imports."""
