//! A parent's cancel goes on to its current fan-outs: their unfinished
//! children, and a gather that has not run.

use diesel::sql_types::{Array, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{BulkId, ItemId, StageName, TenantId};

use super::items::{cancel_items, insert_cancelled_run, InsertedRun};
use super::{CancelledChild, CancelledFrom, CancelledStage};
use crate::ops::{audit, Actor, OpsError};

/// The unfinished children of the item's current fan-outs (not superseded by
/// a rerun of the fan-out stage). `$1` tenant, `$2` the parent item.
pub(crate) const OPEN_CHILDREN_SQL: &str = "\
SELECT c.item_id AS id FROM fanouts f
  JOIN fanout_children c
    ON c.tenant_id = f.tenant_id AND c.parent_item = f.parent_item
   AND c.stage = f.stage AND c.attempt = f.attempt
 WHERE f.tenant_id = $1 AND f.parent_item = $2 AND f.superseded_at IS NULL
   AND c.outcome IS NULL
 ORDER BY c.item_id";

/// Every run of those children, locked before any of them is cancelled: a
/// child's final commit holds its run's lock while it counts itself on the
/// fan-out's row, which cancelling a child (its trigger) takes too, so taking
/// the runs one child at a time could wait on a child holding the other.
/// `$1` tenant, `$2` the children.
pub(crate) const LOCK_CHILD_RUNS_SQL: &str = "\
SELECT id FROM stage_runs
 WHERE tenant_id = $1 AND item_id = ANY($2::text[])
 ORDER BY item_id, created_at, id
   FOR UPDATE";

/// The gather stages of the item's current fan-outs. `$1` tenant, `$2` item.
pub(crate) const GATHERS_SQL: &str = "\
SELECT DISTINCT gather_stage AS id FROM fanouts
 WHERE tenant_id = $1 AND parent_item = $2 AND superseded_at IS NULL";

/// Cancels the unfinished children of `parent`'s current fan-outs, their runs
/// locked first (all of them, in one statement).
pub(super) async fn cancel_children(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    parent: &ItemId,
    actor: &Actor,
    bulk: Option<&BulkId>,
) -> Result<Vec<CancelledChild>, OpsError> {
    let open: Vec<InsertedRun> = diesel::sql_query(OPEN_CHILDREN_SQL)
        .bind::<Text, _>(tenant.as_str())
        .bind::<Text, _>(parent.to_string())
        .load(conn)
        .await?;
    if open.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<String> = open.into_iter().map(|r| r.id).collect();
    let _locked: Vec<InsertedRun> = diesel::sql_query(LOCK_CHILD_RUNS_SQL)
        .bind::<Text, _>(tenant.as_str())
        .bind::<Array<Text>, _>(&ids)
        .load(conn)
        .await?;
    let reason = format!("cancelled by {actor} with its parent {parent}");
    let items = ids
        .iter()
        .map(|id| ItemId::parse(id))
        .collect::<Result<Vec<_>, _>>()?;
    let cancelled = cancel_items(conn, tenant, &items, actor, &reason).await?;
    let mut children = Vec::with_capacity(items.len());
    for (child, (stages, jobs)) in items.into_iter().zip(cancelled) {
        if stages.is_empty() && jobs.is_empty() {
            continue; // it became final before the lock
        }
        let details = serde_json::json!({
            "actor": actor, "parent": parent, "stages": stages, "jobs": jobs,
        });
        audit(conn, tenant, &child, "operator.cancel", details, bulk).await?;
        children.push(CancelledChild {
            item: child,
            stages,
            jobs,
        });
    }
    Ok(children)
}

/// The gathers of `item`'s current fan-outs that have no run get one
/// `cancelled` ([`AwaitingChildren`](CancelledFrom::AwaitingChildren)): the
/// children's counts may complete the fan-out, and nothing runs them then.
pub(super) async fn cancel_gathers(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    actor: &Actor,
    reason: &str,
) -> Result<Vec<CancelledStage>, OpsError> {
    let worker = format!("operator:{actor}");
    let gathers: Vec<InsertedRun> = diesel::sql_query(GATHERS_SQL)
        .bind::<Text, _>(tenant.as_str())
        .bind::<Text, _>(item.to_string())
        .load(conn)
        .await?;
    let mut stages = Vec::new();
    for gather in gathers {
        let stage = StageName::parse(&gather.id)?;
        if let Some(run_id) =
            insert_cancelled_run(conn, tenant, item, &stage, &worker, reason).await?
        {
            stages.push(CancelledStage {
                stage,
                run_id,
                from: CancelledFrom::AwaitingChildren,
            });
        }
    }
    Ok(stages)
}
