//! The reconciler's statements (the baseline migration): which items may have an
//! expected stage without a live job (`items_open`), the plan for a batch of
//! one tenant's items (which stage jobs to send again, which items are
//! settled), settling them, and the mark of a success whose body ended the
//! item (`StageFlow::Stop`), after which the next stage is not expected.
//!
//! `items_open` is a ring of [`OPEN_SLOTS`] slots (`ring.rs`): a round of
//! the reconciler [`rotate`]s it, passes each older slot, opens again in the
//! current slot every item it does not find settled, and [`truncate`]s the
//! slot. Nothing is deleted or updated.
//!
//! A stage is *expected* when it is the first (while the item exists) or its
//! upstream has a current success that did not stop the item; it is *final*
//! when its run is `success`, `dead` or `cancelled`. The plan sends again the job
//! of every expected stage that is not final (no run, `failed`, `stale`, or
//! `running` with an expired lease) and has no live job under its singleton key;
//! the claim then decides, as for any job. The stage order is the caller's
//! (`Pipeline`): the database does not know it.

use diesel::sql_types::{Array, Bool, Integer, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{ItemId, RepoError, StageName, TenantId};

use crate::error::map_diesel_error;
use crate::FencedTx;

mod ring;
pub use ring::{carry, open_items, rotate, seal, truncate, Rotation, OPEN_SLOTS};
pub(crate) use ring::{CARRY_SQL, OPEN_SQL, ROTATE_SQL, SEAL_SQL, TRUNCATE_SQL};

/// The class of the transaction-level advisory locks on an item (`'idmo'`):
/// shared by every writer of a stage job (the trigger of `jobs`), exclusive for
/// the reconciler's last check before it settles the item.
pub const OPEN_LOCK_CLASS: i32 = 0x6964_6d6f;

/// An item that may have an expected stage without a live job.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct OpenItem {
    /// Its tenant.
    pub tenant: TenantId,
    /// The item.
    pub item: ItemId,
}

/// An expected stage that is not final and has no live job: its job is to be
/// sent again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LostStage {
    /// The item.
    pub item: ItemId,
    /// The stage (its queue).
    pub stage: StageName,
    /// The item's stored input hash, for the job's payload.
    pub input_hash: String,
}

/// What [`plan`] found for a batch of one tenant's items.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantPlan {
    /// The stages whose job is to be sent again.
    pub lost: Vec<LostStage>,
    /// The items with every expected stage final and no live job (or no
    /// item of this tenant at all): nothing to look at until a job is written
    /// for them again.
    pub settled: Vec<ItemId>,
}

#[derive(diesel::QueryableByName)]
struct StageRow {
    #[diesel(sql_type = Text)]
    item_id: String,
    #[diesel(sql_type = Text)]
    stage: String,
    #[diesel(sql_type = Text)]
    input_hash: String,
    #[diesel(sql_type = Bool)]
    resend: bool,
    #[diesel(sql_type = Bool)]
    keeps_open: bool,
}

#[derive(diesel::QueryableByName)]
struct Locked {
    #[diesel(sql_type = Text)]
    item_id: String,
}

/// What the reconciler's plan knows of a pipeline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReconciledStages {
    /// The stages, in pipeline order.
    pub stages: Vec<StageName>,
    /// Each stage's upstream (`None`: it reads its item's input; the first
    /// stage, a fan-out's first child stage).
    pub upstreams: Vec<Option<StageName>>,
    /// Whether each stage runs per child of a fan-out (on the child items,
    /// not on their parents).
    pub per_child: Vec<bool>,
    /// Whether each stage is a gather (expected once its upstream's fan-out is
    /// complete).
    pub gathers: Vec<bool>,
    /// Whether the first stage re-runs on new input (`InputChangePolicy::Rerun`).
    pub first_reruns: bool,
}

impl ReconciledStages {
    /// A line of stages: each after the one before it.
    pub fn line(stages: Vec<StageName>, first_reruns: bool) -> Self {
        let upstreams = std::iter::once(None)
            .chain(
                stages
                    .iter()
                    .take(stages.len().saturating_sub(1))
                    .cloned()
                    .map(Some),
            )
            .collect();
        Self {
            per_child: vec![false; stages.len()],
            gathers: vec![false; stages.len()],
            upstreams,
            stages,
            first_reruns,
        }
    }
}

