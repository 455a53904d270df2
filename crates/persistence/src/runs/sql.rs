//! The statements of layer 1, as the text the library sends (`$n` are bind
//! parameters). They are plain SQL so that the isolation specs
//! (`tests/isolation/`) run exactly these statements, and so that pgbench scripts
//! can be checked against them.
//!
//! Every lease time is `clock_timestamp()`, the statement's clock, never `now()`:
//! a claim that waited on a row lock must not hand out a lease that started before
//! the wait (`now()` is the transaction's start).

/// The claim: one `INSERT … SELECT … ON CONFLICT … DO UPDATE … WHERE <guard>`.
///
/// The inserted (or updated) values come from the claim's *source*: the item's
/// stored input for the first stage (`$10` NULL), only if the job's hash `$6` is
/// that input's hash and the item is no superseded child of a fan-out; the
/// upstream stage's current successful attempt otherwise.
/// No source row: nothing is inserted and no conflict is examined, so a stage whose
/// upstream is not done, or a job with a hash the database did not compute, binds
/// nothing. The guard is on the `DO UPDATE` (not on the conflict target, which
/// would only pick the arbiter index): a finished stage is never claimed again,
/// except `stale` (its upstream succeeded again) and, with the `Rerun` policy
/// (`$9`), a success on another input. `stale` and rerun rows get a fresh attempt
/// budget on top of the used one; `attempts` itself only grows (fencing token).
///
/// A run whose current success is what this claim would compute (the same input
/// hash and upstream attempt: an input set back to the one it succeeded on while a
/// rerun on another input failed, lost its lease or went `stale` on its lineage) is
/// not admitted: running it again would be a second success on the same input. The
/// explanation restores it to that success instead ([`RESTORE_SUCCESS`]).
///
/// The update's lease is its own `clock_timestamp()`, not `EXCLUDED`'s: the
/// inserted values are computed before the conflict's row lock is waited for.
///
/// `$1` new run id, `$2` tenant, `$3` item, `$4` stage, `$5` max_attempts, `$6`
/// the job's input hash, `$7` worker, `$8` lease in microseconds, `$9` rerun on new
/// input, `$10` upstream stage or NULL.
pub const CLAIM: &str = "\
INSERT INTO stage_runs AS r
    (id, tenant_id, item_id, stage, status, attempts, max_attempts, input_hash,
     worker_id, started_at, lease_expires_at, upstream_stage, upstream_attempt)
SELECT $1, $2, $3, $4, 'running', 1, $5, src.input_hash, $7,
       clock_timestamp(), clock_timestamp() + $8 * interval '1 microsecond',
       src.upstream_stage, src.upstream_attempt
  FROM (SELECT a.input_sha256 AS input_hash, NULL::text AS upstream_stage,
               NULL::integer AS upstream_attempt
          FROM items a
         WHERE $10::text IS NULL AND a.tenant_id = $2 AND a.id = $3 AND a.input_sha256 = $6
           AND a.superseded_at IS NULL
        UNION ALL
        SELECT h.input_hash, u.stage, u.success_attempt
          FROM stage_runs u
          JOIN stage_attempt_ends h ON h.run_id = u.id AND h.attempt = u.success_attempt
         WHERE u.tenant_id = $2 AND u.item_id = $3 AND u.stage = $10::text) AS src
ON CONFLICT (tenant_id, item_id, stage) DO UPDATE
   SET status = 'running',
       attempts = r.attempts + 1,
       max_attempts = CASE WHEN r.status IN ('success', 'stale')
                           THEN r.attempts + EXCLUDED.max_attempts
                           ELSE r.max_attempts END,
       input_hash = EXCLUDED.input_hash,
       worker_id = EXCLUDED.worker_id,
       started_at = clock_timestamp(),
       lease_expires_at = clock_timestamp() + $8 * interval '1 microsecond',
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
    OR (r.status = 'success' AND r.input_hash <> EXCLUDED.input_hash AND $9)
RETURNING r.id, r.attempts, r.lease_expires_at, r.input_hash, r.upstream_attempt";

