//! `idemstage console` as a process: plain HTTP requests for the token, the
//! CSRF check and bad input, and a real browser (headless Chromium through
//! chromedriver, driven with fantoccini) for the overview, retry and pause.
//! Screenshots of each page go to `target/console-screenshots/`.
//!
//! The browser test needs `/usr/bin/chromium` and `/usr/bin/chromedriver`
//! (Debian: `apt-get install chromium chromium-driver`; `.ci/run` installs
//! them); without them it fails, saying so.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use diesel_async::{AsyncPgConnection, RunQueryDsl};
use fantoccini::{Client, ClientBuilder, Locator};
use idemstage::runs::PgRunRepository;
use idemstage::{
    ids::ItemId,
    ids::StageName,
    ids::TenantId,
    ids::WorkerId,
    runs::ClaimToken,
    runs::{ClaimOutcome, ClaimRequest},
    stage::StagePolicy,
};
use idemstage_testkit::{count, TestDb};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{
    assert_quiet_and_sound, pipeline, send, start_pipeline_worker, stop_pipeline_worker, text,
};

const TOKEN: &str = "console-test-token-0123456789";

/// A console process, killed when dropped.
struct Console {
    child: Child,
    addr: SocketAddr,
}

impl Console {
    fn start(url: &str, extra: &[&str]) -> Console {
        let mut child = Command::new(env!("CARGO_BIN_EXE_idemstage"))
            .args(["console", "--listen", "127.0.0.1:0"])
            .args(extra)
            .env("DATABASE_URL", url)
            .env("IDEMSTAGE_CONSOLE_TOKEN", TOKEN)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start idemstage console");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("idemstage console: http://") {
                    let addr = rest.split('/').next().unwrap().to_owned();
                    let _ = tx.send(addr);
                } else {
                    eprintln!("console: {line}");
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the console printed its address")
            .parse()
            .unwrap();
        Console { child, addr }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for Console {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 exchange on a fresh connection: status, headers (lower-case
/// names), body.
async fn http(
    addr: SocketAddr,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, Vec<(String, String)>, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut request = format!(
        "{method} {target} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if method == "POST" {
        request.push_str("Content-Type: application/x-www-form-urlencoded\r\n");
    }
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    // The server may answer (413, 414) before reading the whole request: a reset
    // after the answer is fine.
    let _ = stream.read_to_end(&mut response).await;
    let response = String::from_utf8_lossy(&response).into_owned();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {response:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    (status, headers, body.to_owned())
}

fn bearer() -> (&'static str, String) {
    ("Authorization", format!("Bearer {TOKEN}"))
}

/// The first `name="csrf" value="…"` of a page.
fn csrf_of(page: &str) -> String {
    let start = page.find("name=\"csrf\" value=\"").expect("a CSRF field") + 19;
    page[start..start + 64].to_owned()
}

/// Everything the console may change, as one text.
async fn snapshot(conn: &mut AsyncPgConnection) -> String {
    #[derive(diesel::QueryableByName)]
    struct S {
        #[diesel(sql_type = diesel::sql_types::Text)]
        s: String,
    }
    diesel::sql_query(
        "SELECT coalesce((SELECT string_agg(r::text, '|' ORDER BY id) FROM stage_runs r), '')
             || coalesce((SELECT string_agg(j::text, '|' ORDER BY id) FROM job_states j), '')
             || coalesce((SELECT string_agg(l::text, '|' ORDER BY id) FROM audit_log l), '')
             || coalesce((SELECT string_agg(c::text, '|' ORDER BY queue, scope) FROM queue_controls c), '')
             AS s",
    )
    .get_result::<S>(conn)
    .await
    .unwrap()
    .s
}

/// Done items of t1 (two) and t2 (one), worked to success by an in-process
/// worker, and one of t2 whose intake died (one attempt, failed for good).
/// Returns the dead one's id.
async fn small_pipeline_run(db: &TestDb) -> ItemId {
    let mut conn = db.conn().await;
    let (t1, t2) = (
        TenantId::parse("t1").unwrap(),
        TenantId::parse("t2").unwrap(),
    );
    for (i, tenant) in [&t1, &t1, &t2].into_iter().enumerate() {
        send(&mut conn, tenant, ItemId::new(), &text(i)).await;
    }
    let dying = ItemId::new();
    send(&mut conn, &t2, dying, &text(7)).await;
    let repo = PgRunRepository::new(db.pool(2).await);
    let req = ClaimRequest {
        tenant: t2.clone(),
        item: dying,
        stage: StageName::parse("intake").unwrap(),
        input_hash: idemstage::ids::input_hash_of(text(7).as_bytes()),
        worker: WorkerId::generate(),
        policy: StagePolicy::default().with_max_attempts(1),
        upstream: None,
    };
    let ClaimOutcome::Claimed {
        run_id, attempt, ..
    } = repo.claim(&req).await.unwrap()
    else {
        panic!("not claimed")
    };
    let token = ClaimToken {
        run_id,
        tenant: t2,
        item: dying,
        stage: req.stage.clone(),
        attempt,
    };
    repo.fail(&token, "scanner on fire <b>&", false)
        .await
        .unwrap();
    let worker = start_pipeline_worker(
        db.pool(4).await,
        db.url(),
        pipeline(),
        2,
        Arc::new(idemstage::worker::Counters::default()),
    );
    let check = assert_quiet_and_sound(db.url(), 120).await;
    stop_pipeline_worker(worker).await;
    assert_eq!(check.stages_succeeded, 12, "{check:?}");
    dying
}

#[tokio::test]
async fn the_console_refuses_requests_without_the_token_posts_without_csrf_and_bad_input() {
    // Refused before it starts: exit 2, with a clear line.
    for (env_token, args, message) in [
        (None, vec![], "IDEMSTAGE_CONSOLE_TOKEN"),
        (Some("short"), vec![], "at least 16 characters"),
        (Some(TOKEN), vec!["--listen", "0.0.0.0:0"], "--allow-remote"),
    ] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_idemstage"));
        cmd.args(["console"])
            .args(&args)
            .env_remove("IDEMSTAGE_CONSOLE_TOKEN");
        cmd.env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none");
        if let Some(t) = env_token {
            cmd.env("IDEMSTAGE_CONSOLE_TOKEN", t);
        }
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }

    let db = idemstage_harness::example::db().await;
    let dying = small_pipeline_run(&db).await;
    let dying_s = dying.to_string();
    let mut conn = db.conn().await;
    let console = Console::start(db.url(), &[]);
    let addr = console.addr;
    let before = snapshot(&mut conn).await;

    // No token: 401 (the login form); a wrong bearer token: 401.
    let (status, headers, body) = http(addr, "GET", "/", &[], "").await;
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("action=\"/login\""), "{body}");
    assert!(headers.iter().any(|(n, _)| n == "www-authenticate"));
    let (status, ..) = http(
        addr,
        "GET",
        "/dead",
        &[("Authorization", "Bearer nope-nope-nope-nope")],
        "",
    )
    .await;
    assert_eq!(status, 401);
    let (status, ..) = http(
        addr,
        "GET",
        "/dead",
        &[("Cookie", "idemstage_session=0000")],
        "",
    )
    .await;
    assert_eq!(status, 401);
    let retry_body = format!("tenant=t2&item={dying_s}&stage=intake");
    let (status, ..) = http(addr, "POST", "/actions/retry", &[], &retry_body).await;
    assert_eq!(status, 401);

    // The bearer token reads; its POSTs need the CSRF token of its pages.
    let (b_name, b_value) = bearer();
    let (status, _, page) = http(addr, "GET", "/", &[(b_name, &b_value)], "").await;
    assert_eq!(status, 200, "{page}");
    let bearer_csrf = csrf_of(&page);
    let (status, _, body) = http(
        addr,
        "POST",
        "/actions/retry",
        &[(b_name, &b_value)],
        &retry_body,
    )
    .await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("CSRF"), "{body}");

    // A browser session: the login sets an HttpOnly, SameSite=Strict cookie.
    let (status, headers, _) =
        http(addr, "POST", "/login", &[], "token=wrong-token-wrong-token").await;
    assert_eq!(status, 401);
    assert!(!headers.iter().any(|(n, _)| n == "set-cookie"));
    let (status, headers, _) = http(
        addr,
        "POST",
        "/login",
        &[],
        &format!("token={TOKEN}&name=bob"),
    )
    .await;
    assert_eq!(status, 303);
    let cookie = headers
        .iter()
        .find(|(n, _)| n == "set-cookie")
        .map(|(_, v)| v.clone())
        .expect("a session cookie");
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    let session = cookie.split(';').next().unwrap().to_owned();
    let cookie_h = ("Cookie", session.as_str());
    let (status, _, page) = http(addr, "GET", "/dead", &[cookie_h], "").await;
    assert_eq!(status, 200);
    assert!(
        page.contains(&format!("retry-t2-{dying_s}-intake")),
        "{page}"
    );
    // The error text is escaped, not markup.
    assert!(page.contains("scanner on fire &lt;b&gt;&amp;"), "{page}");
    let session_csrf = csrf_of(&page);
    assert_ne!(session_csrf, bearer_csrf);
    for body in [
        retry_body.clone(),
        format!("{retry_body}&csrf="),
        format!("{retry_body}&csrf={bearer_csrf}"),
        format!("{retry_body}&csrf={}", "0".repeat(64)),
    ] {
        let (status, _, page) = http(addr, "POST", "/actions/retry", &[cookie_h], &body).await;
        assert_eq!(status, 403, "{body}: {page}");
    }
    let (status, ..) = http(addr, "POST", "/actions/pause", &[cookie_h], "stage=intake").await;
    assert_eq!(status, 403);
    assert_eq!(
        snapshot(&mut conn).await,
        before,
        "a refused POST changed something"
    );

    // Bad input: an error page with a 4xx, nothing changed.
    let done = {
        #[derive(diesel::QueryableByName)]
        struct A {
            #[diesel(sql_type = diesel::sql_types::Text)]
            item_id: String,
        }
        diesel::sql_query(
            "SELECT item_id FROM stage_runs WHERE tenant_id = 't1' AND stage = 'intake' LIMIT 1",
        )
        .get_result::<A>(&mut conn)
        .await
        .unwrap()
        .item_id
    };
    let unknown = ItemId::new().to_string();
    let csrf = format!("&csrf={session_csrf}");
    let long = "a".repeat(3000);
    for (method, target, body, want, message) in [
        (
            "GET",
            "/item?tenant=t1&item=nope".to_owned(),
            String::new(),
            400,
            "invalid item id",
        ),
        (
            "GET",
            "/item?tenant=T%201&item=".to_owned() + &done,
            String::new(),
            400,
            "invalid tenant id",
        ),
        (
            "GET",
            "/item?tenant=t1".to_owned(),
            String::new(),
            400,
            "both the tenant and the item",
        ),
        (
            "GET",
            format!("/item?tenant=t2&item={done}"),
            String::new(),
            404,
            "not found for tenant t2",
        ),
        (
            "GET",
            format!("/item?tenant=t1&item={unknown}"),
            String::new(),
            404,
            "not found for tenant t1",
        ),
        (
            "GET",
            "/dead?tenant=nobody".to_owned(),
            String::new(),
            404,
            "has no items",
        ),
        (
            "GET",
            "/dead?stage=ocr".to_owned(),
            String::new(),
            404,
            "unknown stage",
        ),
        (
            "GET",
            format!("/dead?tenant={long}"),
            String::new(),
            414,
            "at most 2048",
        ),
        (
            "GET",
            "/no-such-page".to_owned(),
            String::new(),
            404,
            "no such page",
        ),
        (
            "POST",
            "/actions/retry".to_owned(),
            format!("tenant=t1&item={done}&stage=intake{csrf}"),
            409,
            "cannot be retried: it succeeded",
        ),
        (
            "POST",
            "/actions/retry".to_owned(),
            format!("tenant=t1&item={unknown}{csrf}"),
            404,
            "not found for tenant t1",
        ),
        (
            "POST",
            "/actions/retry".to_owned(),
            format!("tenant=t2&item={dying_s}&stage=ocr{csrf}"),
            404,
            "unknown stage",
        ),
        (
            "POST",
            "/actions/retry".to_owned(),
            format!("tenant=t2&item={dying_s}&stage=extract{csrf}"),
            404,
            "has no run of stage extract",
        ),
        (
            "POST",
            "/actions/retry".to_owned(),
            format!("tenant=t2{csrf}"),
            400,
            "needs a tenant and an item",
        ),
        (
            "POST",
            "/actions/cancel".to_owned(),
            format!("tenant=t2&item=01ABC{csrf}"),
            400,
            "invalid item id",
        ),
        (
            "POST",
            "/actions/pause".to_owned(),
            format!("stage=intake&tenant=nobody{csrf}"),
            404,
            "has no items",
        ),
        (
            "POST",
            "/actions/pause".to_owned(),
            format!("stage=Not+A+Stage{csrf}"),
            400,
            "invalid",
        ),
        (
            "POST",
            "/actions/pause".to_owned(),
            format!("stage=intake{csrf}&pad={long}"),
            413,
            "at most 2048",
        ),
    ] {
        let (status, _, page) = http(addr, method, &target, &[cookie_h], &body).await;
        assert_eq!(status, want, "{method} {target} {body}: {page}");
        assert!(
            page.to_lowercase().contains(&message.to_lowercase()),
            "{method} {target} {body}: {message:?} not in {page}"
        );
    }
    assert_eq!(
        snapshot(&mut conn).await,
        before,
        "bad input changed something"
    );

    // --read-only: no action buttons, and a POST with the right CSRF token is
    // refused all the same.
    let ro = Console::start(db.url(), &["--read-only"]);
    for target in ["/", "/dead", &format!("/item?tenant=t2&item={dying_s}")] {
        let (status, _, page) = http(ro.addr, "GET", target, &[(b_name, &b_value)], "").await;
        assert_eq!(status, 200, "{target}");
        assert!(!page.contains("/actions/"), "{target}: {page}");
    }
    let (_, _, page) = http(ro.addr, "GET", "/", &[(b_name, &b_value)], "").await;
    let ro_csrf = csrf_of(&page);
    let (status, ..) = http(
        ro.addr,
        "POST",
        "/actions/retry",
        &[(b_name, &b_value)],
        &format!("{retry_body}&csrf={ro_csrf}"),
    )
    .await;
    assert_eq!(status, 403);
    assert_eq!(
        snapshot(&mut conn).await,
        before,
        "read-only changed something"
    );

    // The same request with its CSRF token does retry (so the refusals above
    // refused a request that would otherwise have changed something).
    let (status, _, page) = http(
        addr,
        "POST",
        "/actions/retry",
        &[(b_name, &b_value)],
        &format!("{retry_body}&csrf={bearer_csrf}"),
    )
    .await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("retried stage intake"), "{page}");
    assert_eq!(
        count(
            &mut conn,
            &format!(
                "SELECT 1 FROM audit_log WHERE action = 'operator.retry' AND entity_id = '{dying_s}' \
                 AND details->>'actor' = 'console:bearer'"
            )
        )
        .await,
        1
    );
}

/// `chromedriver` on a free port, killed when dropped.
struct Chromedriver {
    child: Child,
    port: u16,
}

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

impl Chromedriver {
    async fn start() -> Chromedriver {
        for path in [CHROMIUM, CHROMEDRIVER] {
            assert!(
                Path::new(path).exists(),
                "the browser tests need {path}: install the Debian packages `chromium` and \
                 `chromium-driver` (apt-get install -y chromium chromium-driver; .ci/run does)"
            );
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        // Its own process group, so that the browsers it starts go with it.
        let child = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start chromedriver");
        let driver = Chromedriver { child, port };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "chromedriver did not listen on port {port} within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        driver
    }

    async fn browser(&self, profile: &Path) -> Client {
        let caps = serde_json::json!({
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": CHROMIUM,
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    "--disable-dev-shm-usage", "--window-size=1400,1000",
                    format!("--user-data-dir={}", profile.display()),
                ],
            },
        });
        let serde_json::Value::Object(caps) = caps else {
            unreachable!()
        };
        ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{}", self.port))
            .await
            .expect("a chromium session through chromedriver")
    }
}

