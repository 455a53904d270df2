ALTER TABLE pipeline_runs
    DROP COLUMN interrupted_attempt,
    DROP COLUMN interruptions;
