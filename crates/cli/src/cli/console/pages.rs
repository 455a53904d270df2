//! The console's pages (maud: every interpolated value is HTML-escaped) and its
//! error page.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use axum::extract::rejection::{FormRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use chrono::{DateTime, Utc};
use idemstage::ops::{self, DeadFilter, ItemTimeline, OpsError};
use idemstage::pipeline::StageRole;
use idemstage::queue::{self, Scope};
use idemstage::report;
use idemstage::{
    db::RepoError, ids::DomainError, ids::ItemId, ids::StageName, ids::TenantId, runs::RunStatus,
};
use maud::{html, Markup, DOCTYPE};
use serde::Deserialize;

use super::auth::Principal;
use super::Shared;

/// The window of the overview's throughput column.
pub const THROUGHPUT_WINDOW: Duration = Duration::from_secs(60);

/// An error page: a 4xx for the request's fault (nothing was changed), 503
/// when the database is unavailable, 500 otherwise.
#[derive(Debug)]
pub(crate) struct PageError {
    status: StatusCode,
    title: String,
    detail: String,
}

impl PageError {
    pub fn new(status: StatusCode, title: &str, detail: &str) -> Self {
        Self {
            status,
            title: title.to_owned(),
            detail: detail.to_owned(),
        }
    }

    pub fn bad_request(detail: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            title: "Bad request".into(),
            detail: detail.into(),
        }
    }

    pub fn from_form(e: FormRejection) -> Self {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            return Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "Form too large",
                &format!(
                    "The console accepts forms of at most {} bytes. Nothing was changed.",
                    super::MAX_BODY_BYTES
                ),
            );
        }
        Self::bad_request(format!(
            "The form could not be read: {}. Nothing was changed.",
            e.body_text()
        ))
    }

    pub fn from_query(e: QueryRejection) -> Self {
        Self::bad_request(format!(
            "The query string could not be read: {}",
            e.body_text()
        ))
    }
}

impl From<OpsError> for PageError {
    fn from(e: OpsError) -> Self {
        let status = match &e {
            OpsError::ItemNotFound { .. }
            | OpsError::UnknownStage(_)
            | OpsError::StageNotStarted { .. }
            | OpsError::BulkNotFound(_) => StatusCode::NOT_FOUND,
            OpsError::RetryRefused { .. }
            | OpsError::RerunRefused { .. }
            | OpsError::SignalRefused { .. } => StatusCode::CONFLICT,
            OpsError::Invalid(_) => StatusCode::BAD_REQUEST,
            OpsError::Repo(repo) => return repo_status(repo, e.to_string()),
        };
        Self {
            status,
            title: status.canonical_reason().unwrap_or("Error").to_owned(),
            detail: format!("{e}. Nothing was changed."),
        }
    }
}

fn repo_status(repo: &RepoError, text: String) -> PageError {
    let status = if matches!(repo, RepoError::ItemNotFound { .. }) {
        StatusCode::NOT_FOUND
    } else if repo.is_bad_request() {
        StatusCode::BAD_REQUEST
    } else if repo.is_retryable() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::INTERNAL_SERVER_ERROR
    };
    if status.is_server_error() {
        tracing::warn!(error = %text, "console: database error");
    }
    PageError {
        status,
        title: status.canonical_reason().unwrap_or("Error").to_owned(),
        detail: text,
    }
}

impl From<RepoError> for PageError {
    fn from(e: RepoError) -> Self {
        let text = e.to_string();
        repo_status(&e, text)
    }
}

impl From<DomainError> for PageError {
    fn from(e: DomainError) -> Self {
        Self::bad_request(format!("{e}. Nothing was changed."))
    }
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        error_page(self.status, &self.title, &self.detail)
    }
}

/// A page of its own for an error (no navigation: it may be shown to a request
/// without the token).
pub(crate) fn error_page(status: StatusCode, title: &str, detail: &str) -> Response {
    let body = html! {
        section.error {
            h2 { (status.as_u16()) " " (title) }
            p #error-detail { (detail) }
            p { a href="/" { "Back to the overview" } }
        }
    };
    (status, layout(title, None, false, body)).into_response()
}

