//! Who may use the console, and the CSRF check of its POSTs.
//!
//! The console has one secret, its access token (`IDEMSTAGE_CONSOLE_TOKEN` or
//! `--token-file`). A request shows it either as `Authorization: Bearer <token>`
//! (scripts, curl) or, in a browser, through a session: `POST /login` with the
//! token sets a random session id in a cookie (`HttpOnly`, `SameSite=Strict`,
//! 12 hours), kept in this process's memory only (a restart logs everybody out).
//! Tokens are compared in constant time (SHA-256 of both, then
//! `subtle::ConstantTimeEq`, so not even the length leaks).
//!
//! Every POST that changes something carries a `csrf` form field: the session's
//! own random CSRF token (bearer clients: one per process, shown in the pages
//! they GET), compared in constant time; without it, or with another, the POST
//! is refused (403) before anything is read from the database. The login form
//! itself needs none: it only ever logs in whoever knows the token.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::rejection::FormRejection;
use axum::extract::{Form, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use idemstage::ops::Actor;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::pages::{self, PageError};
use super::Shared;

/// The shortest token accepted.
pub const MIN_TOKEN_CHARS: usize = 16;

/// The session cookie's name.
pub const COOKIE: &str = "idemstage_session";

/// How long a session lasts.
const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);

/// The most sessions kept at once; past it the oldest go first.
const MAX_SESSIONS: usize = 1024;

/// The token, its sessions, the bearer clients' CSRF token.
pub(crate) struct Authenticator {
    token_digest: [u8; 32],
    sessions: Mutex<HashMap<String, Session>>,
    bearer_csrf: String,
}

struct Session {
    csrf: String,
    actor: Actor,
    expires: Instant,
}

/// Who a request is, after [`require_token`]: what its actions are recorded
/// as, and the CSRF token its forms carry.
#[derive(Clone, Debug)]
pub(crate) struct Principal {
    pub actor: Actor,
    pub csrf: String,
}

fn random_hex() -> String {
    let bytes: [u8; 32] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn digest(text: &str) -> [u8; 32] {
    Sha256::digest(text.as_bytes()).into()
}

impl Authenticator {
    pub fn new(token: &str) -> Self {
        Self {
            token_digest: digest(token),
            sessions: Mutex::new(HashMap::new()),
            bearer_csrf: random_hex(),
        }
    }

    /// `given` is the token (constant time).
    fn is_token(&self, given: &str) -> bool {
        bool::from(digest(given).ct_eq(&self.token_digest))
    }

    fn new_session(&self, actor_name: Option<&str>) -> String {
        let id = random_hex();
        let actor = Actor::parse(&format!(
            "console:{}",
            actor_name.unwrap_or(&format!("session-{}", &id[..8]))
        ))
        .expect("a checked name makes a valid actor");
        let mut sessions = self.sessions.lock().expect("sessions lock");
        let now = Instant::now();
        sessions.retain(|_, s| s.expires > now);
        while sessions.len() >= MAX_SESSIONS {
            let oldest = sessions
                .iter()
                .min_by_key(|(_, s)| s.expires)
                .map(|(k, _)| k.clone())
                .expect("not empty");
            sessions.remove(&oldest);
        }
        sessions.insert(
            id.clone(),
            Session {
                csrf: random_hex(),
                actor,
                expires: now + SESSION_TTL,
            },
        );
        id
    }

    fn session(&self, id: &str) -> Option<Principal> {
        let sessions = self.sessions.lock().expect("sessions lock");
        sessions
            .get(id)
            .filter(|s| s.expires > Instant::now())
            .map(|s| Principal {
                actor: s.actor.clone(),
                csrf: s.csrf.clone(),
            })
    }

    fn end_session(&self, id: &str) {
        self.sessions.lock().expect("sessions lock").remove(id);
    }

    /// The principal of a request, if it shows the token or a live session.
    /// `Err` for an `Authorization` header that is not the token.
    fn principal(&self, headers: &HeaderMap) -> Result<Option<Principal>, ()> {
        if let Some(value) = headers.get(header::AUTHORIZATION) {
            let given = value
                .to_str()
                .ok()
                .and_then(|v| v.strip_prefix("Bearer "))
                .ok_or(())?;
            return if self.is_token(given.trim()) {
                Ok(Some(Principal {
                    actor: Actor::parse("console:bearer").expect("valid actor"),
                    csrf: self.bearer_csrf.clone(),
                }))
            } else {
                Err(())
            };
        }
        Ok(session_cookie(headers).and_then(|id| self.session(id)))
    }
}

/// The session id in the request's cookies, if any.
fn session_cookie(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value)
}

