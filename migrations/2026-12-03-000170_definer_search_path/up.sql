-- The one SECURITY DEFINER function, the control-change trigger (000140/000150),
-- runs as the tables' owner. Under 000150 it called `idemstage_actor_tag()`
-- unqualified with `search_path = public, pg_temp`, and wrote
-- `queue_control_changes` by name: whoever may drop and create objects in
-- `public` (its owner, `pg_database_owner`, i.e. the database's owner on
-- PostgreSQL 15) could replace that function, or that table (with a trigger of
-- its own), and the next control change by anyone ran that code as the owner,
-- who may switch row-level security off.
--
-- Now the function:
-- * resolves names in `pg_catalog` only (`search_path = pg_catalog, pg_temp`;
--   functions and operators are never looked up in `pg_temp`), and names every
--   table `public.`-qualified;
-- * computes the statement's tag itself, from `pg_catalog` functions (the same
--   expression as `public.idemstage_actor_tag()`, which the library's control
--   statements still call as the caller, with the caller's rights);
-- * writes only into a `public.queue_control_changes` that its own owner owns
--   (locked first, so it cannot be swapped in between), and runs only for a
--   `public.queue_controls` its owner owns: a table put in their place by
--   another role makes the control change fail instead of running that role's
--   triggers as the owner.
CREATE OR REPLACE FUNCTION public.idemstage_record_control_change() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_change text;
    v_tag text;
    v_setting text;
    v_actor text;
    v_owner oid;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        IF OLD.paused IS DISTINCT FROM NEW.paused THEN
            v_change := CASE WHEN NEW.paused THEN 'pause' ELSE 'resume' END;
        ELSIF (OLD.max_active, OLD.rate_count, OLD.rate_period_ms, OLD.rate_burst, OLD.weight)
              IS DISTINCT FROM
              (NEW.max_active, NEW.rate_count, NEW.rate_period_ms, NEW.rate_burst, NEW.weight) THEN
            v_change := 'limits';
        ELSE
            -- Nothing an operator sees changed (the fetch's lock, a repeated
            -- setting): not a change, and nothing more to read.
            RETURN NULL;
        END IF;
    END IF;
    -- Only the owner's own tables: the one this trigger is on, and the record.
    LOCK TABLE public.queue_control_changes IN ROW EXCLUSIVE MODE;
    SELECT r.oid INTO v_owner FROM pg_catalog.pg_roles r WHERE r.rolname = current_user;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_class c
                    WHERE c.oid = pg_catalog.to_regclass('public.queue_control_changes')
                      AND c.relowner = v_owner)
       OR NOT EXISTS (SELECT FROM pg_catalog.pg_class c
                       WHERE c.oid = TG_RELID
                         AND c.oid = pg_catalog.to_regclass('public.queue_controls')
                         AND c.relowner = v_owner)
    THEN
        RAISE EXCEPTION 'idemstage: public.queue_controls or public.queue_control_changes is not owned by %: not recording into it', current_user
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    -- The actor only if the setting is this statement's (idemstage_actor_tag()).
    v_tag := (extract(epoch FROM pg_catalog.statement_timestamp()) * 1000000)::bigint::text || ':';
    v_setting := coalesce(pg_catalog.current_setting('idemstage.actor', true), '');
    IF pg_catalog.starts_with(v_setting, v_tag) THEN
        v_actor := nullif(pg_catalog.substr(v_setting, pg_catalog.length(v_tag) + 1), '');
    END IF;
    IF TG_OP = 'DELETE' THEN
        INSERT INTO public.queue_control_changes (queue, scope, change, actor, db_user)
        VALUES (OLD.queue, OLD.scope, 'remove', v_actor, session_user);
        RETURN NULL;
    END IF;
    IF TG_OP = 'INSERT' THEN
        v_change := CASE WHEN NEW.paused THEN 'pause' ELSE 'limits' END;
    END IF;
    INSERT INTO public.queue_control_changes
        (queue, scope, change, paused, max_active, rate_count, rate_period_ms,
         rate_burst, weight, actor, db_user)
    VALUES (NEW.queue, NEW.scope, v_change, NEW.paused, NEW.max_active,
            NEW.rate_count, NEW.rate_period_ms, NEW.rate_burst, NEW.weight,
            v_actor, session_user);
    RETURN NULL;
END
$$;
