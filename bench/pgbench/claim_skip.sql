-- Generated from the statements idemstage sends (captured with log_statement=all),
-- with the bind parameters written in as literals: pgbench has no string
-- expressions, and ids must be 26-character ULID text, so they are built by
-- substituting numbers into quoted literals, which only the simple protocol does
-- (run with -M simple). Anfragen 10000000..10009999 are numbered anfragen of tenant
-- 'bench' (bench_support::ANFRAGE_BASE, cli::bench::CLAIM_ANFRAGEN).
-- The claim of a succeeded key (skip path): the claim, which returns no row, then
-- the read that explains the skip and the database clock it compares leases with.
-- Every tenant-scoped transaction starts with persistence::tenant::scope (row-level
-- security), so the claim is BEGIN; scope; INSERT; COMMIT, as the library sends it.
\set a random(10000000, 10009999)
\set r random(100000000000000000, 999999999999999999)
BEGIN;
SELECT set_config('role', 'idemstage_app', true), set_config('app.tenant_id', 'bench', true), set_config('idle_in_transaction_session_timeout', '10000', true);
INSERT INTO "pipeline_runs" ("id", "tenant_id", "anfrage_id", "stage", "status", "attempts", "max_attempts", "input_hash", "worker_id", "started_at", "lease_expires_at") VALUES ('00000000:r', 'bench', '000000000000000000:a', 'done', 'running', 1, 5, '63ff0668491a0d9cb9b6b7d42d553b6a7f774d615a7a6285194610f7e29d3042', 'pgbench', CURRENT_TIMESTAMP, (CURRENT_TIMESTAMP + interval '30 seconds')) ON CONFLICT ("tenant_id", "anfrage_id", "stage") DO UPDATE SET "status" = 'running', "attempts" = ("pipeline_runs"."attempts" + 1), "max_attempts" = CASE WHEN pipeline_runs.status = 'success' THEN pipeline_runs.attempts + excluded.max_attempts ELSE pipeline_runs.max_attempts END, "input_hash" = excluded."input_hash", "worker_id" = excluded."worker_id", "started_at" = CURRENT_TIMESTAMP, "lease_expires_at" = (CURRENT_TIMESTAMP + interval '30 seconds'), "finished_at" = NULL, "last_error" = NULL WHERE (((("pipeline_runs"."status" = ANY('{failed,stale}'::text[])) OR (("pipeline_runs"."status" = 'running') AND ("pipeline_runs"."lease_expires_at" < CURRENT_TIMESTAMP))) AND ("pipeline_runs"."attempts" < "pipeline_runs"."max_attempts")) OR ((("pipeline_runs"."status" = 'success') AND ("pipeline_runs"."input_hash" != excluded."input_hash")) AND false)) RETURNING "pipeline_runs"."id", "pipeline_runs"."attempts", "pipeline_runs"."lease_expires_at";
COMMIT;
BEGIN;
SELECT set_config('role', 'idemstage_app', true), set_config('app.tenant_id', 'bench', true), set_config('idle_in_transaction_session_timeout', '10000', true);
SELECT "pipeline_runs"."id", "pipeline_runs"."tenant_id", "pipeline_runs"."anfrage_id", "pipeline_runs"."stage", "pipeline_runs"."status", "pipeline_runs"."attempts", "pipeline_runs"."max_attempts", "pipeline_runs"."input_hash", "pipeline_runs"."worker_id", "pipeline_runs"."started_at", "pipeline_runs"."lease_expires_at", "pipeline_runs"."finished_at", "pipeline_runs"."last_error", CURRENT_TIMESTAMP FROM "pipeline_runs" WHERE ((("pipeline_runs"."tenant_id" = 'bench') AND ("pipeline_runs"."anfrage_id" = '000000000000000000:a')) AND ("pipeline_runs"."stage" = 'done')) LIMIT 1;
COMMIT;
