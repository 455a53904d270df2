//! The typed contract a team writes a stage against: what it reads, what it
//! prepares outside any transaction, and what it commits and hands on.

use std::future::Future;

use async_trait::async_trait;
use diesel_async::AsyncPgConnection;
use idemstage_domain::{ItemId, RunId, StageError, StageName, StagePolicy, TenantId};
use idemstage_persistence::tenant::TenantBody;
use idemstage_persistence::{FencedTx, PgRunRepository};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::watch;

use crate::StageFlow;

/// What a stage reads, prepares or hands on: any serde type that may cross
/// threads. JSON is what is stored (`stage_runs.output`, `stage_checkpoints`).
pub trait StageData: Serialize + DeserializeOwned + Send + Sync + 'static {}

impl<T: Serialize + DeserializeOwned + Send + Sync + 'static> StageData for T {}

/// One stage of a pipeline, typed: a product team implements this in its own
/// crate, and [`Pipeline::builder`](crate::Pipeline::builder) checks at compile
/// time that each stage's [`Input`](Stage::Input) is its upstream's
/// [`Output`](Stage::Output).
///
/// An execution claims the stage, reads exactly what its run is bound to (the
/// first stage: the item's input whose hash the claim bound; a later stage:
/// its upstream's output at the attempt the claim bound), calls
/// [`prepare`](Stage::prepare) outside any transaction while the lease is renewed,
/// then [`commit`](Stage::commit) inside the fenced transaction. What `commit`
/// writes and returns commits together with the stage's `success`, or not at
/// all; its output is kept with that attempt and handed to the next stage.
///
/// What `prepare` returns is checkpointed (unless it is JSON `null`, or the
/// policy's `reuse_prepared` is off) and reused by the next attempt of the same
/// run on the same input and upstream attempt: a paid call is not paid again
/// after a failed commit, a crash, or a lost lease. A permanent error throws it
/// away (it may be the value `commit` refused), so an operator's retry of the
/// dead run calls `prepare` again.
///
/// Errors: [`StageError::Transient`] for a failure worth another attempt,
/// [`StageError::Permanent`] for one that is not (the run ends `dead` at once),
/// [`StageError::RateLimited`] for a service that said "later" (not counted).
///
/// ```no_run
/// use idemstage::{async_trait, fenced::FencedTx, stage::PrepareContext, stage::Stage, stage::StageError, stage::Done};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize)]
/// struct Words(Vec<String>);
///
/// /// Splits the item's input into words.
/// struct Split;
///
/// #[async_trait]
/// impl Stage for Split {
///     const NAME: &'static str = "split";
///     type Input = String; // the first stage reads the item's input text
///     type Prepared = Words;
///     type Output = usize;
///
///     // Slow work without writes (an API call) belongs here: no transaction
///     // is open, and its result is kept for a retry of this attempt.
///     async fn prepare(&self, ctx: &PrepareContext<'_, String>) -> Result<Words, StageError> {
///         Ok(Words(ctx.input().split_whitespace().map(str::to_owned).collect()))
///     }
///
///     async fn commit(
///         &self,
///         tx: &mut FencedTx<'_>,
///         _input: &String,
///         words: &Words,
///     ) -> Result<Done<usize>, StageError> {
///         tx.audit("split", "split.done", idemstage::serde_json::json!({ "words": words.0.len() }))
///             .await?;
///         Ok(Done::next(words.0.len()))
///     }
/// }
/// ```
#[async_trait]
pub trait Stage: Send + Sync + 'static {
    /// The stage's name: its queue's name and part of its claim key. Unique in a
    /// pipeline, and stable: renaming a stage makes its finished runs another
    /// stage's. ([`PipelineBuilder::then_named`](crate::PipelineBuilder::then_named)
    /// runs a stage under another name.)
    const NAME: &'static str;

    /// What the stage reads. The first stage: the item's input text (`String`
    /// takes it as it is; any other type is parsed from it as JSON). A later
    /// stage: its upstream's `Output`.
    type Input: StageData;

    /// What [`prepare`](Stage::prepare) hands to [`commit`](Stage::commit); kept
    /// for the next attempt on the same binding (see the trait's docs). `()` for
    /// a stage that prepares nothing.
    type Prepared: StageData;

    /// What the stage hands to the next stage, kept with its successful attempt.
    /// `()` for none.
    type Output: StageData;

    /// Attempts, lease, heartbeat, timeout, input-change rule and checkpoint
    /// reuse of this stage. Default: [`StagePolicy::default`].
    fn policy(&self) -> StagePolicy {
        StagePolicy::default()
    }

    /// Work that takes long and writes nothing (an LLM call, a download), after
    /// the claim and outside any transaction, while the lease is renewed. Skipped
    /// when the run has a checkpointed value on this attempt's binding.
    async fn prepare(
        &self,
        ctx: &PrepareContext<'_, Self::Input>,
    ) -> Result<Self::Prepared, StageError>;

    /// The stage's writes, inside the fenced transaction (the connection is
    /// scoped to the run's tenant: [`FencedTx::conn`] and the helpers), and its
    /// output and flow. May run more than once if the transaction is retried
    /// after a serialization failure or deadlock: write idempotently.
    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        input: &Self::Input,
        prepared: &Self::Prepared,
    ) -> Result<Done<Self::Output>, StageError>;
}

