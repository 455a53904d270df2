//! The console's bulk actions: `GET /bulk` previews what a rerun, retry or
//! cancel over a filter would select (counts by tenant and state, nothing
//! changed) and shows a bulk action's progress (`?id=`); `POST /actions/bulk`
//! starts it (the same checks as every action first) and runs it in the
//! background, batch by batch, as `idemstage rerun|retry|cancel` does; a run
//! the console did not finish (it stopped) goes on with `--resume`.

use axum::extract::rejection::{FormRejection, QueryRejection};
use axum::extract::{Form, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use idemstage::ids::BulkId;
use idemstage::ops::{self, BulkAction, BulkFilter, BulkPreview, BulkProgress};
use maud::html;
use serde::Deserialize;

use super::auth::{check_csrf, Principal};
use super::pages::{csrf_field, done_page, known_stage, known_tenant, layout, PageError};
use super::Shared;

/// The fields of the bulk form, as the query of `GET /bulk` and the body of
/// `POST /actions/bulk`.
#[derive(Deserialize, Default)]
pub(crate) struct BulkForm {
    csrf: Option<String>,
    id: Option<String>,
    action: Option<String>,
    tenant: Option<String>,
    stage: Option<String>,
    status: Option<String>,
    since: Option<String>,
    until: Option<String>,
}

fn field(value: &Option<String>) -> Option<&str> {
    value.as_deref().map(str::trim).filter(|v| !v.is_empty())
}

/// The action and filter of the form (400/404 for bad ones), or `None` when the
/// form names no filter yet.
async fn parsed(
    console: &Shared,
    form: &BulkForm,
) -> Result<Option<(BulkAction, BulkFilter)>, PageError> {
    let any = [
        &form.tenant,
        &form.stage,
        &form.status,
        &form.since,
        &form.until,
    ]
    .iter()
    .any(|f| field(f).is_some());
    if !any {
        return Ok(None);
    }
    let action: BulkAction = field(&form.action).unwrap_or("rerun").parse()?;
    let time = |name: &str, v: Option<&str>| v.map(|v| BulkFilter::parse_time(name, v)).transpose();
    let filter = BulkFilter {
        tenant: match field(&form.tenant) {
            Some(t) => Some(known_tenant(console, t).await?),
            None => None,
        },
        stage: field(&form.stage)
            .map(|s| known_stage(console, s))
            .transpose()?,
        statuses: field(&form.status)
            .map(BulkFilter::parse_statuses)
            .transpose()?
            .unwrap_or_default(),
        since: time("since", field(&form.since))?,
        until: time("until", field(&form.until))?,
        items: None,
    };
    filter.check(action)?;
    Ok(Some((action, filter)))
}

fn value(v: &Option<String>) -> &str {
    v.as_deref().map(str::trim).unwrap_or("")
}

pub(crate) async fn page(
    State(console): State<Shared>,
    Extension(p): Extension<Principal>,
    query: Result<Query<BulkForm>, QueryRejection>,
) -> Result<Response, PageError> {
    let Query(q) = query.map_err(PageError::from_query)?;
    let mut conn = idemstage::db::get(&console.pool).await?;
    if let Some(id) = field(&q.id) {
        let progress = ops::bulk_progress(&mut conn, &BulkId::parse(id)?).await?;
        drop(conn);
        return Ok(progress_page(&console, &p, &progress));
    }
    let request = parsed(&console, &q).await?;
    let preview = match &request {
        Some((action, filter)) => Some(ops::preview(&mut conn, *action, filter).await?),
        None => None,
    };
    drop(conn);
    let ro = console.read_only;
    let action = value(&q.action);
    let body = html! {
        section {
            h2 { "Many items at once" }
            p { "Rerun a stage (and what follows it), retry, or cancel every item a filter selects. "
                "A filter names a tenant or a time the items were registered from." }
            form #bulk-filter method="get" action="/bulk" {
                label { "Action "
                    select name="action" {
                        @for a in ["rerun", "retry", "cancel"] {
                            option value=(a) selected[action == a] { (a) }
                        }
                    }
                }
                label { "Tenant " input type="text" name="tenant" value=(value(&q.tenant)) maxlength="63"; }
                label { "Stage " input type="text" name="stage" value=(value(&q.stage)) maxlength="63"; }
                label { "Status " input type="text" name="status" value=(value(&q.status)) placeholder="success,dead" maxlength="100"; }
                label { "Since " input type="text" name="since" value=(value(&q.since)) placeholder="2026-11-27T00:00:00Z" maxlength="40"; }
                label { "Until " input type="text" name="until" value=(value(&q.until)) maxlength="40"; }
                button #bulk-preview type="submit" { "Preview" }
            }
            @if let Some(preview) = &preview {
                (preview_table(preview))
                @if !ro && preview.eligible > 0 {
                    form.inline method="post" action="/actions/bulk" {
                        (csrf_field(&p))
                        @for (name, v) in [("action", preview.action.as_str()), ("tenant", value(&q.tenant)),
                                           ("stage", value(&q.stage)), ("status", value(&q.status)),
                                           ("since", value(&q.since)), ("until", value(&q.until))] {
                            input type="hidden" name=(name) value=(v);
                        }
                        button #bulk-run class="danger" type="submit" {
                            (preview.action.as_str()) " " (preview.selected) " items"
                        }
                    }
                }
            }
        }
    };
    Ok(layout("Many items", Some(&p), ro, body).into_response())
}

