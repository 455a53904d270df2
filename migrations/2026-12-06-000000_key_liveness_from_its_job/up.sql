-- A key's row names its job; whether the key is held is read from that job
-- (issue 31). Before, an end for good wrote the key's row (`live` false): a
-- row version per stage job, pruned only when a later statement read its
-- page (a stage key is mostly used once, so most waited for VACUUM), and
-- under a held snapshot one version per stage. Now nothing is written to
-- `job_keys` when a job ends: the key is held while its job's row is
-- `created` or `retry` and no `completed` closure names the row's current
-- entry (`idemstage_key_holder_live`, two probes by key).
--
-- Who writes a key's row, and how they meet (READ COMMITTED):
--
-- * A send inserts the row; on a conflict it reads the holder and, while the
--   holder is live, is a `Duplicate` without a lock (a holder whose end is
--   not yet committed is live: the send is ordered before that end). A
--   holder that ended is taken over by an update of the version it read
--   (`xmin`): a sender that took it first, or the holder made live again,
--   wrote another version, and the send reads the key again.
-- * A job made live again (an operator's retry) or moved onto a key takes
--   the row under its lock and writes it even when it names the job
--   already: a sender that saw the holder ended finds another version; under
--   REPEATABLE READ the written row is a serialization failure for it.
-- * An end for good writes nothing; the row is deleted with its last job's
--   row (the retention), as before.
--
-- Under REPEATABLE READ a holder that ended after the snapshot is live to
-- it: a `Duplicate`, as the snapshot says. The tenant scope needs no write
-- on `job_keys` any more (its completion wrote `live`): it may read and
-- lock its rows, not write them.

-- PL/pgSQL, not SQL: its plan is kept for the session (a SQL function with
-- a SET clause is planned again on every call from the send's function).
CREATE FUNCTION idemstage_key_holder_live(p_job text) RETURNS boolean
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN EXISTS (
        SELECT 1 FROM public.jobs j
         WHERE j.id = p_job AND j.state IN ('created', 'retry')
           AND (SELECT 1 FROM public.job_closures z
                 WHERE z.ready_seq = j.ready_seq AND z.outcome = 'completed') IS NULL);
END;
$$;

-- Takes the key (`p_queue`, `p_key`) for job `p_job`: false when a live job
-- holds it (the send's `Duplicate`). Called by the key triggers only. A
-- holder that ended is taken over by an update of the very version of the
-- row that was read (its `xmin`): a sender that took the row first, or the
-- holder made live again (which writes the row), leaves another version, the
-- update's re-check after its wait finds none, and the key is read again.
CREATE OR REPLACE FUNCTION idemstage_take_key(p_queue text, p_key text, p_job text,
                                              p_tenant text)
RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_version xid;
    v_live boolean;
BEGIN
    LOOP
        INSERT INTO public.job_keys (queue, singleton_key, job_id, tenant_id)
        VALUES (p_queue, p_key, p_job, p_tenant)
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            RETURN true;
        END IF;
        SELECT k.xmin,
               EXISTS (SELECT 1 FROM public.jobs j
                        WHERE j.id = k.job_id AND j.state IN ('created', 'retry')
                          AND (SELECT 1 FROM public.job_closures z
                                WHERE z.ready_seq = j.ready_seq
                                  AND z.outcome = 'completed') IS NULL)
          INTO v_version, v_live
          FROM public.job_keys k
         WHERE k.queue = p_queue AND k.singleton_key = p_key;
        IF FOUND THEN
            IF v_live THEN
                RETURN false;
            END IF;
            UPDATE public.job_keys SET job_id = p_job, tenant_id = p_tenant
             WHERE queue = p_queue AND singleton_key = p_key AND xmin = v_version;
            IF FOUND THEN
                RETURN true;
            END IF;
        END IF;
        -- Taken over, written, or deleted with its job since the look: again.
    END LOOP;
END;
$$;

-- Takes the key for a job made live again (or moved onto a key), as the
-- unique index on `jobs` did: another live job of the key is a unique
-- violation. The row is written even when it names the job already (above).
CREATE OR REPLACE FUNCTION idemstage_take_key_or_raise(p_queue text, p_key text,
                                                       p_job text, p_tenant text)
RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_holder text;
BEGIN
    LOOP
        INSERT INTO public.job_keys (queue, singleton_key, job_id, tenant_id)
        VALUES (p_queue, p_key, p_job, p_tenant)
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            RETURN;
        END IF;
        SELECT job_id INTO v_holder FROM public.job_keys
         WHERE queue = p_queue AND singleton_key = p_key
           FOR UPDATE;
        IF FOUND THEN
            IF v_holder <> p_job AND public.idemstage_key_holder_live(v_holder) THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'unique_violation',
                    CONSTRAINT = 'job_keys_pkey',
                    MESSAGE = format('duplicate key value violates unique constraint '
                                     '"job_keys_pkey": key %s of queue %s is held by live '
                                     'job %s', p_key, p_queue, v_holder);
            END IF;
            UPDATE public.job_keys SET job_id = p_job, tenant_id = p_tenant
             WHERE queue = p_queue AND singleton_key = p_key;
            RETURN;
        END IF;
    END LOOP;
END;
$$;

-- A job ended for good leaves its key's row as it is; made live again, it
-- takes the key back.
CREATE OR REPLACE FUNCTION idemstage_jobs_key_follows_state() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NEW.state IN ('created', 'retry') THEN
        PERFORM public.idemstage_take_key_or_raise(NEW.queue, NEW.singleton_key, NEW.id,
                                                   NEW.tenant_id);
    END IF;
    RETURN NULL;
END;
$$;

-- The tenant scope locks its key's row (a repoint; FOR UPDATE needs an
-- UPDATE privilege) and writes none: the privilege is for the lock, the
-- policy refuses every row an UPDATE would write.
DROP POLICY scope_releases_only ON job_keys;
ALTER TABLE job_keys DROP COLUMN live;
GRANT UPDATE (job_id) ON job_keys TO idemstage_app;
CREATE POLICY scope_locks_only ON job_keys AS RESTRICTIVE FOR UPDATE TO idemstage_app
    USING (true) WITH CHECK (false);
