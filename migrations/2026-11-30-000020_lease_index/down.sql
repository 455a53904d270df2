DROP INDEX jobs_lease_idx;
CREATE INDEX jobs_lease_idx ON jobs (lease_expires_at) WHERE state = 'active';
ALTER TABLE jobs DROP CONSTRAINT jobs_lease_iff_active;
