-- A claim and a closure are keyed by a job's ready entry (`ready_seq`), and
-- under the tenant scope (idemstage_app) their policy checked only the row's
-- own tenant label: a scoped transaction could insert a claim or a closure
-- naming another tenant's entry, and that job was then never fetched (its
-- entry claimed) or never ended (every end meets the closure's key). In the
-- scope a new claim or closure must now name one of the scope's own jobs at
-- its current entry; `jobs`' own policy hides every other tenant's job from
-- the probe. Restrictive: it narrows `tenant_isolation`, which stays as it is.
-- The workers and the operator (their policies `true`) are not probed.
CREATE POLICY own_entry ON job_claims AS RESTRICTIVE FOR INSERT TO idemstage_app
    WITH CHECK (EXISTS (SELECT 1 FROM jobs j
                         WHERE j.id = job_claims.job_id
                           AND j.ready_seq = job_claims.ready_seq
                           AND j.tenant_id = job_claims.tenant_id));
CREATE POLICY own_entry ON job_closures AS RESTRICTIVE FOR INSERT TO idemstage_app
    WITH CHECK (EXISTS (SELECT 1 FROM jobs j
                         WHERE j.id = job_closures.job_id
                           AND j.ready_seq = job_closures.ready_seq
                           AND j.tenant_id = job_closures.tenant_id));
