-- The claim of a key that succeeded (skip path), as `PgRunRepository::claim`
-- sends it: the claim (`run_claim`), which returns no row, then the read that
-- explains the skip (`run_explain_skip`), both in one tenant-scoped transaction
-- (`tenant_scope`; persistence::statements). Every numbered item has a
-- succeeded run of stage `done` (`idemstage bench claim --setup-only`).
--
-- Run with `-M prepared`: every `$n` of the library is a bind parameter here
-- too, so the server parses each statement once per connection and, as for the
-- library, switches to a generic plan after five executions. pgbench variables
-- are numbers, so a 26-character ULID is built in SQL from a random integer
-- (`lpad(n::text, 26, '0')`: all digits with a leading 0 is valid `ulid_text`),
-- and the values that are the same in every execution come from `-D`, as
-- `cargo xtask bench` passes them:
--   -D tenant=bench -D worker=pgbench -D idle_ms=10000 -D done_stage=done
--   -D input_hash=63ff0668491a0d9cb9b6b7d42d553b6a7f774d615a7a6285194610f7e29d3042
-- A NULL bind (no upstream stage) is `nullif(:none, 0)`, NULL in every
-- execution but a parameter to the planner, as the library's NULL is.
-- Numbered item i has id lpad(10000000 + i, 26, '0') (cli::fixtures,
-- cli::bench::CLAIM_ITEMS); `crates/cli` tests check these statements
-- against the registry.
-- BEGIN and the scope in one round trip (`-D pipeline=1`, `\startpipeline`), as
-- the library sends them (one message: BEGIN and three SET LOCAL; prepared
-- mode takes no multi-statement message, hence the pipeline); `-D pipeline=0`
-- sends each in a round trip of its own.
\set a random(10000000, 10009999)
\set r random(100000000000000000, 999999999999999999)
\set none 0
\set max_attempts 5
\set lease_us 30000000
\set rerun 0
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
SELECT lpad((:r)::text, 26, '0'), :tenant, lpad((:a)::text, 26, '0'), :done_stage, 'running', 1, :max_attempts, src.input_hash, :worker,
       clock_timestamp(), clock_timestamp() + :lease_us * interval '1 microsecond',
       src.upstream_stage, src.upstream_attempt
  FROM (SELECT a.input_sha256 AS input_hash, NULL::text AS upstream_stage,
               NULL::integer AS upstream_attempt
          FROM items a
         WHERE nullif(:none, 0)::text IS NULL AND a.tenant_id = :tenant AND a.id = lpad((:a)::text, 26, '0') AND a.input_sha256 = :input_hash
           AND a.superseded_at IS NULL
        UNION ALL
        SELECT h.input_hash, u.stage, u.success_attempt
          FROM stage_runs u
          JOIN stage_attempt_ends h ON h.run_id = u.id AND h.attempt = u.success_attempt
         WHERE u.tenant_id = :tenant AND u.item_id = lpad((:a)::text, 26, '0') AND u.stage = nullif(:none, 0)::text) AS src
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
SELECT clock_timestamp() AS db_now,
       a.input_sha256 AS stored_hash, a.superseded_at IS NOT NULL AS superseded,
       u.status AS upstream_status, u.success_attempt AS upstream_success,
       u.lease_expires_at AS upstream_lease, h.input_hash AS upstream_hash,
       r.id AS run_id, r.status, r.attempts, r.max_attempts, r.input_hash,
       r.lease_expires_at, s.input_hash AS success_hash, s.upstream_attempt AS success_upstream
  FROM (SELECT 1) AS one
  LEFT JOIN items a ON a.tenant_id = :tenant AND a.id = lpad((:a)::text, 26, '0')
  LEFT JOIN stage_runs u ON u.tenant_id = :tenant AND u.item_id = lpad((:a)::text, 26, '0') AND u.stage = nullif(:none, 0)::text
  LEFT JOIN stage_attempt_ends h ON h.run_id = u.id AND h.attempt = u.success_attempt
  LEFT JOIN stage_runs r ON r.tenant_id = :tenant AND r.item_id = lpad((:a)::text, 26, '0') AND r.stage = :done_stage
  LEFT JOIN stage_attempt_ends s ON s.run_id = r.id AND s.attempt = r.success_attempt;
COMMIT;
