-- Row-level security for a team's own table in one line of its migration:
--     SELECT idemstage_tenant_table('ocr_pages');
--
-- Puts the table under the same tenant isolation as ours (migration
-- 2026-11-30-000010_rls): the policy `tenant_isolation` for idemstage_app on
-- `tenant_id = current_setting('app.tenant_id', true)`, USING and WITH CHECK, and
-- SELECT, INSERT, UPDATE, DELETE granted to idemstage_app, so a transaction scoped
-- with `persistence::tenant::scope` sees and writes only its tenant's rows, and one
-- without a tenant sees none.
--
-- Unlike our tables (ENABLE only), the table is also FORCEd: its owner, when it
-- connects directly (not SET ROLE idemstage_app), is subject to the policy too and,
-- having none of its own, sees and writes no row at all. Superusers and BYPASSRLS
-- roles still see everything; scoped transactions are unaffected (they run as
-- idemstage_app). Consequence for the team: a later migration or report that reads
-- or backfills the table as its (non-superuser) owner must scope itself or first
-- ALTER TABLE .. NO FORCE ROW LEVEL SECURITY. Issue 15 will make all tables so.
--
-- Idempotent: calling it again re-enables and re-forces RLS, replaces the policy
-- `tenant_isolation` by the canonical one (DROP POLICY IF EXISTS, then CREATE; a
-- differently written policy of that name is overwritten) and repeats the grants.
-- Other policies on the table are left as they are: a permissive policy that also
-- applies to idemstage_app widens what a scope sees (permissive policies are ORed).
--
-- SECURITY INVOKER (the default): it runs with the rights of the migrating user,
-- which must own the table (ALTER TABLE, CREATE POLICY) and, like the migration
-- 000010, be a member of idemstage_app or allowed to grant to it. It checks first,
-- before changing anything, that the relation is a table with a text tenant_id
-- column (text or a domain over it, such as tenant_slug), and raises an error
-- naming the table otherwise. A table outside the schema public needs
-- `GRANT USAGE ON SCHEMA .. TO idemstage_app`, and a serial column
-- `GRANT USAGE ON SEQUENCE ..`, from the team (identity columns need none).
--
-- tbl is a regclass: the caller's search_path resolves the name (an unknown table
-- fails right there), and format('%s', tbl) prints it quoted and, because of the
-- function's own search_path, schema-qualified.
CREATE FUNCTION idemstage_tenant_table(tbl regclass) RETURNS void
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
