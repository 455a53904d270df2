-- One stage execution of the example pipeline, as the `PipelineWorker` sends
-- it (captured with log_statement=all): the claim (`run_claim`, on the
-- upstream stage's success, here the fixtures' succeeded `done` runs) in its
-- own tenant-scoped transaction; then BEGIN; scope; the lineage check
-- (`run_lineage_current`); the fence (`run_fence_success`); the stage's reads
-- and writes (the Diesel statements of examples/seed-pipeline); the next
-- stage's job (`job_send_quiet`: the worker's default wake is after the
-- commit, so the commit sends no NOTIFY, and the worker's notifier, coalesced,
-- is not counted here); COMMIT.
--
-- The stage is one of the pipeline's four at random (`st`, written into the
-- run's stage name after its `s` so that `cargo xtask bench` can check each
-- one's writes), as the worker runs the four equally often:
--   1 intake: read the input, insert its file row, two audit entries;
--   2 extract: read the input, replace the extracted positions, audit entry;
--   3 feasibility: read the positions, upsert the result;
--   4 calculate: read the positions, upsert the result, audit entry.
-- Differences that err against us: every stage claims on an upstream (the
-- worker's intake has none), and calculate sends a next job too (the worker's
-- does not), so that the queue keeps its depth.
--
-- Each client works its own items (as one item's stages never run at
-- once); the next job's singleton key is unique per execution so that no send
-- is refused.
--
-- Two modes, `-D job=0|1`:
--   job=0: the stage's statements only, without the job that carries the
--          execution: no fetch before it, no completion in its transaction.
--   job=1: what the worker sends for it as well: the job's fetch
--          (`job_fetch_async_commit`, its commit asynchronous as the worker's,
--          `-D batch=<n>` jobs per fetch, each client working its
--          batch off one execution at a time, as the worker's buffer does) and
--          the job's completion (`job_complete`) after the next job's send,
--          inside the stage's transaction. The fetch names the pipeline's four
--          queues, as the worker's does; the jobs it takes are the fixtures'
--          in `feasibility` (`cargo xtask bench` sends clients x batch x 4 of
--          them first), and each execution sends its next job there, so the
--          queue's depth stays the same through the run.
--
-- Round trips, `-D pipeline=0|1`:
--   1 (as the worker): BEGIN with the scope, the lineage check with the fence,
--     and the next job's send with the job's completion, each pair in one
--     round trip (`\startpipeline`). The worker sends BEGIN and the scope as
--     one simple-query message (BEGIN and three SET LOCAL); prepared mode takes
--     no multi-statement message, so here BEGIN and the prepared scope are
--     pipelined, which costs the server less than the worker's message does.
--   0: every statement in a round trip of its own.
-- Run with `-M prepared`: every `$n` of the library is a bind parameter here
-- too, so the server parses each statement once per connection and, as for the
-- library, switches to a generic plan after five executions. pgbench variables
-- are numbers, so a 26-character ULID is built in SQL from a random integer
-- (`lpad(n::text, 26, '0')`: all digits with a leading 0 is valid `ulid_text`),
-- and the values that are the same in every execution come from `-D`, as
-- `cargo xtask bench` passes them:
--   -D tenant=bench -D worker=pgbench -D idle_ms=10000 -D done_stage=done
--   -D next_queue=feasibility -D queues={intake,extract,feasibility,calculate}
--   -D input_hash=63ff0668491a0d9cb9b6b7d42d553b6a7f774d615a7a6285194610f7e29d3042
--   -D clients=<the -c count> (client k works the items k, k + clients, ...)
--   -D job=0|1 -D batch=<n> -D k=0 (k: the client's place in its fetched batch;
--   pgbench keeps a client's variables from one transaction to the next)
-- A NULL bind (no upstream stage) is `nullif(:none, 0)`, NULL in every
-- execution but a parameter to the planner, as the library's NULL is.
-- The positions' texts, quantities and units and the audit action are literals:
-- values only written into rows plan the same either way.
\set a 10000000 + :client_id + :clients * random(0, 10000 / :clients - 1)
\set r random(100000000000000000, 999999999999999999)
\set r1 :r + 1000000000000000000
\set r2 :r + 2000000000000000000
\set r3 :r + 3000000000000000000
\set r4 :r + 4000000000000000000
\set r5 :r + 5000000000000000000
\set st random(1, 4)
\set none 0
\set one 1
\set attempt 1
\set max_attempts 5
\set lease_us 30000000
\set rerun 0
\set priority 0
\set retry_limit 25
\set retry_delay_ms 100
\set retry_backoff 1
\set retry_delay_max_ms 30000
\set expire_in_ms 60000
\set start_after_ms 0
\if :job
\if :k = 0
SELECT array_agg(id)::text AS ids, array_agg(attempt)::text AS attempts, count(*) AS got FROM set_config('synchronous_commit', 'off', true) AS s, idemstage_fetch(:queues::text[], :batch) AS f \gset
\endif
\set k :k + 1
\endif
\if :pipeline
\startpipeline
\endif
BEGIN;
SELECT set_config('role', 'idemstage_app', true), set_config('app.tenant_id', :tenant, true), set_config('idle_in_transaction_session_timeout', :idle_ms, true);
\if :pipeline
\endpipeline
\endif
INSERT INTO stage_runs AS r
    (id, tenant_id, item_id, stage, status, attempts, max_attempts, input_hash,
     worker_id, started_at, lease_expires_at, upstream_stage, upstream_attempt)
SELECT lpad((:r)::text, 26, '0'), :tenant, lpad((:a)::text, 26, '0'), 's' || :st || :r, 'running', 1, :max_attempts, src.input_hash, :worker,
       clock_timestamp(), clock_timestamp() + :lease_us * interval '1 microsecond',
       src.upstream_stage, src.upstream_attempt
  FROM (SELECT a.input_sha256 AS input_hash, NULL::text AS upstream_stage,
               NULL::integer AS upstream_attempt
          FROM items a
         WHERE :done_stage::text IS NULL AND a.tenant_id = :tenant AND a.id = lpad((:a)::text, 26, '0') AND a.input_sha256 = :input_hash
           AND a.superseded_at IS NULL
        UNION ALL
        SELECT h.input_hash, u.stage, u.success_attempt
          FROM stage_runs u
          JOIN stage_attempt_ends h ON h.run_id = u.id AND h.attempt = u.success_attempt
         WHERE u.tenant_id = :tenant AND u.item_id = lpad((:a)::text, 26, '0') AND u.stage = :done_stage::text) AS src
ON CONFLICT (tenant_id, item_id, stage) DO UPDATE
   SET status = 'running',
       attempts = r.attempts + 1,
       max_attempts = CASE WHEN r.status IN ('success', 'stale')
                           THEN r.attempts + EXCLUDED.max_attempts
                           ELSE r.max_attempts END,
       input_hash = EXCLUDED.input_hash,
       worker_id = EXCLUDED.worker_id,
       started_at = clock_timestamp(),
       lease_expires_at = clock_timestamp() + :lease_us * interval '1 microsecond',
       finished_at = NULL,
       last_error = NULL,
       upstream_stage = EXCLUDED.upstream_stage,
       upstream_attempt = EXCLUDED.upstream_attempt
 WHERE ((r.status = 'stale'
         OR ((r.status = 'failed' OR (r.status = 'running' AND r.lease_expires_at < clock_timestamp()))
             AND r.attempts < r.max_attempts))
        AND (r.success_attempt IS NULL OR NOT EXISTS (
               SELECT 1 FROM stage_attempt_ends s
                WHERE s.run_id = r.id AND s.attempt = r.success_attempt
                  AND s.input_hash = EXCLUDED.input_hash
                  AND s.upstream_attempt IS NOT DISTINCT FROM EXCLUDED.upstream_attempt)))
    OR (r.status = 'success' AND r.input_hash <> EXCLUDED.input_hash AND :rerun)
RETURNING r.id, r.attempts, r.lease_expires_at, r.input_hash, r.upstream_attempt;
COMMIT;
\if :pipeline
\startpipeline
\endif
BEGIN;
SELECT set_config('role', 'idemstage_app', true), set_config('app.tenant_id', :tenant, true), set_config('idle_in_transaction_session_timeout', :idle_ms, true);
\if :pipeline
\endpipeline
\endif
\if :pipeline
\startpipeline
\endif
SELECT CASE WHEN r.upstream_stage IS NULL
            THEN EXISTS (SELECT 1 FROM items a
                          WHERE a.tenant_id = r.tenant_id AND a.id = r.item_id
                            AND a.input_sha256 = r.input_hash AND a.superseded_at IS NULL
                            FOR SHARE)
            ELSE EXISTS (SELECT 1 FROM stage_runs u
                          WHERE u.tenant_id = r.tenant_id AND u.item_id = r.item_id
                            AND u.stage = r.upstream_stage
                            AND u.success_attempt = r.upstream_attempt
                            FOR SHARE)
       END AS current
  FROM stage_runs r
 WHERE r.id = lpad((:r)::text, 26, '0') AND r.attempts = :attempt AND r.status = 'running';
UPDATE stage_runs
   SET status = 'success', success_attempt = attempts, finished_at = now()
 WHERE id = lpad((:r)::text, 26, '0') AND attempts = :attempt AND status = 'running';
\if :pipeline
\endpipeline
\endif
\if :st = 1
SELECT "items"."input_text" FROM "items" WHERE (("items"."tenant_id" = :tenant) AND ("items"."id" = lpad((:a)::text, 26, '0'))) LIMIT :one;
INSERT INTO "dateien" ("id", "tenant_id", "item_id", "sha256", "s3_key", "size_bytes") VALUES (lpad((:r1)::text, 26, '0'), :tenant, lpad((:a)::text, 26, '0'), :input_hash, 'items/' || :tenant || '/' || lpad((:r)::text, 26, '0') || '/input.txt', 53) ON CONFLICT ("tenant_id", "sha256", "s3_key") DO NOTHING RETURNING "dateien"."id";
INSERT INTO "audit_log" ("id", "tenant_id", "entity_id", "action", "run_id", "attempt", "details") VALUES (lpad((:r2)::text, 26, '0'), :tenant, lpad((:r1)::text, 26, '0'), 'datei.created', lpad((:r)::text, 26, '0'), :attempt, jsonb_build_object('s3_key', 'items/' || :tenant || '/' || lpad((:r)::text, 26, '0') || '/input.txt', 'sha256', :input_hash::text));
INSERT INTO "audit_log" ("id", "tenant_id", "entity_id", "action", "run_id", "attempt", "details") VALUES (lpad((:r4)::text, 26, '0'), :tenant, lpad((:a)::text, 26, '0'), 'item.intake', lpad((:r)::text, 26, '0'), :attempt, jsonb_build_object('datei_id', lpad((:r1)::text, 26, '0')));
\elif :st = 2
SELECT "items"."input_text" FROM "items" WHERE (("items"."tenant_id" = :tenant) AND ("items"."id" = lpad((:a)::text, 26, '0'))) LIMIT :one;
DELETE FROM "anfrage_extraktionen" WHERE (("anfrage_extraktionen"."tenant_id" = :tenant) AND ("anfrage_extraktionen"."item_id" = lpad((:a)::text, 26, '0')));
INSERT INTO "anfrage_extraktionen" ("id", "tenant_id", "item_id", "position_index", "description", "quantity", "unit", "run_id", "attempt") VALUES (lpad((:r1)::text, 26, '0'), :tenant, lpad((:a)::text, 26, '0'), 0, 'Schrauben M8', 10, 'Stk', lpad((:r)::text, 26, '0'), :attempt), (lpad((:r2)::text, 26, '0'), :tenant, lpad((:a)::text, 26, '0'), 1, 'Kabel NYM 3x1,5', 2.5, 'm', lpad((:r)::text, 26, '0'), :attempt), (lpad((:r3)::text, 26, '0'), :tenant, lpad((:a)::text, 26, '0'), 2, 'Montage', 4, 'h', lpad((:r)::text, 26, '0'), :attempt);
INSERT INTO "audit_log" ("id", "tenant_id", "entity_id", "action", "run_id", "attempt", "details") VALUES (lpad((:r4)::text, 26, '0'), :tenant, lpad((:a)::text, 26, '0'), 'item.extracted', lpad((:r)::text, 26, '0'), :attempt, '{"positions": 3}');
\elif :st = 3
SELECT "anfrage_extraktionen"."position_index", "anfrage_extraktionen"."description", "anfrage_extraktionen"."quantity", "anfrage_extraktionen"."unit" FROM "anfrage_extraktionen" WHERE (("anfrage_extraktionen"."tenant_id" = :tenant) AND ("anfrage_extraktionen"."item_id" = lpad((:a)::text, 26, '0'))) ORDER BY "anfrage_extraktionen"."position_index";
INSERT INTO "feasibility_results" ("tenant_id", "item_id", "feasible", "reasons", "run_id", "attempt") VALUES (:tenant, lpad((:a)::text, 26, '0'), true, '[]', lpad((:r)::text, 26, '0'), :attempt) ON CONFLICT ("tenant_id", "item_id") DO UPDATE SET "feasible" = true, "reasons" = '[]', "run_id" = lpad((:r)::text, 26, '0'), "attempt" = :attempt;
\else
SELECT "anfrage_extraktionen"."position_index", "anfrage_extraktionen"."description", "anfrage_extraktionen"."quantity", "anfrage_extraktionen"."unit" FROM "anfrage_extraktionen" WHERE (("anfrage_extraktionen"."tenant_id" = :tenant) AND ("anfrage_extraktionen"."item_id" = lpad((:a)::text, 26, '0'))) ORDER BY "anfrage_extraktionen"."position_index";
INSERT INTO "calculation_results" ("tenant_id", "item_id", "total_cents", "lines", "run_id", "attempt") VALUES (:tenant, lpad((:a)::text, 26, '0'), 28300, '[{"cents": 1500, "position": 0}, {"cents": 800, "position": 1}, {"cents": 26000, "position": 2}]', lpad((:r)::text, 26, '0'), :attempt) ON CONFLICT ("tenant_id", "item_id") DO UPDATE SET "total_cents" = 28300, "lines" = '[{"cents": 1500, "position": 0}, {"cents": 800, "position": 1}, {"cents": 26000, "position": 2}]', "run_id" = lpad((:r)::text, 26, '0'), "attempt" = :attempt;
INSERT INTO "audit_log" ("id", "tenant_id", "entity_id", "action", "run_id", "attempt", "details") VALUES (lpad((:r4)::text, 26, '0'), :tenant, lpad((:a)::text, 26, '0'), 'item.calculated', lpad((:r)::text, 26, '0'), :attempt, '{"total_cents": 28300}');
\endif
\if :pipeline
\startpipeline
\endif
WITH inserted AS (
    INSERT INTO jobs (id, queue, priority, payload, singleton_key, singleton_on,
                      retry_limit, retry_delay_ms, retry_backoff, retry_delay_max_ms,
                      expire_in_ms, dead_letter, start_after, tenant_id)
    VALUES (lpad((:r5)::text, 26, '0'), :next_queue, :priority, jsonb_build_object('tenant_id', :tenant::text, 'item_id', lpad((:a)::text, 26, '0'), 'input_hash', :input_hash::text), :next_queue || ':' || :tenant || ':' || lpad((:a)::text, 26, '0') || ':' || :r,
            CASE WHEN nullif(:none, 0)::int IS NULL THEN NULL
                 ELSE to_timestamp(floor(extract(epoch FROM now()) / nullif(:none, 0)) * nullif(:none, 0)) END,
            :retry_limit, :retry_delay_ms, :retry_backoff, :retry_delay_max_ms, :expire_in_ms, nullif(:none, 0)::text, now() + :start_after_ms * interval '1 millisecond', :tenant)
    RETURNING id, queue
)
SELECT id, false AS notified FROM inserted;
\if :job
WITH closed AS (
    INSERT INTO job_closures (ready_seq, job_id, attempt, queue, tenant_id, priority,
                              outcome, output)
    SELECT j.ready_seq, j.id, coalesce((SELECT k.attempt FROM job_claims k WHERE k.ready_seq = j.ready_seq AND k.job_id = j.id), j.attempt),
           j.queue, j.tenant_id, j.priority, 'completed', nullif(:none, 0)::text::jsonb
      FROM jobs j
     WHERE j.id = (:ids::text[])[:k] AND j.state IN ('created', 'retry') AND (SELECT k.attempt FROM job_claims k WHERE k.ready_seq = j.ready_seq AND k.job_id = j.id) = (:attempts::int[])[:k]
     ORDER BY j.id
    ON CONFLICT (ready_seq) DO NOTHING
    RETURNING ready_seq, job_id, attempt
)
SELECT count(*) AS n FROM closed;
\endif
\if :pipeline
\endpipeline
\endif
\if :job
\if :k >= :got
\set k 0
\endif
\endif
COMMIT;
