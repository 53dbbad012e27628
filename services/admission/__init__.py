"""Admission: validates submissions and cancel requests from the intake subjects."""
