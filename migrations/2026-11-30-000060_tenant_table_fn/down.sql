-- Tables already put under isolation by the function keep their policies, flags
-- and grants: they belong to the teams' migrations, which undo them.
DROP FUNCTION idemstage_tenant_table(regclass);