/// What a stage's [`commit`](Stage::commit) ends with: its output, and whether
/// the pipeline goes on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Done<O> {
    /// Handed to the next stage, and kept with this attempt.
    pub output: O,
    /// Whether the next stage's job is sent.
    pub flow: StageFlow,
}

impl<O> Done<O> {
    /// Succeeded with `output`; the next stage's job is sent (if there is one).
    pub fn next(output: O) -> Self {
        Self {
            output,
            flow: StageFlow::Continue,
        }
    }

    /// Succeeded with `output`; the item ends here (no further stage runs).
    pub fn stop(output: O) -> Self {
        Self {
            output,
            flow: StageFlow::Stop,
        }
    }
}

/// Which claimed attempt a [`PrepareContext`] belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttemptInfo {
    /// The run (`stage_runs` row) of (tenant, item, stage).
    pub run_id: RunId,
    /// The tenant; every read and write of the attempt is scoped to it.
    pub tenant: TenantId,
    /// The item the stage runs for.
    pub item: ItemId,
    /// The stage.
    pub stage: StageName,
    /// The attempt, 1 for the first.
    pub attempt: i32,
    /// The input hash the run is bound to.
    pub input_hash: String,
}

/// What a stage's [`prepare`](Stage::prepare) gets: its bound input, which
/// attempt it is, a tenant-scoped read-only connection, and a signal that the
/// lease was lost.
pub struct PrepareContext<'a, I> {
    pub(crate) input: &'a I,
    pub(crate) attempt: &'a AttemptInfo,
    pub(crate) repo: &'a PgRunRepository,
    pub(crate) lease_lost: watch::Receiver<bool>,
}

impl<I> PrepareContext<'_, I> {
    /// What the run is bound to: the item's input (first stage) or the
    /// upstream's output at the attempt the claim bound. Never a newer one.
    pub fn input(&self) -> &I {
        self.input
    }

    /// The attempt: run, tenant, item, stage, number, input hash.
    pub fn attempt(&self) -> &AttemptInfo {
        self.attempt
    }

    /// The text of the item's input this run is bound to, for any stage (a
    /// later stage's run is bound to the input its upstream's success read): the
    /// stored input while it is current, else the replaced one kept for it; never
    /// a newer one. One read; the first stage has it as its `input` already.
    pub async fn item_text(&self) -> Result<String, StageError> {
        let token = idemstage_domain::ClaimToken {
            run_id: self.attempt.run_id,
            tenant: self.attempt.tenant.clone(),
            item: self.attempt.item,
            stage: self.attempt.stage.clone(),
            attempt: self.attempt.attempt,
        };
        Ok(self.repo.bound_input(&token).await?)
    }

    /// How the run's last wait on this attempt's binding ended, if it waited
    /// (a stage that returned [`StageError::Wait`] reads here, when it runs
    /// again, the signal's payload or that the deadline passed); `None` if it
    /// has not waited on this binding. One read.
    pub async fn signal(&self) -> Result<Option<idemstage_domain::Signal>, StageError> {
        let token = idemstage_domain::ClaimToken {
            run_id: self.attempt.run_id,
            tenant: self.attempt.tenant.clone(),
            item: self.attempt.item,
            stage: self.attempt.stage.clone(),
            attempt: self.attempt.attempt,
        };
        Ok(self.repo.signal(&token).await?)
    }

    /// Runs `body` in a read-only transaction scoped to the run's tenant
    /// (row-level security, as the stage's own writes are): for reading the
    /// team's tables before an external call. A write in it fails, not retryable.
    pub async fn read<R, F>(&self, body: F) -> Result<R, StageError>
    where
        for<'r> F: AsyncFnOnce(&'r mut AsyncPgConnection) -> Result<R, diesel::result::Error>
            + TenantBody<'r, R, diesel::result::Error>
            + Send,
        R: Send,
    {
        Ok(self.repo.read_only(&self.attempt.tenant, body).await?)
    }

    /// Resolves when the lease of this attempt was found lost (taken over, the
    /// stage cancelled): nothing it prepares can commit any more. The executor
    /// cancels `prepare` soon after anyway; a long call can select on this to
    /// stop at once.
    pub fn lease_lost(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut lost = self.lease_lost.clone();
        async move {
            if lost.wait_for(|lost| *lost).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}

/// A shared stage is the stage: a test (or a team) keeps an `Arc` of a stage it
/// hands to the pipeline, to reach its state.
#[async_trait]
impl<S: Stage> Stage for std::sync::Arc<S> {
    const NAME: &'static str = S::NAME;
    type Input = S::Input;
    type Prepared = S::Prepared;
    type Output = S::Output;

    fn policy(&self) -> StagePolicy {
        (**self).policy()
    }

    async fn prepare(
        &self,
        ctx: &PrepareContext<'_, Self::Input>,
    ) -> Result<Self::Prepared, StageError> {
        (**self).prepare(ctx).await
    }

    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        input: &Self::Input,
        prepared: &Self::Prepared,
    ) -> Result<Done<Self::Output>, StageError> {
        (**self).commit(tx, input, prepared).await
    }
}
