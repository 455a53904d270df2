//! Operator commands (`idemstage inspect | retry | cancel | dead`): what an
//! operator reads about one item or all dead stages, and the two writes an
//! operator may make, a retry of a dead stage and the cancel of an item.
//!
//! - [`inspect`]: the timeline of one item (runs, every attempt, its jobs).
//!   Read-only.
//! - [`retry`]: a `dead` stage gets a fresh attempt budget and a new job.
//! - [`rerun`]: a finished stage runs again on its current input and upstream,
//!   and every stage computed from it is invalidated.
//! - [`cancel`]: the item's live jobs are cancelled and its unfinished stages
//!   end `cancelled` (final); a running attempt is fenced.
//! - [`preview`], [`start_bulk`], [`run_bulk`]: a rerun, retry or cancel of
//!   every item a [`BulkFilter`] selects, previewed, in batches, resumable.
//! - [`signal`]: the signal a waiting stage waits for, delivered once.
//! - [`dead`]: the dead-letter list: dead stages and failed jobs, with their
//!   last errors.
//!
//! Every write names its tenant and runs in a transaction scoped to it
//! ([`crate::tenant::scope`]), records who made it in `audit_log` (action
//! `operator.retry` / `operator.rerun` / `operator.cancel`, the [`Actor`] in
//! `details`, and the [`BulkId`] of a bulk action; the entry
//! names no `run_id`, so that it is never taken for a stage's own write), and
//! changes nothing when it refuses. Each is one transaction that is safe beside
//! running workers: its conditional writes re-check the state they change
//! (`status = 'dead'`, not final), and a deadlock or serialization failure is
//! retried. Call them on a connection with no transaction open.
//!
//! ```no_run
//! use idemstage_domain::{ItemId, TenantId};
//! use idemstage_persistence::ops::{self, Actor, CancelOutcome};
//!
//! # async fn demo(conn: &mut diesel_async::AsyncPgConnection) -> Result<(), ops::OpsError> {
//! let tenant = TenantId::parse("acme")?;
//! let item = ItemId::parse("01JBQ8N4V1M8W3Y6Z9C2E5H7KX")?;
//! let timeline = ops::inspect(conn, &tenant, &item).await?;
//! println!("{} stages, {} jobs", timeline.stages.len(), timeline.jobs.len());
//! match ops::cancel(conn, &tenant, &item, &Actor::parse("alice")?).await? {
//!     CancelOutcome::Cancelled { stages, .. } => println!("{} stages cancelled", stages.len()),
//!     CancelOutcome::NothingToCancel => println!("everything was final already"),
//! }
//! # Ok(())
//! # }
//! ```

mod bulk;
pub(crate) mod cancel;
mod dead;
mod inspect;
pub(crate) mod rerun;
mod retry;
pub(crate) mod signal;

