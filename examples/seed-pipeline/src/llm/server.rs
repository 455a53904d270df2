//! [`LlmServer`]: the service on 127.0.0.1, its faults ([`LlmConfig`]) and its
//! counters ([`LlmCounters`]).

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::serve::ListenerExt;
use axum::Router;
use idemstage::serde_json;
use idemstage::{ids::ItemId, ids::TenantId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::{
    ErrorBody, ExtractRequest, ExtractResponse, WirePosition, EXTRACT_PATH, MAX_TEXT_BYTES,
    RETRY_AFTER_MS,
};
use crate::extract_positions;

/// The largest request body the service reads (a larger one is answered 413):
/// room for a [`MAX_TEXT_BYTES`] text even if JSON escapes much of it.
const MAX_BODY_BYTES: usize = 8 * MAX_TEXT_BYTES;

/// How an [`LlmServer`] answers: its latency and its faults. The default answers
/// at once and never fails; the `with_*` methods change one field each.
///
/// Faults are decided per request to `POST /v1/extract`, in the order the
/// requests arrive: the Nth request is first checked against
/// `rate_limited_every`, and if it is not refused, a number drawn from a random
/// generator seeded with `seed` decides whether it fails with 500. The same
/// sequence of requests therefore meets the same faults.
#[derive(Clone, Debug, PartialEq)]
pub struct LlmConfig {
    /// How long the service "thinks" before every answer but a 429 (which refuses
    /// at once).
    pub latency: Duration,
    /// With `Some(n)`, every nth request (the nth, the 2nth, ...) is answered 429
    /// with [`retry_after`](Self::retry_after); `n` must be at least 1.
    pub rate_limited_every: Option<u32>,
    /// The wait a 429 asks for: in the `Retry-After` header in whole seconds
    /// (rounded up) and in `Retry-After-Ms` in milliseconds (rounded up).
    pub retry_after: Duration,
    /// The share of requests (0 to 1) answered 500; 1 fails every request that is
    /// not refused with 429.
    pub failure_rate: f64,
    /// The seed of the random generator that draws the 500s.
    pub seed: u64,
}

impl Default for LlmConfig {
    /// No latency, no faults; a 429, if enabled, asks for 1 s; seed 0.
    fn default() -> Self {
        Self {
            latency: Duration::ZERO,
            rate_limited_every: None,
            retry_after: Duration::from_secs(1),
            failure_rate: 0.0,
            seed: 0,
        }
    }
}

impl LlmConfig {
    /// This config with [`latency`](Self::latency).
    pub fn with_latency(mut self, latency: Duration) -> Self {
        self.latency = latency;
        self
    }

    /// This config answering every `n`th request 429
    /// ([`rate_limited_every`](Self::rate_limited_every)).
    pub fn with_rate_limited_every(mut self, n: u32) -> Self {
        self.rate_limited_every = Some(n);
        self
    }

    /// This config with [`retry_after`](Self::retry_after).
    pub fn with_retry_after(mut self, retry_after: Duration) -> Self {
        self.retry_after = retry_after;
        self
    }

    /// This config with [`failure_rate`](Self::failure_rate).
    pub fn with_failure_rate(mut self, failure_rate: f64) -> Self {
        self.failure_rate = failure_rate;
        self
    }

    /// This config with [`seed`](Self::seed).
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    fn validate(&self) -> io::Result<()> {
        let invalid = |msg: String| Err(io::Error::new(io::ErrorKind::InvalidInput, msg));
        if self.rate_limited_every == Some(0) {
            return invalid("LlmConfig::rate_limited_every must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&self.failure_rate) {
            return invalid(format!(
                "LlmConfig::failure_rate must be between 0 and 1, not {}",
                self.failure_rate
            ));
        }
        Ok(())
    }
}

/// The counters of an [`LlmServer`], shared with it (cloning shares them too):
/// a demo keeps them to report "external calls paid" beside stage executions,
/// also after the server is gone.
#[derive(Clone, Debug, Default)]
pub struct LlmCounters {
    calls: Arc<AtomicU64>,
    requests: Arc<AtomicU64>,
}

impl LlmCounters {
    /// Extraction calls answered 200: the paid calls. Counted before the answer
    /// is sent, so a client that has its answer sees it counted.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    /// Every request to `POST /v1/extract`, whatever its answer (200, 413, 422,
    /// 429, 500), counted as it arrives.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }

    /// The counter behind [`calls`](Self::calls).
    pub fn calls_counter(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.calls)
    }

    /// The counter behind [`requests`](Self::requests).
    pub fn requests_counter(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.requests)
    }
}

/// The "LLM" service: HTTP/1 on 127.0.0.1 at an ephemeral port, answering
/// `POST /v1/extract` (the module's documentation has the wire format).
///
/// It runs as a task on the tokio runtime it was started in. [`shutdown`]
/// stops it gracefully (answers in flight are finished); dropping it stops
/// accepting connections at once.
///
/// [`shutdown`]: Self::shutdown
#[derive(Debug)]
pub struct LlmServer {
    addr: SocketAddr,
    counters: LlmCounters,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<io::Result<()>>>,
}

#[derive(Clone)]
struct Shared {
    config: Arc<LlmConfig>,
    counters: LlmCounters,
    rng: Arc<Mutex<StdRng>>,
}

