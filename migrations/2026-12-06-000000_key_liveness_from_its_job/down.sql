DROP POLICY scope_locks_only ON job_keys;
REVOKE UPDATE (job_id) ON job_keys FROM idemstage_app;
ALTER TABLE job_keys ADD COLUMN live boolean NOT NULL DEFAULT true;
UPDATE job_keys SET live = idemstage_key_holder_live(job_id);
GRANT UPDATE (live) ON job_keys TO idemstage_app;
CREATE POLICY scope_releases_only ON job_keys AS RESTRICTIVE FOR UPDATE TO idemstage_app
    USING (true) WITH CHECK (NOT live);

CREATE OR REPLACE FUNCTION idemstage_take_key(p_queue text, p_key text, p_job text, p_tenant text)
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

CREATE OR REPLACE FUNCTION idemstage_take_key_or_raise(p_queue text, p_key text, p_job text,
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

DROP FUNCTION idemstage_key_holder_live(text);