/// Why a claim returned no row, in one round trip: the item's stored hash, the
/// upstream's state and its successful attempt's hash, the run, and the clock.
/// `$1` tenant, `$2` item, `$3` stage, `$4` upstream stage or NULL.
pub const EXPLAIN_SKIP: &str = "\
SELECT clock_timestamp() AS db_now,
       a.input_sha256 AS stored_hash, a.superseded_at IS NOT NULL AS superseded,
       u.status AS upstream_status, u.success_attempt AS upstream_success,
       u.lease_expires_at AS upstream_lease, h.input_hash AS upstream_hash,
       r.id AS run_id, r.status, r.attempts, r.max_attempts, r.input_hash,
       r.lease_expires_at, s.input_hash AS success_hash, s.upstream_attempt AS success_upstream
  FROM (SELECT 1) AS one
  LEFT JOIN items a ON a.tenant_id = $1 AND a.id = $2
  LEFT JOIN stage_runs u ON u.tenant_id = $1 AND u.item_id = $2 AND u.stage = $4::text
  LEFT JOIN stage_attempt_ends h ON h.run_id = u.id AND h.attempt = u.success_attempt
  LEFT JOIN stage_runs r ON r.tenant_id = $1 AND r.item_id = $2 AND r.stage = $3
  LEFT JOIN stage_attempt_ends s ON s.run_id = r.id AND s.attempt = r.success_attempt";

/// A run whose success is current again ends its detour: it is `success` on that
/// attempt once more, with the attempt's input and upstream, and the attempt after
/// it (a rerun on another input that failed, died, went `stale` on its own lineage
/// or lost its lease) never commits. Only from a state no worker holds (a running
/// attempt only once its lease ran out), fenced on the token. `$1` run id, `$2`
/// attempts.
pub const RESTORE_SUCCESS: &str = "\
UPDATE stage_runs AS r
   SET status = 'success', input_hash = s.input_hash, upstream_attempt = s.upstream_attempt,
       finished_at = clock_timestamp(),
       lease_expires_at = least(r.lease_expires_at, clock_timestamp()),
       last_error = 'restored to the success of attempt ' || r.success_attempt
                    || ': its input is current again'
  FROM stage_attempt_ends s
 WHERE r.id = $1 AND r.attempts = $2
   AND s.run_id = r.id AND s.attempt = r.success_attempt
   AND (r.status IN ('failed', 'dead', 'stale')
        OR (r.status = 'running' AND r.lease_expires_at < clock_timestamp()))";

/// Marks a run `dead` whose budget is used up, but only in a state the claim's
/// guard refuses for that reason (failed, or running with an expired lease): a
/// concurrent `release` (which raises `max_attempts`) or claim wins. `$1` run id.
pub const MARK_EXHAUSTED: &str = "\
UPDATE stage_runs
   SET status = 'dead', finished_at = clock_timestamp(),
       last_error = 'attempt budget used up (last lease expired)'
 WHERE id = $1 AND attempts >= max_attempts
   AND (status = 'failed' OR (status = 'running' AND lease_expires_at < clock_timestamp()))";

/// The input a run's attempt is bound to: the text of the run's `input_hash`, the
/// item's stored input while it is current, else the replaced input kept in
/// `item_inputs` (the baseline migration). Fenced on the token: no row for an
/// attempt that is not the run's current one. `$1` run id, `$2` attempt.
pub const BOUND_INPUT: &str = "\
SELECT r.input_hash,
       coalesce((SELECT a.input_text FROM items a
                  WHERE a.tenant_id = r.tenant_id AND a.id = r.item_id
                    AND a.input_sha256 = r.input_hash),
                (SELECT i.input_text FROM item_inputs i
                  WHERE i.tenant_id = r.tenant_id AND i.item_id = r.item_id
                    AND i.input_sha256 = r.input_hash)) AS input_text
  FROM stage_runs r
 WHERE r.id = $1 AND r.attempts = $2";

