//! The "LLM" service and its client, against the real server on 127.0.0.1: the
//! service extracts what the in-transaction parse does, its faults reach a stage
//! as the right `StageError`, and it counts only the calls it answered 200.

use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::header::HeaderMap;
use hyper::{Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idemstage::serde_json::{self, json};
use idemstage::{ids::ItemId, ids::TenantId, stage::StageError};
use idemstage_example::extract_positions;
use idemstage_example::llm::{LlmClient, LlmConfig, LlmServer, MAX_TEXT_BYTES};

fn tenant() -> TenantId {
    TenantId::parse("acme").unwrap()
}

fn start(config: LlmConfig) -> (LlmServer, LlmClient) {
    let server = LlmServer::start(config).expect("the LLM service starts");
    let client = LlmClient::new(server.url());
    (server, client)
}

async fn extract(
    client: &LlmClient,
    text: &str,
) -> Result<Vec<idemstage_example::Extraktion>, StageError> {
    client.extract(&tenant(), &ItemId::new(), text).await
}

/// A request as any client might send it: status, headers and body of the answer.
async fn post(server: &LlmServer, body: impl Into<Bytes>) -> (StatusCode, HeaderMap, String) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let request = Request::post(format!("{}/v1/extract", server.url()))
        .header("content-type", "application/json")
        .body(Full::new(body.into()))
        .unwrap();
    let (parts, body) = client.request(request).await.unwrap().into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8(body.to_vec()).unwrap(),
    )
}

