//! Queue controls: pause and resume, concurrency caps, rate limits and tenant
//! weights, per queue (a stage's queue is its name) and per tenant. Stored in
//! `queue_controls` and enforced by the fetch itself (`idemstage_fetch`, migration
//! `2026-11-30-000000_baseline`), so they hold across every worker process and
//! take effect at the next fetch of any worker.
//!
//! Every change of a control is recorded in `queue_control_changes` (migration
//! `2026-11-30-000000_baseline`: a trigger, so plain SQL is recorded too)
//! with the [`Actor`] the change was made for and the database login role;
//! [`control_changes`](super::control_changes) reads them.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Bool, Integer, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::queue::validate_queue_name;
use idemstage_domain::{DomainError, RepoError, TenantId};

use super::millis;
use crate::error::map_diesel_error;
use crate::ops::Actor;

/// Whom a control applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// The queue as a whole: its cap counts all its active jobs, its rate all
    /// its fetches.
    Queue,
    /// Each tenant of the queue, as its default (a tenant's own row overrides
    /// it); its cap and rate apply to every tenant separately.
    EveryTenant,
    /// One tenant.
    Tenant(TenantId),
}

impl Scope {
    /// The scope as `queue_controls.scope` stores it: `""` the queue, `"*"` every
    /// tenant, else the tenant's slug.
    pub fn as_key(&self) -> &str {
        match self {
            Scope::Queue => "",
            Scope::EveryTenant => "*",
            Scope::Tenant(t) => t.as_str(),
        }
    }

    pub(super) fn from_key(key: &str) -> Result<Scope, RepoError> {
        Ok(match key {
            "" => Scope::Queue,
            "*" => Scope::EveryTenant,
            slug => Scope::Tenant(TenantId::parse(slug)?),
        })
    }
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Scope::Queue => f.write_str("the whole queue"),
            Scope::EveryTenant => f.write_str("every tenant"),
            Scope::Tenant(t) => write!(f, "tenant {t}"),
        }
    }
}

/// At most `count` fetches per `per`, as a token bucket on the database clock
/// that holds at most `burst` tokens (default `count`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    /// Jobs per period, at least 1.
    pub count: u32,
    /// The period, at least 1 ms.
    pub per: Duration,
    /// Tokens the bucket holds at most (what may start at once after a quiet
    /// spell); `None`: `count`.
    pub burst: Option<u32>,
}

/// The limits of one scope; `None` fields are unlimited (or, for a tenant,
/// inherit the queue's [`Scope::EveryTenant`] value).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    /// At most this many active jobs at once. An active job holds its slot until
    /// it is completed, failed or released, or its lease expires and maintenance
    /// takes it back (so a killed worker's slots come back after the lease).
    pub max_active: Option<u32>,
    /// A rate limit.
    pub rate: Option<Rate>,
    /// A tenant's share of a fetch relative to the other tenants' (1 to 1000;
    /// tenant scopes only). `None`: 1.
    pub weight: Option<u32>,
}

impl Limits {
    fn validate(&self, scope: &Scope) -> Result<(), DomainError> {
        let bad = |m: String| Err(DomainError::InvalidOption(m));
        if let Some(rate) = &self.rate {
            if rate.count == 0 || rate.count > i32::MAX as u32 {
                return bad(format!(
                    "rate count {} must be 1 to {}",
                    rate.count,
                    i32::MAX
                ));
            }
            if rate.per < Duration::from_millis(1) {
                return bad(format!("rate period {:?} must be at least 1 ms", rate.per));
            }
            if rate.burst.is_some_and(|b| b == 0 || b > i32::MAX as u32) {
                return bad("rate burst must be at least 1".into());
            }
        }
        if self.max_active.is_some_and(|m| m > i32::MAX as u32) {
            return bad("max_active is too large".into());
        }
        if let Some(w) = self.weight {
            if *scope == Scope::Queue {
                return bad("a weight is a tenant's share: set it for every tenant or one".into());
            }
            if !(1..=1000).contains(&w) {
                return bad(format!("weight {w} must be 1 to 1000"));
            }
        }
        Ok(())
    }
}

/// `max_active 3, rate 60/60s burst 60, weight 2`: the limits that are set, or
/// `no limits`.
impl std::fmt::Display for Limits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if let Some(m) = self.max_active {
            parts.push(format!("max_active {m}"));
        }
        if let Some(r) = self.rate {
            parts.push(format!(
                "rate {}/{:?} burst {}",
                r.count,
                r.per,
                r.burst.unwrap_or(r.count)
            ));
        }
        if let Some(w) = self.weight {
            parts.push(format!("weight {w}"));
        }
        if parts.is_empty() {
            f.write_str("no limits")
        } else {
            f.write_str(&parts.join(", "))
        }
    }
}

