//! The record of control changes (`queue_control_changes`, migration
//! `2026-11-30-000000_baseline`): written by a trigger on `queue_controls`
//! for every change however it was made, read here.

use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Bool, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::RepoError;

use super::controls::{LimitColumns, Limits, Scope};
use crate::error::map_diesel_error;

/// What a recorded change of a control did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ControlChangeKind {
    /// The scope was paused.
    Pause,
    /// The scope was resumed.
    Resume,
    /// Its limits (cap, rate, weight) were set to other values.
    Limits,
    /// Its control row was deleted (plain SQL; the library never deletes one).
    Remove,
}

impl ControlChangeKind {
    /// Every kind, in the order of the table's CHECK.
    const ALL: [ControlChangeKind; 4] = [
        ControlChangeKind::Pause,
        ControlChangeKind::Resume,
        ControlChangeKind::Limits,
        ControlChangeKind::Remove,
    ];

    /// The kind as `queue_control_changes.change` stores it (and `--json` shows
    /// it): `pause`, `resume`, `limits`, `remove`.
    pub fn as_str(self) -> &'static str {
        match self {
            ControlChangeKind::Pause => "pause",
            ControlChangeKind::Resume => "resume",
            ControlChangeKind::Limits => "limits",
            ControlChangeKind::Remove => "remove",
        }
    }

    fn from_stored(text: &str) -> Result<ControlChangeKind, RepoError> {
        Self::ALL
            .into_iter()
            .find(|k| k.as_str() == text)
            .ok_or_else(|| {
                RepoError::Database(
                    format!("queue_control_changes.change {text:?} is none this version knows")
                        .into(),
                )
            })
    }
}

/// One row of `queue_control_changes`: a change of a control, as [`control_changes`]
/// reads it. Recorded by the database for every change, however it was made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlChange {
    /// The change's number, rising with each change.
    pub id: i64,
    /// When it was made (database clock).
    pub changed_at: DateTime<Utc>,
    /// The queue.
    pub queue: String,
    /// Whom the control applies to.
    pub scope: Scope,
    /// What it did.
    pub kind: ControlChangeKind,
    /// Whether the scope is paused after it (`None` after a [`ControlChangeKind::Remove`]).
    pub paused: Option<bool>,
    /// The limits after it (none after a [`ControlChangeKind::Remove`]).
    pub limits: Limits,
    /// The queue's priority aging after it ([`set_priority_aging`](super::set_priority_aging)).
    pub priority_aging: Option<std::time::Duration>,
    /// Who the library was told made it (`--actor`, the console's session); `None`
    /// for a change made without the library.
    pub actor: Option<String>,
    /// The database login role of the session that made it.
    pub db_user: String,
}

impl ControlChange {
    /// `pause`, `resume`, `remove`, or the values a `limits` change set
    /// (`limits: max_active 3, priority aging every 30s`).
    pub fn describe(&self) -> String {
        match self.kind {
            ControlChangeKind::Limits => match self.priority_aging {
                Some(every) => format!("limits: {}, priority aging every {every:?}", self.limits),
                None => format!("limits: {}", self.limits),
            },
            kind => kind.as_str().to_owned(),
        }
    }
}

#[derive(QueryableByName)]
struct ChangeRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Timestamptz)]
    changed_at: DateTime<Utc>,
    #[diesel(sql_type = Text)]
    queue: String,
    #[diesel(sql_type = Text)]
    scope: String,
    #[diesel(sql_type = Text)]
    change: String,
    #[diesel(sql_type = Nullable<Bool>)]
    paused: Option<bool>,
    #[diesel(embed)]
    limits: LimitColumns,
    #[diesel(sql_type = Nullable<BigInt>)]
    aging_ms: Option<i64>,
    #[diesel(sql_type = Nullable<Text>)]
    actor: Option<String>,
    #[diesel(sql_type = Text)]
    db_user: String,
}

/// The newest `limit` recorded changes of controls, of `queue` or (with `None`) of
/// all queues, newest first.
pub async fn control_changes(
    conn: &mut AsyncPgConnection,
    queue: Option<&str>,
    limit: u32,
) -> Result<Vec<ControlChange>, RepoError> {
    let query = diesel::sql_query(
        "SELECT id, changed_at, queue, scope, change, paused, max_active, rate_count, \
                rate_period_ms, rate_burst, weight, aging_ms, actor, db_user \
           FROM queue_control_changes WHERE $1::text IS NULL OR queue = $1 \
          ORDER BY id DESC LIMIT $2",
    )
    .bind::<Nullable<Text>, _>(queue)
    .bind::<BigInt, _>(i64::from(limit));
    let rows: Vec<ChangeRow> = crate::db::pinned(conn, async move |conn| query.load(conn).await)
        .await
        .map_err(map_diesel_error)?;
    rows.into_iter()
        .map(|r| {
            let kind = ControlChangeKind::from_stored(&r.change)?;
            Ok(ControlChange {
                id: r.id,
                changed_at: r.changed_at,
                scope: Scope::from_key(&r.scope)?,
                queue: r.queue,
                kind,
                paused: r.paused,
                limits: r.limits.into(),
                priority_aging: super::aging::aging(r.aging_ms),
                actor: r.actor,
                db_user: r.db_user,
            })
        })
        .collect()
}
