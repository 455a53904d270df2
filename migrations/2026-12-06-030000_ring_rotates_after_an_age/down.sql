DROP FUNCTION idemstage_items_open_rotate(interval);
CREATE FUNCTION idemstage_items_open_rotate() RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_epoch bigint;
BEGIN
    IF NOT pg_try_advisory_xact_lock(1768189285, -1) THEN
        RETURN (SELECT last_value FROM public.items_open_epoch);
    END IF;
    SELECT last_value INTO v_epoch FROM public.items_open_epoch;
    IF EXISTS (SELECT 1 FROM public.items_open WHERE slot = (v_epoch + 1) % 4) THEN
        RETURN v_epoch;
    END IF;
    RETURN nextval('public.items_open_epoch');
END;
$$;
REVOKE EXECUTE ON FUNCTION idemstage_items_open_rotate() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idemstage_items_open_rotate() TO idemstage_worker, idemstage_operator;
