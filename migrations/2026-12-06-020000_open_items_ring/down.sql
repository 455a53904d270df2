DROP FUNCTION idemstage_items_open_truncate(smallint);
DROP FUNCTION idemstage_items_open_seal(smallint);
DROP FUNCTION idemstage_items_open_rotate();

CREATE OR REPLACE FUNCTION idemstage_open_item(p_tenant text, p_item text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock_shared(1768189295, pg_catalog.hashtext(p_item));
    INSERT INTO public.items_open (tenant_id, item_id) VALUES (p_tenant, p_item)
        ON CONFLICT DO NOTHING;
END;
$$;

ALTER TABLE items_open RENAME TO items_open_ring;
CREATE TABLE items_open (
    tenant_id text        NOT NULL,
    item_id   text        NOT NULL,
    opened_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, item_id)
);
INSERT INTO items_open (tenant_id, item_id, opened_at)
SELECT tenant_id, item_id, min(opened_at) FROM items_open_ring GROUP BY tenant_id, item_id;
DROP TABLE items_open_ring;
DROP SEQUENCE items_open_epoch;

ALTER TABLE items_open SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
GRANT SELECT, INSERT, DELETE ON items_open TO idemstage_app;
GRANT SELECT, INSERT ON items_open TO idemstage_worker, idemstage_operator;
ALTER TABLE items_open ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON items_open TO idemstage_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
CREATE POLICY queue_work ON items_open TO idemstage_worker, idemstage_operator
    USING (true) WITH CHECK (true);
