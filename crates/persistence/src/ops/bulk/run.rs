//! A bulk action's record and its run: batches that commit with their
//! progress, resumed from the last one after a crash.

use chrono::{DateTime, Utc};
use diesel::sql_types::{Array, Integer, Jsonb, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{BulkId, DomainError, ItemId, TenantId};
use serde::Serialize;

use super::{BulkAction, BulkFilter, SELECTED};
use crate::ops::{Actor, OpsError, RetryPlanner};

/// A bulk action's record (`bulk_actions`): what it selects and how far it got.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BulkProgress {
    /// Its id.
    pub id: BulkId,
    /// The action.
    pub action: BulkAction,
    /// The filter, as given.
    pub filter: BulkFilter,
    /// Who started it.
    pub actor: String,
    /// Items per batch (one transaction each).
    pub batch_size: i32,
    /// Items taken so far.
    pub selected: i32,
    /// Items the action changed.
    pub acted: i32,
    /// Batches committed.
    pub batches: i32,
    /// The last item taken (tenant, item), if any.
    pub done: Option<(String, String)>,
    /// When it finished (no item left after `done`).
    pub finished_at: Option<DateTime<Utc>>,
}

#[derive(QueryableByName)]
struct ProgressRow {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Text)]
    action: String,
    #[diesel(sql_type = Jsonb)]
    filter: serde_json::Value,
    #[diesel(sql_type = Text)]
    actor: String,
    #[diesel(sql_type = Integer)]
    batch_size: i32,
    #[diesel(sql_type = Nullable<Text>)]
    done_tenant: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    done_item: Option<String>,
    #[diesel(sql_type = Integer)]
    selected: i32,
    #[diesel(sql_type = Integer)]
    acted: i32,
    #[diesel(sql_type = Integer)]
    batches: i32,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    finished_at: Option<DateTime<Utc>>,
}

impl ProgressRow {
    fn into_progress(self) -> Result<BulkProgress, OpsError> {
        let filter: BulkFilter = serde_json::from_value(self.filter).map_err(|e| {
            DomainError::InvalidOption(format!("bulk action {}: its filter: {e}", self.id))
        })?;
        Ok(BulkProgress {
            id: BulkId::parse(&self.id)?,
            action: self.action.parse()?,
            filter,
            actor: self.actor,
            batch_size: self.batch_size,
            selected: self.selected,
            acted: self.acted,
            batches: self.batches,
            done: self.done_tenant.zip(self.done_item),
            finished_at: self.finished_at,
        })
    }
}

#[derive(QueryableByName)]
struct Selected {
    #[diesel(sql_type = Text)]
    tenant_id: String,
    #[diesel(sql_type = Text)]
    item_id: String,
}

const PROGRESS_COLUMNS: &str = "id, action, filter, actor, batch_size, done_tenant, done_item, \
     selected, acted, batches, finished_at";

/// Records a bulk action (nothing acted on yet) and returns its progress; run it
/// with [`run_bulk`]. `batch_size`: items per transaction, 1 to 10,000.
pub async fn start_bulk(
    conn: &mut AsyncPgConnection,
    action: BulkAction,
    filter: &BulkFilter,
    actor: &Actor,
    batch_size: u32,
) -> Result<BulkProgress, OpsError> {
    filter.check(action)?;
    if !(1..=10_000).contains(&batch_size) {
        return Err(DomainError::InvalidOption(format!(
            "batch size {batch_size}: expected 1 to 10000"
        ))
        .into());
    }
    let row: ProgressRow = diesel::sql_query(format!(
        "INSERT INTO bulk_actions (id, action, filter, actor, batch_size) \
         VALUES ($1, $2, $3, $4, $5) RETURNING {PROGRESS_COLUMNS}"
    ))
    .bind::<Text, _>(BulkId::new().to_string())
    .bind::<Text, _>(action.as_str())
    .bind::<Jsonb, _>(serde_json::to_value(filter).expect("a filter serializes"))
    .bind::<Text, _>(actor.as_str())
    .bind::<Integer, _>(batch_size as i32)
    .get_result(conn)
    .await?;
    row.into_progress()
}

