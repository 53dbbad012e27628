"""Serving: keeps inference services at their desired replicas (docs/serving.md)."""
