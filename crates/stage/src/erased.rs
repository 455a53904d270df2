//! The typed [`Stage`] behind one object-safe interface, so that the pipeline,
//! the executor and the claim SQL handle every stage alike: values cross it as
//! JSON where they are stored, and as the stage's own types in between.

use std::any::Any;
use std::sync::Arc;

use async_trait::async_trait;
use idemstage_domain::{
    ChildFailure, ClaimToken, DomainError, GatherPolicy, Gathered, GatheredChild, RepoError,
    StageError, StageName, StagePolicy,
};
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

    /// A gather stage under its `NAME`: its input is read from the children
    /// of the fan-out its run is bound to, not from its upstream's output
    /// ([`FanOutBuilder::gather`](crate::FanOutBuilder::gather)).
    pub(crate) fn gather<S, O>(stage: S, policy: GatherPolicy) -> Result<Self, DomainError>
    where
        S: Stage<Input = Gathered<O>>,
        O: crate::StageData,
    {
        Ok(Self {
            name: StageName::parse(S::NAME)?,
            policy: stage.policy(),
            stage: Arc::new(GatherTyped {
                stage,
                policy,
                output: std::marker::PhantomData::<fn() -> O>,
            }),
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
    /// A gather's: the version of its fan-out its children were read at,
    /// checked again at its commit.
    pub gather_version: Option<i32>,
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

    async fn prepare(&self, mut bound: Bound<'_>) -> Result<Prepared, StageError> {
        let raw = std::mem::replace(&mut bound.input, BoundInput::Text(String::new()));
        let input: S::Input = decode_input(&bound.attempt.stage, raw)?;
        prepare_typed(&self.0, input, bound, None).await
    }

    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        prepared: &Prepared,
    ) -> Result<(Value, StageFlow), StageError> {
        commit_typed(&self.0, tx, prepared).await
    }
}

/// `prepare` of a typed stage on `input`, or its checkpoint on this binding
/// reused. A gather's checkpoint keeps the version of the children it was
/// computed from (`gather_version`), and is reused only at that version.
async fn prepare_typed<S: Stage>(
    stage_impl: &S,
    input: S::Input,
    bound: Bound<'_>,
    gather_version: Option<i32>,
) -> Result<Prepared, StageError> {
    let stage = &bound.attempt.stage;
    let kept = bound
        .checkpoint
        .filter(|_| bound.reuse_prepared)
        .and_then(|kept| match gather_version {
            None => Some(kept),
            Some(version) => (kept.get("version").and_then(Value::as_i64)
                == Some(i64::from(version)))
            .then(|| kept.get("prepared").cloned())
            .flatten(),
        });
    if let Some(kept) = kept {
        match serde_json::from_value::<S::Prepared>(kept) {
            Ok(prepared) => {
                crate::telemetry::record_prepared(stage.as_str(), "reused");
                return Ok(Prepared {
                    state: Box::new((input, prepared)),
                    checkpoint: None,
                    reused: true,
                    gather_version,
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
    let prepared = stage_impl.prepare(&ctx).await?;
    crate::telemetry::record_prepared(stage.as_str(), "prepared");
    let checkpoint = if bound.reuse_prepared {
        let value = serde_json::to_value(&prepared).map_err(|e| {
            StageError::Permanent(
                format!("stage {stage}: its prepared value does not serialize: {e}").into(),
            )
        })?;
        match (value.is_null(), gather_version) {
            (true, _) => None,
            (false, None) => Some(value),
            (false, Some(version)) => {
                Some(serde_json::json!({ "version": version, "prepared": value }))
            }
        }
    } else {
        None
    };
    Ok(Prepared {
        state: Box::new((input, prepared)),
        checkpoint,
        reused: false,
        gather_version,
    })
}

/// `commit` of a typed stage, its output as JSON.
async fn commit_typed<S: Stage>(
    stage_impl: &S,
    tx: &mut FencedTx<'_>,
    prepared: &Prepared,
) -> Result<(Value, StageFlow), StageError> {
    let (input, value) = prepared
        .state
        .downcast_ref::<(S::Input, S::Prepared)>()
        .expect("the state `prepare` of the same stage made");
    let done = stage_impl.commit(tx, input, value).await?;
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

/// A gather stage: its input is every child of the fan-out its run is bound
/// to, read in one statement with the fan-out's version; its commit checks
/// that version again, so a child that ended again meanwhile is never
/// gathered in its old state.
struct GatherTyped<S, O> {
    stage: S,
    policy: GatherPolicy,
    output: std::marker::PhantomData<fn() -> O>,
}

#[async_trait]
impl<S, O> ErasedStage for GatherTyped<S, O>
where
    S: Stage<Input = Gathered<O>>,
    O: crate::StageData,
{
    fn reads_binding(&self, _attempt: i32, _reuse_prepared: bool) -> bool {
        true
    }

    async fn prepare(&self, bound: Bound<'_>) -> Result<Prepared, StageError> {
        let info = bound.attempt;
        let token = ClaimToken {
            run_id: info.run_id,
            tenant: info.tenant.clone(),
            item: info.item,
            stage: info.stage.clone(),
            attempt: info.attempt,
        };
        let Some(read) = bound.repo.gather_read(&token).await? else {
            return Err(StageError::Transient(
                format!("gather {}: no fan-out for this attempt", info.stage).into(),
            ));
        };
        if !read.complete {
            let done = read.children.iter().filter(|c| c.outcome.is_some()).count();
            return Err(StageError::Transient(
                format!(
                    "gather {}: {done} of {} children final; it runs when all are",
                    info.stage,
                    read.children.len()
                )
                .into(),
            ));
        }
        let mut children = Vec::with_capacity(read.children.len());
        for child in read.children {
            let stage = child
                .final_stage
                .clone()
                .unwrap_or_else(|| info.stage.clone());
            let result = match child.outcome.as_deref() {
                Some("success") if child.current => {
                    match serde_json::from_value::<O>(child.output) {
                        Ok(output) => Ok(output),
                        Err(e) => {
                            return Err(StageError::Permanent(
                                format!(
                                    "gather {}: child {}'s output does not fit its Input: {e}",
                                    info.stage, child.key
                                )
                                .into(),
                            ))
                        }
                    }
                }
                Some("success") => {
                    return Err(StageError::Transient(
                        format!("gather {}: child {} runs again", info.stage, child.key).into(),
                    ))
                }
                Some("stopped") => Err(ChildFailure::Stopped { stage }),
                Some("dead") => Err(ChildFailure::Dead {
                    stage,
                    error: child.error,
                }),
                Some("cancelled") => Err(ChildFailure::Cancelled { stage }),
                _ => {
                    return Err(StageError::Transient(
                        format!("gather {}: child {} is not final", info.stage, child.key).into(),
                    ))
                }
            };
            if let (GatherPolicy::FailOnDead, Err(failure)) = (self.policy, &result) {
                return Err(StageError::Permanent(
                    format!(
                        "gather {}: child {} (item {}): {failure}",
                        info.stage, child.key, child.item
                    )
                    .into(),
                ));
            }
            children.push(GatheredChild {
                key: child.key,
                item: child.item,
                result,
            });
        }
        prepare_typed(
            &self.stage,
            Gathered { children },
            bound,
            Some(read.version),
        )
        .await
    }

    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        prepared: &Prepared,
    ) -> Result<(Value, StageFlow), StageError> {
        // A child that ended again after the read (an operator's retry of a
        // dead child, a rerun of one) changed the version: this attempt read
        // an old state. Not the stage's fault: run again (uncounted after the
        // retries), and the next attempt reads the children anew.
        let read = prepared.gather_version;
        if tx.gather_version().await? != read {
            return Err(StageError::Repo(RepoError::Conflict(
                "a child of the fan-out ended again after the gather read it".into(),
            )));
        }
        commit_typed(&self.stage, tx, prepared).await
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
