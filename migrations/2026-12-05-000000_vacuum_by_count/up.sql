-- Vacuum the hot tables by count, not by size (issue 31).
--
-- Autovacuum visits a table when its dead tuples pass
-- `autovacuum_vacuum_threshold + autovacuum_vacuum_scale_factor * rows`
-- (defaults 50 + 20 %). `jobs` keeps every finished job for the retention (7
-- days), and each job leaves two dead tuples (its lease and its finish are no
-- HOT updates: they change the ready index's predicate column), so at a steady
-- rate the dead tuples it waits for grow with the table: at 200 jobs/s for two
-- hours, ~290,000 before a visit, and their room in the heap and the indexes is
-- reused only after it. The stage tables and the other queue tables grow and
-- churn the same way, less (their updates are mostly HOT; `items_open` and
-- `stage_waits` delete).
--
-- With the scale factor at 0 a table is visited once it has 1,000 dead tuples,
-- whatever its size, so the dead tuples stay bounded by what one autovacuum
-- round (`autovacuum_naptime`, 1 minute by default) lets pile up. Such a visit
-- stays cheap on a large table: the visibility map skips the pages of finished
-- rows, and below 2 % of pages with dead tuples vacuum skips the index pass.
-- What a held snapshot keeps, no setting reclaims: that is the storage work of
-- docs/storage-under-pressure.md.
ALTER TABLE jobs SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
ALTER TABLE items_open SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
ALTER TABLE stage_runs SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
ALTER TABLE stage_run_attempts SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
ALTER TABLE stage_checkpoints SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
ALTER TABLE stage_waits SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
ALTER TABLE fanouts SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
ALTER TABLE fanout_children SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
ALTER TABLE job_lanes SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
ALTER TABLE queue_buckets SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
