-- Back to the single-column keys of 000001, under their original names.
ALTER TABLE calculation_results
    DROP CONSTRAINT calculation_results_run_fk,
    ADD CONSTRAINT calculation_results_run_id_fkey FOREIGN KEY (run_id)
        REFERENCES pipeline_runs (id);
ALTER TABLE feasibility_results
    DROP CONSTRAINT feasibility_results_run_fk,
    ADD CONSTRAINT feasibility_results_run_id_fkey FOREIGN KEY (run_id)
        REFERENCES pipeline_runs (id);
ALTER TABLE anfrage_extraktionen
    DROP CONSTRAINT anfrage_extraktionen_run_fk,
    ADD CONSTRAINT anfrage_extraktionen_run_id_fkey FOREIGN KEY (run_id)
        REFERENCES pipeline_runs (id);
ALTER TABLE pipeline_run_attempts
    DROP CONSTRAINT pipeline_run_attempts_run_fk,
    ADD CONSTRAINT pipeline_run_attempts_run_id_fkey FOREIGN KEY (run_id)
        REFERENCES pipeline_runs (id);

ALTER TABLE pipeline_runs DROP CONSTRAINT pipeline_runs_tenant_id_uq;
