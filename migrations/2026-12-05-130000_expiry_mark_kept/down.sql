DROP TRIGGER job_expiry_mark_not_truncated ON job_expiry_mark;
DROP TRIGGER job_expiry_mark_kept ON job_expiry_mark;
DROP FUNCTION idemstage_expiry_mark_kept();
