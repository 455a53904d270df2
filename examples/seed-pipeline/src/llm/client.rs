//! [`LlmClient`]: the extraction call and how its failures map onto
//! [`StageError`].

use std::borrow::Cow;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::header::{self, HeaderMap};
use hyper::{Request, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idemstage::serde_json;
use idemstage::{ids::ItemId, ids::TenantId, stage::StageError};

use super::{ErrorBody, ExtractRequest, ExtractResponse, EXTRACT_PATH, RETRY_AFTER_MS};
use crate::tables::Extraktion;

/// How long [`LlmClient::extract`] waits for a whole answer unless told
/// otherwise ([`LlmClient::with_timeout`]): 30 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// The wait of a 429 that names none the client understands (no header, or
/// `Retry-After` as an HTTP date).
const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// How much of an error answer's body a [`StageError`] quotes.
const QUOTED_BODY_CHARS: usize = 200;

/// A client of the "LLM" service ([`LlmServer`](super::LlmServer) or anything
/// speaking its wire format) over plain HTTP/1, keeping connections alive
/// between calls. Cheap to clone; clones share the connections.
#[derive(Clone, Debug)]
pub struct LlmClient {
    base_url: String,
    timeout: Duration,
    http: Client<HttpConnector, Full<Bytes>>,
}

impl LlmClient {
    /// A client of the service at `base_url` (`http://host:port`, optionally with
    /// a path prefix; a trailing `/` is ignored), with [`DEFAULT_TIMEOUT`]. A URL
    /// that is not `http://` (there is no TLS here) or not a URL at all makes
    /// every call fail with `StageError::Permanent`.
    pub fn new(base_url: impl Into<String>) -> Self {
        let mut base_url = base_url.into();
        while base_url.ends_with('/') {
            base_url.pop();
        }
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Self {
            base_url,
            timeout: DEFAULT_TIMEOUT,
            http: Client::builder(TokioExecutor::new()).build(connector),
        }
    }

    /// This client waiting at most `timeout` for a whole answer (connecting,
    /// sending, the service's work and reading the answer).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The base URL the client calls.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// How long a call waits for its whole answer.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The positions the service extracts from `text` (for `tenant`'s `item`):
    /// the same as [`extract_positions`](crate::extract_positions)`(text)` when
    /// the service is an [`LlmServer`](super::LlmServer).
    ///
    /// Failures, as a stage returns them:
    /// - 429 → [`StageError::RateLimited`] with the wait the answer names
    ///   (`Retry-After-Ms` in milliseconds, else `Retry-After` in seconds, else
    ///   1 s);
    /// - 5xx, 408, a connection that cannot be made or breaks, no whole answer
    ///   within the [timeout](Self::with_timeout) → [`StageError::Transient`];
    /// - any other status (422: a request the service refuses), an unreadable 200,
    ///   a base URL that is not `http://` → [`StageError::Permanent`].
    ///
    /// Each message names the service's URL and, for an error answer, its status
    /// and its `error`.
    pub async fn extract(
        &self,
        tenant: &TenantId,
        item: &ItemId,
        text: &str,
    ) -> Result<Vec<Extraktion>, StageError> {
        let uri = self.extract_uri()?;
        let item = item.to_string();
        let body = serde_json::to_vec(&ExtractRequest {
            tenant: Cow::Borrowed(tenant.as_str()),
            item: Cow::Borrowed(&item),
            text: Cow::Borrowed(text),
        })
        .map_err(|e| StageError::Permanent(format!("cannot write the LLM request: {e}").into()))?;
        let request = Request::post(uri)
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::ACCEPT, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| {
                StageError::Permanent(format!("cannot build the LLM request: {e}").into())
            })?;
        let (status, headers, body) = tokio::time::timeout(self.timeout, self.send(request))
            .await
            .map_err(|_| {
                StageError::Transient(
                    format!(
                        "LLM service at {} gave no answer within {:?}",
                        self.base_url, self.timeout
                    )
                    .into(),
                )
            })??;
        self.interpret(status, &headers, &body)
    }

    fn extract_uri(&self) -> Result<Uri, StageError> {
        let url = format!("{}{EXTRACT_PATH}", self.base_url);
        let uri: Uri = url
            .parse()
            .map_err(|e| StageError::Permanent(format!("LLM service URL {url:?}: {e}").into()))?;
        if uri.scheme_str() != Some("http") || uri.authority().is_none() {
            return Err(StageError::Permanent(
                format!("LLM service URL {url:?}: not http://host:port").into(),
            ));
        }
        Ok(uri)
    }

    async fn send(
        &self,
        request: Request<Full<Bytes>>,
    ) -> Result<(StatusCode, HeaderMap, Bytes), StageError> {
        let transient = |what: &str, e: &dyn std::error::Error| {
            StageError::Transient(
                format!(
                    "LLM service at {}: {what}: {}",
                    self.base_url,
                    error_chain(e)
                )
                .into(),
            )
        };
        let response = self
            .http
            .request(request)
            .await
            .map_err(|e| transient("request failed", &e))?;
        let (parts, body) = response.into_parts();
        let body = body
            .collect()
            .await
            .map_err(|e| transient("answer broken off", &e))?
            .to_bytes();
        Ok((parts.status, parts.headers, body))
    }

    fn interpret(
        &self,
        status: StatusCode,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Result<Vec<Extraktion>, StageError> {
        match status {
            StatusCode::OK => decode(body).map_err(|e| {
                StageError::Permanent(
                    format!(
                        "LLM service at {} answered 200 with an unreadable body: {e}",
                        self.base_url
                    )
                    .into(),
                )
            }),
            StatusCode::TOO_MANY_REQUESTS => Err(StageError::RateLimited {
                retry_after: retry_after_of(headers),
            }),
            s if s.is_server_error() || s == StatusCode::REQUEST_TIMEOUT => {
                Err(StageError::Transient(self.describe(s, body).into()))
            }
            s => Err(StageError::Permanent(self.describe(s, body).into())),
        }
    }

    /// "LLM service at URL answered 500 Internal Server Error: injected failure".
    fn describe(&self, status: StatusCode, body: &[u8]) -> String {
        let reason = match serde_json::from_slice::<ErrorBody>(body) {
            Ok(ErrorBody { error }) => error,
            Err(_) => String::from_utf8_lossy(body).into_owned(),
        };
        let mut quoted: String = reason.chars().take(QUOTED_BODY_CHARS).collect();
        if quoted.len() < reason.len() {
            quoted.push('…');
        }
        format!(
            "LLM service at {} answered {status}: {quoted}",
            self.base_url
        )
    }
}

fn decode(body: &[u8]) -> Result<Vec<Extraktion>, String> {
    let answer: ExtractResponse = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    answer
        .positions
        .into_iter()
        .map(Extraktion::try_from)
        .collect()
}

/// The wait a 429 asks for: `Retry-After-Ms` (milliseconds, possibly
/// fractional), else `Retry-After` in whole seconds, else [`DEFAULT_RETRY_AFTER`]
/// (also for `Retry-After` as an HTTP date, which is not read).
fn retry_after_of(headers: &HeaderMap) -> Duration {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    if let Some(ms) = header(RETRY_AFTER_MS).and_then(|v| v.parse::<f64>().ok()) {
        if let Ok(wait) = Duration::try_from_secs_f64(ms / 1000.0) {
            return wait;
        }
    }
    header(header::RETRY_AFTER.as_str())
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_RETRY_AFTER)
}