fn preview_table(preview: &BulkPreview) -> maud::Markup {
    html! {
        table #bulk-groups {
            thead { tr { th { "tenant" } th { "state" } th.num { "items" } } }
            tbody {
                @for g in &preview.groups {
                    tr { td.tenant { (g.tenant.as_str()) } td { (g.state) } td.num { (g.items) } }
                }
            }
        }
        p #bulk-counts {
            (preview.selected) " items selected, " (preview.eligible)
            " to " (preview.action.as_str()) " as things stand."
        }
    }
}

fn progress_page(console: &Shared, p: &Principal, progress: &BulkProgress) -> Response {
    let body = html! {
        section {
            h2 { "Bulk " (progress.action.as_str()) " " code { (progress.id.to_string()) } }
            p #bulk-progress {
                (progress.selected) " items taken in " (progress.batches) " batches, "
                (progress.acted) " acted on; "
                @match &progress.finished_at {
                    Some(at) => { "finished " (at.format("%Y-%m-%d %H:%M:%S UTC")) "." }
                    None => { "running (reload to follow; if the console stopped, go on with "
                              code { "idemstage " (progress.action.as_str()) " --resume " (progress.id.to_string()) }
                              ")." }
                }
            }
            p { "Started by " (progress.actor) ", " (progress.batch_size) " items per batch." }
        }
    };
    layout("Bulk action", Some(p), console.read_only, body).into_response()
}

pub(crate) async fn start(
    State(console): State<Shared>,
    Extension(p): Extension<Principal>,
    form: Result<Form<BulkForm>, FormRejection>,
) -> Result<Response, PageError> {
    if console.read_only {
        return Err(PageError::new(
            axum::http::StatusCode::FORBIDDEN,
            "Read-only",
            "This console runs with --read-only: it changes nothing.",
        ));
    }
    let Form(form) = form.map_err(PageError::from_form)?;
    check_csrf(&p, form.csrf.as_deref())?;
    let Some((action, filter)) = parsed(&console, &form).await? else {
        return Err(PageError::bad_request(
            "The form needs a filter: a tenant or a time. Nothing was changed.",
        ));
    };
    let mut conn = idemstage::db::get(&console.pool).await?;
    let started = ops::start_bulk(&mut conn, action, &filter, &p.actor, 100).await?;
    drop(conn);
    tracing::info!(actor = %p.actor, bulk = %started.id, %action, "console: bulk action started");
    let (task_console, id, actor) = (console.clone(), started.id, p.actor.clone());
    // In the background: the page answers now and the progress page follows
    // the record.
    tokio::spawn(async move {
        let result = match idemstage::db::get(&task_console.pool).await {
            Ok(mut conn) => {
                ops::run_bulk(&mut conn, &id, &actor, &task_console.pipeline, |_| {}).await
            }
            Err(e) => Err(e.into()),
        };
        match result {
            Ok(done) => tracing::info!(bulk = %id, acted = done.acted, "console: bulk action done"),
            Err(e) => tracing::error!(bulk = %id, error = %e, "console: bulk action stopped"),
        }
    });
    Ok(done_page(
        &console,
        &p,
        "Started",
        &[format!("bulk {action} {} started", started.id)],
        Some((format!("/bulk?id={}", started.id), "Its progress")),
    ))
}
