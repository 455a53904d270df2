//! A pipeline: stages in order, the jobs between them, and their payload.

use idemstage_domain::queue::stage_singleton_key;
use idemstage_domain::{
    DomainError, GatherPolicy, ItemId, JobToSend, SendOptions, StageName, TenantId,
};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use thiserror::Error;

use crate::{Stage, StageRef};

mod builder;

pub use builder::{FanOutBuilder, PipelineBuilder};

/// The payload of every stage job. The queue of a stage is named after the stage.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageJob {
    /// The tenant the item belongs to; every write of the stage is scoped to it.
    pub tenant_id: TenantId,
    /// The item the stage runs for.
    pub item_id: ItemId,
    /// The hash the claim binds to: the SHA-256 of the item's input.
    pub input_hash: String,
}

impl StageJob {
    /// Parses a job payload; a malformed one is a clear, permanent error.
    pub fn from_payload(queue: &str, payload: &serde_json::Value) -> Result<Self, DomainError> {
        let job: StageJob = serde_json::from_value(payload.clone())
            .map_err(|e| DomainError::InvalidPayload(format!("queue {queue}: {e}")))?;
        // One canonical form (lower-case hex, as `input_hash_of` writes it): an
        // upper-case hash of the same input is another string to the claim.
        if job.input_hash.len() != 64
            || !job
                .input_hash
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(DomainError::InvalidPayload(format!(
                "queue {queue}: input_hash must be 64 lower-case hex characters"
            )));
        }
        Ok(job)
    }
}

/// Why a pipeline was refused at construction ([`Pipeline::new`],
/// [`Pipeline::with_send_options`]): a configuration mistake, never retryable.
#[derive(Debug, Error)]
pub enum PipelineError {
    /// `Pipeline::new` was given no stage.
    #[error("pipeline has no stages")]
    Empty,
    /// Two stages share a name: a stage's name is its queue and its claim key.
    #[error("stage {0} appears twice in the pipeline")]
    DuplicateStage(StageName),
    /// A stage job that gives up before its stage does would leave the stage with
    /// no live job: lost.
    #[error(
        "the jobs' retry_limit {retry_limit} is below stage {stage}'s max_attempts {max_attempts}: \
         a job must outlive its stage's attempts"
    )]
    RetryBudgetTooSmall {
        /// The first stage whose attempts outnumber the job's retries.
        stage: StageName,
        /// The jobs' `SendOptions::retry_limit`.
        retry_limit: i32,
        /// The stage's `StagePolicy::max_attempts`.
        max_attempts: i32,
    },
    /// A stage's policy is invalid (`StagePolicy::validate`).
    #[error(transparent)]
    Invalid(#[from] DomainError),
    /// A fan-out whose gather follows it at once: at least one stage runs per
    /// child.
    #[error("fan-out stage {0} has no stage per child before its gather")]
    NoChildStage(StageName),
}

/// What a stage is in its pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StageRole {
    /// Runs once per item: on the item's input (the first stage) or on the
    /// current success of the stage before it.
    Plain,
    /// Runs once per item, and its success hands on children
    /// ([`Children`](idemstage_domain::Children)): each runs the stages after it, up to the gather, as an
    /// item of its own.
    FanOut,
    /// Runs once per child of the fan-out before it. The first reads the
    /// child's input; the last one's end makes the child final.
    Child {
        /// Reads the child's input (the stage right after the fan-out).
        first: bool,
        /// The child's last stage before the gather.
        last: bool,
    },
    /// Runs once per fan-out, on the parent item, when every child is final,
    /// on the fan-out stage's current success.
    Gather(GatherPolicy),
}

/// Stages in order. Each stage's `policy().downstream` is what a rerun invalidates;
/// `Pipeline::new` checks the stages and the policies.
#[derive(Clone)]
pub struct Pipeline {
    stages: Vec<StageRef>,
    roles: Vec<StageRole>,
    index: HashMap<StageName, usize>,
    send_options: SendOptions,
}