/// One row of `queue_controls`, as [`controls`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueControl {
    /// The queue.
    pub queue: String,
    /// Whom it applies to.
    pub scope: Scope,
    /// No job of the scope is fetched (running ones finish).
    pub paused: bool,
    /// Its limits.
    pub limits: Limits,
    /// The queue's priority aging ([`set_priority_aging`](super::set_priority_aging); the queue scope only).
    pub priority_aging: Option<Duration>,
    /// When it was last changed (database clock).
    pub updated_at: DateTime<Utc>,
    /// The database user that changed it last.
    pub updated_by: String,
}

/// What [`pause`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseOutcome {
    /// The scope was running and is paused now.
    Paused,
    /// It was paused already; nothing changed.
    AlreadyPaused,
}

/// What [`resume`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResumeOutcome {
    /// The scope was paused and runs again.
    Resumed,
    /// It was not paused; nothing changed.
    NotPaused,
}

/// `$3` the actor: set for the statement's transaction, tagged with this
/// statement's start (`idemstage_actor_tag()`, the baseline migration), where the
/// trigger that records the change reads it (`queue_control_changes.actor`); a
/// later statement of the transaction has another tag, so it names nobody.
const PAUSE_SQL: &str = "\
WITH actor AS (
    SELECT set_config('idemstage.actor', idemstage_actor_tag() || $3, true) AS name
), before AS (
    SELECT paused FROM queue_controls WHERE queue = $1 AND scope = $2
), upsert AS (
    INSERT INTO queue_controls (queue, scope, paused) VALUES ($1, $2, true)
    ON CONFLICT (queue, scope) DO UPDATE
       SET paused = true, updated_at = now(), updated_by = current_user
     WHERE NOT queue_controls.paused
    RETURNING 1
)
SELECT coalesce((SELECT paused FROM before), false) AS was
  FROM (SELECT count(*) FROM upsert) u, actor";

/// Resuming wakes idle workers of the queue at once (the NOTIFY fires on commit).
/// `$3` the actor, as in `PAUSE_SQL`.
const RESUME_SQL: &str = "\
WITH actor AS (
    SELECT set_config('idemstage.actor', idemstage_actor_tag() || $3, true) AS name
), resumed AS (
    UPDATE queue_controls SET paused = false, updated_at = now(), updated_by = current_user
     WHERE queue = $1 AND scope = $2 AND paused
    RETURNING queue
)
SELECT (SELECT count(*) FROM resumed) > 0 AS was,
       (SELECT count(pg_notify('idemstage_jobs', queue)) FROM resumed) AS n
  FROM actor";

#[derive(QueryableByName)]
struct Was {
    #[diesel(sql_type = Bool)]
    was: bool,
}

/// Pauses `scope` of `queue`: no worker fetches its jobs from the next fetch on
/// (running jobs finish). Durable; [`resume`] ends it. The change is recorded
/// with `actor` ([`control_changes`](super::control_changes)).
pub async fn pause(
    conn: &mut AsyncPgConnection,
    queue: &str,
    scope: &Scope,
    actor: &Actor,
) -> Result<PauseOutcome, RepoError> {
    validate_queue_name(queue)?;
    let query = diesel::sql_query(PAUSE_SQL)
        .bind::<Text, _>(queue)
        .bind::<Text, _>(scope.as_key())
        .bind::<Text, _>(actor.as_str());
    let row: Was = crate::db::pinned(conn, async move |conn| query.get_result(conn).await)
        .await
        .map_err(map_diesel_error)?;
    Ok(if row.was {
        PauseOutcome::AlreadyPaused
    } else {
        PauseOutcome::Paused
    })
}

/// Resumes `scope` of `queue` and wakes the queue's idle workers. The change is
/// recorded with `actor` ([`control_changes`](super::control_changes)).
pub async fn resume(
    conn: &mut AsyncPgConnection,
    queue: &str,
    scope: &Scope,
    actor: &Actor,
) -> Result<ResumeOutcome, RepoError> {
    validate_queue_name(queue)?;
    let query = diesel::sql_query(RESUME_SQL)
        .bind::<Text, _>(queue)
        .bind::<Text, _>(scope.as_key())
        .bind::<Text, _>(actor.as_str());
    let row: Was = crate::db::pinned(conn, async move |conn| query.get_result(conn).await)
        .await
        .map_err(map_diesel_error)?;
    Ok(if row.was {
        ResumeOutcome::Resumed
    } else {
        ResumeOutcome::NotPaused
    })
}

