//! # idemstage
//!
//! Multi-stage, multi-tenant pipelines on PostgreSQL where every stage succeeds
//! **at most once** per (tenant, item, stage), is **never lost**, and is computed
//! from the **current** success of the stage before it, with many workers on many
//! machines, duplicate sends, crashes, retries, reruns and stale workers.
//!
//! This crate is the API boundary: a team depends on `idemstage` (and
//! `idemstage-testkit` for its tests) and nothing else of ours. It re-exports
//! Diesel, diesel-async, diesel_migrations and serde_json on purpose, so that a team's schema
//! and ours use the same versions.
//!
//! ## A stage, a pipeline, a start and a worker
//!
//! A [`Stage`](stage::Stage) is typed: it reads the input its run is bound to (the first
//! stage: the item's input; a later one: its upstream's output), prepares
//! outside any transaction (a paid call, checkpointed so that it is paid once),
//! and commits the team's own tables through the fenced transaction
//! ([`FencedTx`](fenced::FencedTx)): its writes commit together with the stage's success and its
//! output, or not at all, and never after another worker took the stage over.
//!
//! ```no_run
//! use idemstage::diesel;
//! use idemstage::diesel_async::RunQueryDsl;
//! use idemstage::prelude::*;
//!
//! /// Reads the item's input, writes it in upper case, hands on its length.
//! struct Ocr;
//!
//! #[async_trait]
//! impl Stage for Ocr {
//!     const NAME: &'static str = "ocr";
//!     type Input = String;
//!     type Prepared = String;
//!     type Output = usize;
//!
//!     // Outside any transaction: the place for a slow, paid call.
//!     async fn prepare(&self, ctx: &PrepareContext<'_, String>) -> Result<String, StageError> {
//!         Ok(ctx.input().to_uppercase())
//!     }
//!
//!     async fn commit(
//!         &self,
//!         tx: &mut FencedTx<'_>,
//!         _input: &String,
//!         text: &String,
//!     ) -> Result<Done<usize>, StageError> {
//!         let (tenant, item) = (tx.token().tenant.to_string(), tx.token().item.to_string());
//!         // The team's own table, on the tenant-scoped connection of the fenced
//!         // transaction (its own Diesel schema works the same way).
//!         diesel::sql_query("INSERT INTO ocr_pages (tenant_id, item_id, text) VALUES ($1, $2, $3)")
//!             .bind::<diesel::sql_types::Text, _>(tenant)
//!             .bind::<diesel::sql_types::Text, _>(item)
//!             .bind::<diesel::sql_types::Text, _>(text)
//!             .execute(tx.conn())
//!             .await?; // a Diesel error is a `StageError` (retryable or not, as the database said)
//!         Ok(Done::next(text.len()))
//!     }
//! }
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let pipeline = Pipeline::builder(Ocr).build()?;
//! let url = "postgres://localhost/app";
//! idemstage::db::migrate(url).await?;
//! let pool = idemstage::db::connect_pool(url, Default::default()).await?;
//!
//! // Register the input and send the first job, in one transaction.
//! let item = ItemId::new();
//! start(&pool, &pipeline, &TenantId::parse("acme")?, &item, "scan of page 1").await?;
//!
//! // Work the pipeline's queues until told to stop (the builder makes a pool
//! // of the size 8 executions need; `.pool(..)` gives one, checked).
//! let worker = PipelineWorker::builder(url, pipeline).concurrency(8).build().await?;
//! let shutdown = CancellationToken::new();
//! worker.run(shutdown).await;
//! # Ok(())
//! # }
//! ```
//!
//! A team's migration puts its table under the same tenant isolation as ours with
//! one line: `SELECT idemstage_tenant_table('ocr_pages');` (after the core's
//! migrations: [`migrate_with`](db::migrate_with) runs both). The team embeds its migrations with
//! [`embed_migrations!`] (Diesel's, through this crate).
#![warn(missing_docs)]

pub use async_trait::async_trait;
pub use {diesel, diesel_async, diesel_migrations, serde_json};

