-- The old predicate `state = 'active'` was implied by every fenced job statement
-- (`WHERE id = $1 AND attempt = $2 AND state = 'active'`). When the statistics said
-- that no job was active (analysed while the queue was idle, or right after a bulk
-- insert), the planner costed a full scan of this index at one row, below a probe
-- of the primary key, and then scanned every active job for each statement:
-- `complete_many` became quadratic in the number of jobs in flight. Keyed on the
-- lease itself, the index is chosen only by conditions on the lease (maintenance's
-- `lease_expires_at < now()`); the CHECK keeps "has a lease" and "is active" the
-- same set of rows.
ALTER TABLE jobs ADD CONSTRAINT jobs_lease_iff_active
    CHECK ((state = 'active') = (lease_expires_at IS NOT NULL));
DROP INDEX jobs_lease_idx;
CREATE INDEX jobs_lease_idx ON jobs (lease_expires_at) WHERE lease_expires_at IS NOT NULL;
