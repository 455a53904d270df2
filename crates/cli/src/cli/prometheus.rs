//! `--metrics-listen`: the process's Prometheus recorder, and an HTTP listener that
//! serves its text exposition on `GET /metrics`.
//!
//! The library crates record through the `metrics` facade only; this is the one
//! place a recorder is installed (process-wide, once). The listener is our own
//! (hyper on a tokio listener) rather than the exporter's built-in one, so that a
//! port of 0 works and the bound address can be printed.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use super::BadInput;

/// Buckets of the stage duration histogram, in seconds: from a skip's claim (a
/// millisecond or so) to a long stage body.
const DURATION_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// How often the recorder drains its histograms' buffers when nobody scrapes.
const UPKEEP: Duration = Duration::from_secs(5);

/// Installs the Prometheus recorder for this process and serves it on `listen`
/// (`GET /metrics`, or `GET /`) until the runtime ends. Returns the bound address
/// (the port the system chose for port 0).
pub async fn serve(listen: SocketAddr) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| BadInput(format!("--metrics-listen {listen}: {e}")))?;
    let addr = listener.local_addr()?;
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(idemstage::telemetry::STAGE_DURATION.to_owned()),
            DURATION_BUCKETS,
        )?
        .install_recorder()?;
    idemstage::telemetry::describe();
    {
        let handle = handle.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(UPKEEP).await;
                handle.run_upkeep();
            }
        });
    }
    tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, say: try again shortly.
                    tracing::warn!(error = %e, "metrics listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let handle = handle.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let response = respond(&handle, &req);
                    async move { Ok::<_, Infallible>(response) }
                });
                if let Err(e) = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await
                {
                    tracing::debug!(error = %e, "metrics listener: connection ended");
                }
            });
        }
    });
    Ok(addr)
}

fn respond(handle: &PrometheusHandle, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics" | "/") => (
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            handle.render(),
        ),
        (&Method::GET, _) => (
            StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            "not found: the metrics are at /metrics\n".to_owned(),
        ),
        _ => (
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain; charset=utf-8",
            "only GET\n".to_owned(),
        ),
    };
    Response::builder()
        .status(status)
        .header(hyper::header::CONTENT_TYPE, content_type)
        .body(Full::new(Bytes::from(body)))
        .expect("a response of static parts")
}
