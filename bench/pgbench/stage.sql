-- Generated from the statements idemstage sends (captured with log_statement=all),
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
INSERT INTO "pipeline_runs" ("id", "tenant_id", "anfrage_id", "stage", "status", "attempts", "max_attempts", "input_hash", "worker_id", "started_at", "lease_expires_at") VALUES ('00000000:r', 'bench', '000000000000000000:a', 's:r', 'running', 1, 5, '63ff0668491a0d9cb9b6b7d42d553b6a7f774d615a7a6285194610f7e29d3042', 'pgbench', CURRENT_TIMESTAMP, (CURRENT_TIMESTAMP + interval '30 seconds')) ON CONFLICT ("tenant_id", "anfrage_id", "stage") DO UPDATE SET "status" = 'running', "attempts" = ("pipeline_runs"."attempts" + 1), "max_attempts" = CASE WHEN pipeline_runs.status = 'success' THEN pipeline_runs.attempts + excluded.max_attempts ELSE pipeline_runs.max_attempts END, "input_hash" = excluded."input_hash", "worker_id" = excluded."worker_id", "started_at" = CURRENT_TIMESTAMP, "lease_expires_at" = (CURRENT_TIMESTAMP + interval '30 seconds'), "finished_at" = NULL, "last_error" = NULL WHERE (((("pipeline_runs"."status" = ANY('{failed,stale}'::text[])) OR (("pipeline_runs"."status" = 'running') AND ("pipeline_runs"."lease_expires_at" < CURRENT_TIMESTAMP))) AND ("pipeline_runs"."attempts" < "pipeline_runs"."max_attempts")) OR ((("pipeline_runs"."status" = 'success') AND ("pipeline_runs"."input_hash" != excluded."input_hash")) AND false)) RETURNING "pipeline_runs"."id", "pipeline_runs"."attempts", "pipeline_runs"."lease_expires_at";
COMMIT;
BEGIN;
SELECT set_config('role', 'idemstage_app', true), set_config('app.tenant_id', 'bench', true), set_config('idle_in_transaction_session_timeout', '10000', true);
UPDATE "pipeline_runs" SET "status" = 'success', "finished_at" = CURRENT_TIMESTAMP WHERE ((("pipeline_runs"."id" = '00000000:r') AND ("pipeline_runs"."attempts" = 1)) AND ("pipeline_runs"."status" = 'running'));
SELECT "anfragen"."input_text" FROM "anfragen" WHERE (("anfragen"."tenant_id" = 'bench') AND ("anfragen"."id" = '000000000000000000:a')) LIMIT 1;
DELETE FROM "anfrage_extraktionen" WHERE (("anfrage_extraktionen"."tenant_id" = 'bench') AND ("anfrage_extraktionen"."anfrage_id" = '000000000000000000:a'));
INSERT INTO "anfrage_extraktionen" ("id", "tenant_id", "anfrage_id", "position_index", "description", "quantity", "unit", "run_id", "attempt") VALUES ('10000000:r', 'bench', '000000000000000000:a', 0, 'Schrauben M8', 10, 'Stk', '00000000:r', 1), ('20000000:r', 'bench', '000000000000000000:a', 1, 'Kabel NYM 3x1,5', 2.5, 'm', '00000000:r', 1), ('30000000:r', 'bench', '000000000000000000:a', 2, 'Montage', 4, 'h', '00000000:r', 1);
INSERT INTO "audit_log" ("id", "tenant_id", "entity_id", "action", "run_id", "attempt", "details") VALUES ('40000000:r', 'bench', '000000000000000000:a', 'anfrage.extracted', '00000000:r', 1, '{"positions": 3}');
WITH inserted AS ( INSERT INTO jobs (id, queue, priority, payload, singleton_key, singleton_on, retry_limit, retry_delay_ms, retry_backoff, retry_delay_max_ms, expire_in_ms, dead_letter, start_after) VALUES ('50000000:r', 'feasibility', 0, '{"tenant_id": "bench", "anfrage_id": "000000000000000000:a", "input_hash": "63ff0668491a0d9cb9b6b7d42d553b6a7f774d615a7a6285194610f7e29d3042"}', 'feasibility:bench:000000000000000000:a:r', CASE WHEN NULL::int IS NULL THEN NULL ELSE to_timestamp(floor(extract(epoch FROM now()) / NULL) * NULL) END, 25, 100, true, 30000, 60000, NULL, now() + 0 * interval '1 millisecond') ON CONFLICT (queue, singleton_key) WHERE singleton_key IS NOT NULL AND state IN ('created', 'retry', 'active') DO NOTHING RETURNING id, queue ) SELECT id, pg_notify('idemstage_jobs', queue) IS NULL AS notified FROM inserted;
COMMIT;
