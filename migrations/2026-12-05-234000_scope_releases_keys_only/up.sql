-- The tenant scope may release a key's row, never take one
-- (2026-12-05-233000_keys_kept_between_jobs kept a key's row between its
-- jobs, not live, and left the scope UPDATE of `live` for a stage's fenced
-- completion, which runs in the scope and releases its key). Set live again
-- by hand, an ended key's row would hold the key for a job that is over:
-- every later send of it refused until the retention, another tenant's too
-- (a plain key is shared between tenants). A key is taken only by `jobs`'
-- triggers, which run as the tables' owner and are not held by this policy.
-- A lock on the row (a repoint's FOR UPDATE) checks no new row.
CREATE POLICY scope_releases_only ON job_keys AS RESTRICTIVE FOR UPDATE TO idemstage_app
    USING (true) WITH CHECK (NOT live);
