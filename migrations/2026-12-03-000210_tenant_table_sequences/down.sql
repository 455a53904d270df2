-- Back to 000060's idemstage_tenant_table (grants made by the newer one stay).
CREATE OR REPLACE FUNCTION idemstage_tenant_table(tbl regclass) RETURNS void
LANGUAGE plpgsql
SECURITY INVOKER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    kind "char";
    category "char";
BEGIN
    SELECT c.relkind INTO kind FROM pg_class c WHERE c.oid = tbl;
    IF kind IS DISTINCT FROM 'r' AND kind IS DISTINCT FROM 'p' THEN
        RAISE EXCEPTION 'idemstage_tenant_table: % is not a table', tbl
            USING ERRCODE = 'wrong_object_type';
    END IF;
    SELECT t.typcategory INTO category
      FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
     WHERE a.attrelid = tbl AND a.attname = 'tenant_id'
       AND a.attnum > 0 AND NOT a.attisdropped;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idemstage_tenant_table: table % has no tenant_id column', tbl
            USING ERRCODE = 'undefined_column',
                  HINT = 'Add a column tenant_id text NOT NULL (the tenant slug) first.';
    END IF;
    IF category <> 'S' THEN
        RAISE EXCEPTION 'idemstage_tenant_table: tenant_id of table % is not text', tbl
            USING ERRCODE = 'datatype_mismatch',
                  HINT = 'The policy compares tenant_id with the text setting app.tenant_id.';
    END IF;

    EXECUTE format('ALTER TABLE %s ENABLE ROW LEVEL SECURITY', tbl);
    EXECUTE format('ALTER TABLE %s FORCE ROW LEVEL SECURITY', tbl);
    EXECUTE format('DROP POLICY IF EXISTS tenant_isolation ON %s', tbl);
    EXECUTE format(
        'CREATE POLICY tenant_isolation ON %s TO idemstage_app '
        'USING (tenant_id = current_setting(%L, true)) '
        'WITH CHECK (tenant_id = current_setting(%L, true))',
        tbl, 'app.tenant_id', 'app.tenant_id');
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON %s TO idemstage_app', tbl);
END
$$;