impl LlmServer {
    /// Binds 127.0.0.1 at a port the system picks and starts serving on the
    /// current tokio runtime. An error if `config` is invalid
    /// ([`InvalidInput`](io::ErrorKind::InvalidInput): `rate_limited_every` of 0,
    /// `failure_rate` outside 0 to 1), if there is no current runtime, or if the
    /// port cannot be bound.
    pub fn start(config: LlmConfig) -> io::Result<Self> {
        config.validate()?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|e| {
            io::Error::other(format!("LlmServer::start needs a tokio runtime: {e}"))
        })?;
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let _entered = runtime.enter();
        let listener = tokio::net::TcpListener::from_std(listener)?.tap_io(|tcp| {
            // Small requests and answers: do not let Nagle delay them.
            let _ = tcp.set_nodelay(true);
        });

        let counters = LlmCounters::default();
        let shared = Shared {
            rng: Arc::new(Mutex::new(StdRng::seed_from_u64(config.seed))),
            config: Arc::new(config),
            counters: counters.clone(),
        };
        let app = Router::new()
            .route(EXTRACT_PATH, post(extract))
            .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
            .with_state(shared);
        let (shutdown, stopped) = oneshot::channel::<()>();
        let task = runtime.spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    // A dropped sender stops the server as well.
                    let _ = stopped.await;
                })
                .await
        });
        Ok(Self {
            addr,
            counters,
            shutdown: Some(shutdown),
            task: Some(task),
        })
    }

    /// The base URL, `http://127.0.0.1:PORT`, for [`LlmClient::new`](super::LlmClient::new).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Extraction calls answered 200 so far: the paid calls
    /// ([`LlmCounters::calls`]).
    pub fn calls(&self) -> u64 {
        self.counters.calls()
    }

    /// Requests to `POST /v1/extract` so far, whatever their answer
    /// ([`LlmCounters::requests`]).
    pub fn requests(&self) -> u64 {
        self.counters.requests()
    }

    /// The server's counters, to keep beyond its life or share with a report.
    pub fn counters(&self) -> LlmCounters {
        self.counters.clone()
    }

    /// Stops accepting connections, finishes the answers in flight, and waits
    /// until the server's task has ended. An error if serving failed.
    pub async fn shutdown(mut self) -> io::Result<()> {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        match self.task.take() {
            Some(task) => task.await.map_err(io::Error::other)?,
            None => Ok(()),
        }
    }
}

impl Drop for LlmServer {
    /// Stops the server's task (not yet if [`shutdown`](Self::shutdown) took it):
    /// no new connection is accepted; connections already open are not waited for.
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// `POST /v1/extract`.
async fn extract(State(shared): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    let config = &shared.config;
    let n = shared.counters.requests.fetch_add(1, Ordering::SeqCst) + 1;
    if config
        .rate_limited_every
        .is_some_and(|every| n % u64::from(every) == 0)
    {
        return rate_limited(config.retry_after);
    }
    let fails = {
        let mut rng = shared.rng.lock().unwrap_or_else(|e| e.into_inner());
        rng.random::<f64>() < config.failure_rate
    };
    if !config.latency.is_zero() {
        tokio::time::sleep(config.latency).await;
    }
    if fails {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "injected failure".into());
    }
    let body = match body {
        Ok(body) => body,
        Err(rejection) => return error(rejection.status(), rejection.body_text()),
    };
    match answer(&body) {
        Ok(answer) => {
            shared.counters.calls.fetch_add(1, Ordering::SeqCst);
            json(StatusCode::OK, &answer)
        }
        Err(message) => error(StatusCode::UNPROCESSABLE_ENTITY, message),
    }
}

/// The positions of a request's text, or why the request is refused (422).
fn answer(body: &[u8]) -> Result<ExtractResponse, String> {
    let request: ExtractRequest<'_> =
        serde_json::from_slice(body).map_err(|e| format!("invalid request body: {e}"))?;
    TenantId::parse(&request.tenant).map_err(|e| format!("tenant: {e}"))?;
    ItemId::parse(&request.item).map_err(|e| format!("item: {e}"))?;
    if request.text.len() > MAX_TEXT_BYTES {
        return Err(format!(
            "text is {} bytes, more than the limit of {MAX_TEXT_BYTES}",
            request.text.len()
        ));
    }
    let positions = extract_positions(&request.text);
    Ok(ExtractResponse {
        positions: positions.iter().map(WirePosition::from).collect(),
    })
}

fn rate_limited(retry_after: Duration) -> Response {
    // Both rounded up: a client that waits as told is never early.
    let secs = retry_after
        .as_secs()
        .saturating_add(u64::from(retry_after.subsec_nanos() > 0));
    let millis = u64::try_from(retry_after.as_millis())
        .unwrap_or(u64::MAX)
        .saturating_add(u64::from(retry_after.subsec_nanos() % 1_000_000 > 0));
    let mut response = error(
        StatusCode::TOO_MANY_REQUESTS,
        format!("rate limited; retry after {retry_after:?}"),
    );
    let headers = response.headers_mut();
    headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    headers.insert(RETRY_AFTER_MS, HeaderValue::from(millis));
    response
}

fn error(status: StatusCode, error: String) -> Response {
    json(status, &ErrorBody { error })
}

fn json<T: serde::Serialize>(status: StatusCode, body: &T) -> Response {
    match serde_json::to_vec(body) {
        Ok(bytes) => (
            status,
            [(header::CONTENT_TYPE, "application/json")],
            Bytes::from(bytes),
        )
            .into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot write the answer: {e}"),
        )
            .into_response(),
    }
}
