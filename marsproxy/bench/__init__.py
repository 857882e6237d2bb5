"""Benchmarks and workload replay."""
