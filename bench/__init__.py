"""Side-by-side benchmarks: shoal against torch-native peers and analytic limits (run as python -m bench.<name>)."""