/// An error and its sources, `: `-separated (hyper-util's own message alone is
/// only "client error (Connect)").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(e) = source {
        out.push_str(": ");
        out.push_str(&e.to_string());
        source = e.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, value.parse().unwrap());
        }
        map
    }

    #[test]
    fn the_wait_of_a_429_is_read_from_its_headers() {
        let ms = Duration::from_millis;
        assert_eq!(
            retry_after_of(&headers(&[
                ("retry-after", "2"),
                ("retry-after-ms", "1500")
            ])),
            ms(1500)
        );
        assert_eq!(
            retry_after_of(&headers(&[("retry-after-ms", "2.5")])),
            Duration::from_micros(2500)
        );
        assert_eq!(
            retry_after_of(&headers(&[("retry-after", " 7 ")])),
            ms(7000)
        );
        // Unreadable milliseconds fall back to the seconds.
        assert_eq!(
            retry_after_of(&headers(&[("retry-after-ms", "-3"), ("retry-after", "4")])),
            ms(4000)
        );
        for unread in [
            headers(&[]),
            headers(&[("retry-after", "Wed, 21 Oct 2015 07:28:00 GMT")]),
            headers(&[("retry-after-ms", "soon")]),
        ] {
            assert_eq!(retry_after_of(&unread), DEFAULT_RETRY_AFTER, "{unread:?}");
        }
    }

    #[test]
    fn a_base_url_that_is_not_http_fails_every_call_permanently() {
        for url in [
            "https://example.com",
            "example.com:80",
            "http://",
            "not a url",
        ] {
            let client = LlmClient::new(url);
            assert!(
                matches!(client.extract_uri(), Err(StageError::Permanent(_))),
                "{url}"
            );
        }
        assert_eq!(
            LlmClient::new("http://127.0.0.1:1/llm//")
                .extract_uri()
                .unwrap()
                .to_string(),
            "http://127.0.0.1:1/llm/v1/extract"
        );
    }

    #[test]
    fn an_error_answer_is_quoted_with_its_status() {
        let client = LlmClient::new("http://127.0.0.1:1");
        let described = client.describe(StatusCode::BAD_GATEWAY, b"upstream down");
        assert_eq!(
            described,
            "LLM service at http://127.0.0.1:1 answered 502 Bad Gateway: upstream down"
        );
        let long = "x".repeat(500);
        let described = client.describe(StatusCode::BAD_REQUEST, long.as_bytes());
        assert!(
            described.ends_with(&format!("{}…", "x".repeat(200))),
            "{described}"
        );
    }
}