impl Drop for Chromedriver {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn screenshot_dir() -> PathBuf {
    // CARGO_TARGET_TMPDIR is target/tmp.
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .unwrap()
        .join("console-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn screenshot(browser: &Client, name: &str) {
    let png = browser.screenshot().await.unwrap();
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    std::fs::write(screenshot_dir().join(format!("{name}.png")), png).unwrap();
}

async fn text_of(browser: &Client, id: &str) -> String {
    browser
        .find(Locator::Id(id))
        .await
        .unwrap_or_else(|e| panic!("#{id}: {e}"))
        .text()
        .await
        .unwrap()
}

/// Clicks `#id` and waits for an element of the page it leads to.
async fn click_and_wait(browser: &Client, id: &str, then: &str) {
    browser
        .find(Locator::Id(id))
        .await
        .unwrap_or_else(|e| panic!("#{id}: {e}"))
        .click()
        .await
        .unwrap();
    browser
        .wait()
        .at_most(Duration::from_secs(30))
        .for_element(Locator::Id(then))
        .await
        .unwrap_or_else(|e| panic!("#{then} after clicking #{id}: {e}"));
}

#[tokio::test]
async fn in_a_browser_the_overview_matches_the_database_and_a_retried_dead_stage_succeeds() {
    let driver = Chromedriver::start().await;
    let db = idemstage_harness::example::db().await;
    let dying = small_pipeline_run(&db).await;
    let dying_s = dying.to_string();
    let mut conn = db.conn().await;
    let console = Console::start(db.url(), &[]);
    let profile =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("chromium-{}", ItemId::new()));
    let browser = driver.browser(&profile).await;

