-- Which ledger rows were logged after a statement (statements.py: a period changed by an
-- attempt that ended late is recomputed, and revised if its figures differ).
CREATE INDEX usage_ledger_sequence ON usage_ledger (sequence);