/// `$1` the stages in pipeline order, `$2` the tenant, `$3` its items, `$4`
/// whether the first stage re-runs on new input, `$5` each stage's upstream
/// (NULL: it reads its item's input), `$6` whether it runs per child, `$7`
/// whether it is a gather: one row per (item, stage) of the items that exist
/// for the tenant, the stages of its kind only (a fan-out's child items run
/// the child stages, every other item the rest). A gather is expected once
/// the fan-out its upstream's success wrote is complete; a child its parent's
/// rerun superseded expects nothing (settled). Under `Rerun` a
/// first stage that succeeded on another input than the item's stored one has
/// a rerun due (its job may have been lost before its claim): not final.
/// Index probes only: the item's primary key, `fanout_children`'s and
/// `fanouts`' primary keys, `stage_runs_tenant_item_stage_uq` for the run and
/// its upstream's, `job_keys_pkey` and the holder's primary key and closure for a live job.
const PLAN_SQL: &str = "\
WITH stages AS (
    SELECT s.stage, s.up, s.per_child, s.gather, s.pos
      FROM unnest($1::text[], $5::text[], $6::bool[], $7::bool[])
           WITH ORDINALITY AS s(stage, up, per_child, gather, pos)
), stage_state AS (
    SELECT a.id AS item_id, a.input_sha256, s.stage, r.status,
           r.status = 'running' AND r.lease_expires_at < clock_timestamp() AS lease_over,
           s.up IS NULL OR (u.success_attempt IS NOT NULL
                            AND u.stopped_attempt IS DISTINCT FROM u.success_attempt
                            AND (NOT s.gather OR EXISTS (
                                SELECT 1 FROM fanouts f
                                 WHERE f.tenant_id = a.tenant_id AND f.parent_item = a.id
                                   AND f.stage = s.up AND f.attempt = u.success_attempt
                                   AND f.completed_at IS NOT NULL))) AS expected,
           coalesce(s.pos = 1 AND $4 AND r.status = 'success'
                    AND r.input_hash <> a.input_sha256, false) AS rerun_due,
           EXISTS (SELECT 1 FROM job_keys g
                    WHERE g.queue = s.stage
                      AND g.singleton_key = s.stage || ':' || a.tenant_id || ':' || a.id
                      AND idemstage_key_holder_live(g.job_id)) AS live_job
      FROM items a
      LEFT JOIN fanout_children c ON c.tenant_id = a.tenant_id AND c.item_id = a.id
      JOIN stages s ON s.per_child = (c.item_id IS NOT NULL)
      LEFT JOIN stage_runs r
             ON r.tenant_id = a.tenant_id AND r.item_id = a.id AND r.stage = s.stage
      LEFT JOIN stage_runs u
             ON u.tenant_id = a.tenant_id AND u.item_id = a.id AND u.stage = s.up
     WHERE a.tenant_id = $2 AND a.id = ANY($3::text[]) AND a.superseded_at IS NULL
)
SELECT item_id, stage, input_sha256 AS input_hash,
       coalesce(expected AND NOT live_job
                AND (status IS NULL OR status IN ('failed', 'stale') OR lease_over
                     OR rerun_due), false)
           AS resend,
       coalesce(live_job OR (expected AND (status IS NULL OR rerun_due
                                           OR status NOT IN ('success', 'dead', 'cancelled'))),
                true) AS keeps_open
  FROM stage_state";

/// JIT off for the rest of the plan's transaction. The plan's estimated cost
/// grows with the tables it probes (a batch of items' runs and jobs); past
/// `jit_above_cost` the server compiled it on every call, 0.4-2.8 s each in the
/// idle_in_tx pressure cell, for a statement that runs in milliseconds. Sent
/// apart: the setting counts from the next statement's planning on.
const NO_JIT_SQL: &str = "SELECT set_config('jit', 'off', true)";

/// `$1` the items, `$2` [`OPEN_LOCK_CLASS`]: those whose lock this transaction got (no writer of one of
/// their jobs is in a transaction right now, and none can commit one before this
/// transaction ends).
const LOCK_SQL: &str = "\
SELECT a AS item_id FROM unnest($1::text[]) AS a
 WHERE pg_try_advisory_xact_lock($2, hashtext(a))";