pub(crate) async fn not_found() -> Response {
    error_page(StatusCode::NOT_FOUND, "Not found", "There is no such page.")
}

pub(crate) async fn stylesheet() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("console.css"),
    )
        .into_response()
}

/// The frame of every page: the title, the navigation (for a principal), the
/// body.
pub(crate) fn layout(
    title: &str,
    principal: Option<&Principal>,
    read_only: bool,
    body: Markup,
) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " — idemstage console" }
                link rel="stylesheet" href="/console.css";
            }
            body {
                header {
                    h1 { a href="/" { "idemstage console" } }
                    @if let Some(p) = principal {
                        nav {
                            a href="/" { "Overview" }
                            a href="/dead" { "Dead letters" }
                            a href="/bulk" { "Many items" }
                            a href="/item" { "Item" }
                            span.who { (p.actor.as_str()) @if read_only { " · read-only" } }
                            form.inline method="post" action="/logout" {
                                (csrf_field(p))
                                button type="submit" { "Log out" }
                            }
                        }
                    }
                }
                main { (body) }
            }
        }
    }
}

pub(crate) fn csrf_field(p: &Principal) -> Markup {
    html! { input type="hidden" name="csrf" value=(p.csrf); }
}

/// A POST button: a form of hidden fields and the CSRF token.
fn action_button(
    p: &Principal,
    id: &str,
    action: &str,
    fields: &[(&str, &str)],
    label: &str,
    class: &str,
) -> Markup {
    html! {
        form.inline method="post" action=(action) {
            (csrf_field(p))
            @for (name, value) in fields {
                input type="hidden" name=(name) value=(value);
            }
            button #(id) class=(class) type="submit" { (label) }
        }
    }
}

