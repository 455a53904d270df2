//! `idemstage console`: a web console for operators, server-rendered HTML (no
//! JavaScript) on axum.
//!
//! - `GET /` the overview: per tenant and stage the runs by status and the
//!   successes of the last minute; per stage its queue (ready, delayed, active,
//!   the oldest ready job's age) and its pause; pause/resume per stage and per
//!   (stage, tenant).
//! - `GET /item?tenant=T&item=A` an item's timeline (`ops::inspect`),
//!   with retry (per dead stage) and cancel.
//! - `GET /dead[?tenant=T&stage=S]` the dead-letter list (`ops::dead`) with
//!   retry and cancel.
//! - `POST /actions/{retry,cancel,pause,resume}` the operator writes, through
//!   `idemstage::ops` and `queue::{pause, resume}`.
//! - `GET|POST /login`, `POST /logout`: the browser's session (see [`auth`]).
//!
//! Every page but the login form and the stylesheet needs the token (see
//! [`auth`]); every POST but the login needs the session's CSRF token. Bad
//! input is an error page with a 4xx status and changes nothing.

mod actions;
mod auth;
mod bulk;
mod pages;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Request};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use idemstage::pipeline::Pipeline;
use idemstage::{db::PgPool, db::PoolConfig};

use super::BadInput;

/// The environment variable the token is read from (unless `--token-file`).
pub const TOKEN_ENV: &str = "IDEMSTAGE_CONSOLE_TOKEN";

/// The longest request target (path and query) accepted, in bytes: longer is
/// `414 URI Too Long`.
pub const MAX_URI_BYTES: usize = 2048;

/// The largest form body accepted, in bytes: larger is `413 Payload Too Large`.
pub const MAX_BODY_BYTES: usize = 2048;

#[derive(clap::Args)]
pub struct Args {
    /// Address to serve on (port 0: a free port; the bound address is printed).
    /// Only loopback addresses unless --allow-remote
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Read the access token from this file (first line, trimmed) instead of
    /// $IDEMSTAGE_CONSOLE_TOKEN; at least 16 characters
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// Allow a --listen address that is not loopback. The console speaks plain
    /// HTTP: put a TLS-terminating proxy in front of it
    #[arg(long)]
    allow_remote: bool,
    /// Show everything, change nothing: no action buttons, every action POST is
    /// refused (403)
    #[arg(long)]
    read_only: bool,
}

/// What every handler shares.
pub(crate) struct Console {
    pub pool: PgPool,
    pub pipeline: Pipeline,
    pub read_only: bool,
    pub auth: auth::Authenticator,
}

pub(crate) type Shared = Arc<Console>;

/// The token: `--token-file`, else the environment; refused (bad input) if
/// missing or shorter than [`auth::MIN_TOKEN_CHARS`].
fn load_token(file: Option<&PathBuf>) -> anyhow::Result<String> {
    let token = match file {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                BadInput(format!(
                    "--token-file {}: cannot read it: {e}",
                    path.display()
                ))
            })?;
            text.lines().next().unwrap_or("").trim().to_owned()
        }
        None => std::env::var(TOKEN_ENV)
            .map(|t| t.trim().to_owned())
            .map_err(|_| {
                BadInput(format!(
                    "the console needs an access token: set {TOKEN_ENV} or pass --token-file FILE"
                ))
            })?,
    };
    if token.chars().count() < auth::MIN_TOKEN_CHARS {
        return Err(BadInput(format!(
            "the console's access token must have at least {} characters (got {})",
            auth::MIN_TOKEN_CHARS,
            token.chars().count()
        ))
        .into());
    }
    Ok(token)
}

pub async fn run(db: &super::Db, args: Args, team: Pipeline) -> anyhow::Result<ExitCode> {
    // Everything the user can get wrong is refused before the first connection.
    let token = load_token(args.token_file.as_ref())?;
    if !args.listen.ip().is_loopback() && !args.allow_remote {
        return Err(BadInput(format!(
            "--listen {}: not a loopback address; the console serves plain HTTP, so pass \
             --allow-remote (behind a TLS-terminating proxy) to listen there",
            args.listen
        ))
        .into());
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| BadInput(format!("--listen {}: {e}", args.listen)))?;
    let addr = listener.local_addr()?;
    let pool = db
        .pool(
            PoolConfig::default()
                .with_max_size(4)
                .with_connection_timeout(Duration::from_secs(5)),
        )
        .await?;
    let console = Arc::new(Console {
        pool,
        pipeline: team,
        read_only: args.read_only,
        auth: auth::Authenticator::new(&token),
    });
    eprintln!(
        "idemstage console: http://{addr}/{}",
        if args.read_only { " (read-only)" } else { "" }
    );
    axum::serve(listener, router(console))
        .with_graceful_shutdown(shutdown())
        .await?;
    Ok(ExitCode::SUCCESS)
}

/// SIGINT or SIGTERM.
async fn shutdown() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}

/// The routes, with the token check on every page but the login form and the
/// stylesheet, the size limits and the security headers on all.
pub(crate) fn router(console: Shared) -> Router {
    let protected = Router::new()
        .route("/", get(pages::overview))
        .route("/item", get(pages::item))
        .route("/dead", get(pages::dead))
        .route("/bulk", get(bulk::page))
        .route("/actions/bulk", post(bulk::start))
        .route("/actions/retry", post(actions::retry))
        .route("/actions/cancel", post(actions::cancel))
        .route("/actions/signal", post(actions::signal))
        .route("/actions/pause", post(actions::pause))
        .route("/actions/resume", post(actions::resume))
        .route("/logout", post(auth::logout))
        .route_layer(middleware::from_fn_with_state(
            console.clone(),
            auth::require_token,
        ));
    Router::new()
        .route("/login", get(auth::login_form).post(auth::login))
        .route("/console.css", get(pages::stylesheet))
        .merge(protected)
        .fallback(pages::not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn(limits_and_headers))
        .with_state(console)
}

/// Refuses an oversized request target (414) before routing, and sets the
/// headers every response carries: no caching, no framing, no referrer, a
/// content security policy that allows no script at all.
async fn limits_and_headers(request: Request, next: Next) -> Response {
    let target = request
        .uri()
        .path_and_query()
        .map_or(0, |p| p.as_str().len());
    let mut response = if target > MAX_URI_BYTES {
        pages::error_page(
            StatusCode::URI_TOO_LONG,
            "Request too long",
            &format!(
                "The address has {target} bytes; the console accepts at most {MAX_URI_BYTES}."
            ),
        )
    } else {
        next.run(request).await
    };
    let headers = response.headers_mut();
    for (name, value) in [
        (header::CACHE_CONTROL, "no-store"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; \
             frame-ancestors 'none'; base-uri 'none'",
        ),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}
