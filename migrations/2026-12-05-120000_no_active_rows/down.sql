ALTER TABLE jobs DROP CONSTRAINT jobs_no_lease;
ALTER TABLE jobs ADD CONSTRAINT jobs_lease_iff_active
    CHECK ((state = 'active') = (lease_expires_at IS NOT NULL));
ALTER TABLE jobs DROP CONSTRAINT jobs_state_check;
ALTER TABLE jobs ADD CONSTRAINT jobs_state_check
    CHECK (state IN ('created', 'retry', 'active', 'completed', 'cancelled', 'failed'));