/// Diesel's `embed_migrations!` for a crate that depends on `idemstage` only: the
/// team's migration directories (relative to its `Cargo.toml`; default
/// `migrations`), for [`migrate_with`](db::migrate_with) and the testkit. Diesel's macro names
/// `diesel_migrations::…` in what it expands to, so called as
/// `idemstage::diesel_migrations::embed_migrations!` it compiles only where
/// `diesel_migrations` is a name in scope (`use idemstage::diesel_migrations;`);
/// this one brings the name along.
///
/// ```no_run
/// # // As in a team's crate, where no `diesel_migrations` is in scope (this
/// # // doctest has the facade's dependencies; this empty module hides it).
/// # mod diesel_migrations {}
/// use idemstage::diesel_migrations::EmbeddedMigrations;
///
/// // In a team's crate: `embed_migrations!("migrations")`, or `!()` for the default.
/// pub const MIGRATIONS: EmbeddedMigrations = idemstage::embed_migrations!("../../migrations");
///
/// # async fn demo() -> Result<(), idemstage::db::RepoError> {
/// idemstage::db::migrate_with("postgres://localhost/app", vec![MIGRATIONS]).await?;
/// # Ok(())
/// # }
/// ```
#[macro_export]
macro_rules! embed_migrations {
    ($($path:tt)*) => {{
        use $crate::diesel_migrations;
        diesel_migrations::embed_migrations!($($path)*)
    }};
}

/// What a team's stage code needs, in one import: `use idemstage::prelude::*;`.
///
/// The typed stage ([`Stage`](stage::Stage), [`Done`](stage::Done),
/// [`PrepareContext`](stage::PrepareContext), the fenced transaction
/// [`FencedTx`](fenced::FencedTx)), the errors and policy, the pipeline and its
/// start, the worker, the ids, and `async_trait` for the impls.
///
/// ```
/// use idemstage::prelude::*;
/// let tenant = TenantId::parse("acme").unwrap();
/// let policy = StagePolicy::default().with_max_attempts(5);
/// # let _ = (tenant, policy, ItemId::new());
/// ```
///
/// Every other name is in the module of its concept, none at the root:
///
/// ```compile_fail
/// use idemstage::Stage; // `idemstage::stage::Stage`, or the prelude
/// ```
pub mod prelude {
    pub use crate::async_trait;
    pub use crate::db::RepoError;
    pub use crate::fenced::FencedTx;
    pub use crate::ids::{ItemId, TenantId};
    pub use crate::pipeline::{start, start_in, Pipeline};
    pub use crate::stage::{
        ChildFailure, Children, Done, GatherPolicy, Gathered, InputChangePolicy, OnTimeout,
        PrepareContext, Signal, Stage, StageError, StageFlow, StagePolicy, WaitFor,
    };
    pub use crate::worker::{CancellationToken, PipelineWorker};
}

/// The typed stage contract: a [`Stage`](stage::Stage) reads the input its run is
/// bound to, prepares outside any transaction ([`PrepareContext`](stage::PrepareContext)),
/// and commits through the fenced transaction, returning [`Done`](stage::Done);
/// its [`StagePolicy`](stage::StagePolicy) and [`StageError`](stage::StageError)
/// (which says what is retried). [`StageRef`](stage::StageRef) is a stage with its
/// types erased; [`Executor`](stage::Executor) runs one stage job (what a worker
/// does for each job it fetches).
pub mod stage {
    pub use idemstage_domain::{
        Child, ChildFailure, Children, GatherPolicy, Gathered, GatheredChild, InputChangePolicy,
        OnTimeout, Signal, StageError, StagePolicy, WaitFor,
    };
    pub use idemstage_stage::{
        AttemptInfo, Done, ExecutionOutcome, Executor, PrepareContext, Stage, StageData, StageFlow,
        StageJob, StageRef,
    };
}

/// A pipeline (stages in order, built and type-checked by
/// [`Pipeline::builder`](pipeline::Pipeline::builder)) and its start: [`start`](pipeline::start)
/// registers an item's input and sends its first stage's job in one transaction.
///
/// ```no_run
/// # use idemstage::prelude::*;
/// # async fn demo(pool: &idemstage::db::PgPool, pipeline: &Pipeline) -> Result<(), Box<dyn std::error::Error>> {
/// let tenant = TenantId::parse("acme")?;
/// let item = ItemId::new();
/// idemstage::pipeline::start(pool, pipeline, &tenant, &item, "10 Stk Schrauben").await?;
/// # Ok(())
/// # }
/// ```
pub mod pipeline {
    pub use idemstage_stage::{
        first_job, start, start_in, FanOutBuilder, Pipeline, PipelineBuilder, PipelineError,
        StageRole,
    };
}

