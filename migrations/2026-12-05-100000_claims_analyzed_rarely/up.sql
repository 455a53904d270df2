-- `job_claims` is insert-only on the hot path, so its autovacuum is the one
-- that inserts start (to set the visibility map) and its ANALYZE, at the
-- defaults every 1,000 and every 50 rows plus a fraction of the table. While
-- the table is small (a young database, a benchmark's) that is a round every
-- few hundred milliseconds at a drain's pace, and an ANALYZE holds a snapshot
-- while it samples: the fetch's spent entries cannot be marked dead in the
-- ready index meanwhile, and each fetch walks them again. Measured
-- (BENCHMARKS.md "2026-12-05 01:00"): the raw drain loops of two at 57k jobs/s
-- with the defaults, 71-73k with autovacuum off on the table, as before the
-- claims. Its plans do not need fresh statistics (the fetch probes it by key
-- and forces generic plans; expiry and caps read it by index ranges), so both
-- wait for 100,000 rows; dead tuples (renewals, retention) are still vacuumed
-- every 1,000.
ALTER TABLE job_claims SET (
    autovacuum_vacuum_insert_threshold = 100000,
    autovacuum_analyze_threshold = 100000
);
