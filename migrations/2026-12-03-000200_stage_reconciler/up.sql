-- Issue 29, item 4: a stage lost to a job that holds its singleton key, and the
-- reconciler that re-sends the job of every expected stage without a live one.
--
-- 1. A stage job's labels are checked against its payload, for every writer
--    (the library, a hand-written INSERT, a stage body's raw connection):
--    * a payload that names a tenant (`tenant_id`, a slug) names the job's tenant
--      (`jobs.tenant_id`): a job labelled otherwise would escape that tenant's
--      pause, caps and fair share;
--    * a singleton key of the stage form `<queue>:<tenant>:<anfrage>` names the
--      payload's tenant and anfrage: only the stage's own job may hold it. A job
--      squatting on it (another payload, another anfrage) would make the stage's
--      real send `Duplicate`.
--    A trigger, not a CHECK: a CHECK is evaluated on every UPDATE of a row (each
--    fetch, renewal, completion) and would refuse, at its next fetch, a row that
--    was written before this migration; the trigger runs only when one of the
--    columns it checks is written. Generic jobs (`QueueWorker`) are affected only
--    if their payload has a `tenant_id` slug (which must then be the label) or
--    their key has the stage form.
--
-- 2. `pipeline_runs.stopped_attempt`: the successful attempt whose body returned
--    `StageFlow::Stop` (the anfrage ends there, e.g. infeasible). The stage after
--    it is not expected while that attempt is the run's current success; a rerun
--    that succeeds with `Continue` moves `success_attempt` past it.
--
-- 3. `anfragen_open`: the anfragen that may have an expected stage which is not
--    final, so that the reconciler looks at those only, never at every anfrage
--    ever. A row is added when an anfrage is registered and whenever a stage job
--    is written for it (every way an anfrage's stage becomes not final again,
--    an operator's retry or a rerun on new input, sends such a job); the
--    reconciler deletes it once every expected stage is final and no job is live.
--    Writers take a shared transaction-level advisory lock on the anfrage (class
--    1768189295, 'idmo'), the reconciler an exclusive one before its last check
--    and the delete: a job written while the reconciler decides cannot be missed.

ALTER TABLE pipeline_runs ADD COLUMN stopped_attempt integer;

-- Plain text: the writers (the triggers below) pass only a tenant slug and a
-- ULID they checked, and a domain's regex would run again on every stage job.
CREATE TABLE anfragen_open (
    tenant_id  text        NOT NULL,
    anfrage_id text        NOT NULL,
    opened_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, anfrage_id)
);

-- Every anfrage registered before this migration is looked at once; the finished
-- ones are settled within the first passes (batch_limit per pass and worker).
INSERT INTO anfragen_open (tenant_id, anfrage_id) SELECT tenant_id, id FROM anfragen;

-- Like `jobs`: ids and tenants, no content. Added to by whoever writes jobs or
-- anfragen (through the triggers below, with the writer's rights); read across
-- tenants by the worker (which tenants to look at); settled inside a tenant's
-- scope.
GRANT SELECT, INSERT, DELETE ON anfragen_open TO idemstage_app;
GRANT SELECT, INSERT ON anfragen_open TO idemstage_worker, idemstage_operator;

-- `$1` tenant, `$2` anfrage: the anfrage is (again) one to look at.
-- PL/pgSQL, not SQL: a SQL function called from a trigger is planned again on
-- every call (a bulk insert of stage jobs measured 300 against 60 us a row).
CREATE FUNCTION idemstage_open_anfrage(p_tenant text, p_anfrage text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock_shared(1768189295, pg_catalog.hashtext(p_anfrage));
    INSERT INTO public.anfragen_open (tenant_id, anfrage_id) VALUES (p_tenant, p_anfrage)
        ON CONFLICT DO NOTHING;
END;
$$;
GRANT EXECUTE ON FUNCTION idemstage_open_anfrage(text, text)
    TO idemstage_app, idemstage_worker, idemstage_operator;

CREATE FUNCTION idemstage_jobs_check_labels() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_tenant  text;
    v_anfrage text;
    v_rest    text;
    v_key_tenant  text;
    v_key_anfrage text;
BEGIN
    IF pg_catalog.jsonb_typeof(NEW.payload) = 'object' THEN
        IF pg_catalog.jsonb_typeof(NEW.payload -> 'tenant_id') = 'string' THEN
            v_tenant := NEW.payload ->> 'tenant_id';
        END IF;
        IF pg_catalog.jsonb_typeof(NEW.payload -> 'anfrage_id') = 'string' THEN
            v_anfrage := NEW.payload ->> 'anfrage_id';
        END IF;
    END IF;
    -- A tenant that is no slug names no tenant: the job fails at its handler.
    IF v_tenant ~ '^[a-z0-9][a-z0-9_-]*$' AND pg_catalog.length(v_tenant) <= 63
       AND v_tenant <> NEW.tenant_id THEN
        RAISE EXCEPTION USING
            ERRCODE = 'check_violation',
            CONSTRAINT = 'jobs_tenant_label',
            MESSAGE = pg_catalog.format(
                'job %s of queue %s: its payload names tenant %s but the job is labelled %L',
                NEW.id, NEW.queue, v_tenant, NEW.tenant_id);
    END IF;
    IF NEW.singleton_key IS NOT NULL
       AND pg_catalog.left(NEW.singleton_key, pg_catalog.length(NEW.queue) + 1) = NEW.queue || ':' THEN
        v_rest := pg_catalog.substr(NEW.singleton_key, pg_catalog.length(NEW.queue) + 2);
        -- The stage form: a slug, a colon, a ULID (no counted repetition: a
        -- class with * and length tests).
        IF v_rest ~ '^[a-z0-9][a-z0-9_-]*:[0-7][0-9A-HJKMNP-TV-Z]*$' THEN
            v_key_tenant := pg_catalog.split_part(v_rest, ':', 1);
            v_key_anfrage := pg_catalog.split_part(v_rest, ':', 2);
            IF pg_catalog.length(v_key_tenant) <= 63 AND pg_catalog.length(v_key_anfrage) = 26 THEN
                IF v_tenant IS DISTINCT FROM v_key_tenant
                   OR v_anfrage IS DISTINCT FROM v_key_anfrage
                   OR NEW.tenant_id <> v_key_tenant THEN
                    RAISE EXCEPTION USING
                        ERRCODE = 'check_violation',
                        CONSTRAINT = 'jobs_stage_key',
                        MESSAGE = pg_catalog.format(
                            'job %s of queue %s: its singleton key %s is the key of the stage '
                            'job of tenant %s and anfrage %s, but its payload names tenant %s '
                            'and anfrage %s and it is labelled %L',
                            NEW.id, NEW.queue, NEW.singleton_key, v_key_tenant, v_key_anfrage,
                            coalesce(v_tenant, 'none'), coalesce(v_anfrage, 'none'),
                            NEW.tenant_id);
                END IF;
                PERFORM public.idemstage_open_anfrage(v_key_tenant, v_key_anfrage);
            END IF;
        END IF;
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER jobs_check_labels
    BEFORE INSERT OR UPDATE OF queue, payload, singleton_key, tenant_id ON jobs
    FOR EACH ROW EXECUTE FUNCTION idemstage_jobs_check_labels();

CREATE FUNCTION idemstage_anfragen_open() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM public.idemstage_open_anfrage(NEW.tenant_id, NEW.id);
    RETURN NULL;
END;
$$;

-- A new input (a rerun) makes the first stage expected again.
CREATE TRIGGER anfragen_open
    AFTER INSERT OR UPDATE OF input_sha256 ON anfragen
    FOR EACH ROW EXECUTE FUNCTION idemstage_anfragen_open();