    let result = async {
        // Not logged in: the login form (401).
        browser.goto(&console.url("/")).await.unwrap();
        browser.wait().at_most(Duration::from_secs(30)).for_element(Locator::Id("token")).await.unwrap();
        screenshot(&browser, "login").await;
        browser.find(Locator::Id("token")).await.unwrap().send_keys(TOKEN).await.unwrap();
        browser.find(Locator::Id("name")).await.unwrap().send_keys("alice").await.unwrap();
        click_and_wait(&browser, "login", "stages").await;

        // The overview's counts are the database's.
        #[derive(diesel::QueryableByName)]
        struct Row {
            #[diesel(sql_type = diesel::sql_types::Text)]
            tenant_id: String,
            #[diesel(sql_type = diesel::sql_types::Text)]
            stage: String,
            #[diesel(sql_type = diesel::sql_types::Text)]
            status: String,
            #[diesel(sql_type = diesel::sql_types::BigInt)]
            n: i64,
        }
        let rows: Vec<Row> = diesel::sql_query(
            "SELECT tenant_id, stage, status, count(*) AS n FROM stage_runs GROUP BY 1, 2, 3",
        )
        .load(&mut conn)
        .await
        .unwrap();
        assert_eq!(rows.iter().map(|r| r.n).sum::<i64>(), 13);
        for r in &rows {
            let id = format!("count-{}-{}-{}", r.tenant_id, r.stage, r.status);
            assert_eq!(text_of(&browser, &id).await, r.n.to_string(), "#{id}");
        }
        assert_eq!(text_of(&browser, "count-t2-intake-dead").await, "1");
        assert_eq!(text_of(&browser, "count-t1-calculate-dead").await, "0");
        assert_eq!(text_of(&browser, "total-intake-success").await, "3");
        assert_eq!(text_of(&browser, "total-intake-dead").await, "1");
        // The throughput: calculate's successes of the last minute. No stage runs
        // meanwhile, so the count can only fall as the window moves on: the page's
        // lies between the database's before and after it.
        let recent = "SELECT 1 FROM stage_run_attempts a JOIN stage_runs r ON r.id = a.run_id \
                      WHERE r.stage = 'calculate' AND a.outcome = 'success' \
                      AND a.finished_at > now() - interval '60 seconds'";
        let high = count(&mut conn, recent).await;
        browser.refresh().await.unwrap();
        browser.wait().at_most(Duration::from_secs(30)).for_element(Locator::Id("stages")).await.unwrap();
        let shown: i64 = text_of(&browser, "rate-calculate").await.parse().unwrap();
        let low = count(&mut conn, recent).await;
        assert!((low..=high).contains(&shown), "{low} <= {shown} <= {high}");
        assert!(high > 0, "the successes are recent");
        screenshot(&browser, "overview").await;

        // Pause extract for t1 with its button, then resume it.
        click_and_wait(&browser, "pause-extract-t1", "done-title").await;
        assert_eq!(text_of(&browser, "done-title").await, "Paused");
        assert_eq!(
            count(&mut conn, "SELECT 1 FROM queue_controls WHERE queue = 'extract' AND scope = 't1' AND paused").await,
            1
        );
        browser.goto(&console.url("/")).await.unwrap();
        browser.wait().at_most(Duration::from_secs(30)).for_element(Locator::Id("stages")).await.unwrap();
        assert_eq!(text_of(&browser, "paused-extract-t1").await, "paused");
        assert_eq!(text_of(&browser, "paused-extract").await, "running");
        click_and_wait(&browser, "resume-extract-t1", "done-title").await;
        assert_eq!(text_of(&browser, "done-title").await, "Resumed");
        assert_eq!(
            count(&mut conn, "SELECT 1 FROM queue_controls WHERE queue = 'extract' AND paused").await,
            0
        );
        // Both changes are recorded with the session's actor, and listed, newest first.
        assert_eq!(
            count(&mut conn, "SELECT 1 FROM queue_control_changes WHERE queue = 'extract' AND scope = 't1' AND actor LIKE 'console:%'").await,
            2
        );
        browser.goto(&console.url("/")).await.unwrap();
        browser.wait().at_most(Duration::from_secs(30)).for_element(Locator::Id("changes")).await.unwrap();
        let listed = text_of(&browser, "changes").await;
        let (resume, pause) = (listed.find("resume"), listed.find("pause"));
        assert!(resume.is_some() && pause.is_some() && resume < pause, "{listed}");
        assert!(listed.contains("console:"), "{listed}");
        screenshot(&browser, "changes").await;

        // The dead list, and retry with its button.
        browser.goto(&console.url("/dead")).await.unwrap();
        let retry = format!("retry-t2-{dying_s}-intake");
        browser.wait().at_most(Duration::from_secs(30)).for_element(Locator::Id(&retry)).await.unwrap();
        assert!(text_of(&browser, &format!("dead-t2-{dying_s}-intake")).await.contains("scanner on fire <b>&"));
        screenshot(&browser, "dead").await;
        click_and_wait(&browser, &retry, "done-title").await;
        assert_eq!(text_of(&browser, "done-title").await, "Retried");
        screenshot(&browser, "retried").await;
        assert_eq!(
            count(
                &mut conn,
                &format!(
                    "SELECT 1 FROM audit_log WHERE action = 'operator.retry' AND entity_id = '{dying_s}' \
                     AND details->>'actor' = 'console:alice'"
                )
            )
            .await,
            1
        );

        // A worker runs the retried stage, and the rest of the pipeline, to success.
        let worker = start_pipeline_worker(
            db.pool(4).await,
            db.url(),
            pipeline(),
            2,
            Arc::new(idemstage::worker::Counters::default()),
        );
        let check = assert_quiet_and_sound(db.url(), 120).await;
        stop_pipeline_worker(worker).await;
        assert_eq!(check.stages_succeeded, 16, "{check:?}");
        assert_eq!(
            count(
                &mut conn,
                &format!("SELECT 1 FROM stage_runs WHERE item_id = '{dying_s}' AND status = 'success'")
            )
            .await,
            4
        );

        // Its timeline shows it.
        click_and_wait(&browser, "done-back", "item-id").await;
        assert_eq!(text_of(&browser, "item-id").await, dying_s);
        assert_eq!(text_of(&browser, "item-tenant").await, "t2");
        for stage in ["intake", "extract", "feasibility", "calculate"] {
            assert_eq!(text_of(&browser, &format!("status-{stage}")).await, "success", "{stage}");
        }
        screenshot(&browser, "item").await;

        // The search form leads to the same page.
        browser.goto(&console.url("/item")).await.unwrap();
        browser.wait().at_most(Duration::from_secs(30)).for_element(Locator::Id("search-tenant")).await.unwrap();
        browser.find(Locator::Id("search-tenant")).await.unwrap().send_keys("t2").await.unwrap();
        browser.find(Locator::Id("search-item")).await.unwrap().send_keys(&dying_s).await.unwrap();
        click_and_wait(&browser, "search-go", "item-id").await;
        assert_eq!(text_of(&browser, "status-intake").await, "success");
    }
    .await;
    let _ = browser.close().await;
    let _ = std::fs::remove_dir_all(&profile);
    result
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_pgbouncer_in_transaction_mode_the_console_reads_retries_and_pauses() {
    let db = idemstage_harness::example::db().await;
    let dying = small_pipeline_run(&db).await;
    let bouncer = idemstage_harness::PgBouncer::start(db.url(), 2);
    let console = Console::start(&bouncer.url(db.url()), &["--pooler", "transaction"]);
    let addr = console.addr;
    let (b_name, b_value) = bearer();
    let auth = [(b_name, b_value.as_str())];

    let (status, _, page) = http(addr, "GET", "/", &auth, "").await;
    assert_eq!(status, 200, "{page}\n{}", bouncer.log());
    assert!(page.contains("calculate"), "{page}");
    let csrf = csrf_of(&page);
    let timeline = format!("/item?tenant=t2&item={dying}");
    let (status, _, page) = http(addr, "GET", &timeline, &auth, "").await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("scanner on fire"), "{page}");
    let (status, _, page) = http(addr, "GET", "/dead", &auth, "").await;
    assert_eq!(status, 200, "{page}");

