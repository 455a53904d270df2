-- A singleton key's row is kept between the key's jobs (issue 31): before,
-- `job_singletons` had a row per keyed job, deleted when the job ended
-- (every stage job: one dead tuple a stage, which only VACUUM reclaims, and
-- with it an index entry). Now the two rules have a table each:
--
-- * `job_keys`, one row per (queue, key), the key's last job and whether it
--   is live. A job ended for good sets `live` false; the key's next send
--   takes the row over (`job_id`, `live`). Neither touches an indexed column,
--   so both are HOT updates (the fillfactor keeps room on the page): a page
--   read prunes the old version, no VACUUM needed, and the index does not
--   grow. The row is deleted with its last job's row (the retention).
-- * `job_windows`, one row per job sent with a throttle window, as before:
--   one job per (queue, key, window) while the job's row is kept.
--
-- Taking a key, in a send (READ COMMITTED): insert the row; on a conflict,
-- take it over only where it is not live. The insert's conflict check waits
-- for a transaction writing the row (a completion releasing it, another
-- sender taking it), so the takeover's snapshot, taken after, sees what that
-- transaction committed: a send that waited for the holder's completion goes
-- in, as it did when the completion deleted the row. A duplicate takes no
-- lock on the row, so a sender's open transaction never holds up the
-- holder's completion. Under REPEATABLE READ or SERIALIZABLE the takeover
-- is one INSERT ... ON CONFLICT DO UPDATE: a row released after the
-- transaction's snapshot is a serialization failure (retryable), never a
-- silent `Duplicate`.
--
-- The key functions run as the tables' owner (SECURITY DEFINER): a released
-- row of one tenant's generic key is taken over by another tenant's send,
-- which that tenant's scope could not see. Every row they write mirrors a
-- job row that passed `jobs`' policies and labels check (a stage key names
-- its job's tenant), so the tenant scope keeps only SELECT on the tables,
-- and on `job_keys` an UPDATE of `live` (a stage's fenced completion, in the
-- tenant scope, releases its key; a repoint locks the row): it can neither
-- insert nor delete nor rename a key row.

CREATE TABLE job_keys (
    queue text NOT NULL,
    singleton_key text NOT NULL,
    -- The job that took the key last (live, or ended).
    job_id text NOT NULL,
    live boolean NOT NULL DEFAULT true,
    tenant_id text NOT NULL,
    PRIMARY KEY (queue, singleton_key)
) WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0,
        autovacuum_vacuum_threshold = 1000);

CREATE TABLE job_windows (
    job_id text PRIMARY KEY,
    queue text NOT NULL,
    singleton_key text NOT NULL,
    singleton_on timestamptz NOT NULL,
    tenant_id text NOT NULL,
    CONSTRAINT job_windows_uq UNIQUE (queue, singleton_key, singleton_on)
) WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);

INSERT INTO job_keys (queue, singleton_key, job_id, live, tenant_id)
SELECT queue, singleton_key, job_id, true, tenant_id FROM job_singletons WHERE live;
INSERT INTO job_windows (job_id, queue, singleton_key, singleton_on, tenant_id)
SELECT job_id, queue, singleton_key, singleton_on, tenant_id
  FROM job_singletons WHERE singleton_on IS NOT NULL;

