//! The console's POSTs: retry, cancel, signal (through `idemstage::ops`,
//! which records the actor in `audit_log`), pause and resume (through
//! `idemstage::queue`). Each checks, in this order: read-only mode
//! (403), the form (413 / 400), its CSRF token (403), its ids (400 / 404); only
//! then does it write.

use axum::extract::rejection::FormRejection;
use axum::extract::{Form, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Extension;
use idemstage::ops::{self, CancelOutcome, RetryOutcome};
use idemstage::queue::{self, PauseOutcome, ResumeOutcome, Scope};
use idemstage::{ids::ItemId, ids::TenantId, queue::SendResult};
use serde::Deserialize;

use super::auth::{check_csrf, Principal};
use super::pages::{done_page, item_href, known_stage, known_tenant, PageError};
use super::Shared;

#[derive(Deserialize)]
pub(crate) struct ActionForm {
    csrf: Option<String>,
    tenant: Option<String>,
    item: Option<String>,
    stage: Option<String>,
    signal: Option<String>,
    payload: Option<String>,
}

fn field(value: &Option<String>) -> Option<&str> {
    value.as_deref().map(str::trim).filter(|v| !v.is_empty())
}

/// Read-only mode, the form, its CSRF token: what every action checks first.
fn admit(
    console: &Shared,
    principal: &Principal,
    form: Result<Form<ActionForm>, FormRejection>,
) -> Result<ActionForm, PageError> {
    if console.read_only {
        return Err(PageError::new(
            StatusCode::FORBIDDEN,
            "Read-only",
            "This console runs with --read-only: it changes nothing.",
        ));
    }
    let Form(form) = form.map_err(PageError::from_form)?;
    check_csrf(principal, form.csrf.as_deref())?;
    Ok(form)
}

fn ids(form: &ActionForm) -> Result<(TenantId, ItemId), PageError> {
    let (Some(tenant), Some(item)) = (field(&form.tenant), field(&form.item)) else {
        return Err(PageError::bad_request(
            "The form needs a tenant and an item. Nothing was changed.",
        ));
    };
    Ok((TenantId::parse(tenant)?, ItemId::parse(item)?))
}

pub(crate) async fn retry(
    State(console): State<Shared>,
    Extension(p): Extension<Principal>,
    form: Result<Form<ActionForm>, FormRejection>,
) -> Result<Response, PageError> {
    let form = admit(&console, &p, form)?;
    let (tenant, item) = ids(&form)?;
    let stage = field(&form.stage)
        .map(|s| known_stage(&console, s))
        .transpose()?;
    let mut conn = idemstage::db::get(&console.pool).await?;
    let outcome = ops::retry(
        &mut conn,
        &tenant,
        &item,
        stage.as_ref(),
        &p.actor,
        &console.pipeline,
    )
    .await?;
    drop(conn);
    tracing::info!(actor = %p.actor, %tenant, %item, ?stage, "console: retry");
    let back = (item_href(&tenant, &item), "The item");
    let (title, lines) = match &outcome {
        RetryOutcome::Retried { stages } => (
            "Retried",
            stages
                .iter()
                .map(|s| {
                    let job = match &s.job {
                        SendResult::Sent(id) => format!("job {id}"),
                        SendResult::Duplicate => "its live job".into(),
                    };
                    format!(
                        "retried stage {} of item {item} (tenant {tenant}): attempts {}/{}, {job}",
                        s.stage, s.attempts, s.max_attempts
                    )
                })
                .collect(),
        ),
        RetryOutcome::NothingToRetry {
            stage: Some(stage),
            status,
        } => (
            "Nothing to retry",
            vec![format!(
                "stage {stage} of item {item} (tenant {tenant}) is {}: {}",
                status.map_or("-".into(), |s| s.to_string()),
                crate::cli::ops::what_runs_it_again(*status)
            )],
        ),
        RetryOutcome::NothingToRetry { stage: None, .. } => (
            "Nothing to retry",
            vec![format!("item {item} (tenant {tenant}) has no dead stage")],
        ),
    };
    Ok(done_page(&console, &p, title, &lines, Some(back)))
}

pub(crate) async fn cancel(
    State(console): State<Shared>,
    Extension(p): Extension<Principal>,
    form: Result<Form<ActionForm>, FormRejection>,
) -> Result<Response, PageError> {
    let form = admit(&console, &p, form)?;
    let (tenant, item) = ids(&form)?;
    let mut conn = idemstage::db::get(&console.pool).await?;
    let outcome = ops::cancel(&mut conn, &tenant, &item, &p.actor).await?;
    drop(conn);
    tracing::info!(actor = %p.actor, %tenant, %item, "console: cancel");
    let (title, lines) =
        match &outcome {
            CancelOutcome::Cancelled {
                stages,
                jobs,
                children,
            } => (
                "Cancelled",
                stages
                    .iter()
                    .map(|s| format!("cancelled stage {} (was {})", s.stage, s.from))
                    .chain(jobs.iter().map(|j| {
                        format!("cancelled job {} on {} (was {})", j.id, j.queue, j.state)
                    }))
                    .chain(children.iter().map(|c| {
                        format!(
                            "cancelled child {} ({} stages, {} jobs)",
                            c.item,
                            c.stages.len(),
                            c.jobs.len()
                        )
                    }))
                    .collect::<Vec<_>>(),
            ),
            CancelOutcome::NothingToCancel => (
                "Nothing to cancel",
                vec![format!(
                    "every stage of item {item} (tenant {tenant}) is final"
                )],
            ),
        };
    Ok(done_page(
        &console,
        &p,
        title,
        &lines,
        Some((item_href(&tenant, &item), "The item")),
    ))
}

pub(crate) async fn signal(
    State(console): State<Shared>,
    Extension(p): Extension<Principal>,
    form: Result<Form<ActionForm>, FormRejection>,
) -> Result<Response, PageError> {
    let form = admit(&console, &p, form)?;
    let (tenant, item) = ids(&form)?;
    let (Some(stage), Some(name)) = (field(&form.stage), field(&form.signal)) else {
        return Err(PageError::bad_request(
            "The form needs a stage and a signal. Nothing was changed.",
        ));
    };
    let stage = known_stage(&console, stage)?;
    let name = idemstage::ids::StageName::parse(name)?;
    let payload: serde_json::Value = match field(&form.payload) {
        Some(text) => serde_json::from_str(text).map_err(|e| {
            PageError::bad_request(format!(
                "The payload is not JSON ({e}). Nothing was changed."
            ))
        })?,
        None => serde_json::Value::Null,
    };
    let mut conn = idemstage::db::get(&console.pool).await?;
    let outcome = ops::signal(
        &mut conn,
        &tenant,
        &item,
        &stage,
        &name,
        &payload,
        &p.actor,
        &console.pipeline,
    )
    .await?;
    drop(conn);
    tracing::info!(actor = %p.actor, %tenant, %item, %stage, signal = %name, "console: signal");
    let (title, line) = match &outcome {
        ops::SignalOutcome::Delivered { .. } => (
            "Delivered",
            format!("signal {name} delivered to stage {stage} of item {item}: it runs again"),
        ),
        ops::SignalOutcome::AlreadyDelivered {
            delivered_at,
            actor,
        } => (
            "Delivered already",
            format!("signal {name} was delivered by {actor} at {delivered_at}: nothing changed"),
        ),
    };
    Ok(done_page(
        &console,
        &p,
        title,
        &[line],
        Some((item_href(&tenant, &item), "The item")),
    ))
}

async fn pause_or_resume(
    console: Shared,
    p: Principal,
    form: Result<Form<ActionForm>, FormRejection>,
    pause: bool,
) -> Result<Response, PageError> {
    let form = admit(&console, &p, form)?;
    let Some(stage) = field(&form.stage) else {
        return Err(PageError::bad_request(
            "The form needs a stage. Nothing was changed.",
        ));
    };
    let stage = known_stage(&console, stage)?;
    let scope = match field(&form.tenant) {
        Some(t) => Scope::Tenant(known_tenant(&console, t).await?),
        None => Scope::Queue,
    };
    let mut conn = idemstage::db::get(&console.pool).await?;
    let (title, changed) = if pause {
        match queue::pause(&mut conn, stage.as_str(), &scope, &p.actor).await? {
            PauseOutcome::Paused => ("Paused", true),
            PauseOutcome::AlreadyPaused => ("Already paused", false),
        }
    } else {
        match queue::resume(&mut conn, stage.as_str(), &scope, &p.actor).await? {
            ResumeOutcome::Resumed => ("Resumed", true),
            ResumeOutcome::NotPaused => ("Not paused", false),
        }
    };
    drop(conn);
    // Recorded in queue_control_changes with the session's actor; logged too.
    tracing::info!(actor = %p.actor, stage = %stage, %scope, pause, changed, "console: pause/resume");
    let line = format!("stage {stage}, {scope}: {}", title.to_lowercase());
    Ok(done_page(
        &console,
        &p,
        title,
        &[line],
        Some(("/".to_owned(), "The overview")),
    ))
}

pub(crate) async fn pause(
    State(console): State<Shared>,
    Extension(p): Extension<Principal>,
    form: Result<Form<ActionForm>, FormRejection>,
) -> Result<Response, PageError> {
    pause_or_resume(console, p, form, true).await
}

pub(crate) async fn resume(
    State(console): State<Shared>,
    Extension(p): Extension<Principal>,
    form: Result<Form<ActionForm>, FormRejection>,
) -> Result<Response, PageError> {
    pause_or_resume(console, p, form, false).await
}
