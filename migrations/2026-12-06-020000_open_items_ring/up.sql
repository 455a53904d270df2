-- The reconciler's open items as a ring of four slots (issue 31). Before, a
-- settled item's row was deleted: a dead tuple per item for VACUUM (1,000 at
-- the median of the soaks, a vacuum a minute). Now `items_open` is list-
-- partitioned by `slot`, a slot is emptied whole by TRUNCATE once the
-- reconciler has passed it, and an item it does not find settled is opened
-- again in the current slot: nothing is ever deleted or updated.
--
-- The current slot is `epoch mod 4`, the epoch a sequence: its `last_value`
-- is read outside any snapshot, so a writer in REPEATABLE READ sees a
-- rotation that committed after its snapshot began. How a writer and the
-- reconciler meet (advisory locks of class 1768189285, 'idme', keyed by slot):
--
-- * a writer (`idemstage_open_item`, under the item's shared lock as before)
--   reads the epoch, takes the shared lock on its slot, reads the epoch again
--   and inserts into that slot only if it is unchanged (otherwise again, with
--   the new one);
-- * the rotation (`idemstage_items_open_rotate`, one at a time, key -1)
--   takes the next epoch only while the slot it makes current is empty;
-- * before a slot is passed, `idemstage_items_open_seal` takes the exclusive
--   lock on the slot in a transaction of its own (and refuses the current
--   slot): every writer that inserts into the slot has committed, and every
--   later one reads a newer epoch;
-- * `idemstage_items_open_truncate` empties a slot after its pass, under an
--   ACCESS EXCLUSIVE lock taken before it checks that the slot is still not
--   the current one (a writer of a slot made current again in between is
--   waited for, then the truncate is refused).
--
-- So a row is never inserted into a slot between the seal before its pass
-- and its truncate, and a slot is truncated only after a pass that carried
-- every item not found settled into the current slot. Nothing is lost if a
-- truncate fails (a lock timeout while a reader holds the slot): the slot
-- is passed again next round, and the rotation waits for it.

CREATE SEQUENCE items_open_epoch AS bigint MINVALUE 0 START 0;
SELECT setval('items_open_epoch', 0, true);
GRANT SELECT, USAGE ON SEQUENCE items_open_epoch TO idemstage_app, idemstage_worker,
    idemstage_operator;

ALTER TABLE items_open RENAME TO items_open_rows;
CREATE TABLE items_open (
    slot      smallint    NOT NULL CHECK (slot BETWEEN 0 AND 3),
    tenant_id text        NOT NULL,
    item_id   text        NOT NULL,
    opened_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (slot, tenant_id, item_id)
) PARTITION BY LIST (slot);
CREATE TABLE items_open_0 PARTITION OF items_open FOR VALUES IN (0);
CREATE TABLE items_open_1 PARTITION OF items_open FOR VALUES IN (1);
CREATE TABLE items_open_2 PARTITION OF items_open FOR VALUES IN (2);
CREATE TABLE items_open_3 PARTITION OF items_open FOR VALUES IN (3);
INSERT INTO items_open (slot, tenant_id, item_id, opened_at)
SELECT 0, tenant_id, item_id, opened_at FROM items_open_rows;
DROP TABLE items_open_rows;

-- Through the parent only: the partitions have row-level security and no
-- grant, so their rows are reached only under the parent's policies.
ALTER TABLE items_open_0 ENABLE ROW LEVEL SECURITY;
ALTER TABLE items_open_1 ENABLE ROW LEVEL SECURITY;
ALTER TABLE items_open_2 ENABLE ROW LEVEL SECURITY;
ALTER TABLE items_open_3 ENABLE ROW LEVEL SECURITY;
GRANT SELECT, INSERT ON items_open TO idemstage_app, idemstage_worker, idemstage_operator;
ALTER TABLE items_open ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON items_open TO idemstage_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY queue_work ON items_open TO idemstage_worker, idemstage_operator
    USING (true) WITH CHECK (true);

CREATE OR REPLACE FUNCTION idemstage_open_item(p_tenant text, p_item text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_epoch bigint;
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock_shared(1768189295, pg_catalog.hashtext(p_item));
    LOOP
        SELECT last_value INTO v_epoch FROM public.items_open_epoch;
        PERFORM pg_catalog.pg_advisory_xact_lock_shared(1768189285, (v_epoch % 4)::integer);
        EXIT WHEN v_epoch = (SELECT last_value FROM public.items_open_epoch);
    END LOOP;
    INSERT INTO public.items_open (slot, tenant_id, item_id)
    VALUES ((v_epoch % 4)::smallint, p_tenant, p_item)
        ON CONFLICT DO NOTHING;
END;
$$;

-- The next epoch, while the slot after the current one is empty (passed and
-- truncated); one rotation at a time. Returns the epoch now current.
-- SECURITY DEFINER: the worker may advance the epoch, nothing else.
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

-- Waits until every writer of `p_slot` has committed, unless it is the
-- current slot (false). Call it in a transaction of its own before the
-- slot's pass: the lock goes with the transaction's end.
CREATE FUNCTION idemstage_items_open_seal(p_slot smallint) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF p_slot = (SELECT last_value FROM public.items_open_epoch) % 4 THEN
        RETURN false;
    END IF;
    PERFORM pg_advisory_xact_lock(1768189285, p_slot::integer);
    RETURN true;
END;
$$;

-- Empties `p_slot` after its pass, unless it is the current slot again
-- (false). The lock first, then the check: a writer that inserted into the
-- slot since it became current again has committed, and is seen.
-- SECURITY DEFINER: the worker may truncate a slot it passed, nothing else.
CREATE FUNCTION idemstage_items_open_truncate(p_slot smallint) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    CASE p_slot
        WHEN 0 THEN LOCK TABLE public.items_open_0 IN ACCESS EXCLUSIVE MODE;
        WHEN 1 THEN LOCK TABLE public.items_open_1 IN ACCESS EXCLUSIVE MODE;
        WHEN 2 THEN LOCK TABLE public.items_open_2 IN ACCESS EXCLUSIVE MODE;
        WHEN 3 THEN LOCK TABLE public.items_open_3 IN ACCESS EXCLUSIVE MODE;
    END CASE;
    IF p_slot = (SELECT last_value FROM public.items_open_epoch) % 4 THEN
        RETURN false;
    END IF;
    CASE p_slot
        WHEN 0 THEN TRUNCATE public.items_open_0;
        WHEN 1 THEN TRUNCATE public.items_open_1;
        WHEN 2 THEN TRUNCATE public.items_open_2;
        WHEN 3 THEN TRUNCATE public.items_open_3;
    END CASE;
    RETURN true;
END;
$$;
REVOKE EXECUTE ON FUNCTION idemstage_items_open_rotate() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION idemstage_items_open_truncate(smallint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION idemstage_items_open_rotate(), idemstage_items_open_truncate(smallint)
    TO idemstage_worker, idemstage_operator;
