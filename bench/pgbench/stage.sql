-- Generated from the statements idemstage sends (persistence::runs::sql for the claim,
-- the explanation of a skip, the lineage check and the fence; the rest captured with
-- log_statement=all),
-- with the bind parameters written in as literals: pgbench has no string
-- expressions, and ids must be 26-character ULID text, so they are built by
-- substituting numbers into quoted literals, which only the simple protocol does
-- (run with -M simple). Anfragen 10000000..10009999 are numbered anfragen of tenant
-- 'bench' (bench_support::ANFRAGE_BASE, cli::bench::CLAIM_ANFRAGEN).
-- One stage execution of the example pipeline's extract stage, statement by
-- statement: the claim; BEGIN; the fenced UPDATE; the stage's read and writes
-- (input text, replace the extracted positions, audit entry); the next stage's
-- job; COMMIT. Not included: the job fetch and the job completion around it.
-- Each client works its own anfragen (as one anfrage's stages never run at once).
-- Every tenant-scoped transaction starts with persistence::tenant::scope (row-level
-- security), so the claim is BEGIN; scope; INSERT; COMMIT, as the library sends it.
\set a 10000000 + :client_id + 16 * random(0, 624)
\set r random(100000000000000000, 999999999999999999)
BEGIN;
SELECT set_config('role', 'idemstage_app', true), set_config('app.tenant_id', 'bench', true), set_config('idle_in_transaction_session_timeout', '10000', true);
INSERT INTO pipeline_runs AS r (id, tenant_id, anfrage_id, stage, status, attempts, max_attempts, input_hash, worker_id, started_at, lease_expires_at, upstream_stage, upstream_attempt) SELECT '00000000:r', 'bench', '000000000000000000:a', 's:r', 'running', 1, 5, src.input_hash, 'pgbench', clock_timestamp(), clock_timestamp() + 30000000 * interval '1 microsecond', src.upstream_stage, src.upstream_attempt FROM (SELECT a.input_sha256 AS input_hash, NULL::text AS upstream_stage, NULL::integer AS upstream_attempt FROM anfragen a WHERE NULL::text IS NULL AND a.tenant_id = 'bench' AND a.id = '000000000000000000:a' AND a.input_sha256 = '63ff0668491a0d9cb9b6b7d42d553b6a7f774d615a7a6285194610f7e29d3042' UNION ALL SELECT h.input_hash, u.stage, u.success_attempt FROM pipeline_runs u JOIN pipeline_run_attempts h ON h.run_id = u.id AND h.attempt = u.success_attempt WHERE u.tenant_id = 'bench' AND u.anfrage_id = '000000000000000000:a' AND u.stage = NULL::text) AS src ON CONFLICT (tenant_id, anfrage_id, stage) DO UPDATE SET status = 'running', attempts = r.attempts + 1, max_attempts = CASE WHEN r.status IN ('success', 'stale') THEN r.attempts + EXCLUDED.max_attempts ELSE r.max_attempts END, input_hash = EXCLUDED.input_hash, worker_id = EXCLUDED.worker_id, started_at = clock_timestamp(), lease_expires_at = clock_timestamp() + 30000000 * interval '1 microsecond', finished_at = NULL, last_error = NULL, upstream_stage = EXCLUDED.upstream_stage, upstream_attempt = EXCLUDED.upstream_attempt WHERE r.status = 'stale' OR ((r.status = 'failed' OR (r.status = 'running' AND r.lease_expires_at < clock_timestamp())) AND r.attempts < r.max_attempts) OR (r.status = 'success' AND r.input_hash <> EXCLUDED.input_hash AND false) RETURNING r.id, r.attempts, r.lease_expires_at, r.input_hash, r.upstream_attempt;
COMMIT;
BEGIN;
SELECT set_config('role', 'idemstage_app', true), set_config('app.tenant_id', 'bench', true), set_config('idle_in_transaction_session_timeout', '10000', true);
SELECT CASE WHEN r.upstream_stage IS NULL THEN EXISTS (SELECT 1 FROM anfragen a WHERE a.tenant_id = r.tenant_id AND a.id = r.anfrage_id AND a.input_sha256 = r.input_hash FOR SHARE) ELSE EXISTS (SELECT 1 FROM pipeline_runs u WHERE u.tenant_id = r.tenant_id AND u.anfrage_id = r.anfrage_id AND u.stage = r.upstream_stage AND u.success_attempt = r.upstream_attempt FOR SHARE) END AS current FROM pipeline_runs r WHERE r.id = '00000000:r' AND r.attempts = 1 AND r.status = 'running';
UPDATE pipeline_runs SET status = 'success', success_attempt = attempts, finished_at = now() WHERE id = '00000000:r' AND attempts = 1 AND status = 'running';
SELECT "anfragen"."input_text" FROM "anfragen" WHERE (("anfragen"."tenant_id" = 'bench') AND ("anfragen"."id" = '000000000000000000:a')) LIMIT 1;
DELETE FROM "anfrage_extraktionen" WHERE (("anfrage_extraktionen"."tenant_id" = 'bench') AND ("anfrage_extraktionen"."anfrage_id" = '000000000000000000:a'));
INSERT INTO "anfrage_extraktionen" ("id", "tenant_id", "anfrage_id", "position_index", "description", "quantity", "unit", "run_id", "attempt") VALUES ('10000000:r', 'bench', '000000000000000000:a', 0, 'Schrauben M8', 10, 'Stk', '00000000:r', 1), ('20000000:r', 'bench', '000000000000000000:a', 1, 'Kabel NYM 3x1,5', 2.5, 'm', '00000000:r', 1), ('30000000:r', 'bench', '000000000000000000:a', 2, 'Montage', 4, 'h', '00000000:r', 1);
INSERT INTO "audit_log" ("id", "tenant_id", "entity_id", "action", "run_id", "attempt", "details") VALUES ('40000000:r', 'bench', '000000000000000000:a', 'anfrage.extracted', '00000000:r', 1, '{"positions": 3}');
WITH inserted AS ( INSERT INTO jobs (id, queue, priority, payload, singleton_key, singleton_on, retry_limit, retry_delay_ms, retry_backoff, retry_delay_max_ms, expire_in_ms, dead_letter, start_after) VALUES ('50000000:r', 'feasibility', 0, '{"tenant_id": "bench", "anfrage_id": "000000000000000000:a", "input_hash": "63ff0668491a0d9cb9b6b7d42d553b6a7f774d615a7a6285194610f7e29d3042"}', 'feasibility:bench:000000000000000000:a:r', CASE WHEN NULL::int IS NULL THEN NULL ELSE to_timestamp(floor(extract(epoch FROM now()) / NULL) * NULL) END, 25, 100, true, 30000, 60000, NULL, now() + 0 * interval '1 millisecond') ON CONFLICT (queue, singleton_key) WHERE singleton_key IS NOT NULL AND state IN ('created', 'retry', 'active') DO NOTHING RETURNING id, queue ) SELECT id, pg_notify('idemstage_jobs', queue) IS NULL AS notified FROM inserted;
COMMIT;
