"""Benchmarks: the cross-backbone table (`python -m train.bench`), the op benchmarks and their timing helpers."""