impl Pipeline {
    /// A pipeline of `stages`, run in this order: each stage after the first runs
    /// on the current success of the one before it. Its jobs get
    /// [`Pipeline::default_send_options`]. Refused if `stages` is empty, a name
    /// repeats, a policy is invalid, or a stage's `max_attempts` exceeds the jobs'
    /// `retry_limit` (25).
    ///
    /// Unlike [`Pipeline::builder`], nothing checks here that a stage's `Input`
    /// is its upstream's `Output`: a mismatch fails the stage's attempts
    /// permanently. Use it for a pipeline whose stages are chosen at run time.
    ///
    /// ```no_run
    /// use idemstage::{async_trait, stage::Done, fenced::FencedTx, pipeline::Pipeline, pipeline::PipelineError, stage::PrepareContext, stage::Stage, stage::StageError, stage::StageRef};
    ///
    /// struct Step;
    ///
    /// #[async_trait]
    /// impl Stage for Step {
    ///     const NAME: &'static str = "step";
    ///     type Input = String;
    ///     type Prepared = ();
    ///     type Output = String;
    ///     async fn prepare(&self, _: &PrepareContext<'_, String>) -> Result<(), StageError> {
    ///         Ok(())
    ///     }
    ///     async fn commit(&self, _: &mut FencedTx<'_>, input: &String, _: &()) -> Result<Done<String>, StageError> {
    ///         Ok(Done::next(input.clone()))
    ///     }
    /// }
    ///
    /// # fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// // `ocr` runs on the item's input, `translate` on `ocr`'s current success.
    /// let pipeline = Pipeline::new(vec![StageRef::named("ocr", Step)?, StageRef::named("translate", Step)?])?;
    /// assert_eq!(pipeline.first_stage().name().as_str(), "ocr");
    ///
    /// // Jobs that give up before their stage does are refused.
    /// let few_retries = Pipeline::default_send_options().with_retry_limit(2);
    /// assert!(matches!(
    ///     pipeline.with_send_options(few_retries),
    ///     Err(PipelineError::RetryBudgetTooSmall { .. })
    /// ));
    /// # Ok(())
    /// # }
    /// ```
    pub fn new(stages: Vec<StageRef>) -> Result<Self, PipelineError> {
        if stages.is_empty() {
            return Err(PipelineError::Empty);
        }
        let mut index = HashMap::new();
        for (i, stage) in stages.iter().enumerate() {
            stage.policy().validate()?;
            if index.insert(stage.name().clone(), i).is_some() {
                return Err(PipelineError::DuplicateStage(stage.name().clone()));
            }
        }
        Self {
            roles: vec![StageRole::Plain; stages.len()],
            stages,
            index,
            send_options: SendOptions::default(),
        }
        .with_send_options(Self::default_send_options())
    }

    /// As [`new`](Self::new), with each stage's role (the typed builder's).
    fn with_roles(stages: Vec<StageRef>, roles: Vec<StageRole>) -> Result<Self, PipelineError> {
        let mut pipeline = Self::new(stages)?;
        for (i, role) in roles.iter().enumerate() {
            if *role == StageRole::FanOut
                && !matches!(roles.get(i + 1), Some(StageRole::Child { .. }))
            {
                return Err(PipelineError::NoChildStage(
                    pipeline.stages[i].name().clone(),
                ));
            }
        }
        pipeline.roles = roles;
        Ok(pipeline)
    }

    /// What `stage` is in this pipeline (`Plain` for a name not in it).
    pub fn role(&self, stage: &StageName) -> StageRole {
        self.index
            .get(stage)
            .map_or(StageRole::Plain, |&i| self.roles[i])
    }

    /// The fan-out stage a child stage or a gather belongs to (the last one
    /// before it).
    pub fn fan_out_of(&self, stage: &StageName) -> Option<&StageRef> {
        let &i = self.index.get(stage)?;
        if !matches!(
            self.roles[i],
            StageRole::Child { .. } | StageRole::Gather(_)
        ) {
            return None;
        }
        (0..i)
            .rev()
            .find(|&j| self.roles[j] == StageRole::FanOut)
            .map(|j| &self.stages[j])
    }

