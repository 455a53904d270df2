DROP POLICY own_entry ON job_closures;
DROP POLICY own_entry ON job_claims;
