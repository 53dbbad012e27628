"""Scheduler: places jobs that hold quota onto nodes."""
