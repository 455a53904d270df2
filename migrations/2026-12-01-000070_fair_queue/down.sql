DROP FUNCTION idemstage_fetch(text[], integer);
DROP FUNCTION idemstage_fetch_controlled(text, integer);
DROP FUNCTION idemstage_fetch_plain(text, integer);
DROP FUNCTION idemstage_bucket_tokens(queue_buckets, integer, bigint, integer);
DROP TABLE queue_buckets;
DROP TABLE queue_controls;
DROP INDEX jobs_lease_idx;
CREATE INDEX jobs_lease_idx ON jobs (lease_expires_at) WHERE lease_expires_at IS NOT NULL;
DROP INDEX jobs_fetch_idx;
CREATE INDEX jobs_fetch_idx ON jobs (queue, priority DESC, id)
    WHERE state IN ('created', 'retry');
ALTER TABLE jobs DROP COLUMN tenant_id;
