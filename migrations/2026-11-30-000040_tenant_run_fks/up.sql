-- A row that names a run also names a tenant, and the two must agree: with a
-- foreign key on run_id alone, a row of tenant A could point at tenant B's run
-- (RLS checks only the row's own tenant_id, and the connecting superuser bypasses
-- it). Keyed on (tenant_id, run_id) they cannot differ; a team's table whose rows
-- name the run that wrote them references pipeline_runs (tenant_id, id) the same
-- way (see the example pipeline's migration in examples/seed-pipeline).
-- Adding the keys checks the existing rows: a database holding such a row fails
-- here, naming the constraint, instead of keeping it.
ALTER TABLE pipeline_runs
    ADD CONSTRAINT pipeline_runs_tenant_id_uq UNIQUE (tenant_id, id);

ALTER TABLE pipeline_run_attempts
    DROP CONSTRAINT pipeline_run_attempts_run_id_fkey,
    ADD CONSTRAINT pipeline_run_attempts_run_fk FOREIGN KEY (tenant_id, run_id)
        REFERENCES pipeline_runs (tenant_id, id);