/// The fenced transaction a stage commits in ([`FencedTx`](fenced::FencedTx)): the
/// team's writes commit with the stage's success and output, or not at all, and
/// never after another worker took the stage over; its helpers
/// ([`insert_or_get`](fenced::insert_or_get), [`FencedWrite`](fenced::FencedWrite)),
/// and [`tenant_transaction`](fenced::tenant_transaction), a tenant-scoped
/// transaction outside any stage.
pub mod fenced {
    pub use idemstage_persistence::fenced::insert_or_get;
    pub use idemstage_persistence::tenant::{transaction as tenant_transaction, TenantBody};
    pub use idemstage_persistence::{FencedTx, FencedWrite, InsertOrGet, Replaced};
}

/// The workers: [`PipelineWorker`](worker::PipelineWorker) works a pipeline's
/// stages, [`QueueWorker`](worker::QueueWorker) any queue through a
/// [`JobHandler`](worker::JobHandler); both stop on a
/// [`CancellationToken`](worker::CancellationToken), finishing what they hold.
///
/// ```no_run
/// # async fn demo(pipeline: idemstage::pipeline::Pipeline) -> Result<(), Box<dyn std::error::Error>> {
/// use idemstage::worker::{CancellationToken, PipelineWorker};
/// let worker = PipelineWorker::builder("postgres://localhost/app", pipeline)
///     .concurrency(8)
///     .build()
///     .await?;
/// worker.run(CancellationToken::new()).await;
/// # Ok(())
/// # }
/// ```
pub mod worker {
    pub use idemstage_runner::{
        handler_fn, Counters, CountersSnapshot, Handled, HandlerError, JobHandler, PipelineWorker,
        PipelineWorkerBuilder, PipelineWorkerConfig, QueueWorker, QueueWorkerConfig,
        WorkerBuildError, WorkerError, WorkerStatsSnapshot,
    };
    pub use tokio_util::sync::CancellationToken;
}

/// Connections, the pool and the migrations: [`migrate`](db::migrate) runs the
/// core's migrations, [`migrate_with`](db::migrate_with) the core's and a team's
/// ([`embed_migrations!`](crate::embed_migrations)); [`RepoError`](db::RepoError)
/// is the error of every database call (retryable or not).
///
/// ```no_run
/// # async fn demo() -> Result<(), idemstage::db::RepoError> {
/// let url = "postgres://localhost/app";
/// idemstage::db::migrate(url).await?;
/// let pool = idemstage::db::connect_pool(url, Default::default()).await?;
/// let _conn = idemstage::db::get(&pool).await?;
/// # Ok(())
/// # }
/// ```
pub mod db {
    pub use idemstage_domain::{RepoError, RepoMessage};
    pub use idemstage_persistence::{
        connect, connect_pool, connect_with, get, map_diesel_error, migrate, migrate_with, pinned,
        revert_all_with, PgPool, PoolConfig, Pooler,
    };
}

/// The ids: an item, a tenant, a stage, a run, a job, a worker; each parses what
/// it accepts and refuses the rest with a [`DomainError`](ids::DomainError).
///
/// ```
/// use idemstage::ids::{ItemId, TenantId};
/// assert!(TenantId::parse("acme").is_ok());
/// assert!(TenantId::parse("Acme Corp").is_err());
/// let item = ItemId::new();
/// assert_eq!(ItemId::parse(&item.to_string()).unwrap(), item);
/// ```
pub mod ids {
    pub use idemstage_domain::{
        input_hash_of, BulkId, DomainError, ItemId, JobId, RowId, RunId, StageName, TenantId,
        WorkerId,
    };
}

/// The operator commands (`idemstage inspect | retry | rerun | cancel | dead`):
/// the timeline of an item, a retry of its dead stages (a
/// [`Pipeline`](pipeline::Pipeline) is the [`RetryPlanner`](ops::RetryPlanner)),
/// a rerun of a stage and what follows it, its cancel, the dead-letter list;
/// retry, rerun and cancel of every item a [`BulkFilter`](ops::BulkFilter)
/// selects ([`preview`](ops::preview), [`start_bulk`](ops::start_bulk),
/// [`run_bulk`](ops::run_bulk), resumable). Every write is tenant-scoped and
/// recorded in `audit_log` with its [`Actor`](ops::Actor).
pub mod ops {
    pub use idemstage_persistence::ops::{
        bulk_progress, cancel, dead, inspect, preview, rerun, retry, run_bulk, start_bulk, Actor,
        AttemptView, BulkAction, BulkFilter, BulkPreview, BulkProgress, CancelOutcome,
        CancelledFrom, CancelledJob, CancelledStage, DeadFilter, DeadLetters, DeadStage, FailedJob,
        ItemTimeline, JobView, OpsError, PreviewGroup, RerunOutcome, RerunRefusal, RetriedStage,
        RetryOutcome, RetryPlanner, RetryRefusal, StageTimeline,
    };
    pub use idemstage_persistence::ops::{
        signal, SignalOutcome, SignalRefusal, WaitView, MAX_SIGNAL_PAYLOAD_BYTES,
    };
    pub use idemstage_persistence::waits::{expire_due, ExpiredWaits};
}

