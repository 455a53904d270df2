-- A row that names a run also names a tenant, and the two must agree: with a
-- foreign key on run_id alone, a row of tenant A could point at tenant B's run
-- (RLS checks only the row's own tenant_id, and the connecting superuser bypasses
-- it). Keyed on (tenant_id, run_id) they cannot differ, as the children's keys on
-- (tenant_id, anfrage_id) already do for anfragen.
-- Adding the keys checks the existing rows: a database holding such a row fails
-- here, naming the constraint, instead of keeping it.
ALTER TABLE pipeline_runs
    ADD CONSTRAINT pipeline_runs_tenant_id_uq UNIQUE (tenant_id, id);

ALTER TABLE pipeline_run_attempts
    DROP CONSTRAINT pipeline_run_attempts_run_id_fkey,
    ADD CONSTRAINT pipeline_run_attempts_run_fk FOREIGN KEY (tenant_id, run_id)
        REFERENCES pipeline_runs (tenant_id, id);
ALTER TABLE anfrage_extraktionen
    DROP CONSTRAINT anfrage_extraktionen_run_id_fkey,
    ADD CONSTRAINT anfrage_extraktionen_run_fk FOREIGN KEY (tenant_id, run_id)
        REFERENCES pipeline_runs (tenant_id, id);
ALTER TABLE feasibility_results
    DROP CONSTRAINT feasibility_results_run_id_fkey,
    ADD CONSTRAINT feasibility_results_run_fk FOREIGN KEY (tenant_id, run_id)
        REFERENCES pipeline_runs (tenant_id, id);
ALTER TABLE calculation_results
    DROP CONSTRAINT calculation_results_run_id_fkey,
    ADD CONSTRAINT calculation_results_run_fk FOREIGN KEY (tenant_id, run_id)
        REFERENCES pipeline_runs (tenant_id, id);
