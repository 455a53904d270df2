ALTER TABLE job_claims RESET (autovacuum_vacuum_insert_threshold, autovacuum_analyze_threshold);