use diesel::sql_types::{Jsonb, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{BulkId, DomainError, ItemId, RepoError, RowId, StageName, TenantId};
use serde::Serialize;
use thiserror::Error;

use crate::error::map_diesel_error;

pub use bulk::{
    bulk_progress, preview, run_bulk, start_bulk, BulkAction, BulkFilter, BulkPreview,
    BulkProgress, PreviewGroup,
};
pub use cancel::{
    cancel, CancelOutcome, CancelledChild, CancelledFrom, CancelledJob, CancelledStage,
};
pub use dead::{dead, DeadFilter, DeadLetters, DeadStage, FailedJob};
pub use inspect::{
    inspect, AttemptView, ChildOf, ChildView, FanOutView, ItemTimeline, JobView, StageTimeline,
    WaitView,
};
pub use rerun::{rerun, RerunOutcome, RerunRefusal};
pub use retry::{retry, RetriedStage, RetryOutcome, RetryPlanner};
pub use signal::{signal, SignalOutcome, SignalRefusal, MAX_SIGNAL_PAYLOAD_BYTES};

/// Who ran an operator command, as recorded in `audit_log.details.actor`: 1 to
/// 128 bytes, no control characters, trimmed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Actor(String);

impl Actor {
    /// The most bytes an actor has.
    pub const MAX_BYTES: usize = 128;

    /// Parses an actor name (a user, a service); refuses an empty one, one longer
    /// than [`Actor::MAX_BYTES`] or one with control characters.
    pub fn parse(name: &str) -> Result<Actor, DomainError> {
        let name = name.trim();
        if name.is_empty() || name.len() > Self::MAX_BYTES || name.chars().any(char::is_control) {
            return Err(DomainError::InvalidOption(format!(
                "invalid actor {name:?}: expected 1 to {} bytes without control characters",
                Self::MAX_BYTES
            )));
        }
        Ok(Actor(name.to_owned()))
    }

    /// The actor's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Actor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why a `dead` stage could not be retried: it is not dead, and not about to be
/// retried by the workers either.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum RetryRefusal {
    /// The stage succeeded: there is nothing to retry (a rerun is a new input's
    /// business).
    Succeeded,
    /// A worker holds a live lease on it.
    Running {
        /// When the lease runs out (database clock).
        lease_expires_at: chrono::DateTime<chrono::Utc>,
    },
    /// The item was cancelled: final.
    Cancelled,
}

impl std::fmt::Display for RetryRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RetryRefusal::Succeeded => f.write_str("it succeeded"),
            RetryRefusal::Running { lease_expires_at } => {
                write!(f, "it is running (lease until {lease_expires_at})")
            }
            RetryRefusal::Cancelled => f.write_str("it was cancelled"),
        }
    }
}