/// The database roles (migration `2026-11-30-000000_baseline`; README, "Deploying"):
/// [`check_worker_role`](roles::check_worker_role) tells whether a connection's
/// login role is one row-level security restricts, as a worker's must be.
pub mod roles {
    pub use idemstage_persistence::roles::{
        check_worker_role, RoleCheck, CORE_TABLES, OPERATOR_ROLE, WORKER_ROLE,
    };
}

/// The metrics the workers and the executor record through the `metrics` facade
/// (their names, and `describe`): a no-op until the binary installs a `metrics`
/// recorder. `idemstage_cli`'s `worker --metrics-listen ADDR` installs a
/// Prometheus one; a team's own binary installs any recorder (e.g.
/// `metrics-exporter-prometheus`'s), calls [`telemetry::describe`], and sets
/// `QueueWorkerConfig::queue_gauges_interval` for the queue gauges. The list is
/// in the README ("Metrics").
pub mod telemetry {
    pub use idemstage_runner::telemetry::*;
    pub use idemstage_stage::telemetry::{
        outcome_label, STAGE_DURATION, STAGE_LEASE_RENEWALS, STAGE_OUTCOMES, STAGE_PREPARED,
    };
}

/// The job queue (layer 2): sending jobs (also inside a caller's transaction),
/// the outcome types of a job's lifecycle, and the controls the fetch enforces
/// (pause, caps, rate limits, holds, tenant weights).
pub mod queue {
    pub use idemstage_domain::{
        FetchedJob, JobCancelOutcome, JobCompleteOutcome, JobFailOutcome, JobRetryOutcome,
        JobState, JobToSend,
    };
    pub use idemstage_domain::{
        QueueStats, RejectReason, SendOptions, SendResult, SkipReason, StateCounts,
    };
    pub use idemstage_persistence::queue::{
        complete, complete_many, control_changes, controls, fetch, held_until, hold, pause,
        queue_depths, queue_stats, resume, send, send_batch, send_in, send_in_waking, set_limits,
        set_priority_aging, ControlChange, ControlChangeKind, JobListener, LeaseCommit, Limits,
        MaintenanceConfig, Notifier, PauseOutcome, QueueControl, QueueDepth, Rate, ResumeOutcome,
        Scope, Wake, MAX_PRIORITY_AGING,
    };
}

/// The stage runs (layer 1) below the executor: the claim of a stage by a worker
/// ([`PgRunRepository::claim`](runs::PgRunRepository::claim) with a
/// [`ClaimRequest`](runs::ClaimRequest)), its outcomes, and the error of a
/// transaction that mixes a team's statements with ours ([`TxError`](runs::TxError)).
pub mod runs {
    pub use idemstage_domain::{
        ClaimOutcome, ClaimRequest, ClaimToken, CompleteOutcome, FailOutcome, RunStatus,
    };
    pub use idemstage_persistence::{PgRunRepository, TxError};
}

/// The items and their inputs below [`start`](pipeline::start): the input's
/// validation and limit, the registration of an item's input alone (no job
/// sent), and [`start_in`](items::start_in), which registers it and sends a job
/// the caller builds, in the caller's transaction.
pub mod items {
    pub use idemstage_persistence::items::{
        register_input, register_item, start_in, validate_input, RegisterOutcome, StartOutcome,
        MAX_INPUT_BYTES,
    };
}

/// Read-only reports over the core's tables (`idemstage status`, the console's
/// overview): stage × status counts, one tenant's stages, whether a tenant exists.
pub mod report {
    pub use idemstage_persistence::report::{
        stage_status_counts, tenant_exists, tenant_stage_overview, StageStatusCount, TenantStageRow,
    };
}

/// The core's Diesel tables (`stage_runs`, `items`, `jobs`, …), for reading
/// them in a team's reports and tests; every write goes through the functions of
/// this crate.
pub mod schema {
    pub use idemstage_persistence::schema::*;
}
