DROP POLICY scope_releases_only ON job_keys;
