-- Money is numeric, never a binary float (docs/accounting.md#money): an issued statement's total
-- as the statement writes it, and the price book's CPU and memory prices as the book gives them.
ALTER TABLE statements ALTER COLUMN total_cost TYPE numeric USING total_cost::numeric;
ALTER TABLE price_books ALTER COLUMN cpu_core_hour TYPE numeric USING cpu_core_hour::numeric,
                        ALTER COLUMN memory_gib_hour TYPE numeric USING memory_gib_hour::numeric;