    /// The gather of a fan-out stage, or of a child stage's fan-out (the first
    /// gather after it).
    pub fn gather_of(&self, stage: &StageName) -> Option<&StageRef> {
        let &i = self.index.get(stage)?;
        if !matches!(self.roles[i], StageRole::FanOut | StageRole::Child { .. }) {
            return None;
        }
        (i + 1..self.stages.len())
            .find(|&j| matches!(self.roles[j], StageRole::Gather(_)))
            .map(|j| &self.stages[j])
    }

    /// A pipeline that starts with `first`, typed: [`PipelineBuilder::then`]
    /// accepts only a stage whose `Input` is the previous stage's `Output`.
    ///
    /// ```no_run
    /// # use idemstage::{async_trait, stage::Done, fenced::FencedTx, pipeline::Pipeline, stage::PrepareContext, stage::Stage, stage::StageError};
    /// # struct Parse; struct Book;
    /// # #[async_trait] impl Stage for Parse {
    /// #     const NAME: &'static str = "parse"; type Input = String; type Prepared = (); type Output = u32;
    /// #     async fn prepare(&self, _: &PrepareContext<'_, String>) -> Result<(), StageError> { Ok(()) }
    /// #     async fn commit(&self, _: &mut FencedTx<'_>, _: &String, _: &()) -> Result<Done<u32>, StageError> { Ok(Done::next(1)) }
    /// # }
    /// # #[async_trait] impl Stage for Book {
    /// #     const NAME: &'static str = "book"; type Input = u32; type Prepared = (); type Output = ();
    /// #     async fn prepare(&self, _: &PrepareContext<'_, u32>) -> Result<(), StageError> { Ok(()) }
    /// #     async fn commit(&self, _: &mut FencedTx<'_>, _: &u32, _: &()) -> Result<Done<()>, StageError> { Ok(Done::next(())) }
    /// # }
    /// # fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// // `Book` reads the `u32` that `Parse` hands on; `.then(Parse)` after
    /// // `Book` would not compile.
    /// let pipeline = Pipeline::builder(Parse).then(Book).build()?;
    /// assert_eq!(pipeline.stages().len(), 2);
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder<S: Stage>(first: S) -> PipelineBuilder<S::Output> {
        PipelineBuilder::start(StageRef::new(first))
    }

    /// Stage jobs retry generously with capped backoff: the stage's `max_attempts`
    /// is what limits executions, and a job must outlive its stage's retries (a
    /// job that gives up first would leave the stage lost).
    pub fn default_send_options() -> SendOptions {
        SendOptions::default()
            .with_retry_limit(25)
            .with_retry_delay(std::time::Duration::from_millis(100))
            .with_retry_backoff(true)
            .with_retry_delay_max(std::time::Duration::from_secs(30))
            // Renewed by the worker while it runs: short, so a dead worker's job
            // comes back soon.
            .with_expire_in(std::time::Duration::from_secs(60))
    }

    /// Options for the jobs this pipeline sends (retries, job lease); the singleton
    /// key is always set per job. Refused if a job would give up before its stage:
    /// `retry_limit` must be at least every stage's `max_attempts`.
    pub fn with_send_options(mut self, options: SendOptions) -> Result<Self, PipelineError> {
        let retry_limit = options.retry_limit;
        for stage in &self.stages {
            let max_attempts = stage.policy().max_attempts;
            if retry_limit < max_attempts {
                return Err(PipelineError::RetryBudgetTooSmall {
                    stage: stage.name().clone(),
                    retry_limit,
                    max_attempts,
                });
            }
        }
        self.send_options = options;
        Ok(self)
    }

    /// The options of the jobs this pipeline sends (retries, job lease).
    pub fn send_options(&self) -> &SendOptions {
        &self.send_options
    }

    /// The stages, in order.
    pub fn stages(&self) -> &[StageRef] {
        &self.stages
    }

