-- The two singleton rules of `jobs` move to an exact-key table, so that a job
-- with a singleton key (every stage job) ends by a closure too, as a plain
-- job does since `2026-12-05-150000_job_closures` (issue 31,
-- docs/storage-under-pressure.md, step 4 (a)). Before, such a job had to
-- leave the partial index `jobs_singleton_live_uq` by an UPDATE of its row:
-- a dead tuple in the table the fetch walks, for every stage job.
--
-- * `job_singletons`: one row per job sent with a key, inserted by the send
--   in the statement that inserts the job (a conflict is the send's
--   `Duplicate`, and then no job is inserted). Its two partial unique indexes
--   are the rules `jobs` had: one live job per (queue, key), and one job per
--   (queue, key, window) while the job's row is kept.
-- * Every end of a job for good (completed, failed, cancelled; not a retry)
--   releases its key in the same statement: a key without a window is
--   deleted (a dead tuple here, in a small table read by exact key only); a
--   windowed one stays, not live, until its job's row is deleted. A
--   completion writes only a closure and releases the key itself; an end that
--   writes the row's state (a failure, a cancel, an expiry, or any writer's
--   UPDATE) releases it by the trigger below, which also takes the key back
--   for a job made live again (a second live job of the key is then a unique
--   violation, as it was with the index on `jobs`).
-- * A job's row deleted (the retention, or by hand) takes its key with it, in
--   the deleting statement (a statement trigger): no key outlives its job, so
--   none refuses a send, or keeps an item open, for a job that is gone.
-- * Two ends of one attempt meet on the closure's key (`job_closures`), for
--   every job now; only the one whose closure was inserted releases the key.
-- * The stage form of a key (`<queue>:<tenant>:<item>`) names the row's
--   tenant, for the tenant scope (idemstage_app), as `jobs`' labels check
--   requires of a job: a scoped transaction cannot hold another tenant's
--   stage key by a row of its own.

CREATE TABLE job_singletons (
    job_id text PRIMARY KEY,
    queue text NOT NULL,
    singleton_key text NOT NULL,
    -- Start of the job's throttle window (`singleton_seconds`); NULL: none.
    singleton_on timestamptz,
    live boolean NOT NULL DEFAULT true,
    tenant_id text NOT NULL
) WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
CREATE UNIQUE INDEX job_singletons_live_uq ON job_singletons (queue, singleton_key)
    WHERE live;
CREATE UNIQUE INDEX job_singletons_window_uq
    ON job_singletons (queue, singleton_key, singleton_on)
    WHERE singleton_on IS NOT NULL;

INSERT INTO job_singletons (job_id, queue, singleton_key, singleton_on, live, tenant_id)
SELECT j.id, j.queue, j.singleton_key, j.singleton_on, j.state IN ('created', 'retry'),
       j.tenant_id
  FROM jobs j
 WHERE j.singleton_key IS NOT NULL
   AND (j.state IN ('created', 'retry') OR j.singleton_on IS NOT NULL);

DROP INDEX jobs_singleton_live_uq;
DROP INDEX jobs_singleton_window_uq;

-- AFTER, and only when the state crosses between live and ended: the hot
-- path (fetch, completion) writes no version of the row, and a retry or a
-- release stays live (the WHEN is false).
CREATE FUNCTION idemstage_jobs_key_follows_state() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state IN ('created', 'retry') THEN
        INSERT INTO public.job_singletons (job_id, queue, singleton_key, singleton_on,
                                           tenant_id)
        VALUES (NEW.id, NEW.queue, NEW.singleton_key, NEW.singleton_on, NEW.tenant_id)
        ON CONFLICT (job_id) DO UPDATE SET live = true;
    ELSIF NEW.singleton_on IS NULL THEN
        DELETE FROM public.job_singletons WHERE job_id = NEW.id;
    ELSE
        UPDATE public.job_singletons SET live = false WHERE job_id = NEW.id AND live;
    END IF;
    RETURN NULL;
END;
$$;
CREATE TRIGGER jobs_key_follows_state
    AFTER UPDATE OF state ON jobs
    FOR EACH ROW
    WHEN (NEW.singleton_key IS NOT NULL
          AND (OLD.state IN ('created', 'retry')) <> (NEW.state IN ('created', 'retry')))
    EXECUTE FUNCTION idemstage_jobs_key_follows_state();

CREATE FUNCTION idemstage_jobs_release_keys() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM public.job_singletons g
     WHERE g.job_id = ANY(ARRAY(SELECT d.id FROM deleted d));
    RETURN NULL;
END;
$$;
CREATE TRIGGER jobs_release_keys
    AFTER DELETE ON jobs REFERENCING OLD TABLE AS deleted
    FOR EACH STATEMENT EXECUTE FUNCTION idemstage_jobs_release_keys();

-- The tenant a key of the stage form names, or NULL for any other key (the
-- form `jobs`' labels check reads: a slug, a colon, a ULID, after the queue).
CREATE FUNCTION idemstage_stage_key_tenant(p_queue text, p_key text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path TO 'pg_catalog', 'pg_temp'
AS $$
    SELECT CASE
        WHEN left(p_key, length(p_queue) + 1) = p_queue || ':'
         AND substr(p_key, length(p_queue) + 2) ~ '^[a-z0-9][a-z0-9_-]*:[0-7][0-9A-HJKMNP-TV-Z]*$'
         AND length(split_part(substr(p_key, length(p_queue) + 2), ':', 1)) <= 63
         AND length(split_part(substr(p_key, length(p_queue) + 2), ':', 2)) = 26
        THEN split_part(substr(p_key, length(p_queue) + 2), ':', 1)
    END
$$;

-- Not FORCEd, as `jobs`: the owner works the queue as it is.
ALTER TABLE job_singletons ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON job_singletons TO idemstage_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY stage_key_of_own_tenant ON job_singletons AS RESTRICTIVE FOR INSERT
    TO idemstage_app
    WITH CHECK (coalesce(idemstage_stage_key_tenant(queue, singleton_key) = tenant_id, true));
CREATE POLICY queue_work ON job_singletons TO idemstage_worker, idemstage_operator
    USING (true) WITH CHECK (true);
GRANT SELECT, INSERT, UPDATE, DELETE ON job_singletons
    TO idemstage_app, idemstage_worker, idemstage_operator;