    // An action: a transaction of the ops layer, through the pooler too.
    let retry = format!("tenant=t2&item={dying}&stage=intake&csrf={csrf}");
    let (status, _, page) = http(addr, "POST", "/actions/retry", &auth, &retry).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("retried stage intake"), "{page}");
    let pause = format!("stage=extract&csrf={csrf}");
    let (status, _, page) = http(addr, "POST", "/actions/pause", &auth, &pause).await;
    assert_eq!(status, 200, "{page}");

    let mut conn = db.conn().await;
    let paused = idemstage_testkit::count(
        &mut conn,
        "SELECT 1 FROM queue_controls WHERE queue = 'extract' AND paused",
    )
    .await;
    assert_eq!(paused, 1);
    let revived = idemstage_testkit::count(
        &mut conn,
        "SELECT 1 FROM job_states WHERE queue = 'intake' AND state = 'created'",
    )
    .await;
    assert_eq!(revived, 1);
}

#[tokio::test]
async fn the_console_previews_a_bulk_rerun_runs_it_and_shows_its_progress() {
    let db = idemstage_harness::example::db().await;
    small_pipeline_run(&db).await;
    let mut conn = db.conn().await;
    let console = Console::start(db.url(), &[]);
    let addr = console.addr;
    let (b_name, b_value) = bearer();
    let auth = [(b_name, b_value.as_str())];
    let before = snapshot(&mut conn).await;

    // The preview: t1's two items whose calculate succeeded; nothing changed.
    let query = "action=rerun&tenant=t1&stage=calculate&status=success";
    let (status, _, page) = http(addr, "GET", &format!("/bulk?{query}"), &auth, "").await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("2 items selected, 2 to rerun"), "{page}");
    assert!(page.contains("id=\"bulk-run\""), "{page}");
    // Bad filters: 400 or 404, nothing changed.
    for (target, want) in [
        (
            "/bulk?action=rerun&tenant=t1&stage=calculate&status=done",
            400,
        ),
        ("/bulk?action=rerun&tenant=t1&stage=ocr", 404),
        ("/bulk?action=rerun&tenant=nobody&stage=calculate", 404),
        ("/bulk?action=rerun&tenant=t1", 400),
        ("/bulk?action=rerun&stage=calculate&since=yesterday", 400),
    ] {
        let (status, _, body) = http(addr, "GET", target, &auth, "").await;
        assert_eq!(status, want, "{target}: {body}");
    }
    assert_eq!(snapshot(&mut conn).await, before);
    assert_eq!(count(&mut conn, "SELECT 1 FROM bulk_actions").await, 0);

    // Without the page's CSRF token: 403. With it: started in the background.
    let form = format!("{query}&since=&until=");
    let (status, _, body) = http(addr, "POST", "/actions/bulk", &auth, &form).await;
    assert_eq!(status, 403, "{body}");
    let csrf = csrf_of(&page);
    let (status, _, body) = http(
        addr,
        "POST",
        "/actions/bulk",
        &auth,
        &format!("csrf={csrf}&{form}"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("Started"), "{body}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while count(
        &mut conn,
        "SELECT 1 FROM bulk_actions WHERE finished_at IS NOT NULL",
    )
    .await
        == 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the bulk action did not finish"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    #[derive(diesel::QueryableByName)]
    struct Id {
        #[diesel(sql_type = diesel::sql_types::Text)]
        id: String,
    }
    let id: Id = diesel::sql_query("SELECT id FROM bulk_actions")
        .get_result(&mut conn)
        .await
        .unwrap();
    let (status, _, progress) = http(addr, "GET", &format!("/bulk?id={}", id.id), &auth, "").await;
    assert_eq!(status, 200, "{progress}");
    assert!(
        progress.contains("2 items taken in 1 batches, 2 acted on; finished"),
        "{progress}"
    );
    let audited = count(
        &mut conn,
        "SELECT 1 FROM audit_log WHERE action = 'operator.rerun' \
           AND details->>'actor' = 'console:bearer'",
    )
    .await;
    assert_eq!(audited, 2);

    // The workers rerun them; the checker finds everything sound.
    let worker = start_pipeline_worker(
        db.pool(4).await,
        db.url(),
        pipeline(),
        2,
        Arc::new(idemstage::worker::Counters::default()),
    );
    assert_quiet_and_sound(db.url(), 120).await;
    stop_pipeline_worker(worker).await;
    let twice = "SELECT 1 FROM stage_run_attempts a JOIN stage_runs r ON r.id = a.run_id \
                  WHERE r.stage = 'calculate' AND a.outcome = 'success' \
                  GROUP BY r.id HAVING count(*) = 2";
    assert_eq!(count(&mut conn, twice).await, 2);

    // A read-only console refuses the POST.
    drop(console);
    let console = Console::start(db.url(), &["--read-only"]);
    let (_, _, page) = http(console.addr, "GET", "/", &auth, "").await;
    let csrf = csrf_of(&page);
    let (status, _, body) = http(
        console.addr,
        "POST",
        "/actions/bulk",
        &auth,
        &format!("csrf={csrf}&{form}"),
    )
    .await;
    assert_eq!(status, 403, "{body}");
}

