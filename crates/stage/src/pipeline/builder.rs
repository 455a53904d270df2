//! Building a pipeline stage by stage, typed: each stage's input is the
//! output of the one before ([`Pipeline::builder`]).

use idemstage_domain::{Children, DomainError, GatherPolicy, Gathered, SendOptions};

use super::{Pipeline, PipelineError, StageRole};
use crate::{Stage, StageRef};

/// A pipeline under construction whose last stage hands on an `O`
/// ([`Pipeline::builder`]). Errors (an invalid name, a repeated one, an invalid
/// policy) are reported by [`build`](Self::build).
pub struct PipelineBuilder<O> {
    stages: Result<Vec<(StageRef, StageRole)>, DomainError>,
    send_options: Option<SendOptions>,
    last_output: std::marker::PhantomData<fn() -> O>,
}

impl<O> PipelineBuilder<O> {
    pub(super) fn start(first: Result<StageRef, DomainError>) -> Self {
        Self {
            stages: first.map(|s| vec![(s, StageRole::Plain)]),
            send_options: None,
            last_output: std::marker::PhantomData,
        }
    }

    fn push<N>(self, stage: Result<StageRef, DomainError>) -> PipelineBuilder<N> {
        self.push_as(stage, StageRole::Plain)
    }

    fn push_as<N>(
        self,
        stage: Result<StageRef, DomainError>,
        role: StageRole,
    ) -> PipelineBuilder<N> {
        PipelineBuilder {
            stages: self.stages.and_then(|mut stages| {
                stages.push((stage?, role));
                Ok(stages)
            }),
            send_options: self.send_options,
            last_output: std::marker::PhantomData,
        }
    }

    /// Appends a fan-out `stage`: it runs on this pipeline's last stage's
    /// output, and its success hands on [`Children`]. The stages appended to
    /// the [`FanOutBuilder`] run once per child (each child an item of its
    /// own), up to its [`gather`](FanOutBuilder::gather).
    pub fn fan_out<S, C>(self, stage: S) -> FanOutBuilder<C>
    where
        S: Stage<Input = O, Output = Children<C>>,
        C: crate::StageData,
    {
        FanOutBuilder {
            inner: self.push_as(StageRef::new(stage), StageRole::FanOut),
            children: 0,
        }
    }

    /// Appends `stage`, which runs on this pipeline's last stage's output.
    pub fn then<S: Stage<Input = O>>(self, stage: S) -> PipelineBuilder<S::Output> {
        self.push(StageRef::new(stage))
    }

    /// As [`then`](Self::then), under `name` instead of the stage's `NAME`.
    pub fn then_named<S: Stage<Input = O>>(
        self,
        name: &str,
        stage: S,
    ) -> PipelineBuilder<S::Output> {
        self.push(StageRef::named(name, stage))
    }

    /// Options for the jobs the pipeline sends (see
    /// [`Pipeline::with_send_options`]).
    pub fn send_options(mut self, options: SendOptions) -> Self {
        self.send_options = Some(options);
        self
    }

    /// The pipeline, checked as [`Pipeline::new`] checks one.
    pub fn build(self) -> Result<Pipeline, PipelineError> {
        let (stages, roles) = self.stages?.into_iter().unzip();
        let pipeline = Pipeline::with_roles(stages, roles)?;
        match self.send_options {
            Some(options) => pipeline.with_send_options(options),
            None => Ok(pipeline),
        }
    }
}

/// The stages that run per child of a fan-out, the last of which hands on an
/// `O` ([`PipelineBuilder::fan_out`]); [`gather`](Self::gather) ends them.
pub struct FanOutBuilder<O> {
    inner: PipelineBuilder<O>,
    children: usize,
}

impl<O> FanOutBuilder<O> {
    /// Appends `stage`, run once per child on the previous child stage's
    /// output (the first: on the child's input).
    pub fn then<S: Stage<Input = O>>(self, stage: S) -> FanOutBuilder<S::Output> {
        let role = StageRole::Child {
            first: self.children == 0,
            last: false,
        };
        FanOutBuilder {
            inner: self.inner.push_as(StageRef::new(stage), role),
            children: self.children + 1,
        }
    }

    /// As [`then`](Self::then), under `name` instead of the stage's `NAME`.
    pub fn then_named<S: Stage<Input = O>>(self, name: &str, stage: S) -> FanOutBuilder<S::Output> {
        let role = StageRole::Child {
            first: self.children == 0,
            last: false,
        };
        FanOutBuilder {
            inner: self.inner.push_as(StageRef::named(name, stage), role),
            children: self.children + 1,
        }
    }

    /// Appends the gather `stage`: it runs once per fan-out, on the parent
    /// item, when every child is final, and reads each child's last output
    /// ([`Gathered`]); `policy` says what a child that did not succeed does.
    /// The pipeline goes on after it with its output.
    pub fn gather<S: Stage<Input = Gathered<O>>>(
        self,
        stage: S,
        policy: GatherPolicy,
    ) -> PipelineBuilder<S::Output>
    where
        O: crate::StageData,
    {
        let mut inner = self.inner;
        if let Ok(stages) = &mut inner.stages {
            if let Some((_, StageRole::Child { last, .. })) = stages.last_mut() {
                *last = true;
            }
        }
        inner.push_as(
            StageRef::gather::<S, O>(stage, policy),
            StageRole::Gather(policy),
        )
    }
}
