//! The stage layer: the `Stage` trait, pipelines of stages, and the executor that
//! runs one stage execution: claim → skip or run → fenced commit (with the next
//! stage's job) or fail, renewing the lease while the body runs.
//!
//! Invariant: this crate names no table and no SQL. A stage body writes through the
//! fenced transaction handle (`FencedTx`) that `persistence` opens.

#![warn(missing_docs)]

mod executor;
mod ops;
mod pipeline;
mod reconcile;
mod start;
pub mod telemetry;

pub use executor::{ExecutionOutcome, Executor, JobLease};
pub use pipeline::{first_job, Pipeline, PipelineError, StageJob};
pub use reconcile::{ReconcileReport, Reconciler};
pub use start::{start, start_in};

use async_trait::async_trait;
use idemstage_domain::{StageError, StageName, StagePolicy};
use idemstage_persistence::FencedTx;

/// What the pipeline does after a stage succeeded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum StageFlow {
    /// Send the next stage's job (in the same transaction), if there is one.
    Continue,
    /// The anfrage ends here (e.g. infeasible): no further stage.
    Stop,
}

/// One stage of a pipeline. A product team implements this in its own crate.
///
/// The executor claims the stage, calls [`prepare`](Stage::prepare) outside any
/// transaction, then [`run`](Stage::run) inside the fenced transaction: `run`'s
/// writes commit with the stage's success, or not at all. Return
/// `StageError::Transient` for a failure worth another attempt and
/// `StageError::Permanent` for one that is not (the run ends `dead` at once).
///
/// A stage that writes the team's own table through the transaction's
/// tenant-scoped connection:
///
/// ```no_run
/// use idemstage::diesel_async::RunQueryDsl;
/// use idemstage::{
///     async_trait, diesel, map_diesel_error, FencedTx, Stage, StageError, StageFlow,
///     StageJob, StageName, StagePolicy,
/// };
///
/// struct Translate {
///     name: StageName,
///     policy: StagePolicy,
/// }
///
/// #[async_trait]
/// impl Stage for Translate {
///     fn name(&self) -> &StageName {
///         &self.name
///     }
///     fn policy(&self) -> &StagePolicy {
///         &self.policy
///     }
///     // Slow work without writes (an API call) belongs here, not in `run`: the
///     // fenced transaction must not sit idle.
///     async fn prepare(&self, _job: &StageJob) -> Result<idemstage::serde_json::Value, StageError> {
///         Ok(idemstage::serde_json::json!({ "lang": "de" }))
///     }
///     async fn run(
///         &self,
///         job: &StageJob,
///         prepared: &idemstage::serde_json::Value,
///         tx: &mut FencedTx<'_>,
///     ) -> Result<StageFlow, StageError> {
///         let lang = prepared["lang"]
///             .as_str()
///             .ok_or_else(|| StageError::Permanent("no language".into()))?
///             .to_owned();
///         let text = tx.anfrage_text().await?;
///         // May run again (a retried transaction, a later attempt): write idempotently.
///         diesel::sql_query(
///             "INSERT INTO translations (tenant_id, anfrage_id, lang, text) VALUES ($1, $2, $3, $4) \
///              ON CONFLICT (tenant_id, anfrage_id, lang) DO UPDATE SET text = EXCLUDED.text",
///         )
///         .bind::<diesel::sql_types::Text, _>(job.tenant_id.to_string())
///         .bind::<diesel::sql_types::Text, _>(job.anfrage_id.to_string())
///         .bind::<diesel::sql_types::Text, _>(lang)
///         .bind::<diesel::sql_types::Text, _>(text)
///         .execute(tx.conn())
///         .await
///         .map_err(|e| StageError::Repo(map_diesel_error(e)))?;
///         Ok(StageFlow::Continue)
///     }
/// }
/// ```
#[async_trait]
pub trait Stage: Send + Sync + 'static {
    /// The stage's name: its queue's name and part of its claim key. Unique in a
    /// pipeline, and stable: renaming a stage makes its finished runs another
    /// stage's.
    fn name(&self) -> &StageName;

    /// Attempts, lease, heartbeat, timeout and input-change rule of this stage.
    fn policy(&self) -> &StagePolicy;

    /// Work that takes long and writes nothing (an LLM call, a download), done after
    /// the claim and outside any transaction while the lease is renewed. Its result
    /// is handed to `run`. Default: nothing to prepare.
    async fn prepare(&self, _job: &StageJob) -> Result<serde_json::Value, StageError> {
        Ok(serde_json::Value::Null)
    }

    /// The stage's writes, inside the fenced transaction: they commit together with
    /// `status = 'success'` or not at all. May run more than once if the transaction
    /// is retried after a serialization failure or deadlock.
    async fn run(
        &self,
        job: &StageJob,
        prepared: &serde_json::Value,
        tx: &mut FencedTx<'_>,
    ) -> Result<StageFlow, StageError>;
}