#[tokio::test]
async fn the_console_delivers_a_waiting_stages_signal_once() {
    let db = idemstage_harness::example::db().await;
    let mut conn = db.conn().await;
    let t1 = TenantId::parse("t1").unwrap();
    let item = ItemId::new();
    send(&mut conn, &t1, item, "5 Kisten Bier").await;
    let mut workers =
        crate::support::Workers::start(db.url(), 1, &["--review-infeasible-s", "3600"]);
    crate::support::wait_until(db.url(), "the item waiting for review", 120, |c| {
        c.is_quiet() && c.waiting == 1
    })
    .await;
    let console = Console::start(db.url(), &[]);
    let (b_name, b_value) = bearer();
    let auth = [(b_name, b_value.as_str())];
    let (status, _, page) = http(
        console.addr,
        "GET",
        &format!("/item?tenant=t1&item={item}"),
        &auth,
        "",
    )
    .await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("id=\"signal-feasibility\""), "{page}");
    assert!(page.contains("Waits for signal review until"), "{page}");
    let csrf = csrf_of(&page);
    let post = |body: String| async move {
        http(console.addr, "POST", "/actions/signal", &auth, &body).await
    };
    let form = |signal: &str, payload: &str| {
        format!(
            "csrf={csrf}&tenant=t1&item={item}&stage=feasibility&signal={signal}&payload={}",
            payload
                .replace('{', "%7B")
                .replace('}', "%7D")
                .replace('"', "%22")
                .replace(':', "%3A")
                .replace(' ', "+")
        )
    };
    // Bad JSON (400) and another signal (409): nothing changed.
    let (status, _, body) = post(form("review", "{nope")).await;
    assert_eq!(status, 400, "{body}");
    let (status, _, body) = post(form("payment", "{}")).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(
        count(
            &mut conn,
            "SELECT 1 FROM audit_log WHERE action = 'operator.signal'"
        )
        .await,
        0
    );
    // Delivered once; the second is reported.
    let (status, _, body) = post(form("review", r#"{"approve": false}"#)).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("Delivered"), "{body}");
    let (status, _, body) = post(form("review", r#"{"approve": true}"#)).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("Delivered already"), "{body}");
    crate::support::wait_until(db.url(), "the reviewed item stopped", 60, |c| {
        c.is_quiet() && c.waiting == 0
    })
    .await;
    workers.stop_all();
    let signalled = "SELECT 1 FROM audit_log WHERE action = 'operator.signal' \
                      AND details->>'actor' = 'console:bearer'";
    assert_eq!(count(&mut conn, signalled).await, 1);
}

/// The item page of a fan-out's parent lists its fan-out with each child's end,
/// each child linked; a child's page links its parent.
#[tokio::test]
async fn the_console_shows_a_parents_fan_out_and_a_childs_parent() {
    let db = idemstage_harness::example::db().await;
    let mut conn = db.conn().await;
    let t1 = TenantId::parse("t1").unwrap();
    let item = ItemId::new();
    send(&mut conn, &t1, item, &text(2)).await;
    let pipeline = idemstage_example::fan_out_pipeline(
        idemstage_example::Chaos::default(),
        StagePolicy::default(),
    )
    .unwrap();
    let mut workers = crate::support::Workers::start(db.url(), 1, &["--fan-out"]);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let check = idemstage_testkit::check_pipeline(&mut conn, &pipeline)
            .await
            .unwrap();
        if check.is_quiet() && check.items == 3 {
            assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not quiet: {check:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    workers.stop_all();
    #[derive(diesel::QueryableByName)]
    struct Child {
        #[diesel(sql_type = diesel::sql_types::Text)]
        item_id: String,
    }
    let children: Vec<Child> =
        diesel::sql_query("SELECT item_id FROM fanout_children ORDER BY position")
            .load(&mut conn)
            .await
            .unwrap();
    assert_eq!(children.len(), 2);

    // The example binary's console over the fan-out form (`--fan-out`): a
    // parent lists no child stage as not started, a child no parent stage.
    let console = Console::start(db.url(), &["--fan-out"]);
    let (b_name, b_value) = bearer();
    let auth = [(b_name, b_value.as_str())];
    let (status, _, page) = http(
        console.addr,
        "GET",
        &format!("/item?tenant=t1&item={item}"),
        &auth,
        "",
    )
    .await;
    assert_eq!(status, 200, "{page}");
    assert!(!page.contains("not started"), "{page}");
    assert!(page.contains("id=\"fan-out-extract-1\""), "{page}");
    assert!(page.contains("2/2"), "{page}");
    assert!(page.contains("gathered by calculate"), "{page}");
    for child in &children {
        assert!(
            page.contains(&format!("/item?tenant=t1&amp;item={}", child.item_id)),
            "{page}"
        );
    }
    assert!(page.contains("success (feasibility)"), "{page}");
    let (status, _, page) = http(
        console.addr,
        "GET",
        &format!("/item?tenant=t1&item={}", children[0].item_id),
        &auth,
        "",
    )
    .await;
    assert_eq!(status, 200, "{page}");
    assert!(!page.contains("not started"), "{page}");
    assert!(page.contains("id=\"child-of\""), "{page}");
    assert!(
        page.contains(&format!("/item?tenant=t1&amp;item={item}")),
        "{page}"
    );
}
