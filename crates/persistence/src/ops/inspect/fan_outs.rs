//! The fan-out side of an item's timeline: a parent's fan-outs with each
//! child's end, and a child's parent.

use chrono::{DateTime, Utc};
use diesel::sql_types::{Bool, Integer, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{ItemId, StageName, TenantId};
use serde::Serialize;

use crate::ops::OpsError;

/// Where a child item comes from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChildOf {
    /// The parent item.
    pub parent: ItemId,
    /// The parent's fan-out stage.
    pub stage: StageName,
    /// The fan-out stage's attempt that wrote it.
    pub attempt: i32,
    /// Its key among its siblings.
    pub key: String,
    /// Its place in the fan-out's order (from 0).
    pub position: i32,
    /// A rerun of the fan-out stage superseded it: it never runs again.
    pub superseded: bool,
}

/// One fan-out of the item: a fan-out stage's successful attempt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FanOutView {
    /// The fan-out stage.
    pub stage: StageName,
    /// Its attempt that wrote the children.
    pub attempt: i32,
    /// The stage that gathers them.
    pub gather_stage: StageName,
    /// How many final so far (`children.len()` in all).
    pub final_children: i32,
    /// Raised whenever a child's end is counted or changes.
    pub version: i32,
    /// When it was written.
    pub created_at: DateTime<Utc>,
    /// When its last child was counted final.
    pub completed_at: Option<DateTime<Utc>>,
    /// When a rerun of the fan-out stage superseded it.
    pub superseded_at: Option<DateTime<Utc>>,
    /// Its children in the fan-out's order.
    pub children: Vec<ChildView>,
}

/// One child of a fan-out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChildView {
    /// The child item (`idemstage inspect --item` it).
    pub item: ItemId,
    /// Its key.
    pub key: String,
    /// `success`, `stopped`, `dead` or `cancelled` once final; `None` while it
    /// runs.
    pub outcome: Option<String>,
    /// The stage whose end made it final.
    pub final_stage: Option<StageName>,
    /// When it became final.
    pub finished_at: Option<DateTime<Utc>>,
}

#[derive(QueryableByName)]
struct ChildOfRow {
    #[diesel(sql_type = Text)]
    parent_item: String,
    #[diesel(sql_type = Text)]
    stage: String,
    #[diesel(sql_type = Integer)]
    attempt: i32,
    #[diesel(sql_type = Text)]
    child_key: String,
    #[diesel(sql_type = Integer)]
    position: i32,
    #[diesel(sql_type = Bool)]
    superseded: bool,
}

#[derive(QueryableByName)]
struct FanOutRow {
    #[diesel(sql_type = Text)]
    stage: String,
    #[diesel(sql_type = Integer)]
    attempt: i32,
    #[diesel(sql_type = Text)]
    gather_stage: String,
    #[diesel(sql_type = Integer)]
    final_children: i32,
    #[diesel(sql_type = Integer)]
    version: i32,
    #[diesel(sql_type = Timestamptz)]
    created_at: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    completed_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    superseded_at: Option<DateTime<Utc>>,
}

#[derive(QueryableByName)]
struct ChildRow {
    #[diesel(sql_type = Text)]
    stage: String,
    #[diesel(sql_type = Integer)]
    attempt: i32,
    #[diesel(sql_type = Text)]
    item_id: String,
    #[diesel(sql_type = Text)]
    child_key: String,
    #[diesel(sql_type = Nullable<Text>)]
    outcome: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    final_stage: Option<String>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    finished_at: Option<DateTime<Utc>>,
}

/// The fan-out a child item belongs to (none for an item that is no child).
const CHILD_OF_SQL: &str = "\
SELECT c.parent_item, c.stage, c.attempt, c.child_key, c.position,
       f.superseded_at IS NOT NULL AS superseded
  FROM fanout_children c
  JOIN fanouts f ON f.tenant_id = c.tenant_id AND f.parent_item = c.parent_item
                AND f.stage = c.stage AND f.attempt = c.attempt
 WHERE c.tenant_id = $1 AND c.item_id = $2";

const FAN_OUTS_SQL: &str = "\
SELECT stage, attempt, gather_stage, final_children, version, created_at, completed_at,
       superseded_at
  FROM fanouts WHERE tenant_id = $1 AND parent_item = $2
 ORDER BY created_at, stage, attempt";

const CHILDREN_SQL: &str = "\
SELECT stage, attempt, item_id, child_key, outcome, final_stage, finished_at
  FROM fanout_children WHERE tenant_id = $1 AND parent_item = $2
 ORDER BY stage, attempt, position";

/// The item's parent (if it is a child) and its own fan-outs, oldest first,
/// read in the caller's transaction (scoped to `tenant`).
pub(super) async fn read(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
) -> Result<(Option<ChildOf>, Vec<FanOutView>), OpsError> {
    let bind = |sql: &'static str| {
        diesel::sql_query(sql)
            .bind::<Text, _>(tenant.as_str().to_owned())
            .bind::<Text, _>(item.to_string())
    };
    let child_of: Vec<ChildOfRow> = bind(CHILD_OF_SQL).load(conn).await?;
    let fan_outs: Vec<FanOutRow> = bind(FAN_OUTS_SQL).load(conn).await?;
    let children: Vec<ChildRow> = if fan_outs.is_empty() {
        Vec::new()
    } else {
        bind(CHILDREN_SQL).load(conn).await?
    };
    let child_of = child_of
        .into_iter()
        .next()
        .map(|c| {
            Ok::<_, OpsError>(ChildOf {
                parent: ItemId::parse(&c.parent_item)?,
                stage: StageName::parse(&c.stage)?,
                attempt: c.attempt,
                key: c.child_key,
                position: c.position,
                superseded: c.superseded,
            })
        })
        .transpose()?;
    let mut views = Vec::with_capacity(fan_outs.len());
    for f in fan_outs {
        let children = children
            .iter()
            .filter(|c| c.stage == f.stage && c.attempt == f.attempt)
            .map(|c| {
                Ok(ChildView {
                    item: ItemId::parse(&c.item_id)?,
                    key: c.child_key.clone(),
                    outcome: c.outcome.clone(),
                    final_stage: c.final_stage.as_deref().map(StageName::parse).transpose()?,
                    finished_at: c.finished_at,
                })
            })
            .collect::<Result<Vec<_>, OpsError>>()?;
        views.push(FanOutView {
            stage: StageName::parse(&f.stage)?,
            attempt: f.attempt,
            gather_stage: StageName::parse(&f.gather_stage)?,
            final_children: f.final_children,
            version: f.version,
            created_at: f.created_at,
            completed_at: f.completed_at,
            superseded_at: f.superseded_at,
            children,
        });
    }
    Ok((child_of, views))
}
