-- Every change of a queue control (pause, resume, a cap, a rate, a weight) is
-- recorded, with who made it: `queue_control_changes`, append-only, written by a
-- trigger on `queue_controls`, so that a change made through the CLI, the
-- console, the library or plain SQL is recorded alike.
--
-- * actor: who the library was told made it (`idemstage pause --actor`, the
--   console's session), passed as the transaction-local setting
--   `idemstage.actor`; NULL for a change made without one (plain SQL).
-- * db_user: the login role of the session (`session_user`), always.
-- * the control's values after the change (NULLs for a removed row).
--
-- The trigger function runs as the table's owner (SECURITY DEFINER), so the
-- operator role that changes controls may read the changes but never write,
-- alter or delete one; nobody but the owner can.
CREATE TABLE queue_control_changes (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    changed_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    queue          text NOT NULL,
    scope          text NOT NULL,
    change         text NOT NULL
        CHECK (change IN ('pause', 'resume', 'limits', 'remove')),
    paused         boolean,
    max_active     integer,
    rate_count     integer,
    rate_period_ms bigint,
    rate_burst     integer,
    weight         integer,
    actor          text,
    db_user        text NOT NULL
);

CREATE INDEX queue_control_changes_queue_idx ON queue_control_changes (queue, id);

CREATE FUNCTION idemstage_record_control_change() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v_row queue_controls;
    v_change text;
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO queue_control_changes (queue, scope, change, actor, db_user)
        VALUES (OLD.queue, OLD.scope, 'remove',
                nullif(current_setting('idemstage.actor', true), ''), session_user);
        RETURN NULL;
    END IF;
    v_row := NEW;
    IF TG_OP = 'UPDATE' THEN
        IF OLD.paused IS DISTINCT FROM NEW.paused THEN
            v_change := CASE WHEN NEW.paused THEN 'pause' ELSE 'resume' END;
        ELSIF (OLD.max_active, OLD.rate_count, OLD.rate_period_ms, OLD.rate_burst, OLD.weight)
              IS DISTINCT FROM
              (NEW.max_active, NEW.rate_count, NEW.rate_period_ms, NEW.rate_burst, NEW.weight) THEN
            v_change := 'limits';
        ELSE
            -- Nothing an operator sees changed (the fetch's lock, a repeated
            -- setting): not a change.
            RETURN NULL;
        END IF;
    ELSE
        v_change := CASE WHEN NEW.paused THEN 'pause' ELSE 'limits' END;
    END IF;
    INSERT INTO queue_control_changes
        (queue, scope, change, paused, max_active, rate_count, rate_period_ms,
         rate_burst, weight, actor, db_user)
    VALUES (v_row.queue, v_row.scope, v_change, v_row.paused, v_row.max_active,
            v_row.rate_count, v_row.rate_period_ms, v_row.rate_burst, v_row.weight,
            nullif(current_setting('idemstage.actor', true), ''), session_user);
    RETURN NULL;
END
$$;

REVOKE ALL ON FUNCTION idemstage_record_control_change() FROM PUBLIC;

CREATE TRIGGER queue_controls_changes
    AFTER INSERT OR UPDATE OR DELETE ON queue_controls
    FOR EACH ROW EXECUTE FUNCTION idemstage_record_control_change();

GRANT SELECT ON queue_control_changes TO idemstage_operator;
