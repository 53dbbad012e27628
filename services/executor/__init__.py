"""Executor: materialises placements on a backend and reports what happens to them."""
