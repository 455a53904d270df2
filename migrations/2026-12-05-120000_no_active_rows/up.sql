-- No job's row is `active` any more (issue 31): since the claims
-- (2026-12-05-090000_job_claims) a job is active while a claim in
-- `job_claims` names its current ready entry, and `job_states` shows it so.
-- A row written `active` by hand had no claim: nothing would fetch it, expire
-- it or end it, and the view would show it active for good. The state is now
-- refused in `jobs` (the migration that made the claims turned every active
-- row into a claim), and so is a lease on the row: the claim holds it.
-- Validating the new checks reads `jobs` once.
ALTER TABLE jobs DROP CONSTRAINT jobs_state_check;
ALTER TABLE jobs ADD CONSTRAINT jobs_state_check
    CHECK (state IN ('created', 'retry', 'completed', 'cancelled', 'failed'));
ALTER TABLE jobs DROP CONSTRAINT jobs_lease_iff_active;
ALTER TABLE jobs ADD CONSTRAINT jobs_no_lease CHECK (lease_expires_at IS NULL);
