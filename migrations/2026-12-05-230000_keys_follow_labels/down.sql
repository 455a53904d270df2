DROP TRIGGER jobs_key_follows_labels ON jobs;
DROP FUNCTION idemstage_jobs_key_follows_labels();