/// What an attempt of the typed contract reads before its `prepare`, in one
/// statement, fenced on the token (no row for an attempt that is not the run's
/// current one): for the first stage the text of the run's bound input hash (as
/// [`BOUND_INPUT`]); for a later stage its upstream's output at exactly the
/// attempt the run is bound to (`upstream_found` false: that attempt is no longer
/// the upstream's success, so this attempt is stale); and, if `$3`, the
/// checkpointed prepared value of this run whose binding is this attempt's.
/// `$1` run id, `$2` attempt, `$3` whether to read the checkpoint.
pub const READ_BOUND: &str = "\
SELECT r.input_hash,
       r.upstream_stage IS NULL AS first_stage,
       CASE WHEN r.upstream_stage IS NULL THEN
           coalesce((SELECT a.input_text FROM items a
                      WHERE a.tenant_id = r.tenant_id AND a.id = r.item_id
                        AND a.input_sha256 = r.input_hash),
                    (SELECT i.input_text FROM item_inputs i
                      WHERE i.tenant_id = r.tenant_id AND i.item_id = r.item_id
                        AND i.input_sha256 = r.input_hash))
       END AS input_text,
       u.found IS NOT NULL AS upstream_found,
       u.output AS upstream_output,
       (SELECT c.prepared FROM stage_checkpoints c
         WHERE $3 AND c.run_id = r.id AND c.input_hash = r.input_hash
           AND c.upstream_attempt IS NOT DISTINCT FROM r.upstream_attempt) AS checkpoint
  FROM stage_runs r
  LEFT JOIN LATERAL (SELECT true AS found, u.output FROM stage_runs u
                      WHERE u.tenant_id = r.tenant_id AND u.item_id = r.item_id
                        AND u.stage = r.upstream_stage
                        AND u.success_attempt = r.upstream_attempt) u ON true
 WHERE r.id = $1 AND r.attempts = $2";

/// Keeps an attempt's prepared value with the binding it was computed from, for
/// the next attempt of the same run (replacing an earlier attempt's). Fenced on
/// the token: nothing is written for an attempt that is no longer the run's
/// running one. `$1` run id, `$2` attempt, `$3` the prepared value (jsonb).
pub const CHECKPOINT: &str = "\
INSERT INTO stage_checkpoints (run_id, tenant_id, input_hash, upstream_attempt, attempt, prepared)
SELECT r.id, r.tenant_id, r.input_hash, r.upstream_attempt, r.attempts, $3
  FROM stage_runs r
 WHERE r.id = $1 AND r.attempts = $2 AND r.status = 'running'
ON CONFLICT (run_id) DO UPDATE
   SET input_hash = EXCLUDED.input_hash, upstream_attempt = EXCLUDED.upstream_attempt,
       attempt = EXCLUDED.attempt, prepared = EXCLUDED.prepared,
       written_at = clock_timestamp()";

/// In the fenced transaction, after the body: the stage's output, kept with the
/// attempt that is now its `success_attempt`. `$1` run id, `$2` attempt, `$3` the
/// output (jsonb).
pub const RECORD_OUTPUT: &str = "\
UPDATE stage_runs SET output = $3
 WHERE id = $1 AND attempts = $2 AND status = 'success'";

/// As [`RECORD_OUTPUT`], for an attempt that wrote or reused a checkpoint: the
/// success used it, so it is deleted with the same statement.
pub const RECORD_OUTPUT_CLEAR_CHECKPOINT: &str = "\
WITH cleared AS (DELETE FROM stage_checkpoints WHERE run_id = $1)
UPDATE stage_runs SET output = $3
 WHERE id = $1 AND attempts = $2 AND status = 'success'";

/// The lineage check, the first statement of the fenced completion: is the input
/// this attempt read still current? For the first stage, the item's stored input
/// hash must still be the run's (and the item no superseded child); for the
/// others, the upstream's `success_attempt` must still be the one the attempt
/// was claimed on. The row read is share-locked,
/// so the upstream cannot succeed again (and the input cannot be replaced) until
/// this transaction ends; taking that lock before the run's own (the fence) keeps
/// the lock order of every transaction upstream-first, so the two cannot deadlock.
/// No row: the token no longer holds. `$1` run id, `$2` attempt.
pub const LINEAGE_CURRENT: &str = "\
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
 WHERE r.id = $1 AND r.attempts = $2 AND r.status = 'running'";