#[tokio::test]
async fn the_service_extracts_exactly_what_the_in_transaction_parse_does() {
    let (server, client) = start(LlmConfig::default());
    let long_line = format!("3 Stk {}", "Größenänderung ".repeat(60));
    let inputs = [
        "10 Stk Schrauben M8\n\n2,5 m Kabel NYM\nMontage vor Ort\n3 Fass Öl",
        "12 m2 Fliesen für die Küche\r\n4 Stk Türgriffe aus Messing\n\
         1 psch Entsorgung (Bauschutt, groß)\n0,75 h Prüfung der Übergänge\nStraße räumen",
        "1e300 stk Schrauben\n1e999 Stk Muttern\n-1e999 kg Sand\n-5 m Kabel\n-0 h Pause\n\
         0,1 l Öl\n1.2345678901234567e-5 kg Staub",
        "inf stk Schrauben\nNaN stk Muttern\n\"Zitat\" \\ Backslash\t😀 Emoji",
        long_line.as_str(),
        "",
        "  \n\t\n ",
    ];
    for text in inputs {
        let got = extract(&client, text).await.unwrap();
        let want = extract_positions(text);
        assert_eq!(got, want, "{text:?}");
        // Debug tells -0 from 0 where == does not.
        assert_eq!(format!("{got:?}"), format!("{want:?}"), "{text:?}");
    }

    // Not trivially equal: the German input survives with its umlauts.
    let german = extract(&client, inputs[1]).await.unwrap();
    assert_eq!(german.len(), 5);
    assert_eq!(german[0].description, "Fliesen für die Küche");
    assert_eq!(german[3].quantity, Some(0.75));
    assert_eq!(german[3].description, "Prüfung der Übergänge");
    assert_eq!(german[4].description, "Straße räumen");
    assert_eq!(german[4].quantity, None);
    // And so do the infinity of 1e999 and a description cut at 500 characters.
    let odd = extract(&client, inputs[2]).await.unwrap();
    assert_eq!(odd[1].quantity, Some(f64::INFINITY));
    assert_eq!(odd[2].quantity, Some(f64::NEG_INFINITY));
    let long = extract(&client, &long_line).await.unwrap();
    assert_eq!(long[0].description.chars().count(), 500);

    let answered = inputs.len() as u64 + 3;
    assert_eq!((server.calls(), server.requests()), (answered, answered));
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn every_nth_request_is_rate_limited_with_the_configured_wait() {
    let retry_after = Duration::from_millis(1500);
    let (server, client) = start(
        LlmConfig::default()
            .with_rate_limited_every(3)
            .with_retry_after(retry_after),
    );
    let mut outcomes = Vec::new();
    for _ in 0..7 {
        outcomes.push(match extract(&client, "1 Stk Schraube").await {
            Ok(_) => "ok".to_owned(),
            Err(StageError::RateLimited { retry_after: wait }) => {
                assert_eq!(wait, retry_after);
                "429".to_owned()
            }
            Err(e) => panic!("{e}"),
        });
    }
    assert_eq!(outcomes, ["ok", "ok", "429", "ok", "ok", "429", "ok"]);
    assert_eq!((server.calls(), server.requests()), (5, 7));

    // The 8th is answered, the 9th refused: its headers say 1.5 s both ways, in
    // whole seconds (rounded up) and in milliseconds.
    extract(&client, "1 Stk Schraube").await.unwrap();
    let body = json!({ "tenant": "acme", "item": ItemId::new().to_string(), "text": "x" });
    let (status, headers, body) = post(&server, serde_json::to_vec(&body).unwrap()).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert_eq!(headers["retry-after"], "2");
    assert_eq!(headers["retry-after-ms"], "1500");
    assert_eq!((server.calls(), server.requests()), (6, 9));
}

#[tokio::test]
async fn a_500_is_transient_and_not_paid() {
    let (server, client) = start(LlmConfig::default().with_failure_rate(1.0));
    match extract(&client, "1 Stk Schraube").await {
        Err(StageError::Transient(message)) => {
            assert!(message.to_string().contains("500"), "{message}");
            assert!(
                message.to_string().contains("injected failure"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!((server.calls(), server.requests()), (0, 1));
}

#[tokio::test]
async fn the_failures_are_drawn_from_the_seed_and_only_200s_are_counted() {
    let run = |seed: u64| async move {
        let (server, client) = start(LlmConfig::default().with_failure_rate(0.5).with_seed(seed));
        let mut pattern = String::new();
        for _ in 0..32 {
            pattern.push(match extract(&client, "2 h Montage").await {
                Ok(_) => '+',
                Err(StageError::Transient(_)) => '5',
                Err(e) => panic!("{e}"),
            });
        }
        let ok = pattern.matches('+').count() as u64;
        assert_eq!((server.calls(), server.requests()), (ok, 32), "{pattern}");
        pattern
    };
    let first = run(7).await;
    assert!(first.contains('+') && first.contains('5'), "{first}");
    assert_eq!(run(7).await, first);
    assert_ne!(run(8).await, first);
}

#[tokio::test]
async fn a_request_the_service_refuses_is_permanent() {
    let (server, client) = start(LlmConfig::default());
    // The core's input limit: one byte more is refused, the limit itself is not.
    match extract(&client, &"x".repeat(MAX_TEXT_BYTES + 1)).await {
        Err(StageError::Permanent(message)) => {
            assert!(message.to_string().contains("422"), "{message}");
            assert!(
                message.to_string().contains("more than the limit"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        extract(&client, &"x".repeat(MAX_TEXT_BYTES))
            .await
            .unwrap()
            .len(),
        1
    );

    // Whatever else is not a request is answered 422 with a JSON error.
    let item = ItemId::new().to_string();
    let refused: [(Vec<u8>, &str); 4] = [
        (b"{\"tenant\": \"acme\"".to_vec(), "invalid request body"),
        (
            serde_json::to_vec(&json!({ "tenant": "acme", "item": item })).unwrap(),
            "missing field `text`",
        ),
        (
            serde_json::to_vec(&json!({ "tenant": "Acme Corp", "item": item, "text": "" }))
                .unwrap(),
            "tenant",
        ),
        (
            serde_json::to_vec(&json!({ "tenant": "acme", "item": "42", "text": "" })).unwrap(),
            "item",
        ),
    ];
    for (body, reason) in refused {
        let (status, headers, answer) = post(&server, body).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{answer}");
        assert_eq!(headers["content-type"], "application/json");
        let answer: serde_json::Value = serde_json::from_str(&answer).unwrap();
        let error = answer["error"].as_str().unwrap();
        assert!(error.contains(reason), "{error} lacks {reason:?}");
    }
    assert_eq!((server.calls(), server.requests()), (1, 6));
}

#[tokio::test]
async fn every_answer_comes_after_the_latency() {
    let latency = Duration::from_millis(300);
    let (server, client) = start(LlmConfig::default().with_latency(latency));
    for _ in 0..2 {
        let started = Instant::now();
        extract(&client, "1 Stk Schraube").await.unwrap();
        assert!(started.elapsed() >= latency, "{:?}", started.elapsed());
    }
    assert_eq!(server.calls(), 2);
}

#[tokio::test]
async fn no_answer_within_the_timeout_is_transient() {
    let (server, client) = start(LlmConfig::default().with_latency(Duration::from_secs(600)));
    let client = client.with_timeout(Duration::from_millis(100));
    match extract(&client, "1 Stk Schraube").await {
        Err(StageError::Transient(message)) => {
            assert!(
                message.to_string().contains("no answer within 100ms"),
                "{message}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(server.calls(), 0);
}

#[tokio::test]
async fn a_service_that_is_gone_is_transient() {
    let (server, client) = start(LlmConfig::default());
    extract(&client, "1 Stk Schraube").await.unwrap();
    let counters = server.counters();
    server.shutdown().await.unwrap();
    match extract(&client, "1 Stk Schraube").await {
        Err(StageError::Transient(message)) => {
            assert!(message.to_string().contains("request failed"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    // The counters outlive the server.
    assert_eq!((counters.calls(), counters.requests()), (1, 1));
}

#[tokio::test]
async fn an_invalid_config_is_refused() {
    for config in [
        LlmConfig::default().with_rate_limited_every(0),
        LlmConfig::default().with_failure_rate(1.5),
        LlmConfig::default().with_failure_rate(f64::NAN),
    ] {
        let err = LlmServer::start(config.clone()).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{config:?}");
    }
}
