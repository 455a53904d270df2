-- A foreign-key check on stage_runs (tenant_id, id) keeps the plan its
-- connection made at its first checks. While stage_runs held a few hundred
-- rows, the unique index on (tenant_id, item_id, stage) cost the same as the
-- key (tenant_id, id) for that check (its tenant prefix, id as a filter), was
-- chosen, and then read every run of the tenant at each check for the
-- connection's life. The same unique key, led by the item: no index but the
-- key itself starts with the tenant, so no check can pick another. Queries by
-- tenant alone use (tenant_id, id); every query by item names the item.
CREATE UNIQUE INDEX stage_runs_item_stage_tenant_uq
    ON stage_runs (item_id, stage, tenant_id);
DROP INDEX stage_runs_tenant_item_stage_uq;
-- The key's name stays (errors name it; it is the same key).
ALTER INDEX stage_runs_item_stage_tenant_uq RENAME TO stage_runs_tenant_item_stage_uq;
