//! `idemstage inspect | retry | rerun | cancel | signal | dead`: the operator commands
//! (`idemstage::ops`). They connect as the `DATABASE_URL` user and
//! name the tenant of every write, which runs scoped to it.

use std::process::ExitCode;

use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage::ops::{
    self, Actor, BulkAction, CancelOutcome, DeadFilter, ItemTimeline, RerunOutcome, RetryOutcome,
    SignalOutcome,
};
use idemstage::pipeline::{Pipeline, StageRole};
use idemstage::{ids::ItemId, ids::StageName, ids::TenantId, queue::SendResult};

#[derive(clap::Args)]
pub struct InspectArgs {
    /// Tenant slug
    #[arg(long)]
    tenant: String,
    /// Item id (ULID)
    #[arg(long)]
    item: String,
    /// One JSON object instead of text
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct RetryArgs {
    /// Tenant slug (with --item: the item's; without: only this tenant's items)
    #[arg(long)]
    tenant: Option<String>,
    /// Item id (ULID); without it, every item the filters select
    #[arg(long)]
    item: Option<String>,
    /// Only this stage (default: every dead stage of the item)
    #[arg(long)]
    stage: Option<String>,
    /// Who is retrying, for the audit log (default: $USER, else the database user)
    #[arg(long)]
    actor: Option<String>,
    /// One JSON object instead of text
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    bulk: super::bulk::BulkArgs,
}

#[derive(clap::Args)]
pub struct RerunArgs {
    /// Tenant slug (with --item: the item's; without: only this tenant's items)
    #[arg(long)]
    tenant: Option<String>,
    /// Item id (ULID); without it, every item the filters select
    #[arg(long)]
    item: Option<String>,
    /// The stage to run again (every stage after it is invalidated and runs
    /// again after it)
    #[arg(long)]
    stage: String,
    /// Who is rerunning, for the audit log (default: $USER, else the database user)
    #[arg(long)]
    actor: Option<String>,
    /// One JSON object instead of text
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    bulk: super::bulk::BulkArgs,
}

#[derive(clap::Args)]
pub struct CancelArgs {
    /// Tenant slug (with --item: the item's; without: only this tenant's items)
    #[arg(long)]
    tenant: Option<String>,
    /// Item id (ULID); without it, every item the filters select
    #[arg(long)]
    item: Option<String>,
    /// Without --item: only items with a run of this stage (--status is its status)
    #[arg(long)]
    stage: Option<String>,
    /// Who is cancelling, for the audit log (default: $USER, else the database user)
    #[arg(long)]
    actor: Option<String>,
    /// One JSON object instead of text
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    bulk: super::bulk::BulkArgs,
}

/// One item's command (`--item`) or a bulk action (filters): which, checked
/// before the first connection. One item's takes `--tenant` and no bulk flag.
fn one_item(
    tenant: Option<&str>,
    item: Option<&str>,
    bulk: &super::bulk::BulkArgs,
) -> anyhow::Result<Option<(TenantId, ItemId)>> {
    match (tenant, item) {
        (_, Some(_)) if bulk.any() => Err(super::BadInput(
            "--item names one item: --status, --since, --until, --items-file, --dry-run \
             and --resume select many, without --item"
                .into(),
        )
        .into()),
        (Some(tenant), Some(item)) => Ok(Some(ids(tenant, item)?)),
        (None, Some(_)) => Err(super::BadInput("--item needs its --tenant".into()).into()),
        (_, None) => Ok(None),
    }
}

#[derive(clap::Args)]
pub struct SignalArgs {
    /// Tenant slug
    #[arg(long)]
    tenant: String,
    /// Item id (ULID)
    #[arg(long)]
    item: String,
    /// The waiting stage
    #[arg(long)]
    stage: String,
    /// The signal's name (what the stage waits for)
    #[arg(long)]
    signal: String,
    /// What is sent with it, as JSON (default: null)
    #[arg(long, conflicts_with = "payload_file")]
    payload: Option<String>,
    /// The payload from a file (JSON)
    #[arg(long)]
    payload_file: Option<std::path::PathBuf>,
    /// Who is signalling, for the audit log (default: $USER, else the database user)
    #[arg(long)]
    actor: Option<String>,
    /// One JSON object instead of text
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct DeadArgs {
    /// Only this tenant's
    #[arg(long)]
    tenant: Option<String>,
    /// Only this stage's
    #[arg(long)]
    stage: Option<String>,
    /// At most this many dead stages (and failed jobs), newest first
    #[arg(long, default_value_t = 1000)]
    limit: u32,
    /// One JSON object instead of tables
    #[arg(long)]
    json: bool,
}

/// The ids of a command, checked before the first connection: bad input writes
/// nothing.
fn ids(tenant: &str, item: &str) -> anyhow::Result<(TenantId, ItemId)> {
    Ok((TenantId::parse(tenant)?, ItemId::parse(item)?))
}

/// Why a stage a retry or rerun left alone runs again anyway: a waiting one
/// when its signal or deadline comes, any other when a worker takes it.
pub(crate) fn what_runs_it_again(status: Option<idemstage::runs::RunStatus>) -> &'static str {
    match status {
        Some(idemstage::runs::RunStatus::Waiting) => "its signal or its deadline runs it again",
        _ => "the workers run it again",
    }
}

/// `--actor`, else `$USER`, else the database's `current_user`.
pub(crate) async fn actor(
    flag: Option<Actor>,
    conn: &mut AsyncPgConnection,
) -> anyhow::Result<Actor> {
    if let Some(actor) = flag {
        return Ok(actor);
    }
    if let Some(user) = std::env::var("USER").ok().filter(|u| !u.trim().is_empty()) {
        if let Ok(actor) = Actor::parse(&user) {
            return Ok(actor);
        }
    }
    #[derive(diesel::QueryableByName)]
    struct User {
        #[diesel(sql_type = diesel::sql_types::Text)]
        name: String,
    }
    let query = diesel::sql_query("SELECT current_user::text AS name");
    let user: User = idemstage::db::pinned(conn, async move |conn| query.get_result(conn).await)
        .await
        .map_err(idemstage::db::map_diesel_error)?;
    Ok(Actor::parse(&user.name)?)
}

pub async fn inspect(
    db: &super::Db,
    args: InspectArgs,
    team: Pipeline,
) -> anyhow::Result<ExitCode> {
    let (tenant, item) = ids(&args.tenant, &args.item)?;
    let pipeline = team;
    let mut conn = db.connect().await?;
    let mut timeline = ops::inspect(&mut conn, &tenant, &item).await?;
    // In the pipeline's order; a stage the pipeline does not know last.
    let order = |s: &StageName| {
        pipeline
            .stages()
            .iter()
            .position(|p| p.name() == s)
            .unwrap_or(usize::MAX)
    };
    timeline.stages.sort_by_key(|s| order(&s.stage));
    if args.json {
        let not_started: Vec<&str> = pipeline
            .stages()
            .iter()
            .map(|s| s.name().as_str())
            .filter(|name| timeline.stages.iter().all(|t| t.stage.as_str() != *name))
            .collect();
        let mut value = serde_json::to_value(&timeline)?;
        value["not_started"] = serde_json::json!(not_started);
        println!("{value}");
    } else {
        print_timeline(&timeline, &pipeline);
    }
    Ok(ExitCode::SUCCESS)
}

fn print_timeline(t: &ItemTimeline, pipeline: &Pipeline) {
    println!(
        "item {} of tenant {} (input sha256 {}, registered {})",
        t.item, t.tenant, t.input_sha256, t.created_at
    );
    for run in &t.stages {
        let upstream = match (&run.upstream_stage, run.upstream_attempt) {
            (Some(stage), Some(attempt)) => format!(", read {stage} attempt {attempt}"),
            _ => String::new(),
        };
        println!(
            "\n{}: {}{} (run {}, attempts {}/{}, success attempt {}{upstream})",
            run.stage,
            run.status,
            if run.lease_live { ", lease live" } else { "" },
            run.run_id,
            run.attempts,
            run.max_attempts,
            run.success_attempt.map_or("-".into(), |a| a.to_string()),
        );
        if let Some(w) = &run.wait {
            println!(
                "  waits for {} until {} (then {})",
                w.signal
                    .as_ref()
                    .map_or("a timer".to_owned(), |s| format!("signal {s}")),
                w.until,
                w.on_timeout
            );
        }
        if let Some(e) = &run.last_error {
            println!("  last error: {e}");
        }
        for a in &run.attempts_history {
            println!(
                "  attempt {:>3} {:<9} worker {} started {} finished {}{}{}{}",
                a.attempt,
                a.outcome,
                a.worker_id,
                a.started_at,
                a.finished_at.map_or("-".into(), |f| f.to_string()),
                a.lease_expires_at
                    .map_or(String::new(), |l| format!(" lease {l}")),
                a.upstream_attempt
                    .map_or(String::new(), |u| format!(" upstream attempt {u}")),
                a.error
                    .as_ref()
                    .map_or(String::new(), |e| format!(" error: {e}")),
            );
        }
    }
    for s in pipeline.stages() {
        // A child runs the child stages only, any other item the rest.
        let per_child = matches!(pipeline.role(s.name()), StageRole::Child { .. });
        if per_child == t.child_of.is_some() && t.stages.iter().all(|r| &r.stage != s.name()) {
            println!("\n{}: not started", s.name());
        }
    }
    if let Some(c) = &t.child_of {
        println!(
            "\nchild {:?} (position {}) of item {}, fan-out {} attempt {}{}",
            c.key,
            c.position,
            c.parent,
            c.stage,
            c.attempt,
            if c.superseded {
                ", superseded by a rerun of the fan-out"
            } else {
                ""
            }
        );
    }
    for f in &t.fan_outs {
        println!(
            "\nfan-out {} attempt {}: {}/{} children final{}{}, gathered by {}",
            f.stage,
            f.attempt,
            f.final_children,
            f.children.len(),
            f.completed_at
                .map_or(String::new(), |at| format!(", complete {at}")),
            f.superseded_at
                .map_or(String::new(), |at| format!(", superseded {at}")),
            f.gather_stage,
        );
        for c in &f.children {
            println!(
                "  {} {:<20} {}",
                c.item,
                c.key,
                match (&c.outcome, &c.final_stage) {
                    (Some(o), Some(s)) => format!("{o} ({s})"),
                    (Some(o), None) => o.clone(),
                    _ => "not final".into(),
                }
            );
        }
    }
    println!("\njobs:");
    if t.jobs.is_empty() {
        println!("  none");
    }
    for j in &t.jobs {
        println!(
            "  {} {:<12} {:<9} deliveries {} retries {}/{} next run {}{}{}",
            j.id,
            j.queue,
            j.state,
            j.attempt,
            j.retry_count,
            j.retry_limit,
            j.start_after,
            j.lease_expires_at
                .map_or(String::new(), |l| format!(" lease {l}")),
            j.last_error
                .as_ref()
                .map_or(String::new(), |e| format!(" error: {e}")),
        );
    }
}

pub async fn retry(db: &super::Db, args: RetryArgs, team: Pipeline) -> anyhow::Result<ExitCode> {
    let pipeline = team;
    let stage = args
        .stage
        .as_deref()
        .map(|s| super::known::stage(&pipeline, s))
        .transpose()?;
    let flag_actor = args.actor.as_deref().map(Actor::parse).transpose()?;
    let Some((tenant, item)) = one_item(args.tenant.as_deref(), args.item.as_deref(), &args.bulk)?
    else {
        return super::bulk::run(
            db,
            BulkAction::Retry,
            args.tenant.as_deref(),
            stage,
            &args.bulk,
            flag_actor,
            args.json,
            &pipeline,
        )
        .await;
    };
    let mut conn = db.connect().await?;
    let actor = actor(flag_actor, &mut conn).await?;
    let outcome = ops::retry(&mut conn, &tenant, &item, stage.as_ref(), &actor, &pipeline).await?;
    if args.json {
        let mut value = serde_json::to_value(&outcome)?;
        value["tenant"] = serde_json::json!(tenant);
        value["item"] = serde_json::json!(item);
        value["actor"] = serde_json::json!(actor);
        println!("{value}");
    } else {
        match &outcome {
            RetryOutcome::Retried { stages } => {
                for s in stages {
                    let job = match &s.job {
                        SendResult::Sent(id) => format!("job {id}"),
                        SendResult::Duplicate => "its live job".into(),
                    };
                    println!(
                        "retried {} of item {item}: attempts {}/{}, {job}",
                        s.stage, s.attempts, s.max_attempts
                    );
                }
            }
            RetryOutcome::NothingToRetry {
                stage: Some(stage),
                status,
            } => println!(
                "nothing to retry: stage {stage} is {} ({})",
                status.map_or("-".into(), |s| s.to_string()),
                what_runs_it_again(*status)
            ),
            RetryOutcome::NothingToRetry { stage: None, .. } => {
                println!("nothing to retry: item {item} has no dead stage")
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn cancel(db: &super::Db, args: CancelArgs, team: Pipeline) -> anyhow::Result<ExitCode> {
    let pipeline = team;
    let stage = args
        .stage
        .as_deref()
        .map(|s| super::known::stage(&pipeline, s))
        .transpose()?;
    let flag_actor = args.actor.as_deref().map(Actor::parse).transpose()?;
    let Some((tenant, item)) = one_item(args.tenant.as_deref(), args.item.as_deref(), &args.bulk)?
    else {
        return super::bulk::run(
            db,
            BulkAction::Cancel,
            args.tenant.as_deref(),
            stage,
            &args.bulk,
            flag_actor,
            args.json,
            &pipeline,
        )
        .await;
    };
    if stage.is_some() {
        return Err(super::BadInput(
            "--stage filters the items of a bulk cancel: an item's cancel ends all its stages"
                .into(),
        )
        .into());
    }
    let mut conn = db.connect().await?;
    let actor = actor(flag_actor, &mut conn).await?;
    let outcome = ops::cancel(&mut conn, &tenant, &item, &actor).await?;
    if args.json {
        let mut value = serde_json::to_value(&outcome)?;
        value["tenant"] = serde_json::json!(tenant);
        value["item"] = serde_json::json!(item);
        value["actor"] = serde_json::json!(actor);
        println!("{value}");
    } else {
        match &outcome {
            CancelOutcome::Cancelled {
                stages,
                jobs,
                children,
            } => {
                for s in stages {
                    println!("cancelled stage {} (was {})", s.stage, s.from);
                }
                for j in jobs {
                    println!("cancelled job {} on {} (was {})", j.id, j.queue, j.state);
                }
                for c in children {
                    for s in &c.stages {
                        println!(
                            "cancelled child {} stage {} (was {})",
                            c.item, s.stage, s.from
                        );
                    }
                    for j in &c.jobs {
                        println!(
                            "cancelled child {} job {} on {} (was {})",
                            c.item, j.id, j.queue, j.state
                        );
                    }
                }
            }
            CancelOutcome::NothingToCancel => {
                println!("nothing to cancel: every stage of item {item} is final")
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn rerun(db: &super::Db, args: RerunArgs, team: Pipeline) -> anyhow::Result<ExitCode> {
    let pipeline = team;
    let stage = super::known::stage(&pipeline, &args.stage)?;
    let flag_actor = args.actor.as_deref().map(Actor::parse).transpose()?;
    let Some((tenant, item)) = one_item(args.tenant.as_deref(), args.item.as_deref(), &args.bulk)?
    else {
        return super::bulk::run(
            db,
            BulkAction::Rerun,
            args.tenant.as_deref(),
            Some(stage),
            &args.bulk,
            flag_actor,
            args.json,
            &pipeline,
        )
        .await;
    };
    let mut conn = db.connect().await?;
    let actor = actor(flag_actor, &mut conn).await?;
    let outcome = ops::rerun(&mut conn, &tenant, &item, &stage, &actor, &pipeline).await?;
    if args.json {
        let mut value = serde_json::to_value(&outcome)?;
        value["tenant"] = serde_json::json!(tenant);
        value["item"] = serde_json::json!(item);
        value["actor"] = serde_json::json!(actor);
        println!("{value}");
    } else {
        match &outcome {
            RerunOutcome::Rerun {
                stage,
                from,
                attempts,
                invalidated,
                job,
                ..
            } => {
                let job = match job {
                    SendResult::Sent(id) => format!("job {id}"),
                    SendResult::Duplicate => "its live job".into(),
                };
                println!(
                    "rerun {stage} of item {item} (was {from} after {attempts} attempts), \
                     {invalidated} stages after it invalidated, {job}"
                );
            }
            RerunOutcome::NothingToRerun { stage, status } => println!(
                "nothing to rerun: stage {stage} is {status} ({})",
                what_runs_it_again(Some(*status))
            ),
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn signal(db: &super::Db, args: SignalArgs, team: Pipeline) -> anyhow::Result<ExitCode> {
    let pipeline = team;
    let (tenant, item) = ids(&args.tenant, &args.item)?;
    let stage = super::known::stage(&pipeline, &args.stage)?;
    let name = StageName::parse(&args.signal).map_err(|_| {
        super::BadInput(format!(
            "invalid signal name {:?}: expected [a-z][a-z0-9_]{{0,62}}",
            args.signal
        ))
    })?;
    let text = match (&args.payload, &args.payload_file) {
        (Some(text), _) => Some(text.clone()),
        (None, Some(path)) => Some(
            std::fs::read_to_string(path)
                .map_err(|e| super::BadInput(format!("--payload-file {}: {e}", path.display())))?,
        ),
        (None, None) => None,
    };
    let payload: serde_json::Value = match text {
        Some(text) => serde_json::from_str(&text)
            .map_err(|e| super::BadInput(format!("the payload is not JSON: {e}")))?,
        None => serde_json::Value::Null,
    };
    let flag_actor = args.actor.as_deref().map(Actor::parse).transpose()?;
    let mut conn = db.connect().await?;
    let actor = actor(flag_actor, &mut conn).await?;
    let outcome = ops::signal(
        &mut conn, &tenant, &item, &stage, &name, &payload, &actor, &pipeline,
    )
    .await?;
    if args.json {
        let mut value = serde_json::to_value(&outcome)?;
        value["tenant"] = serde_json::json!(tenant);
        value["item"] = serde_json::json!(item);
        value["stage"] = serde_json::json!(stage);
        value["signal"] = serde_json::json!(name);
        println!("{value}");
    } else {
        match &outcome {
            SignalOutcome::Delivered { attempt, job, .. } => {
                let job = match job {
                    SendResult::Sent(id) => format!("job {id}"),
                    SendResult::Duplicate => "its live job".into(),
                };
                println!(
                    "signal {name} delivered to {stage} of item {item} (it waited after attempt {attempt}); {job}"
                );
            }
            SignalOutcome::AlreadyDelivered {
                delivered_at,
                actor,
            } => println!(
                "signal {name} was delivered already (by {actor} at {delivered_at}): nothing changed"
            ),
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn dead(db: &super::Db, args: DeadArgs, team: Pipeline) -> anyhow::Result<ExitCode> {
    let pipeline = team;
    let filter = DeadFilter {
        tenant: args.tenant.as_deref().map(TenantId::parse).transpose()?,
        stage: args
            .stage
            .as_deref()
            .map(|s| super::known::stage(&pipeline, s))
            .transpose()?,
        limit: Some(args.limit),
    };
    let mut conn = db.connect().await?;
    // An unknown filter is refused, not answered with an empty list that looks
    // like "no dead letters".
    if let Some(tenant) = &filter.tenant {
        super::known::tenant(&mut conn, tenant).await?;
    }
    let letters = ops::dead(&mut conn, &filter).await?;
    if args.json {
        println!("{}", serde_json::to_value(&letters)?);
    } else {
        println!(
            "{:<16} {:<26} {:<14} {:>8}  last error",
            "tenant", "item", "stage", "attempts"
        );
        for d in &letters.stages {
            println!(
                "{:<16} {:<26} {:<14} {:>8}  {}",
                d.tenant.as_str(),
                d.item.to_string(),
                d.stage.as_str(),
                format!("{}/{}", d.attempts, d.max_attempts),
                d.last_error.as_deref().unwrap_or("-")
            );
        }
        if !letters.jobs.is_empty() {
            println!("\nfailed jobs:");
            for j in &letters.jobs {
                println!(
                    "{} {:<14} tenant {} item {} retries {}: {}",
                    j.id,
                    j.queue,
                    j.tenant.as_deref().unwrap_or("-"),
                    j.item.as_deref().unwrap_or("-"),
                    j.retry_count,
                    j.last_error.as_deref().unwrap_or("-")
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
