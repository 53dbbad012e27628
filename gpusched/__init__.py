"""Shared runtime of the gpusched services: event log, clock, settings, observability, CLI.

Services import this package and :mod:`schemas`, never each other.
"""