/// The fence: checks the token, marks success, locks the run's row. `$1` run id,
/// `$2` attempt.
pub const FENCE_SUCCESS: &str = "\
UPDATE stage_runs
   SET status = 'success', success_attempt = attempts, finished_at = now()
 WHERE id = $1 AND attempts = $2 AND status = 'running'";

/// In the success transaction of a stage that succeeded before: every stage
/// computed from an earlier success of it (directly, or through a chain of
/// `upstream_stage`) is `stale` and runs again, and its results are no longer
/// current (`success_attempt` NULL), so nothing downstream is computed from them
/// until it has run again. A running downstream attempt is fenced by this (its
/// completion expects `running`). A `cancelled` stage stays cancelled (final on
/// every path): only its results stop being current, so nothing after it runs. A
/// failed or dead rerun never gets here, so it invalidates nothing. `$1` tenant,
/// `$2` item, `$3` stage, `$4` reason.
pub const INVALIDATE_DOWNSTREAM: &str = "\
WITH RECURSIVE downstream AS (
    SELECT d.stage FROM stage_runs d
     WHERE d.tenant_id = $1 AND d.item_id = $2 AND d.upstream_stage = $3
    UNION
    SELECT d.stage FROM stage_runs d JOIN downstream ON d.upstream_stage = downstream.stage
     WHERE d.tenant_id = $1 AND d.item_id = $2
)
UPDATE stage_runs
   SET status = CASE WHEN status = 'cancelled' THEN 'cancelled' ELSE 'stale' END,
       last_error = CASE WHEN status = 'cancelled' THEN last_error ELSE $4 END,
       success_attempt = NULL,
       lease_expires_at = least(lease_expires_at, clock_timestamp())
 WHERE tenant_id = $1 AND item_id = $2 AND stage IN (SELECT stage FROM downstream)
   AND status <> 'stale' AND NOT (status = 'cancelled' AND success_attempt IS NULL)";

/// The run's attempt read an upstream that is no longer current: the attempt ends
/// (`fenced` in the history) and the run is `stale`, claimable at once. Fenced on
/// the token. `$1` run id, `$2` attempt, `$3` reason.
pub const STALE_ON_LINEAGE: &str = "\
UPDATE stage_runs
   SET status = 'stale', lease_expires_at = clock_timestamp(), last_error = $3
 WHERE id = $1 AND attempts = $2 AND status = 'running'";

/// Records a failed attempt, fenced on the token: `dead` when the budget is used
/// up or the failure is permanent (`$4` false), else `failed`. `$3` the sanitised
/// error text. A permanent failure also deletes the run's checkpoint: the failure
/// may be the prepared value itself (an answer `commit` cannot use), so an
/// operator's retry must pay for a new one. A retryable failure keeps it (the
/// paid call is still good, also for a retry after the budget ran out).
pub const FAIL: &str = "\
WITH failed AS (
    UPDATE stage_runs
       SET status = CASE WHEN attempts >= max_attempts OR NOT $4 THEN 'dead' ELSE 'failed' END,
           last_error = $3, finished_at = clock_timestamp()
     WHERE id = $1 AND attempts = $2 AND status = 'running'
    RETURNING id, status, attempts),
cleared AS (
    DELETE FROM stage_checkpoints c USING failed f WHERE NOT $4 AND c.run_id = f.id)
SELECT status, attempts FROM failed";

/// Gives the lease back without counting the attempt (shutdown, an infrastructure
/// error): the lease ends now and the budget grows by one. `$3` the reason.
pub const RELEASE: &str = "\
UPDATE stage_runs
   SET lease_expires_at = clock_timestamp(), max_attempts = max_attempts + 1, last_error = $3
 WHERE id = $1 AND attempts = $2 AND status = 'running'
RETURNING lease_expires_at";