pub(crate) fn login_page(status: StatusCode, message: Option<&str>) -> Response {
    let body = html! {
        section.login {
            h2 { "Log in" }
            @if let Some(m) = message { p.message #login-message { (m) } }
            form method="post" action="/login" {
                label { "Access token " input #token type="password" name="token" autocomplete="current-password" required; }
                label { "Your name (for the audit log, optional) " input #name type="text" name="name" maxlength="64"; }
                button #login type="submit" { "Log in" }
            }
        }
    };
    (status, layout("Log in", None, false, body)).into_response()
}

fn time(t: &DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

fn opt_time(t: &Option<DateTime<Utc>>) -> String {
    t.as_ref().map_or("-".into(), time)
}

fn age(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    match s {
        0 => "-".into(),
        1..=119 => format!("{s} s"),
        120..=7199 => format!("{} min", s / 60),
        _ => format!("{} h", s / 3600),
    }
}

fn item_link(tenant: &str, item: &str) -> String {
    // Both are slugs and ULIDs (checked when they were written): no escaping needed
    // in a query string beyond what maud does for the attribute.
    format!("/item?tenant={tenant}&item={item}")
}

/// The pipeline's stages in order, then any other stage that has runs.
fn stage_order(console: &Shared, extra: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut stages: Vec<String> = console
        .pipeline
        .stages()
        .iter()
        .map(|s| s.name().as_str().to_owned())
        .collect();
    for s in extra {
        if !stages.contains(&s) {
            stages.push(s);
        }
    }
    stages
}

/// `GET /`: per stage and per (tenant, stage) the counts, the throughput and the
/// queue; pause and resume.
pub(crate) async fn overview(
    State(console): State<Shared>,
    Extension(p): Extension<Principal>,
) -> Result<Response, PageError> {
    let mut conn = idemstage::db::get(&console.pool).await?;
    let rows = report::tenant_stage_overview(&mut conn, THROUGHPUT_WINDOW).await?;
    let stages = stage_order(&console, rows.iter().map(|r| r.stage.clone()));
    let depths = queue::queue_depths(&mut conn, &stages).await?;
    let controls = queue::controls(&mut conn, None).await?;
    let changes = queue::control_changes(&mut conn, None, CONTROL_CHANGES_SHOWN).await?;
    drop(conn);

    let mut counts: HashMap<(&str, &str, &str), i64> = HashMap::new();
    let mut recent: HashMap<(&str, &str), i64> = HashMap::new();
    let mut totals: HashMap<(&str, &str), i64> = HashMap::new();
    let mut recent_totals: HashMap<&str, i64> = HashMap::new();
    let mut tenant_stages: BTreeMap<&str, BTreeSet<usize>> = BTreeMap::new();
    for r in &rows {
        counts.insert((&r.tenant, &r.stage, &r.status), r.count);
        *recent.entry((&r.tenant, &r.stage)).or_default() += r.recent_successes;
        *totals.entry((&r.stage, &r.status)).or_default() += r.count;
        *recent_totals.entry(&r.stage).or_default() += r.recent_successes;
        let index = stages.iter().position(|s| *s == r.stage).unwrap_or(0);
        tenant_stages.entry(&r.tenant).or_default().insert(index);
    }
    let paused = |stage: &str, scope: &Scope| {
        controls
            .iter()
            .any(|c| c.queue == stage && &c.scope == scope && c.paused)
    };
    // Paused tenants without runs of a stage still show up under it.
    for c in controls.iter().filter(|c| c.paused) {
        if let (Scope::Tenant(t), Some(index)) =
            (&c.scope, stages.iter().position(|s| *s == c.queue))
        {
            tenant_stages.entry(t.as_str()).or_default().insert(index);
        }
    }
    let statuses = RunStatus::ALL.map(RunStatus::as_str);
    let ro = console.read_only;
    let body = html! {
        section {
            h2 { "Stages" }
            p.note { "Runs by status over every tenant; successes in the last "
                (THROUGHPUT_WINDOW.as_secs()) " s; the stage's queue now." }
            table #stages {
                thead { tr {
                    th { "stage" }
                    @for s in &statuses { th.num { (s) } }
                    th.num { "successes / min" }
                    th.num { "ready" } th.num { "delayed" } th.num { "active" }
                    th.num { "oldest ready" }
                    th { "fetching" }
                    @if !ro { th { "" } }
                } }
                tbody {
                    @for (i, stage) in stages.iter().enumerate() {
                        @let d = depths.get(i);
                        @let is_paused = paused(stage, &Scope::Queue);
                        tr #{"stage-" (stage)} {
                            th { (stage) }
                            @for s in &statuses {
                                td.num #{"total-" (stage) "-" (s)} { (totals.get(&(stage.as_str(), *s)).copied().unwrap_or(0)) }
                            }
                            td.num #{"rate-" (stage)} { (recent_totals.get(stage.as_str()).copied().unwrap_or(0)) }
                            td.num #{"ready-" (stage)} { (d.map_or(0, |d| d.ready)) }
                            td.num { (d.map_or(0, |d| d.delayed)) }
                            td.num { (d.map_or(0, |d| d.active)) }
                            td.num #{"oldest-" (stage)} { (age(d.map_or(0.0, |d| d.oldest_ready_s))) }
                            td #{"paused-" (stage)} { @if is_paused { span.paused { "paused" } } @else { "running" } }
                            @if !ro {
                                td {
                                    @if is_paused {
                                        (action_button(&p, &format!("resume-{stage}"), "/actions/resume", &[("stage", stage)], "Resume", "resume"))
                                    } @else {
                                        (action_button(&p, &format!("pause-{stage}"), "/actions/pause", &[("stage", stage)], "Pause", "pause"))
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        section {
            h2 { "Tenants" }
            @if tenant_stages.is_empty() { p { "No runs yet." } }
            @else {
                table #tenants {
                    thead { tr {
                        th { "tenant" } th { "stage" }
                        @for s in &statuses { th.num { (s) } }
                        th.num { "successes / min" }
                        th { "fetching" }
                        @if !ro { th { "" } }
                    } }
                    tbody {
                        @for (tenant, indexes) in &tenant_stages {
                            @for i in indexes {
                                @let stage = &stages[*i];
                                @let scope = Scope::Tenant(TenantId::parse(tenant).expect("stored tenants are slugs"));
                                @let is_paused = paused(stage, &scope);
                                tr #{"row-" (tenant) "-" (stage)} {
                                    td.tenant { (tenant) }
                                    td { (stage) }
                                    @for s in &statuses {
                                        td.num #{"count-" (tenant) "-" (stage) "-" (s)} { (counts.get(&(*tenant, stage.as_str(), *s)).copied().unwrap_or(0)) }
                                    }
                                    td.num { (recent.get(&(*tenant, stage.as_str())).copied().unwrap_or(0)) }
                                    td #{"paused-" (stage) "-" (tenant)} { @if is_paused { span.paused { "paused" } } @else { "running" } }
                                    @if !ro {
                                        td {
                                            @if is_paused {
                                                (action_button(&p, &format!("resume-{stage}-{tenant}"), "/actions/resume", &[("stage", stage), ("tenant", tenant)], "Resume", "resume"))
                                            } @else {
                                                (action_button(&p, &format!("pause-{stage}-{tenant}"), "/actions/pause", &[("stage", stage), ("tenant", tenant)], "Pause", "pause"))
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        section {
            h2 { "Control changes" }
            p.note { "The latest " (CONTROL_CHANGES_SHOWN) " pauses, resumes and limits, newest first, with who made them (the actor, and the database user)." }
            @if changes.is_empty() { p #no-changes { "No control was changed yet." } }
            @else {
                table #changes {
                    thead { tr {
                        th { "when" } th { "stage" } th { "scope" } th { "change" } th { "by" } th { "database user" }
                    } }
                    tbody {
                        @for c in &changes {
                            tr #{"change-" (c.id)} {
                                td { (time(&c.changed_at)) }
                                td { (c.queue) }
                                td.tenant { (c.scope) }
                                td.change { (change_text(c)) }
                                td.actor { (c.actor.as_deref().unwrap_or("-")) }
                                td { (c.db_user) }
                            }
                        }
                    }
                }
            }
        }
        (search_form("", ""))
    };
    Ok(layout("Overview", Some(&p), ro, body).into_response())
}

/// How many control changes the overview lists.
const CONTROL_CHANGES_SHOWN: u32 = 10;

/// `pause`, `resume`, `remove`, or the limits a `limits` change set.
fn change_text(c: &queue::ControlChange) -> String {
    c.describe()
}

fn search_form(tenant: &str, item: &str) -> Markup {
    html! {
        section {
            h2 { "Find an item" }
            form #search method="get" action="/item" {
                label { "Tenant " input #search-tenant type="text" name="tenant" value=(tenant) maxlength="63" required; }
                label { "Item " input #search-item type="text" name="item" value=(item) maxlength="26" size="28" required; }
                button #search-go type="submit" { "Show" }
            }
        }
    }
}

#[derive(Deserialize)]
pub(crate) struct ItemQuery {
    tenant: Option<String>,
    item: Option<String>,
}

/// `GET /item?tenant=T&item=A`: the timeline; without both, the search.
pub(crate) async fn item(
    State(console): State<Shared>,
    Extension(p): Extension<Principal>,
    query: Result<Query<ItemQuery>, QueryRejection>,
) -> Result<Response, PageError> {
    let Query(q) = query.map_err(PageError::from_query)?;
    let tenant = q.tenant.as_deref().map(str::trim).unwrap_or("");
    let item = q.item.as_deref().map(str::trim).unwrap_or("");
    if tenant.is_empty() && item.is_empty() {
        let body = search_form("", "");
        return Ok(layout("Item", Some(&p), console.read_only, body).into_response());
    }
    if tenant.is_empty() || item.is_empty() {
        return Err(PageError::bad_request(
            "Give both the tenant and the item id.",
        ));
    }
    let tenant = TenantId::parse(tenant)?;
    let item = ItemId::parse(item)?;
    let mut conn = idemstage::db::get(&console.pool).await?;
    let mut t = ops::inspect(&mut conn, &tenant, &item).await?;
    drop(conn);
    let order = |s: &StageName| {
        console
            .pipeline
            .stages()
            .iter()
            .position(|p| p.name() == s)
            .unwrap_or(usize::MAX)
    };
    t.stages.sort_by_key(|s| order(&s.stage));
    let body = timeline(&console, &p, &t);
    Ok(layout(&format!("Item {item}"), Some(&p), console.read_only, body).into_response())
}

fn timeline(console: &Shared, p: &Principal, t: &ItemTimeline) -> Markup {
    let tenant = t.tenant.as_str();
    let item = t.item.to_string();
    // A parent's cancel cancels its unfinished children and a gather not run.
    let children_open = t.fan_outs.iter().any(|f| {
        f.superseded_at.is_none()
            && (f.children.iter().any(|c| c.outcome.is_none())
                || t.stages.iter().all(|r| r.stage != f.gather_stage))
    });
    let cancellable = t.stages.iter().any(|s| !s.status.is_final())
        || children_open
        || t.jobs
            .iter()
            .any(|j| matches!(j.state.as_str(), "created" | "retry" | "active"));
    // A child runs the child stages only, any other item the rest.
    let not_started: Vec<&str> = console
        .pipeline
        .stages()
        .iter()
        .map(|s| s.name())
        .filter(|name| {
            matches!(console.pipeline.role(name), StageRole::Child { .. }) == t.child_of.is_some()
        })
        .map(|name| name.as_str())
        .filter(|name| t.stages.iter().all(|r| r.stage.as_str() != *name))
        .collect();
    let ro = console.read_only;
    html! {
        section {
            h2 { "Item " code #item-id { (item) } " of tenant " span.tenant #item-tenant { (tenant) } }
            p { "input sha256 " code { (t.input_sha256) } ", registered " (time(&t.created_at)) ", read " (time(&t.read_at)) }
            @if !ro && cancellable {
                (action_button(p, &format!("cancel-{tenant}-{item}"), "/actions/cancel", &[("tenant", tenant), ("item", &item)], "Cancel this item", "danger"))
            }
        }
        @for run in &t.stages {
            @let stage = run.stage.as_str();
            section.stage {
                h3 {
                    (stage) ": " span class={"status " (run.status.as_str())} #{"status-" (stage)} { (run.status.as_str()) }
                    @if run.lease_live { " (lease live)" }
                }
                p {
                    "run " code { (run.run_id) } ", attempts " (run.attempts) "/" (run.max_attempts)
                    ", success attempt " (run.success_attempt.map_or("-".into(), |a| a.to_string()))
                    @if let (Some(us), Some(ua)) = (&run.upstream_stage, run.upstream_attempt) {
                        ", read " (us.as_str()) " attempt " (ua)
                    }
                }
                @if let Some(e) = &run.last_error { p.error { "last error: " (e) } }
                @if !ro && run.status == RunStatus::Waiting {
                    form.signal method="post" action="/actions/signal" {
                        (csrf_field(p))
                        input type="hidden" name="tenant" value=(tenant);
                        input type="hidden" name="item" value=(item);
                        input type="hidden" name="stage" value=(stage);
                        @if let Some(w) = &run.wait {
                            p.wait #{"wait-" (stage)} {
                                "Waits for " (w.signal.as_ref().map_or("a timer".to_owned(), |s| format!("signal {s}")))
                                " until " (w.until.format("%Y-%m-%d %H:%M:%S UTC")) " (then " (w.on_timeout) ")."
                            }
                        }
                        label { "Signal " input #{"signal-name-" (stage)} type="text" name="signal" maxlength="63" required
                            value=(run.wait.as_ref().and_then(|w| w.signal.as_ref()).map_or("", |s| s.as_str())); }
                        label { "Payload (JSON) " textarea #{"signal-payload-" (stage)} name="payload" rows="2" cols="40" { "{}" } }
                        button #{"signal-" (stage)} type="submit" { "Deliver the signal" }
                    }
                }
                @if !ro && run.status == RunStatus::Dead {
                    (action_button(p, &format!("retry-{tenant}-{item}-{stage}"), "/actions/retry", &[("tenant", tenant), ("item", &item), ("stage", stage)], "Retry this stage", "retry"))
                }
                table.attempts {
                    thead { tr { th { "attempt" } th { "outcome" } th { "worker" } th { "started" } th { "finished" } th { "upstream attempt" } th { "error" } } }
                    tbody {
                        @for a in &run.attempts_history {
                            tr {
                                td.num { (a.attempt) }
                                td { (a.outcome) }
                                td { code { (a.worker_id) } }
                                td { (time(&a.started_at)) }
                                td { (opt_time(&a.finished_at)) }
                                td.num { (a.upstream_attempt.map_or("-".into(), |u| u.to_string())) }
                                td.error { (a.error.as_deref().unwrap_or("")) }
                            }
                        }
                    }
                }
            }
        }
        @for s in &not_started {
            section.stage { h3 { (s) ": " span.status #{"status-" (s)} { "not started" } } }
        }
        @if let Some(c) = &t.child_of {
            section #child-of {
                p {
                    "Child " code { (c.key) } " (position " (c.position) ") of item "
                    a #parent-link href=(item_link(tenant, &c.parent.to_string())) { code { (c.parent) } }
                    ", fan-out " (c.stage.as_str()) " attempt " (c.attempt)
                    @if c.superseded { ", superseded by a rerun of the fan-out" }
                    "."
                }
            }
        }
        @for f in &t.fan_outs {
            section.fan-out #{"fan-out-" (f.stage.as_str()) "-" (f.attempt)} {
                h3 {
                    "Fan-out " (f.stage.as_str()) " attempt " (f.attempt) ": "
                    span.children-final { (f.final_children) "/" (f.children.len()) } " children final"
                }
                p {
                    "gathered by " (f.gather_stage.as_str())
                    @if let Some(at) = &f.completed_at { ", complete " (time(at)) }
                    @if let Some(at) = &f.superseded_at { ", superseded " (time(at)) }
                }
                table.children {
                    thead { tr { th { "child" } th { "key" } th { "outcome" } th { "finished" } } }
                    tbody {
                        @for c in &f.children {
                            tr {
                                td { a href=(item_link(tenant, &c.item.to_string())) { code { (c.item) } } }
                                td { code { (c.key) } }
                                td { (c.outcome.as_deref().unwrap_or("not final"))
                                     @if let Some(st) = &c.final_stage { " (" (st.as_str()) ")" } }
                                td { (opt_time(&c.finished_at)) }
                            }
                        }
                    }
                }
            }
        }
        section {
            h3 { "Jobs" }
            @if t.jobs.is_empty() { p { "None (finished jobs are deleted after their retention)." } }
            @else {
                table #jobs {
                    thead { tr { th { "job" } th { "queue" } th { "state" } th.num { "deliveries" } th.num { "retries" } th { "next run" } th { "error" } } }
                    tbody {
                        @for j in &t.jobs {
                            tr {
                                td { code { (j.id) } }
                                td { (j.queue) }
                                td { (j.state) }
                                td.num { (j.attempt) }
                                td.num { (j.retry_count) "/" (j.retry_limit) }
                                td { (time(&j.start_after)) }
                                td.error { (j.last_error.as_deref().unwrap_or("")) }
                            }
                        }
                    }
                }
            }
        }
    }
}

#[derive(Deserialize)]
pub(crate) struct DeadQuery {
    tenant: Option<String>,
    stage: Option<String>,
}

/// Checks a tenant the console is asked about: a slug that has items (404
/// otherwise).
pub(crate) async fn known_tenant(console: &Shared, slug: &str) -> Result<TenantId, PageError> {
    let tenant = TenantId::parse(slug)?;
    let mut conn = idemstage::db::get(&console.pool).await?;
    if !report::tenant_exists(&mut conn, &tenant).await? {
        return Err(PageError::new(
            StatusCode::NOT_FOUND,
            "Unknown tenant",
            &format!("Tenant {tenant} has no items. Nothing was changed."),
        ));
    }
    Ok(tenant)
}

/// A stage of the pipeline (404 otherwise).
pub(crate) fn known_stage(console: &Shared, name: &str) -> Result<StageName, PageError> {
    let stage = StageName::parse(name)?;
    if console.pipeline.stage(stage.as_str()).is_err() {
        return Err(OpsError::UnknownStage(name.to_owned()).into());
    }
    Ok(stage)
}

/// `GET /dead[?tenant=T&stage=S]`: dead stages and failed jobs.
pub(crate) async fn dead(
    State(console): State<Shared>,
    Extension(p): Extension<Principal>,
    query: Result<Query<DeadQuery>, QueryRejection>,
) -> Result<Response, PageError> {
    let Query(q) = query.map_err(PageError::from_query)?;
    let tenant_text = q.tenant.as_deref().map(str::trim).unwrap_or("");
    let stage_text = q.stage.as_deref().map(str::trim).unwrap_or("");
    let tenant = match tenant_text {
        "" => None,
        t => Some(known_tenant(&console, t).await?),
    };
    let stage = match stage_text {
        "" => None,
        s => Some(known_stage(&console, s)?),
    };
    let filter = DeadFilter {
        tenant,
        stage,
        limit: Some(500),
    };
    let mut conn = idemstage::db::get(&console.pool).await?;
    let letters = ops::dead(&mut conn, &filter).await?;
    drop(conn);
    let ro = console.read_only;
    let body = html! {
        section {
            h2 { "Dead letters" }
            form #dead-filter method="get" action="/dead" {
                label { "Tenant " input type="text" name="tenant" value=(tenant_text) maxlength="63"; }
                label { "Stage " input type="text" name="stage" value=(stage_text) maxlength="63"; }
                button type="submit" { "Filter" }
            }
            h3 { "Dead stages" }
            @if letters.stages.is_empty() { p #no-dead { "No dead stage." } }
            @else {
                table #dead-stages {
                    thead { tr {
                        th { "tenant" } th { "item" } th { "stage" } th.num { "attempts" }
                        th { "died" } th { "last error" } @if !ro { th { "" } }
                    } }
                    tbody {
                        @for d in &letters.stages {
                            @let (tenant, item, stage) = (d.tenant.as_str(), d.item.to_string(), d.stage.as_str());
                            tr #{"dead-" (tenant) "-" (item) "-" (stage)} {
                                td.tenant { (tenant) }
                                td { a href=(item_link(tenant, &item)) { code { (item) } } }
                                td { (stage) }
                                td.num { (d.attempts) "/" (d.max_attempts) }
                                td { (opt_time(&d.finished_at)) }
                                td.error { (d.last_error.as_deref().unwrap_or("-")) }
                                @if !ro {
                                    td.actions {
                                        (action_button(&p, &format!("retry-{tenant}-{item}-{stage}"), "/actions/retry", &[("tenant", tenant), ("item", &item), ("stage", stage)], "Retry", "retry"))
                                        (action_button(&p, &format!("cancel-{tenant}-{item}"), "/actions/cancel", &[("tenant", tenant), ("item", &item)], "Cancel item", "danger"))
                                    }
                                }
                            }
                        }
                    }
                }
            }
            h3 { "Failed jobs" }
            @if letters.jobs.is_empty() { p { "No failed job." } }
            @else {
                table #failed-jobs {
                    thead { tr { th { "tenant" } th { "item" } th { "job" } th { "queue" } th.num { "retries" } th { "failed" } th { "last error" } } }
                    tbody {
                        @for j in &letters.jobs {
                            tr {
                                td.tenant { (j.tenant.as_deref().unwrap_or("-")) }
                                td { (j.item.as_deref().unwrap_or("-")) }
                                td { code { (j.id) } }
                                td { (j.queue) }
                                td.num { (j.retry_count) }
                                td { (opt_time(&j.completed_at)) }
                                td.error { (j.last_error.as_deref().unwrap_or("-")) }
                            }
                        }
                    }
                }
            }
        }
    };
    Ok(layout("Dead letters", Some(&p), ro, body).into_response())
}

/// The page after an action: what happened, and where to go on.
pub(crate) fn done_page(
    console: &Shared,
    p: &Principal,
    title: &str,
    lines: &[String],
    back: Option<(String, &str)>,
) -> Response {
    let body = html! {
        section.done {
            h2 #done-title { (title) }
            ul #done-lines { @for l in lines { li { (l) } } }
            p {
                @if let Some((href, label)) = &back { a #done-back href=(href) { (label) } " · " }
                a href="/" { "Overview" } " · " a href="/dead" { "Dead letters" }
            }
        }
    };
    layout(title, Some(p), console.read_only, body).into_response()
}

/// A link to an item's page.
pub(crate) fn item_href(tenant: &TenantId, item: &ItemId) -> String {
    item_link(tenant.as_str(), &item.to_string())
}