/// A bulk action's record; `BulkNotFound` if there is none.
pub async fn bulk_progress(
    conn: &mut AsyncPgConnection,
    id: &BulkId,
) -> Result<BulkProgress, OpsError> {
    load(conn, id, false).await
}

async fn load(
    conn: &mut AsyncPgConnection,
    id: &BulkId,
    lock: bool,
) -> Result<BulkProgress, OpsError> {
    let sql = format!(
        "SELECT {PROGRESS_COLUMNS} FROM bulk_actions WHERE id = $1{}",
        if lock { " FOR UPDATE" } else { "" }
    );
    let row: Option<ProgressRow> = diesel::sql_query(sql)
        .bind::<Text, _>(id.to_string())
        .get_result(conn)
        .await
        .map(Some)
        .or_else(|e| match e {
            diesel::result::Error::NotFound => Ok(None),
            e => Err(e),
        })?;
    row.ok_or(OpsError::BulkNotFound(*id))?.into_progress()
}

/// Runs (or resumes) a bulk action until no selected item is left: a batch at a
/// time, each one transaction whose writes are scoped to its tenant (a batch
/// never spans two)
/// that acts on its items with the action's own conditional writes, each with
/// its audit entry naming the bulk action, and moves the action's `done` past
/// them. A crash loses at most the batch in flight, which the next run takes
/// again: no item is acted on twice. Two runs of one action at once take turns
/// batch by batch (the second waits for the record's row lock and goes on
/// after the first's batch). `on_batch` sees the progress after every batch.
///
/// An item the action refuses (a stage running or cancelled, an item with
/// nothing to do) is taken and not counted in `acted`; a database error ends
/// the run (a deadlock is retried), and the next run resumes where it stopped.
pub async fn run_bulk(
    conn: &mut AsyncPgConnection,
    id: &BulkId,
    actor: &Actor,
    planner: &dyn RetryPlanner,
    mut on_batch: impl FnMut(&BulkProgress) + Send,
) -> Result<BulkProgress, OpsError> {
    let progress = bulk_progress(conn, id).await?;
    // The record is read back, not trusted: a filter changed by hand is
    // refused as it would have been at the start.
    progress.filter.check(progress.action)?;
    if let Some(stage) = &progress.filter.stage {
        if planner.budget(stage).is_none() {
            return Err(OpsError::UnknownStage(stage.to_string()));
        }
    }
    let mut progress = progress;
    loop {
        if progress.finished_at.is_some() {
            return Ok(progress);
        }
        let batch = next_batch(conn, &progress).await?;
        let Some(first) = batch.as_slice().first() else {
            progress = finish(conn, id).await?;
            on_batch(&progress);
            return Ok(progress);
        };
        // One tenant per transaction: the scope is the tenant's.
        let tenant = TenantId::parse(&first.tenant_id)?;
        let items: Vec<ItemId> = batch
            .iter()
            .take_while(|s| s.tenant_id == first.tenant_id)
            .map(|s| ItemId::parse(&s.item_id))
            .collect::<Result<_, _>>()?;
        let mut tries = 0;
        progress = loop {
            let expected = progress.done.clone();
            let result = {
                use diesel_async::AsyncConnection;
                let (tenant, items) = (&tenant, &items);
                conn.transaction::<_, OpsError, _>(async move |conn| {
                    run_batch(conn, id, expected, tenant, items, actor, planner).await
                })
                .await
            };
            if !crate::ops::again_after(&result, &mut tries).await {
                break result?;
            }
        };
        on_batch(&progress);
    }
}