-- Takes the key (`p_queue`, `p_key`) for job `p_job`: false when a live job
-- holds it (the send's `Duplicate`). Called by the key triggers only.
CREATE FUNCTION idemstage_take_key(p_queue text, p_key text, p_job text, p_tenant text)
RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        INSERT INTO public.job_keys AS k (queue, singleton_key, job_id, tenant_id)
        VALUES (p_queue, p_key, p_job, p_tenant)
        ON CONFLICT (queue, singleton_key) DO UPDATE
           SET job_id = EXCLUDED.job_id, live = true, tenant_id = EXCLUDED.tenant_id
         WHERE NOT k.live;
        RETURN FOUND;
    END IF;
    LOOP
        INSERT INTO public.job_keys (queue, singleton_key, job_id, tenant_id)
        VALUES (p_queue, p_key, p_job, p_tenant)
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            RETURN true;
        END IF;
        UPDATE public.job_keys SET job_id = p_job, live = true, tenant_id = p_tenant
         WHERE queue = p_queue AND singleton_key = p_key AND NOT live;
        IF FOUND THEN
            RETURN true;
        END IF;
        PERFORM 1 FROM public.job_keys
         WHERE queue = p_queue AND singleton_key = p_key AND live;
        IF FOUND THEN
            RETURN false;
        END IF;
        -- Released, or deleted with its job, since the update's snapshot: again.
    END LOOP;
END;
$$;
REVOKE EXECUTE ON FUNCTION idemstage_take_key(text, text, text, text) FROM PUBLIC;

-- Takes the key back for a job made live again (or moved onto a key), as
-- the unique index on `jobs` did: another live job of the key is a unique
-- violation.
CREATE FUNCTION idemstage_take_key_or_raise(p_queue text, p_key text, p_job text,
                                            p_tenant text)
RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_holder text;
BEGIN
    INSERT INTO public.job_keys AS k (queue, singleton_key, job_id, tenant_id)
    VALUES (p_queue, p_key, p_job, p_tenant)
    ON CONFLICT (queue, singleton_key) DO UPDATE
       SET job_id = EXCLUDED.job_id, live = true, tenant_id = EXCLUDED.tenant_id
     WHERE NOT k.live OR k.job_id = EXCLUDED.job_id;
    IF NOT FOUND THEN
        SELECT job_id INTO v_holder FROM public.job_keys
         WHERE queue = p_queue AND singleton_key = p_key;
        RAISE EXCEPTION USING
            ERRCODE = 'unique_violation',
            CONSTRAINT = 'job_keys_pkey',
            MESSAGE = format('duplicate key value violates unique constraint "job_keys_pkey": '
                             'key %s of queue %s is held by live job %s', p_key, p_queue,
                             v_holder);
    END IF;
END;
$$;
REVOKE EXECUTE ON FUNCTION idemstage_take_key_or_raise(text, text, text, text) FROM PUBLIC;

CREATE OR REPLACE FUNCTION idemstage_jobs_take_key() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NEW.singleton_on IS NOT NULL THEN
        INSERT INTO public.job_windows (job_id, queue, singleton_key, singleton_on, tenant_id)
        VALUES (NEW.id, NEW.queue, NEW.singleton_key, NEW.singleton_on, NEW.tenant_id)
        ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
    END IF;
    IF public.idemstage_take_key(NEW.queue, NEW.singleton_key, NEW.id, NEW.tenant_id) THEN
        RETURN NEW;
    END IF;
    -- Refused: the job is not inserted, so neither is its window.
    IF NEW.singleton_on IS NOT NULL THEN
        DELETE FROM public.job_windows WHERE job_id = NEW.id;
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION idemstage_jobs_key_follows_state() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NEW.state IN ('created', 'retry') THEN
        PERFORM public.idemstage_take_key_or_raise(NEW.queue, NEW.singleton_key, NEW.id,
                                                   NEW.tenant_id);
    ELSE
        UPDATE public.job_keys SET live = false
         WHERE queue = NEW.queue AND singleton_key = NEW.singleton_key AND job_id = NEW.id
           AND live;
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION idemstage_jobs_key_follows_labels() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF OLD.singleton_key IS NOT NULL THEN
        DELETE FROM public.job_keys
         WHERE queue = OLD.queue AND singleton_key = OLD.singleton_key AND job_id = OLD.id;
        DELETE FROM public.job_windows WHERE job_id = OLD.id;
    END IF;
    IF NEW.singleton_key IS NULL THEN
        RETURN NULL;
    END IF;
    IF NEW.singleton_on IS NOT NULL THEN
        INSERT INTO public.job_windows (job_id, queue, singleton_key, singleton_on, tenant_id)
        VALUES (NEW.id, NEW.queue, NEW.singleton_key, NEW.singleton_on, NEW.tenant_id);
    END IF;
    IF NEW.state IN ('created', 'retry')
       AND NOT EXISTS (SELECT 1 FROM public.job_closures z WHERE z.ready_seq = NEW.ready_seq) THEN
        PERFORM public.idemstage_take_key_or_raise(NEW.queue, NEW.singleton_key, NEW.id,
                                                   NEW.tenant_id);
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION idemstage_jobs_release_keys() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    DELETE FROM public.job_keys k
     USING (SELECT d.id, d.queue, d.singleton_key FROM deleted d
             WHERE d.singleton_key IS NOT NULL) d
     WHERE k.queue = d.queue AND k.singleton_key = d.singleton_key AND k.job_id = d.id;
    DELETE FROM public.job_windows w
     WHERE w.job_id = ANY(ARRAY(SELECT d.id FROM deleted d WHERE d.singleton_on IS NOT NULL));
    RETURN NULL;
END;
$$;

DROP TABLE job_singletons;

-- Not FORCEd, as `jobs`: the owner works the queue as it is.
ALTER TABLE job_keys ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON job_keys TO idemstage_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY queue_work ON job_keys TO idemstage_worker, idemstage_operator
    USING (true) WITH CHECK (true);
GRANT SELECT ON job_keys TO idemstage_app;
GRANT UPDATE (live) ON job_keys TO idemstage_app;
GRANT SELECT, INSERT, UPDATE, DELETE ON job_keys TO idemstage_worker, idemstage_operator;

ALTER TABLE job_windows ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON job_windows TO idemstage_app
    USING (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY queue_work ON job_windows TO idemstage_worker, idemstage_operator
    USING (true) WITH CHECK (true);
GRANT SELECT ON job_windows TO idemstage_app;
GRANT SELECT, INSERT, UPDATE, DELETE ON job_windows TO idemstage_worker, idemstage_operator;
