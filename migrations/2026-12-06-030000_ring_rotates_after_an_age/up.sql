-- The ring of open items moves on once its current slot's oldest item is
-- `p_min_age` old, and says why it did not (issue 31). Two reconcilers whose
-- intervals start together both rotated, one right after the other, and
-- passed the same slots at the same time: each one's settle found the
-- other's locks on the items it had just found settled, and carried them
-- into the current slot (a slot held 8,000-10,000 items where one interval
-- opens 1,500). Now the second finds the ring `recent` and passes nothing;
-- a round passes the older slots only when it `rotated`, or when the slot it
-- would move onto still holds items (`full`: a truncate that failed, passed
-- again now). `busy`: another round is rotating.
DROP FUNCTION idemstage_items_open_rotate();
CREATE FUNCTION idemstage_items_open_rotate(p_min_age interval)
RETURNS TABLE (epoch bigint, outcome text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_epoch bigint;
BEGIN
    v_epoch := (SELECT s.last_value FROM public.items_open_epoch s);
    IF NOT pg_try_advisory_xact_lock(1768189285, -1) THEN
        RETURN QUERY SELECT v_epoch, 'busy'::text;
        RETURN;
    END IF;
    v_epoch := (SELECT s.last_value FROM public.items_open_epoch s);
    IF EXISTS (SELECT 1 FROM public.items_open o WHERE o.slot = (v_epoch + 1) % 4) THEN
        RETURN QUERY SELECT v_epoch, 'full'::text;
        RETURN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM public.items_open o
                    WHERE o.slot = v_epoch % 4 AND o.opened_at <= now() - p_min_age) THEN
        RETURN QUERY SELECT v_epoch, 'recent'::text;
        RETURN;
    END IF;
    RETURN QUERY SELECT nextval('public.items_open_epoch'), 'rotated'::text;
END;
$$;
REVOKE EXECUTE ON FUNCTION idemstage_items_open_rotate(interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idemstage_items_open_rotate(interval)
    TO idemstage_worker, idemstage_operator;