    /// The stage that [`start`](crate::start) sends the first job for; its
    /// `on_input_change` policy decides about an item's new input.
    pub fn first_stage(&self) -> &StageRef {
        &self.stages[0]
    }

    /// The stage called `name` (its queue's name); `DomainError::UnknownStage` if
    /// there is none.
    pub fn stage(&self, name: &str) -> Result<&StageRef, DomainError> {
        StageName::parse(name)
            .ok()
            .and_then(|n| self.index.get(&n))
            .map(|&i| &self.stages[i])
            .ok_or_else(|| DomainError::UnknownStage(name.to_owned()))
    }

    /// The stage before `stage`, whose current success `stage` runs on (`None` for
    /// the first stage, which runs on the item's stored input).
    ///
    /// With a fan-out: a child's first stage runs on the child's input (`None`),
    /// a gather on the fan-out stage's success.
    pub fn upstream_of(&self, stage: &StageName) -> Option<&StageRef> {
        match self.index.get(stage) {
            Some(&i) => match self.roles[i] {
                StageRole::Child { first: true, .. } => None,
                StageRole::Gather(_) => self.fan_out_of(stage),
                _ if i > 0 => Some(&self.stages[i - 1]),
                _ => None,
            },
            None => None,
        }
    }

    /// The stage after `stage`, whose job `stage`'s success sends (`None` for the
    /// last stage, or a name not in the pipeline). `None` too for a fan-out
    /// (its success sends its children's jobs) and a child's last stage (the
    /// child that completes the fan-out sends the gather's job).
    pub fn next(&self, stage: &StageName) -> Option<&StageRef> {
        let &i = self.index.get(stage)?;
        match self.roles[i] {
            StageRole::FanOut | StageRole::Child { last: true, .. } => None,
            _ => self.stages.get(i + 1),
        }
    }

    /// The stage listed after `stage`, whatever its role (a fan-out's first
    /// child stage).
    pub(crate) fn following(&self, stage: &StageName) -> Option<&StageRef> {
        self.index.get(stage).and_then(|&i| self.stages.get(i + 1))
    }

    /// Each stage's upstream (by name; `None`: it reads its item's input),
    /// whether it runs per child, and whether it is a gather: what the
    /// reconciler needs to know which stages an item expects.
    pub fn shape(&self) -> Vec<(StageName, Option<StageName>, bool, bool)> {
        self.stages
            .iter()
            .zip(&self.roles)
            .map(|(s, role)| {
                (
                    s.name().clone(),
                    self.upstream_of(s.name()).map(|u| u.name().clone()),
                    matches!(role, StageRole::Child { .. }),
                    matches!(role, StageRole::Gather(_)),
                )
            })
            .collect()
    }

    /// The names of the stages after `stage`: what a successful rerun of `stage`
    /// invalidates (the database follows the recorded lineage, not this list).
    pub fn downstream_of(&self, stage: &StageName) -> Vec<StageName> {
        match self.index.get(stage) {
            Some(&i) => self.stages[i + 1..]
                .iter()
                .map(|s| s.name().clone())
                .collect(),
            None => Vec::new(),
        }
    }

    /// The job that starts `stage` for an item, with the seed's singleton key.
    pub fn job_for(&self, stage: &StageName, job: &StageJob) -> JobToSend {
        let mut options = self.send_options.clone();
        options.singleton_key = Some(stage_singleton_key(stage, &job.tenant_id, &job.item_id));
        JobToSend {
            queue: stage.as_str().to_owned(),
            tenant: Some(job.tenant_id.clone()),
            payload: serde_json::to_value(job).expect("StageJob serializes"),
            options,
        }
    }
}

/// Helper for tests and CLIs: a job for the first stage.
pub fn first_job(
    pipeline: &Pipeline,
    tenant: TenantId,
    item: ItemId,
    input_hash: String,
) -> JobToSend {
    pipeline.job_for(
        pipeline.first_stage().name(),
        &StageJob {
            tenant_id: tenant,
            item_id: item,
            input_hash,
        },
    )
}
