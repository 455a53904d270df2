//! The typed [`Stage`] behind one object-safe interface, so that the pipeline,
//! the executor and the claim SQL handle every stage alike: values cross it as
//! JSON where they are stored, and as the stage's own types in between.

use std::any::Any;
use std::sync::Arc;

use async_trait::async_trait;
use idemstage_domain::{DomainError, StageError, StageName, StagePolicy};
use idemstage_persistence::runs::BoundInput;
use idemstage_persistence::{FencedTx, PgRunRepository};
use serde_json::Value;
use tokio::sync::watch;

use crate::contract::{AttemptInfo, PrepareContext};
use crate::{Stage, StageFlow};

/// A stage of a pipeline, whatever its types: its name and policy, and the way
/// the executor runs it. Build one with [`StageRef::new`] (under the stage's
/// `NAME`) or [`StageRef::named`]; a [`Pipeline`](crate::Pipeline) holds them in
/// order. Clones share the stage.
#[derive(Clone)]
pub struct StageRef {
    name: StageName,
    policy: StagePolicy,
    stage: Arc<dyn ErasedStage>,
}

impl std::fmt::Debug for StageRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageRef")
            .field("name", &self.name)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl StageRef {
    /// `stage` under its [`Stage::NAME`], with its [`Stage::policy`].
    /// `DomainError::InvalidStageName`-like errors for a `NAME` that is not a
    /// valid stage name.
    pub fn new<S: Stage>(stage: S) -> Result<Self, DomainError> {
        Self::named(S::NAME, stage)
    }

    /// `stage` under `name` instead of its `NAME`: one stage type twice in a
    /// pipeline, or a name chosen at run time.
    pub fn named<S: Stage>(name: &str, stage: S) -> Result<Self, DomainError> {
        Ok(Self {
            name: StageName::parse(name)?,
            policy: stage.policy(),
            stage: Arc::new(Typed(stage)),
        })
    }

    /// As [`named`](Self::named), with `policy` instead of the stage's own.
    pub fn with_policy(mut self, policy: StagePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The stage's name: its queue and part of its claim key.
    pub fn name(&self) -> &StageName {
        &self.name
    }

    /// The stage's policy.
    pub fn policy(&self) -> &StagePolicy {
        &self.policy
    }

    pub(crate) fn erased(&self) -> &Arc<dyn ErasedStage> {
        &self.stage
    }
}

/// What the executor hands a stage's `prepare`.
pub(crate) struct Bound<'a> {
    pub input: BoundInput,
    /// A checkpointed prepared value on this attempt's binding.
    pub checkpoint: Option<Value>,
    pub attempt: &'a AttemptInfo,
    pub repo: &'a PgRunRepository,
    pub lease_lost: watch::Receiver<bool>,
    pub reuse_prepared: bool,
}

/// What `prepare` produced: the typed input and prepared value for `commit`, and
/// what to checkpoint.
pub(crate) struct Prepared {
    pub state: Box<dyn Any + Send + Sync>,
    /// The prepared value to checkpoint (`None`: nothing to keep, or reused).
    pub checkpoint: Option<Value>,
    /// The value came from a checkpoint, not from `prepare`.
    pub reused: bool,
}

#[async_trait]
pub(crate) trait ErasedStage: Send + Sync + 'static {
    /// Whether an attempt must read its binding before `prepare`: a stage whose
    /// `Input` is `()` reads nothing, and only a later attempt (attempts only
    /// grow) of a stage that prepares something can have a checkpoint to reuse.
    fn reads_binding(&self, attempt: i32, reuse_prepared: bool) -> bool;

    async fn prepare(&self, bound: Bound<'_>) -> Result<Prepared, StageError>;

    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        prepared: &Prepared,
    ) -> Result<(Value, StageFlow), StageError>;
}

struct Typed<S>(S);

#[async_trait]
impl<S: Stage> ErasedStage for Typed<S> {
    fn reads_binding(&self, attempt: i32, reuse_prepared: bool) -> bool {
        use std::any::TypeId;
        TypeId::of::<S::Input>() != TypeId::of::<()>()
            || (attempt > 1 && reuse_prepared && TypeId::of::<S::Prepared>() != TypeId::of::<()>())
    }

    async fn prepare(&self, bound: Bound<'_>) -> Result<Prepared, StageError> {
        let stage = &bound.attempt.stage;
        let input: S::Input = decode_input(stage, bound.input)?;
        if let Some(kept) = bound.checkpoint.filter(|_| bound.reuse_prepared) {
            match serde_json::from_value::<S::Prepared>(kept) {
                Ok(prepared) => {
                    crate::telemetry::record_prepared(stage.as_str(), "reused");
                    return Ok(Prepared {
                        state: Box::new((input, prepared)),
                        checkpoint: None,
                        reused: true,
                    });
                }
                // Kept by another version of the stage: prepare anew.
                Err(e) => {
                    tracing::warn!(error = %e, "checkpoint does not fit the stage's Prepared type; preparing anew")
                }
            }
        }
        let ctx = PrepareContext {
            input: &input,
            attempt: bound.attempt,
            repo: bound.repo,
            lease_lost: bound.lease_lost,
        };
        let prepared = self.0.prepare(&ctx).await?;
        crate::telemetry::record_prepared(stage.as_str(), "prepared");
        let checkpoint = if bound.reuse_prepared {
            let value = serde_json::to_value(&prepared).map_err(|e| {
                StageError::Permanent(
                    format!("stage {stage}: its prepared value does not serialize: {e}").into(),
                )
            })?;
            (!value.is_null()).then_some(value)
        } else {
            None
        };
        Ok(Prepared {
            state: Box::new((input, prepared)),
            checkpoint,
            reused: false,
        })
    }

    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        prepared: &Prepared,
    ) -> Result<(Value, StageFlow), StageError> {
        let (input, value) = prepared
            .state
            .downcast_ref::<(S::Input, S::Prepared)>()
            .expect("the state `prepare` of the same stage made");
        let done = self.0.commit(tx, input, value).await?;
        let output = serde_json::to_value(&done.output).map_err(|e| {
            StageError::Permanent(
                format!(
                    "stage {}: its output does not serialize: {e}",
                    tx.token().stage
                )
                .into(),
            )
        })?;
        Ok((output, done.flow))
    }
}

/// The stage's typed input from what the run is bound to. A first stage's
/// `String` takes the text as it is; any other type is parsed from it as JSON.
/// An `Input` of `()` reads nothing, and takes whatever the run is bound to.
fn decode_input<I: serde::de::DeserializeOwned>(
    stage: &StageName,
    input: BoundInput,
) -> Result<I, StageError> {
    use serde::de::IntoDeserializer;
    let decoded = match input {
        BoundInput::Text(text) => {
            let as_text: Result<I, serde::de::value::Error> =
                I::deserialize(text.as_str().into_deserializer());
            // Not a string type: the input is the type's JSON.
            as_text
                .or_else(|_| serde_json::from_str(&text))
                .map_err(|e| {
                    format!("stage {stage}: the item's input does not parse as its Input type: {e}")
                })
        }
        BoundInput::UpstreamOutput(value) => serde_json::from_value(value).map_err(|e| {
            format!("stage {stage}: its upstream's output does not fit its Input type: {e}")
        }),
    };
    decoded.or_else(|message| {
        let unit: Result<I, serde::de::value::Error> = I::deserialize(().into_deserializer());
        unit.map_err(|_| StageError::Permanent(message.into()))
    })
}
