DROP TABLE stage_checkpoints;
ALTER TABLE pipeline_runs DROP COLUMN output;
