CREATE UNIQUE INDEX stage_runs_tenant_item_stage_uq_old
    ON stage_runs (tenant_id, item_id, stage);
DROP INDEX stage_runs_tenant_item_stage_uq;
ALTER INDEX stage_runs_tenant_item_stage_uq_old RENAME TO stage_runs_tenant_item_stage_uq;
