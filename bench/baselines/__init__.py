"""Baselines the benchmarks compare against: systems that are not part of the product."""
