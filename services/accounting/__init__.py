"""Accounting: Postgres read models (jobs, usage ledger) rebuilt from the event log."""