/// Errors of the operator commands. [`OpsError::is_bad_request`]: the request
/// is wrong (unknown item, stage, a state that refuses it) and will fail
/// again; nothing was changed. [`OpsError::is_retryable`]: the database's state
/// at the moment; the same call may succeed later.
#[derive(Debug, Error)]
pub enum OpsError {
    /// No such item for this tenant (it may exist for another tenant, or the
    /// tenant may have none).
    #[error("item {item} not found for tenant {tenant}")]
    ItemNotFound {
        /// The tenant asked for.
        tenant: TenantId,
        /// The item asked for.
        item: ItemId,
    },
    /// The stage is not one of the pipeline's.
    #[error("unknown stage {0:?}: not a stage of the pipeline")]
    UnknownStage(String),
    /// The item has no run of this stage (it never started).
    #[error("item {item} of tenant {tenant} has no run of stage {stage}")]
    StageNotStarted {
        /// The tenant.
        tenant: TenantId,
        /// The item.
        item: ItemId,
        /// The stage asked for.
        stage: StageName,
    },
    /// A retry of a stage that is not dead and will not be retried: succeeded,
    /// running, cancelled.
    #[error("stage {stage} of item {item} (tenant {tenant}) cannot be retried: {reason}")]
    RetryRefused {
        /// The tenant.
        tenant: TenantId,
        /// The item.
        item: ItemId,
        /// The stage.
        stage: StageName,
        /// Its state.
        reason: RetryRefusal,
    },
    /// A rerun of a stage that a worker holds or whose item was cancelled.
    #[error("stage {stage} of item {item} (tenant {tenant}) cannot be rerun: {reason}")]
    RerunRefused {
        /// The tenant.
        tenant: TenantId,
        /// The item.
        item: ItemId,
        /// The stage.
        stage: StageName,
        /// Its state.
        reason: RerunRefusal,
    },
    /// A signal the stage does not wait for.
    #[error("a signal for stage {stage} of item {item} (tenant {tenant}) was refused: {reason}")]
    SignalRefused {
        /// The tenant.
        tenant: TenantId,
        /// The item.
        item: ItemId,
        /// The stage.
        stage: StageName,
        /// Its state.
        reason: SignalRefusal,
    },
    /// No bulk action with this id.
    #[error("bulk action {0} not found")]
    BulkNotFound(BulkId),
    /// Bad input found before anything ran (an id, an actor, a stage name).
    #[error(transparent)]
    Invalid(#[from] DomainError),
    /// A database error; see [`RepoError::is_retryable`].
    #[error(transparent)]
    Repo(#[from] RepoError),
}

impl OpsError {
    /// The request is wrong and will fail again; nothing was changed.
    pub fn is_bad_request(&self) -> bool {
        match self {
            OpsError::Repo(e) => e.is_bad_request(),
            _ => true,
        }
    }

    /// The database's state at the moment (unavailable, a conflict, a timeout):
    /// the same call may succeed later.
    pub fn is_retryable(&self) -> bool {
        match self {
            OpsError::Repo(e) => e.is_retryable(),
            _ => false,
        }
    }
}

impl From<diesel::result::Error> for OpsError {
    fn from(e: diesel::result::Error) -> Self {
        OpsError::Repo(map_diesel_error(e))
    }
}

/// How often a write is run again after a deadlock or serialization failure.
const CONFLICT_RETRIES: u32 = 8;

/// After a deadlock or serialization failure of the `tries`-th run: `true` (after
/// a little backoff) if the write should run again.
async fn again_after(result: &Result<impl Sized, OpsError>, tries: &mut u32) -> bool {
    match result {
        Err(OpsError::Repo(RepoError::Conflict(msg))) if *tries < CONFLICT_RETRIES => {
            *tries += 1;
            tracing::debug!(tries = *tries, %msg, "operator command conflicted, retrying");
            let jitter = rand::random::<u64>() % (5 << (*tries).min(6));
            tokio::time::sleep(std::time::Duration::from_millis(jitter)).await;
            true
        }
        _ => false,
    }
}

/// The item's stored input hash, read in the caller's (scoped) transaction;
/// `ItemNotFound` if the tenant has no such item.
async fn stored_hash(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
) -> Result<String, OpsError> {
    use diesel::{ExpressionMethods, OptionalExtension, QueryDsl};

    use crate::schema::items::dsl as a;
    a::items
        .filter(a::tenant_id.eq(tenant.as_str()))
        .filter(a::id.eq(item.to_string()))
        .select(a::input_sha256)
        .first::<String>(conn)
        .await
        .optional()?
        .ok_or_else(|| OpsError::ItemNotFound {
            tenant: tenant.clone(),
            item: *item,
        })
}

/// A stage run's status and lease, as an operator command that changed nothing
/// explains it.
#[derive(diesel::QueryableByName)]
struct RunState {
    #[diesel(sql_type = Text)]
    status: String,
    #[diesel(sql_type = diesel::sql_types::Timestamptz)]
    lease_expires_at: chrono::DateTime<chrono::Utc>,
    #[diesel(sql_type = diesel::sql_types::Bool)]
    lease_live: bool,
}

/// The run of `stage` for the item, read in the caller's (scoped) transaction;
/// `StageNotStarted` if it has none.
async fn run_state(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    stage: &StageName,
) -> Result<RunState, OpsError> {
    use diesel::OptionalExtension;
    diesel::sql_query(
        "SELECT status, lease_expires_at, lease_expires_at >= clock_timestamp() AS lease_live \
           FROM stage_runs WHERE tenant_id = $1 AND item_id = $2 AND stage = $3",
    )
    .bind::<Text, _>(tenant.as_str())
    .bind::<Text, _>(item.to_string())
    .bind::<Text, _>(stage.as_str())
    .get_result(conn)
    .await
    .optional()?
    .ok_or_else(|| OpsError::StageNotStarted {
        tenant: tenant.clone(),
        item: *item,
        stage: stage.clone(),
    })
}

/// Appends the audit entry of an operator command (no `run_id`: not a stage's
/// write; the actor and what changed are in `details`, with `bulk`, the bulk
/// action it was part of, if any).
async fn audit(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    action: &str,
    mut details: serde_json::Value,
    bulk: Option<&BulkId>,
) -> Result<(), OpsError> {
    if let (Some(bulk), Some(map)) = (bulk, details.as_object_mut()) {
        map.insert("bulk".into(), serde_json::json!(bulk));
    }
    diesel::sql_query(
        "INSERT INTO audit_log (id, tenant_id, entity_id, action, details) \
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind::<Text, _>(RowId::new().to_string())
    .bind::<Text, _>(tenant.as_str())
    .bind::<Text, _>(item.to_string())
    .bind::<Text, _>(action)
    .bind::<Jsonb, _>(details)
    .execute(conn)
    .await
    .map_err(map_diesel_error)?;
    Ok(())
}
