//! `idemstage pause|resume|limit`: the stage controls the fetch enforces
//! (`idemstage::queue::{pause, resume, set_limits}`). A stage's queue
//! is its name.

use std::process::ExitCode;
use std::time::Duration;

use idemstage::ids::TenantId;
use idemstage::ops::Actor;
use idemstage::pipeline::Pipeline;
use idemstage::queue::{self, Limits, PauseOutcome, Rate, ResumeOutcome, Scope};

use super::{known, BadInput};

#[derive(clap::Args)]
pub struct PauseArgs {
    /// The stage (its queue)
    #[arg(long)]
    stage: String,
    /// Only this tenant's jobs of the stage (a tenant with an item)
    #[arg(long)]
    tenant: Option<String>,
    /// Who is pausing or resuming, for the record of control changes (default:
    /// $USER, else the database user)
    #[arg(long)]
    actor: Option<String>,
    /// One JSON object instead of a sentence
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct LimitArgs {
    /// The stage (its queue)
    #[arg(long)]
    stage: String,
    /// The limits of one tenant with an item (else of the whole stage)
    #[arg(long, conflicts_with = "every_tenant")]
    tenant: Option<String>,
    /// The limits each tenant has unless it has its own
    #[arg(long)]
    every_tenant: bool,
    /// At most this many running at once in the scope
    #[arg(long)]
    max_active: Option<u32>,
    /// At most N per period: N/s, N/min or N/h (e.g. 60/min)
    #[arg(long)]
    rate: Option<String>,
    /// Tokens the rate's bucket holds at most (default: N)
    #[arg(long, requires = "rate")]
    burst: Option<u32>,
    /// A tenant's share of a fetch against the others' (tenant scopes)
    #[arg(long)]
    weight: Option<u32>,
    /// Within a tenant's share, a waiting job's priority rises by one per this
    /// interval (e.g. 30s, 500ms, 5min, 1h; `off` ends it): the whole stage only,
    /// set apart from the limits (which it keeps)
    #[arg(long, conflicts_with_all = ["tenant", "every_tenant", "max_active", "rate", "weight", "show"])]
    priority_aging: Option<String>,
    /// Only show the stage's controls (and its latest changes)
    #[arg(long)]
    show: bool,
    /// Who is setting the limits, for the record of control changes (default:
    /// $USER, else the database user)
    #[arg(long)]
    actor: Option<String>,
    /// How many of the stage's latest control changes to show
    #[arg(long, default_value_t = 10)]
    changes: u32,
    /// One JSON object instead of text
    #[arg(long)]
    json: bool,
}

fn scope(tenant: Option<&str>, every_tenant: bool) -> anyhow::Result<Scope> {
    Ok(match (tenant, every_tenant) {
        (Some(t), _) => Scope::Tenant(TenantId::parse(t)?),
        (None, true) => Scope::EveryTenant,
        (None, false) => Scope::Queue,
    })
}

/// `30s`, `500ms`, `5min`, `1h`, or `off` (`None`).
fn parse_aging(text: &str) -> anyhow::Result<Option<Duration>> {
    let bad = || {
        BadInput(format!(
            "--priority-aging {text:?}: expected a number with ms, s, min or h (e.g. 30s), or off"
        ))
    };
    let text = text.trim();
    if text == "off" {
        return Ok(None);
    }
    let split = text.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
    let (count, unit) = text.split_at(split);
    let count: u64 = count.parse().map_err(|_| bad())?;
    let ms = match unit {
        "ms" => 1,
        "s" => 1_000,
        "min" => 60_000,
        "h" => 3_600_000,
        _ => return Err(bad().into()),
    };
    let every = Duration::from_millis(count.checked_mul(ms).ok_or_else(bad)?);
    if every.is_zero() || every > queue::MAX_PRIORITY_AGING {
        return Err(BadInput(format!("--priority-aging {text:?}: must be 1ms to 7 days")).into());
    }
    Ok(Some(every))
}

fn parse_rate(text: &str, burst: Option<u32>) -> anyhow::Result<Rate> {
    let bad = || {
        BadInput(format!(
            "--rate {text:?}: expected N/s, N/min or N/h, e.g. 60/min"
        ))
    };
    let (count, unit) = text.split_once('/').ok_or_else(bad)?;
    let count: u32 = count.trim().parse().map_err(|_| bad())?;
    let per = match unit.trim() {
        "s" | "sec" | "second" => Duration::from_secs(1),
        "min" | "minute" => Duration::from_secs(60),
        "h" | "hour" => Duration::from_secs(3600),
        _ => return Err(bad().into()),
    };
    Ok(Rate { count, per, burst })
}

/// A tenant scope's tenant must be known (see [`known`]): refused before the write.
async fn check_scope(
    conn: &mut diesel_async::AsyncPgConnection,
    scope: &Scope,
) -> anyhow::Result<()> {
    match scope {
        Scope::Tenant(tenant) => known::tenant(conn, tenant).await,
        _ => Ok(()),
    }
}

pub async fn pause(
    db: &super::Db,
    args: PauseArgs,
    pause: bool,
    team: Pipeline,
) -> anyhow::Result<ExitCode> {
    let stage = known::stage(&team, &args.stage)?;
    let scope = scope(args.tenant.as_deref(), false)?;
    let flag_actor = args.actor.as_deref().map(Actor::parse).transpose()?;
    let mut conn = db.connect().await?;
    check_scope(&mut conn, &scope).await?;
    let actor = super::ops::actor(flag_actor, &mut conn).await?;
    let (outcome, changed) = if pause {
        match queue::pause(&mut conn, stage.as_str(), &scope, &actor).await? {
            PauseOutcome::Paused => ("paused", true),
            PauseOutcome::AlreadyPaused => ("already_paused", false),
        }
    } else {
        match queue::resume(&mut conn, stage.as_str(), &scope, &actor).await? {
            ResumeOutcome::Resumed => ("resumed", true),
            ResumeOutcome::NotPaused => ("not_paused", false),
        }
    };
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "stage": stage.as_str(),
                "tenant": args.tenant,
                "outcome": outcome,
                "changed": changed,
                "actor": actor,
            })
        );
    } else {
        println!("stage {stage}, {scope}: {}", outcome.replace('_', " "));
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn limit(db: &super::Db, args: LimitArgs, team: Pipeline) -> anyhow::Result<ExitCode> {
    let stage = known::stage(&team, &args.stage)?;
    let scope = scope(args.tenant.as_deref(), args.every_tenant)?;
    let flag_actor = args.actor.as_deref().map(Actor::parse).transpose()?;
    let aging = args
        .priority_aging
        .as_deref()
        .map(parse_aging)
        .transpose()?;
    let mut conn = db.connect().await?;
    if let Some(every) = aging {
        let actor = super::ops::actor(flag_actor, &mut conn).await?;
        queue::set_priority_aging(&mut conn, stage.as_str(), every, &actor).await?;
    } else if !args.show {
        check_scope(&mut conn, &scope).await?;
        let actor = super::ops::actor(flag_actor, &mut conn).await?;
        let limits = Limits {
            max_active: args.max_active,
            rate: args
                .rate
                .as_deref()
                .map(|r| parse_rate(r, args.burst))
                .transpose()?,
            weight: args.weight,
        };
        queue::set_limits(&mut conn, stage.as_str(), &scope, &limits, &actor).await?;
    }
    let controls = queue::controls(&mut conn, Some(stage.as_str())).await?;
    let changes = queue::control_changes(&mut conn, Some(stage.as_str()), args.changes).await?;
    if args.json {
        let rows: Vec<_> = controls
            .iter()
            .map(|c| {
                let mut row = limits_json(&c.limits);
                row["scope"] = c.scope.as_key().into();
                row["paused"] = c.paused.into();
                row["priority_aging_ms"] =
                    serde_json::json!(c.priority_aging.map(|d| d.as_millis() as u64));
                row["updated_at"] = serde_json::json!(c.updated_at);
                row["updated_by"] = c.updated_by.clone().into();
                row
            })
            .collect();
        let changes: Vec<_> = changes
            .iter()
            .map(|c| {
                let mut row = limits_json(&c.limits);
                row["priority_aging_ms"] =
                    serde_json::json!(c.priority_aging.map(|d| d.as_millis() as u64));
                row["id"] = c.id.into();
                row["changed_at"] = serde_json::json!(c.changed_at);
                row["scope"] = c.scope.as_key().into();
                row["change"] = serde_json::json!(c.kind);
                row["paused"] = serde_json::json!(c.paused);
                row["actor"] = serde_json::json!(c.actor);
                row["db_user"] = c.db_user.clone().into();
                row
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({ "stage": stage.as_str(), "controls": rows, "changes": changes })
        );
    } else {
        for c in &controls {
            println!(
                "{:<20} paused {:<5} {}{}",
                c.scope.to_string(),
                c.paused,
                c.limits,
                c.priority_aging
                    .map_or(String::new(), |d| format!(", priority aging every {d:?}"))
            );
        }
        if !changes.is_empty() {
            println!("latest changes, newest first:");
        }
        for c in &changes {
            let what = c.describe();
            println!(
                "  {} {:<20} {:<60} by {} ({})",
                c.changed_at.format("%Y-%m-%d %H:%M:%S%.3f UTC"),
                c.scope.to_string(),
                what,
                c.actor.as_deref().unwrap_or("-"),
                c.db_user
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `{"max_active", "rate": {"count", "per_ms", "burst"}, "weight"}`, nulls for
/// the unset ones.
fn limits_json(limits: &Limits) -> serde_json::Value {
    serde_json::json!({
        "max_active": limits.max_active,
        "rate": limits.rate.map(|r| serde_json::json!({
            "count": r.count,
            "per_ms": r.per.as_millis() as u64,
            "burst": r.burst,
        })),
        "weight": limits.weight,
    })
}
