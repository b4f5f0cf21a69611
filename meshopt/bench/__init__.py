"""Benchmarks that ship with the package (``meshopt bench ...``)."""
