//! Layer 1: the claim repository on `stage_runs`. The statements are in `sql`.

mod bound;
mod claim;
mod complete;
mod lease;
mod read;
pub mod sql;
pub(crate) mod wait;

pub(crate) use bound::bound_input_text;
pub use bound::{BoundInput, ReadBound};
pub use lease::InterruptOutcome;
pub(crate) use wait::signal_in;
pub use wait::WaitOutcome;

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use idemstage_domain::{ItemId, RepoError, RunId, RunRecord, StageName, TenantId};

use crate::queue::{Notifier, Wake};
use crate::schema::stage_runs;
use crate::PgPool;

/// How often a transaction is re-run after 40001/40P01 before the error is returned.
const CONFLICT_RETRIES: u32 = 8;

/// The claim repository: claim, fenced completion, lease renewal, failure,
/// release and reads of `stage_runs`. Every method takes a connection of its
/// own from the pool and runs in transactions of its own, so none joins a caller's
/// transaction; all but [`attempt_history`](Self::attempt_history) are scoped to
/// the request's or token's tenant. Cloning shares the pool.
#[derive(Clone)]
pub struct PgRunRepository {
    pool: PgPool,
    /// `Some`: jobs sent by fenced completions are woken after the commit.
    notifier: Option<Notifier>,
}

impl PgRunRepository {
    /// A repository on `pool` (build it with [`connect_pool`](crate::connect_pool)),
    /// whose fenced completions NOTIFY inside their commit ([`Wake::InCommit`]).
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            notifier: None,
        }
    }

    /// This repository with jobs sent by its fenced completions waking their
    /// listeners as `wake` says. [`Wake::AfterCommit`] notifies through a
    /// [`Notifier`] on the same pool (it borrows a connection per notification).
    pub fn with_wake(mut self, wake: Wake) -> Self {
        self.notifier = match wake {
            Wake::InCommit => None,
            Wake::AfterCommit => Some(Notifier::new(self.pool.clone())),
        };
        self
    }

    /// How jobs sent by fenced completions wake their listeners.
    pub fn wake(&self) -> Wake {
        match self.notifier {
            Some(_) => Wake::AfterCommit,
            None => Wake::InCommit,
        }
    }

    /// The pool the repository takes its connections from.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub(crate) async fn conn(&self) -> Result<crate::db::PooledConn<'_>, RepoError> {
        crate::db::get(&self.pool).await
    }
}

#[derive(Queryable, Selectable)]
#[diesel(table_name = stage_runs)]
struct RunRow {
    id: String,
    tenant_id: String,
    item_id: String,
    stage: String,
    status: String,
    attempts: i32,
    max_attempts: i32,
    input_hash: String,
    worker_id: String,
    started_at: DateTime<Utc>,
    lease_expires_at: DateTime<Utc>,
    finished_at: Option<DateTime<Utc>>,
    last_error: Option<String>,
    success_attempt: Option<i32>,
    upstream_stage: Option<String>,
    upstream_attempt: Option<i32>,
}

impl RunRow {
    fn into_record(self) -> Result<RunRecord, RepoError> {
        Ok(RunRecord {
            run_id: RunId::parse(&self.id)?,
            tenant: TenantId::parse(&self.tenant_id)?,
            item: ItemId::parse(&self.item_id)?,
            stage: StageName::parse(&self.stage)?,
            status: self.status.parse()?,
            attempts: self.attempts,
            max_attempts: self.max_attempts,
            input_hash: self.input_hash,
            worker_id: self.worker_id,
            started_at: self.started_at,
            lease_expires_at: self.lease_expires_at,
            finished_at: self.finished_at,
            last_error: self.last_error,
            success_attempt: self.success_attempt,
            upstream_stage: self
                .upstream_stage
                .as_deref()
                .map(StageName::parse)
                .transpose()?,
            upstream_attempt: self.upstream_attempt,
        })
    }
}

/// A duration in microseconds, the unit the statements take leases in.
fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// Sleeps a little before re-running a transaction after 40001/40P01.
async fn conflict_backoff(tries: u32, msg: &str) {
    tracing::debug!(tries, %msg, "transaction conflict, retrying");
    let jitter = rand::random::<u64>() % (5 << tries.min(6));
    tokio::time::sleep(Duration::from_millis(jitter)).await;
}