/// An attempt interrupted by the database (a retryable error), fenced on the
/// token: given back like `RELEASE` (lease ended now, budget one larger) while
/// fewer than `$4` attempts in a row before it were; otherwise it counts, as
/// `FAIL` of a retryable error would: `failed`, or `dead` with the budget used up,
/// its error `$5`. The row of interruptions continues only from the attempt just
/// before this one (`interrupted_attempt`), so any other end of an attempt starts
/// a new row. `$3` the release's reason. The row is locked first, so the decision
/// is made on the version it updates.
pub const INTERRUPT: &str = "\
WITH run AS (
    SELECT id,
           CASE WHEN interrupted_attempt = attempts - 1 THEN interruptions ELSE 0 END
               AS in_row
      FROM stage_runs
     WHERE id = $1 AND attempts = $2 AND status = 'running'
       FOR UPDATE)
UPDATE stage_runs AS r
   SET status = CASE WHEN run.in_row < $4 THEN 'running'
                     WHEN r.attempts >= r.max_attempts THEN 'dead'
                     ELSE 'failed' END,
       lease_expires_at = CASE WHEN run.in_row < $4 THEN clock_timestamp()
                               ELSE r.lease_expires_at END,
       max_attempts = r.max_attempts + CASE WHEN run.in_row < $4 THEN 1 ELSE 0 END,
       finished_at = CASE WHEN run.in_row < $4 THEN r.finished_at ELSE clock_timestamp() END,
       last_error = CASE WHEN run.in_row < $4 THEN $3 ELSE $5 END,
       interruptions = CASE WHEN run.in_row < $4 THEN run.in_row + 1 ELSE 0 END,
       interrupted_attempt = CASE WHEN run.in_row < $4 THEN r.attempts END
  FROM run
 WHERE r.id = run.id
RETURNING r.status, r.attempts, run.in_row";

/// The end of the token's attempt (`$3`: `abandoned` or `fenced`) while the
/// attempt is its run's current one and has not ended: the attempt's worker,
/// input, upstream and start from the run's row. An attempt that ended is left
/// as it is. `$1` run id, `$2` attempt.
pub const END_ATTEMPT: &str = "\
INSERT INTO stage_attempt_ends
    (run_id, attempt, tenant_id, worker_id, input_hash, started_at, finished_at, outcome,
     upstream_attempt)
SELECT r.id, r.attempts, r.tenant_id, r.worker_id, r.input_hash, r.started_at,
       greatest(r.started_at, now()), $3, r.upstream_attempt
  FROM stage_runs r
 WHERE r.id = $1 AND r.attempts = $2
ON CONFLICT (run_id, attempt) DO NOTHING";

/// An attempt that was given up (`abandoned`: released, or a newer claim took
/// its run) and whose worker comes back to find its token gone: its end is
/// named `$3` (`fenced`). The one update of an attempt's end. `$1` run id, `$2`
/// attempt.
pub const FENCE_ABANDONED: &str = "\
UPDATE stage_attempt_ends SET outcome = $3, finished_at = greatest(started_at, now())
 WHERE run_id = $1 AND attempt = $2 AND outcome = 'abandoned'";

/// Extends the lease from the statement's clock, fenced on the token. `$3` the
/// lease in microseconds.
pub const RENEW: &str = "\
UPDATE stage_runs
   SET lease_expires_at = clock_timestamp() + $3 * interval '1 microsecond'
 WHERE id = $1 AND attempts = $2 AND status = 'running'
RETURNING lease_expires_at";

/// Before a gather's claim, in its transaction: the fan-out its upstream's
/// current success wrote, how many of its children are final. No row: the
/// upstream has no current success (the claim explains that). `$1` tenant, `$2`
/// item, `$3` the upstream (fan-out) stage.
pub const GATHER_READY: &str = "\
SELECT f.final_children, f.children
  FROM stage_runs u
  JOIN fanouts f ON f.tenant_id = u.tenant_id AND f.parent_item = u.item_id
                AND f.stage = u.stage AND f.attempt = u.success_attempt
 WHERE u.tenant_id = $1 AND u.item_id = $2 AND u.stage = $3";
