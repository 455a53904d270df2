DROP TRIGGER anfragen_open ON anfragen;
DROP FUNCTION idemstage_anfragen_open();
DROP TRIGGER jobs_check_labels ON jobs;
DROP FUNCTION idemstage_jobs_check_labels();
DROP FUNCTION idemstage_open_anfrage(text, text);
DROP TABLE anfragen_open;
ALTER TABLE pipeline_runs DROP COLUMN stopped_attempt;
