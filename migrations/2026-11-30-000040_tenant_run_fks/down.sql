-- Back to the single-column keys of 000001, under their original names.
ALTER TABLE pipeline_run_attempts
    DROP CONSTRAINT pipeline_run_attempts_run_fk,
    ADD CONSTRAINT pipeline_run_attempts_run_id_fkey FOREIGN KEY (run_id)
        REFERENCES pipeline_runs (id);

ALTER TABLE pipeline_runs DROP CONSTRAINT pipeline_runs_tenant_id_uq;