async fn next_batch(
    conn: &mut AsyncPgConnection,
    progress: &BulkProgress,
) -> Result<Vec<Selected>, OpsError> {
    let sql = format!(
        "SELECT tenant_id, item_id FROM ({SELECTED}) s \
          WHERE $7::text IS NULL OR (tenant_id, item_id) > ($7::text, $8::text) \
          ORDER BY tenant_id, item_id LIMIT $9"
    );
    let (done_tenant, done_item) = progress.done.clone().unzip();
    Ok(bind_filter!(diesel::sql_query(sql), &progress.filter)
        .bind::<Nullable<Text>, _>(done_tenant)
        .bind::<Nullable<Text>, _>(done_item)
        .bind::<Integer, _>(progress.batch_size)
        .load(conn)
        .await?)
}

/// One batch in the caller's transaction: the record is locked first (as the
/// connecting operator) and must still be at `expected` (another run of the
/// action may have taken these items meanwhile: then nothing is acted on here,
/// and the next batch is selected from where that run got to); the items are
/// acted on in `tenant`'s scope, which then ends for the record's update.
async fn run_batch(
    conn: &mut AsyncPgConnection,
    id: &BulkId,
    expected: Option<(String, String)>,
    tenant: &TenantId,
    items: &[ItemId],
    actor: &Actor,
    planner: &dyn RetryPlanner,
) -> Result<BulkProgress, OpsError> {
    let locked = load(conn, id, true).await?;
    if locked.done != expected || locked.finished_at.is_some() {
        return Ok(locked);
    }
    crate::tenant::scope(conn, tenant).await?;
    let action = locked.action;
    let stage = locked.filter.stage.clone();
    let mut acted = 0;
    for item in items {
        let changed = match action {
            BulkAction::Rerun => {
                let stage = stage.as_ref().ok_or_else(|| {
                    DomainError::InvalidOption("a bulk rerun names its stage".into())
                })?;
                crate::ops::rerun::rerun_in(conn, tenant, item, stage, actor, Some(id), planner)
                    .await
                    .map(|o| matches!(o, crate::ops::RerunOutcome::Rerun { .. }))
            }
            BulkAction::Retry => crate::ops::retry::retry_in(
                conn,
                tenant,
                item,
                stage.as_ref(),
                actor,
                Some(id),
                planner,
            )
            .await
            .map(|o| matches!(o, crate::ops::RetryOutcome::Retried { .. })),
            BulkAction::Cancel => {
                crate::ops::cancel::cancel_in(conn, tenant, item, actor, Some(id))
                    .await
                    .map(|o| matches!(o, crate::ops::CancelOutcome::Cancelled { .. }))
            }
        };
        match changed {
            Ok(true) => acted += 1,
            Ok(false) => {}
            // Refused by a read after a write that changed nothing: the
            // transaction is intact, the item is taken and not acted on.
            Err(e) if e.is_bad_request() && !matches!(e, OpsError::Repo(_)) => {
                tracing::debug!(%item, error = %e, "bulk action skips an item");
            }
            Err(e) => return Err(e),
        }
    }
    crate::tenant::unscope(conn).await?;
    let last = items.last().expect("a batch has an item");
    let row: ProgressRow = diesel::sql_query(format!(
        "UPDATE bulk_actions \
            SET done_tenant = $2, done_item = $3, selected = selected + $4, \
                acted = acted + $5, batches = batches + 1, updated_at = now() \
          WHERE id = $1 RETURNING {PROGRESS_COLUMNS}"
    ))
    .bind::<Text, _>(id.to_string())
    .bind::<Text, _>(tenant.as_str())
    .bind::<Text, _>(last.to_string())
    .bind::<Integer, _>(items.len() as i32)
    .bind::<Integer, _>(acted)
    .get_result(conn)
    .await?;
    row.into_progress()
}

async fn finish(conn: &mut AsyncPgConnection, id: &BulkId) -> Result<BulkProgress, OpsError> {
    diesel::sql_query(
        "UPDATE bulk_actions SET finished_at = now(), updated_at = now() \
          WHERE id = $1 AND finished_at IS NULL",
    )
    .bind::<Text, _>(id.to_string())
    .execute(conn)
    .await?;
    bulk_progress(conn, id).await
}