/// `$1` run, `$2` its successful attempt.
const STOP_SQL: &str = "\
UPDATE stage_runs SET stopped_attempt = $2 WHERE id = $1 AND success_attempt = $2";

/// The plan for `items` of `tenant`, whose stages are `stages` in pipeline
/// order. Run it inside a transaction scoped to `tenant` (`tenant::transaction`):
/// it reads only what the scope shows, and turns JIT off for the rest of it.
pub async fn plan(
    conn: &mut AsyncPgConnection,
    stages: &ReconciledStages,
    tenant: &TenantId,
    items: &[ItemId],
) -> Result<TenantPlan, RepoError> {
    let stage_names: Vec<&str> = stages.stages.iter().map(StageName::as_str).collect();
    let ids: Vec<String> = items.iter().map(ToString::to_string).collect();
    let upstreams: Vec<Option<&str>> = stages
        .upstreams
        .iter()
        .map(|u| u.as_ref().map(StageName::as_str))
        .collect();
    diesel::sql_query(NO_JIT_SQL)
        .execute(conn)
        .await
        .map_err(map_diesel_error)?;
    let rows: Vec<StageRow> = diesel::sql_query(PLAN_SQL)
        .bind::<Array<Text>, _>(&stage_names)
        .bind::<Text, _>(tenant.as_str())
        .bind::<Array<Text>, _>(&ids)
        .bind::<diesel::sql_types::Bool, _>(stages.first_reruns)
        .bind::<Array<diesel::sql_types::Nullable<Text>>, _>(&upstreams)
        .bind::<Array<Bool>, _>(&stages.per_child)
        .bind::<Array<Bool>, _>(&stages.gathers)
        .load(conn)
        .await
        .map_err(map_diesel_error)?;
    let mut open = std::collections::HashSet::new();
    let mut lost = Vec::new();
    for row in rows {
        if row.keeps_open {
            open.insert(row.item_id.clone());
        }
        if row.resend {
            lost.push(LostStage {
                item: ItemId::parse(&row.item_id)?,
                stage: StageName::parse(&row.stage)?,
                input_hash: row.input_hash,
            });
        }
    }
    let settled = items
        .iter()
        .filter(|a| !open.contains(&a.to_string()))
        .copied()
        .collect();
    Ok(TenantPlan { lost, settled })
}

/// Settles those of `items` (found settled by a [`plan`] a moment ago) that
/// still are: takes their locks (skipping any a writer holds), plans them again
/// in a snapshot taken after the locks, and opens the others again in the
/// current slot ([`carry`]); a settled item is simply not carried, and goes
/// with its slot's truncate. Run it in a transaction of its own scoped to
/// `tenant`, with nothing else in it, so that it never waits for a lock while
/// holding one. Returns how many it settled.
pub async fn settle(
    conn: &mut AsyncPgConnection,
    stages: &ReconciledStages,
    tenant: &TenantId,
    items: &[ItemId],
) -> Result<usize, RepoError> {
    let ids: Vec<String> = items.iter().map(ToString::to_string).collect();
    let locked: Vec<Locked> = diesel::sql_query(LOCK_SQL)
        .bind::<Array<Text>, _>(&ids)
        .bind::<Integer, _>(OPEN_LOCK_CLASS)
        .load(conn)
        .await
        .map_err(map_diesel_error)?;
    let locked: Vec<ItemId> = locked
        .iter()
        .map(|l| ItemId::parse(&l.item_id))
        .collect::<Result<_, _>>()?;
    let settled = if locked.is_empty() {
        Vec::new()
    } else {
        plan(conn, stages, tenant, &locked).await?.settled
    };
    carry(conn, tenant, items, &settled).await?;
    Ok(settled.len())
}

/// Marks the success this fenced transaction commits as the item's end
/// (`StageFlow::Stop`): the stage after it is not expected while this attempt
/// is the run's current success, so the reconciler sends nothing for it.
pub async fn record_stop(tx: &mut FencedTx<'_>) -> Result<(), RepoError> {
    let (run, attempt) = (tx.token().run_id.to_string(), tx.token().attempt);
    diesel::sql_query(STOP_SQL)
        .bind::<Text, _>(run)
        .bind::<Integer, _>(attempt)
        .execute(tx.conn())
        .await
        .map(|_| ())
        .map_err(map_diesel_error)
}
