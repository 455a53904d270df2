//! A durable wait: what a stage attempt ends in when it needs an event from
//! outside (a person's approval, a provider's callback) or time to pass.

use std::time::Duration;

use serde::Serialize;

use crate::{DomainError, StageName};

/// What happens when a wait reaches its deadline without its signal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnTimeout {
    /// The run ends `dead` (the dead-letter list shows why; an operator may
    /// retry it, and it waits again).
    Fail,
    /// The stage runs again; it reads the signal as [`Signal::TimedOut`]. A
    /// timer's wait always resumes.
    Resume,
}

impl OnTimeout {
    /// As stored in `stage_waits.on_timeout`.
    pub fn as_str(self) -> &'static str {
        match self {
            OnTimeout::Fail => "fail",
            OnTimeout::Resume => "resume",
        }
    }
}

/// What a stage waits for: a named signal with a deadline, or a timer.
/// Returned from a stage's body as [`StageError::Wait`](crate::StageError::Wait)
/// (`Err(WaitFor::signal("review", ..)?.into())`): the attempt ends `waiting`,
/// holding no worker, lease or job, and the stage runs again once the signal is
/// delivered (or the deadline passes), on the same binding, with the signal to
/// read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WaitFor {
    /// The signal's name (a stage name's form), `None` for a timer.
    pub signal: Option<StageName>,
    /// How long the wait lasts at most.
    pub timeout: Duration,
    /// What its deadline does.
    pub on_timeout: OnTimeout,
}

impl WaitFor {
    /// The longest wait: 366 days.
    pub const MAX_TIMEOUT: Duration = Duration::from_secs(366 * 24 * 3600);

    /// A wait for the signal `name` (`[a-z][a-z0-9_]{0,62}`) for at most
    /// `timeout` (at least 1 ms, at most [`WaitFor::MAX_TIMEOUT`]); the run ends
    /// `dead` at the deadline unless [`WaitFor::on_timeout`] says otherwise.
    pub fn signal(name: &str, timeout: Duration) -> Result<Self, DomainError> {
        let name = StageName::parse(name).map_err(|_| {
            DomainError::InvalidOption(format!(
                "invalid signal name {name:?}: expected [a-z][a-z0-9_]{{0,62}}"
            ))
        })?;
        Self::checked(Some(name), timeout, OnTimeout::Fail)
    }

    /// A timer: the stage runs again after `delay` (1 ms to
    /// [`WaitFor::MAX_TIMEOUT`]).
    pub fn timer(delay: Duration) -> Result<Self, DomainError> {
        Self::checked(None, delay, OnTimeout::Resume)
    }

    /// What the deadline does (a timer always resumes).
    pub fn on_timeout(mut self, on_timeout: OnTimeout) -> Self {
        if self.signal.is_some() {
            self.on_timeout = on_timeout;
        }
        self
    }

    fn checked(
        signal: Option<StageName>,
        timeout: Duration,
        on_timeout: OnTimeout,
    ) -> Result<Self, DomainError> {
        if timeout < Duration::from_millis(1) || timeout > Self::MAX_TIMEOUT {
            return Err(DomainError::InvalidOption(format!(
                "wait of {timeout:?}: expected 1 ms to 366 days"
            )));
        }
        Ok(Self {
            signal,
            timeout,
            on_timeout,
        })
    }
}

/// What a resumed stage reads of its wait: the signal's payload, or that the
/// wait ran out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "ended_by")]
pub enum Signal {
    /// Delivered with this payload, by this actor.
    Delivered {
        /// The signal's name.
        name: StageName,
        /// What was sent with it (JSON).
        payload: serde_json::Value,
        /// Who delivered it.
        actor: String,
    },
    /// The deadline passed first (a timer's end, or a signal's wait with
    /// [`OnTimeout::Resume`]).
    TimedOut,
}
