-- The audit trail is append-only for everyone but the owner, as
-- queue_control_changes is: a stage's fenced transaction and the operator
-- commands write their entries inside the tenant scope, as idemstage_app, which
-- had UPDATE and DELETE on audit_log since 000010; so every worker and operator
-- login role could rewrite or remove its tenant's entries. Nothing in the
-- library changes or deletes an entry: INSERT and SELECT (within the scope's
-- tenant) are what idemstage_app keeps. TRUNCATE nobody but the owner ever had;
-- revoked here too so that this migration says the whole rule.
REVOKE UPDATE, DELETE, TRUNCATE ON public.audit_log
    FROM idemstage_app, idemstage_worker, idemstage_operator;
