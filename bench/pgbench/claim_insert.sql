-- Generated from the statements idemstage sends (persistence::runs::sql for the claim,
-- the explanation of a skip, the lineage check and the fence; the rest captured with
-- log_statement=all),
-- with the bind parameters written in as literals: pgbench has no string
-- expressions, and ids must be 26-character ULID text, so they are built by
-- substituting numbers into quoted literals, which only the simple protocol does
-- (run with -M simple). Anfragen 10000000..10009999 are numbered anfragen of tenant
-- 'bench' (bench_support::ANFRAGE_BASE, cli::bench::CLAIM_ANFRAGEN).
-- The claim of a fresh key (insert path): a new stage name per execution.
-- Every tenant-scoped transaction starts with persistence::tenant::scope (row-level
-- security), so the claim is BEGIN; scope; INSERT; COMMIT, as the library sends it.
\set a random(10000000, 10009999)
\set r random(100000000000000000, 999999999999999999)
BEGIN;
SELECT set_config('role', 'idemstage_app', true), set_config('app.tenant_id', 'bench', true), set_config('idle_in_transaction_session_timeout', '10000', true);
INSERT INTO pipeline_runs AS r (id, tenant_id, anfrage_id, stage, status, attempts, max_attempts, input_hash, worker_id, started_at, lease_expires_at, upstream_stage, upstream_attempt) SELECT '00000000:r', 'bench', '000000000000000000:a', 's:r', 'running', 1, 5, src.input_hash, 'pgbench', clock_timestamp(), clock_timestamp() + 30000000 * interval '1 microsecond', src.upstream_stage, src.upstream_attempt FROM (SELECT a.input_sha256 AS input_hash, NULL::text AS upstream_stage, NULL::integer AS upstream_attempt FROM anfragen a WHERE NULL::text IS NULL AND a.tenant_id = 'bench' AND a.id = '000000000000000000:a' AND a.input_sha256 = '63ff0668491a0d9cb9b6b7d42d553b6a7f774d615a7a6285194610f7e29d3042' UNION ALL SELECT h.input_hash, u.stage, u.success_attempt FROM pipeline_runs u JOIN pipeline_run_attempts h ON h.run_id = u.id AND h.attempt = u.success_attempt WHERE u.tenant_id = 'bench' AND u.anfrage_id = '000000000000000000:a' AND u.stage = NULL::text) AS src ON CONFLICT (tenant_id, anfrage_id, stage) DO UPDATE SET status = 'running', attempts = r.attempts + 1, max_attempts = CASE WHEN r.status IN ('success', 'stale') THEN r.attempts + EXCLUDED.max_attempts ELSE r.max_attempts END, input_hash = EXCLUDED.input_hash, worker_id = EXCLUDED.worker_id, started_at = clock_timestamp(), lease_expires_at = clock_timestamp() + 30000000 * interval '1 microsecond', finished_at = NULL, last_error = NULL, upstream_stage = EXCLUDED.upstream_stage, upstream_attempt = EXCLUDED.upstream_attempt WHERE r.status = 'stale' OR ((r.status = 'failed' OR (r.status = 'running' AND r.lease_expires_at < clock_timestamp())) AND r.attempts < r.max_attempts) OR (r.status = 'success' AND r.input_hash <> EXCLUDED.input_hash AND false) RETURNING r.id, r.attempts, r.lease_expires_at, r.input_hash, r.upstream_attempt;
COMMIT;
