-- Back to 000150's trigger function.
CREATE OR REPLACE FUNCTION idemstage_record_control_change() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v_change text;
    v_tag text;
    v_setting text;
    v_actor text;
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
    -- The actor only if the setting is this statement's.
    v_tag := idemstage_actor_tag();
    v_setting := coalesce(current_setting('idemstage.actor', true), '');
    IF starts_with(v_setting, v_tag) THEN
        v_actor := nullif(substr(v_setting, length(v_tag) + 1), '');
    END IF;
    IF TG_OP = 'DELETE' THEN
        INSERT INTO queue_control_changes (queue, scope, change, actor, db_user)
        VALUES (OLD.queue, OLD.scope, 'remove', v_actor, session_user);
        RETURN NULL;
    END IF;
    IF TG_OP = 'INSERT' THEN
        v_change := CASE WHEN NEW.paused THEN 'pause' ELSE 'limits' END;
    END IF;
    INSERT INTO queue_control_changes
        (queue, scope, change, paused, max_active, rate_count, rate_period_ms,
         rate_burst, weight, actor, db_user)
    VALUES (NEW.queue, NEW.scope, v_change, NEW.paused, NEW.max_active,
            NEW.rate_count, NEW.rate_period_ms, NEW.rate_burst, NEW.weight,
            v_actor, session_user);
    RETURN NULL;
END
$$;