/// `$8` the actor, as in `PAUSE_SQL`.
const SET_LIMITS_SQL: &str = "\
WITH actor AS (
    SELECT set_config('idemstage.actor', idemstage_actor_tag() || $8, true) AS name
)
INSERT INTO queue_controls (queue, scope, max_active, rate_count, rate_period_ms, rate_burst, weight)
SELECT $1, $2, $3, $4, $5, $6, $7 FROM actor
ON CONFLICT (queue, scope) DO UPDATE
   SET max_active = excluded.max_active, rate_count = excluded.rate_count,
       rate_period_ms = excluded.rate_period_ms, rate_burst = excluded.rate_burst,
       weight = excluded.weight, updated_at = now(), updated_by = current_user";

/// Sets the limits of `scope` of `queue` (all of them: a `None` field removes
/// that limit), keeping its pause. Takes effect at the next fetch of every worker;
/// jobs already active above a lowered cap finish. Bad limits are refused before
/// anything is written. A change is recorded with `actor` ([`control_changes`](super::control_changes));
/// setting the limits a scope has already is none.
pub async fn set_limits(
    conn: &mut AsyncPgConnection,
    queue: &str,
    scope: &Scope,
    limits: &Limits,
    actor: &Actor,
) -> Result<(), RepoError> {
    validate_queue_name(queue)?;
    limits.validate(scope)?;
    let rate = limits.rate.as_ref();
    let query = diesel::sql_query(SET_LIMITS_SQL)
        .bind::<Text, _>(queue)
        .bind::<Text, _>(scope.as_key())
        .bind::<Nullable<Integer>, _>(limits.max_active.map(|m| m as i32))
        .bind::<Nullable<Integer>, _>(rate.map(|r| r.count as i32))
        .bind::<Nullable<BigInt>, _>(rate.map(|r| millis(r.per)))
        .bind::<Nullable<Integer>, _>(rate.and_then(|r| r.burst).map(|b| b as i32))
        .bind::<Nullable<Integer>, _>(limits.weight.map(|w| w as i32))
        .bind::<Text, _>(actor.as_str());
    crate::db::pinned(conn, async move |conn| query.execute(conn).await)
        .await
        .map_err(map_diesel_error)?;
    Ok(())
}

/// The limit columns of `queue_controls` and `queue_control_changes`.
#[derive(QueryableByName)]
pub(super) struct LimitColumns {
    #[diesel(sql_type = Nullable<Integer>)]
    max_active: Option<i32>,
    #[diesel(sql_type = Nullable<Integer>)]
    rate_count: Option<i32>,
    #[diesel(sql_type = Nullable<BigInt>)]
    rate_period_ms: Option<i64>,
    #[diesel(sql_type = Nullable<Integer>)]
    rate_burst: Option<i32>,
    #[diesel(sql_type = Nullable<Integer>)]
    weight: Option<i32>,
}

impl From<LimitColumns> for Limits {
    fn from(c: LimitColumns) -> Limits {
        let rate = match (c.rate_count, c.rate_period_ms) {
            (Some(count), Some(ms)) => Some(Rate {
                count: count as u32,
                per: Duration::from_millis(ms as u64),
                burst: c.rate_burst.map(|b| b as u32),
            }),
            _ => None,
        };
        Limits {
            max_active: c.max_active.map(|m| m as u32),
            rate,
            weight: c.weight.map(|w| w as u32),
        }
    }
}

#[derive(QueryableByName)]
struct ControlRow {
    #[diesel(sql_type = Text)]
    queue: String,
    #[diesel(sql_type = Text)]
    scope: String,
    #[diesel(sql_type = Bool)]
    paused: bool,
    #[diesel(embed)]
    limits: LimitColumns,
    #[diesel(sql_type = Nullable<BigInt>)]
    aging_ms: Option<i64>,
    #[diesel(sql_type = Timestamptz)]
    updated_at: DateTime<Utc>,
    #[diesel(sql_type = Text)]
    updated_by: String,
}

/// Every control row, of `queue` or (with `None`) of all queues, by queue then
/// scope.
pub async fn controls(
    conn: &mut AsyncPgConnection,
    queue: Option<&str>,
) -> Result<Vec<QueueControl>, RepoError> {
    let query = diesel::sql_query(
        "SELECT queue, scope, paused, max_active, rate_count, rate_period_ms, rate_burst, \
                weight, aging_ms, updated_at, updated_by \
           FROM queue_controls WHERE $1::text IS NULL OR queue = $1 ORDER BY queue, scope",
    )
    .bind::<Nullable<Text>, _>(queue);
    let rows: Vec<ControlRow> = crate::db::pinned(conn, async move |conn| query.load(conn).await)
        .await
        .map_err(map_diesel_error)?;
    rows.into_iter()
        .map(|r| {
            Ok(QueueControl {
                scope: Scope::from_key(&r.scope)?,
                limits: r.limits.into(),
                priority_aging: super::aging::aging(r.aging_ms),
                queue: r.queue,
                paused: r.paused,
                updated_at: r.updated_at,
                updated_by: r.updated_by,
            })
        })
        .collect()
}