/// The layer of every protected route: a request without the token or a live
/// session gets 401 (the login form, for a browser), one with a wrong bearer
/// token 401 too; otherwise its [`Principal`] goes into its extensions.
pub(crate) async fn require_token(
    State(console): State<Shared>,
    mut request: Request,
    next: Next,
) -> Response {
    match console.auth.principal(request.headers()) {
        Ok(Some(principal)) => {
            request.extensions_mut().insert(principal);
            next.run(request).await
        }
        Ok(None) => {
            let mut response = pages::login_page(
                StatusCode::UNAUTHORIZED,
                Some("Log in with the console's access token."),
            );
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"idemstage console\""),
            );
            response
        }
        Err(()) => PageError::new(
            StatusCode::UNAUTHORIZED,
            "Not authorised",
            "The Authorization header is not `Bearer` and the console's access token.",
        )
        .into_response(),
    }
}

/// A POST's CSRF field against the principal's token (constant time): 403 if
/// missing or wrong.
pub(crate) fn check_csrf(principal: &Principal, given: Option<&str>) -> Result<(), PageError> {
    let ok = given.is_some_and(|g| bool::from(g.as_bytes().ct_eq(principal.csrf.as_bytes())));
    if ok {
        Ok(())
    } else {
        Err(PageError::new(
            StatusCode::FORBIDDEN,
            "Forbidden",
            "This form is missing its CSRF token, or it is not this session's. \
             Nothing was changed: reload the page and try again.",
        ))
    }
}

pub(crate) async fn login_form() -> Response {
    pages::login_page(StatusCode::OK, None)
}

#[derive(Deserialize)]
pub(crate) struct LoginForm {
    token: Option<String>,
    name: Option<String>,
}

/// A name for the audit log: 1 to 64 of `A-Za-z0-9._@-`.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '@' | '-'))
}

pub(crate) async fn login(
    State(console): State<Shared>,
    form: Result<Form<LoginForm>, FormRejection>,
) -> Result<Response, PageError> {
    let Form(form) = form.map_err(PageError::from_form)?;
    let name = form
        .name
        .as_deref()
        .map(str::trim)
        .filter(|n| !n.is_empty());
    if let Some(name) = name {
        if !valid_name(name) {
            return Err(PageError::new(
                StatusCode::BAD_REQUEST,
                "Bad name",
                "A name for the audit log has 1 to 64 letters, digits or `._@-`.",
            ));
        }
    }
    let token = form.token.unwrap_or_default();
    if !console.auth.is_token(token.trim()) {
        return Ok(pages::login_page(
            StatusCode::UNAUTHORIZED,
            Some("That is not the console's access token."),
        ));
    }
    let id = console.auth.new_session(name);
    let cookie = format!(
        "{COOKIE}={id}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}",
        SESSION_TTL.as_secs()
    );
    let mut response = Redirect::to("/").into_response();
    response.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_str(&cookie).expect("hex cookie"),
    );
    Ok(response)
}

#[derive(Deserialize)]
pub(crate) struct LogoutForm {
    csrf: Option<String>,
}

pub(crate) async fn logout(
    State(console): State<Shared>,
    axum::Extension(principal): axum::Extension<Principal>,
    headers: HeaderMap,
    form: Result<Form<LogoutForm>, FormRejection>,
) -> Result<Response, PageError> {
    let Form(form) = form.map_err(PageError::from_form)?;
    check_csrf(&principal, form.csrf.as_deref())?;
    if let Some(id) = session_cookie(&headers) {
        console.auth.end_session(id);
    }
    let mut response = Redirect::to("/login").into_response();
    response.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_str(&format!(
            "{COOKIE}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0"
        ))
        .expect("static cookie"),
    );
    Ok(response)
}
