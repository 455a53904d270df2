//! PostgreSQL's own `isolationtester` over the specs in `tests/isolation/specs/`,
//! rendered with the library's statements (`idemstage_persistence::statements`), each
//! against a fresh database. How to write, run and bless a spec:
//! `tests/isolation/README.md`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use idemstage_persistence::statements;
use idemstage_testkit::TestDb;

/// Set to `1` to write the expected outputs instead of comparing with them.
const BLESS_ENV: &str = "IDEMSTAGE_BLESS";
/// Path of the isolationtester binary, when it is neither on PATH nor in the
/// Debian location.
const TESTER_ENV: &str = "IDEMSTAGE_ISOLATIONTESTER";
/// How long isolationtester lets a step wait before it cancels it (its default is
/// 360 s); overridden by `PGISOLATIONTIMEOUT` in the environment.
const STEP_TIMEOUT_SECS: &str = "30";
/// What a timestamp in a result becomes (see `normalize`).
const TIMESTAMP_MASK: &str = "<timestamp>";

fn isolation_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/isolation")
}

fn workspace_root() -> PathBuf {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    crate_dir
        .parent()
        .and_then(Path::parent)
        .unwrap_or(crate_dir)
        .to_owned()
}

/// `$CARGO_TARGET_DIR/isolation` (relative to the workspace root when relative), else
/// the workspace's `target/isolation`.
fn output_dir() -> PathBuf {
    let target = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => workspace_root().join(dir),
        _ => workspace_root().join("target"),
    };
    target.join("isolation")
}

fn is_statement_name(s: &str) -> bool {
    let mut bytes = s.bytes();
    bytes.next().is_some_and(|b| b.is_ascii_lowercase())
        && bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// Replaces every `{{name}}` (a lowercase statement name) with that statement's SQL.
/// Any other `{{` is left alone. An unknown name, or a statement whose text holds a
/// `}` (which would end the spec's SQL block early), is an error.
fn render(template: &str, known: &BTreeMap<&'static str, String>) -> Result<String, String> {
    let mut out = String::with_capacity(template.len() * 2);
    let mut unknown = Vec::new();
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        match after.find("}}") {
            Some(end) if is_statement_name(&after[..end]) => {
                let name = &after[..end];
                match known.get(name) {
                    Some(sql) if sql.contains('}') => {
                        return Err(format!(
                            "statement {name} contains `}}`, which ends an isolationtester \
                             SQL block: it cannot be used in a spec as it is"
                        ))
                    }
                    Some(sql) => out.push_str(sql),
                    None => unknown.push(name.to_owned()),
                }
                rest = &after[end + 2..];
            }
            _ => {
                out.push_str("{{");
                rest = after;
            }
        }
    }
    out.push_str(rest);
    if unknown.is_empty() {
        Ok(out)
    } else {
        Err(format!(
            "unknown statement(s) {}; registered in idemstage_persistence::statements::all(): {}",
            unknown.join(", "),
            known.keys().copied().collect::<Vec<_>>().join(", ")
        ))
    }
}

fn statement_map() -> BTreeMap<&'static str, String> {
    let mut map = BTreeMap::new();
    for s in statements::all() {
        assert!(
            map.insert(s.name, s.sql).is_none(),
            "statement {} is registered twice",
            s.name
        );
    }
    map
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `$IDEMSTAGE_ISOLATIONTESTER`, else `isolationtester` on PATH, else the newest
/// `/usr/lib/postgresql/<major>/lib/pgxs/src/test/isolation/isolationtester`.
/// `None` when there is none.
fn find_isolationtester() -> Result<Option<PathBuf>, String> {
    if let Some(path) = std::env::var_os(TESTER_ENV).filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        return if is_executable(&path) {
            Ok(Some(path))
        } else {
            Err(format!(
                "{TESTER_ENV}={} is not an executable file",
                path.display()
            ))
        };
    }
    if let Some(path) = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("isolationtester"))
            .find(|p| is_executable(p))
    }) {
        return Ok(Some(path));
    }
    let newest = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let major: u32 = entry.file_name().to_str()?.parse().ok()?;
            let path = entry
                .path()
                .join("lib/pgxs/src/test/isolation/isolationtester");
            is_executable(&path).then_some((major, path))
        })
        .max();
    Ok(newest.map(|(_, path)| path))
}

/// Length of a timestamp starting at `s` (`YYYY-MM-DD hh:mm:ss[.ffffff][+zz[:zz]]`, the
/// ISO output of timestamp and timestamptz), if one does.
fn timestamp_len(s: &[u8]) -> Option<usize> {
    const SHAPE: &[u8] = b"dddd-dd-dd dd:dd:dd";
    if s.len() < SHAPE.len()
        || !SHAPE.iter().zip(s).all(|(&want, &got)| {
            if want == b'd' {
                got.is_ascii_digit()
            } else {
                want == got
            }
        })
    {
        return None;
    }
    let digits = |from: usize| s[from..].iter().take_while(|b| b.is_ascii_digit()).count();
    let mut n = SHAPE.len();
    if s.get(n) == Some(&b'.') && digits(n + 1) > 0 {
        n += 1 + digits(n + 1);
    }
    if matches!(s.get(n), Some(b'+' | b'-')) && digits(n + 1) == 2 {
        n += 3;
        while s.get(n) == Some(&b':') && digits(n + 1) == 2 {
            n += 3;
        }
    }
    Some(n)
}

/// `text` with every timestamp replaced by `TIMESTAMP_MASK`.
fn mask_timestamps(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let (mut i, mut copied) = (0, 0);
    while i < bytes.len() {
        // A timestamp starts with a digit that does not continue a number.
        let starts = bytes[i].is_ascii_digit() && (i == 0 || !bytes[i - 1].is_ascii_digit());
        match timestamp_len(&bytes[i..]).filter(|_| starts) {
            Some(n) => {
                out.push_str(&text[copied..i]);
                out.push_str(TIMESTAMP_MASK);
                i += n;
                copied = i;
            }
            None => i += 1,
        }
    }
    out.push_str(&text[copied..]);
    out
}

/// The column widths of a result's dash line (`---+-+----`), if `line` is one.
fn dash_widths(line: &str) -> Option<Vec<usize>> {
    let widths: Vec<usize> = line.split('+').map(str::len).collect();
    let dashes_only = line.bytes().all(|b| b == b'-' || b == b'+');
    (dashes_only && widths.iter().all(|&w| w > 0)).then_some(widths)
}

/// The fields of a result line (header or row) whose columns have `widths`.
fn split_fields<'a>(line: &'a str, widths: &[usize]) -> Option<Vec<&'a str>> {
    let mut fields = Vec::with_capacity(widths.len());
    let mut at = 0;
    for (i, &w) in widths.iter().enumerate() {
        fields.push(line.get(at..at + w)?);
        at += w;
        if i + 1 < widths.len() {
            (line.get(at..at + 1)? == "|").then_some(())?;
            at += 1;
        }
    }
    (at == line.len()).then_some(fields)
}

fn is_row_count(line: &str) -> bool {
    line.strip_prefix('(')
        .and_then(|l| l.strip_suffix(" row)").or_else(|| l.strip_suffix(" rows)")))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// A result table (header, dash line, rows) with its timestamps masked. The columns
/// that held one are re-padded to their new width, left-aligned as PQprint aligns
/// text; the others are kept as printed. `None` if the lines are not such a table.
fn mask_table(header: &str, dashes: &str, rows: &[&str]) -> Option<Vec<String>> {
    let widths = dash_widths(dashes)?;
    let mut lines: Vec<Vec<String>> = Vec::with_capacity(rows.len() + 1);
    for line in std::iter::once(&header).chain(rows) {
        let fields = split_fields(line, &widths)?;
        lines.push(fields.into_iter().map(str::to_owned).collect());
    }
    let mut new_widths = widths.clone();
    for (col, width) in new_widths.iter_mut().enumerate() {
        let masked: Vec<String> = lines.iter().map(|l| mask_timestamps(&l[col])).collect();
        if masked.iter().zip(&lines).all(|(m, l)| *m == l[col]) {
            continue;
        }
        let masked: Vec<String> = masked.iter().map(|m| m.trim_end().to_owned()).collect();
        *width = masked.iter().map(String::len).max().unwrap_or(0);
        for (line, m) in lines.iter_mut().zip(masked) {
            line[col] = format!("{m:<w$}", w = *width);
        }
    }
    let mut out: Vec<String> = lines.iter().map(|fields| fields.join("|")).collect();
    let dash_line = new_widths
        .iter()
        .map(|&w| "-".repeat(w))
        .collect::<Vec<_>>()
        .join("+");
    out.insert(1, dash_line);
    Some(out)
}

/// isolationtester's output made comparable across runs: every timestamp becomes
/// `<timestamp>` (their digits and width change from run to run), and a result table
/// holding one is realigned.
fn normalize(output: &str) -> String {
    let lines: Vec<&str> = output.split('\n').collect();
    let mut out: Vec<String> = Vec::with_capacity(lines.len());
    let mut i = 0;
    while i < lines.len() {
        if i + 1 < lines.len() && dash_widths(lines[i + 1]).is_some() {
            if let Some(end) = (i + 2..lines.len()).find(|&j| is_row_count(lines[j])) {
                if let Some(table) = mask_table(lines[i], lines[i + 1], &lines[i + 2..end]) {
                    out.extend(table);
                    i = end;
                    continue;
                }
            }
        }
        out.push(mask_timestamps(lines[i]));
        i += 1;
    }
    out.join("\n")
}

/// `diff -u expected actual`, or both texts in full where `diff` cannot run.
fn diff(expected: &Path, actual: &Path) -> String {
    match Command::new("diff")
        .arg("-u")
        .arg(expected)
        .arg(actual)
        .output()
    {
        Ok(out) if out.status.code() == Some(1) => String::from_utf8_lossy(&out.stdout).into(),
        _ => format!(
            "--- {}\n{}\n+++ {}\n{}",
            expected.display(),
            std::fs::read_to_string(expected).unwrap_or_default(),
            actual.display(),
            std::fs::read_to_string(actual).unwrap_or_default()
        ),
    }
}

/// Runs isolationtester on the rendered spec against `url`; its stdout, normalized.
fn run_isolationtester(tester: &Path, spec: &Path, url: &str) -> Result<String, String> {
    let mut command = Command::new(tester);
    command
        .arg(url)
        .stdin(std::fs::File::open(spec).map_err(|e| format!("open {}: {e}", spec.display()))?)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if std::env::var_os("PGISOLATIONTIMEOUT").is_none() {
        command.env("PGISOLATIONTIMEOUT", STEP_TIMEOUT_SECS);
    }
    let out = command
        .output()
        .map_err(|e| format!("run {}: {e}", tester.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // A failed setup ends the run with a message on stderr; a failed teardown only
    // writes one there, and the run goes on: either is a failure.
    if !out.status.success() || !stderr.trim().is_empty() {
        return Err(format!(
            "isolationtester failed ({}) on {}\n--- stderr\n{stderr}\n--- stdout\n{stdout}",
            out.status,
            spec.display()
        ));
    }
    Ok(normalize(&stdout))
}

/// One spec: render, run on a fresh database, compare (or bless).
async fn check_spec(tester: &Path, template: &Path, bless: bool) -> Result<(), String> {
    let name = template
        .file_stem()
        .and_then(|s| s.to_str())
        .ok_or_else(|| format!("bad spec file name {}", template.display()))?
        .to_owned();
    let text = std::fs::read_to_string(template)
        .map_err(|e| format!("read {}: {e}", template.display()))?;
    let rendered = render(&text, &statement_map()).map_err(|e| format!("{name}.spec: {e}"))?;
    let out_dir = output_dir();
    std::fs::create_dir_all(&out_dir).map_err(|e| format!("{}: {e}", out_dir.display()))?;
    let spec = out_dir.join(format!("{name}.spec"));
    let header = format!(
        "# Rendered from {} with idemstage_persistence::statements: do not edit.\n",
        template.display()
    );
    std::fs::write(&spec, header + &rendered).map_err(|e| format!("{}: {e}", spec.display()))?;

    let db = TestDb::new().await;
    let (tester, spec_path, url) = (tester.to_owned(), spec.clone(), db.url().to_owned());
    let output =
        tokio::task::spawn_blocking(move || run_isolationtester(&tester, &spec_path, &url))
            .await
            .map_err(|e| format!("isolationtester thread: {e}"))??;

    let expected = isolation_dir().join("expected").join(format!("{name}.out"));
    if bless {
        std::fs::write(&expected, &output).map_err(|e| format!("{}: {e}", expected.display()))?;
        eprintln!("isolation: blessed {}", expected.display());
        return Ok(());
    }
    let actual = out_dir.join(format!("{name}.out"));
    std::fs::write(&actual, &output).map_err(|e| format!("{}: {e}", actual.display()))?;
    match std::fs::read_to_string(&expected) {
        Ok(want) if want == output => Ok(()),
        Ok(_) => Err(format!(
            "{name}: isolationtester output differs from {} (rendered spec: {}; \
             IDEMSTAGE_BLESS=1 rewrites the expected file)\n{}",
            expected.display(),
            spec.display(),
            diff(&expected, &actual)
        )),
        Err(e) => Err(format!(
            "{name}: no expected output {} ({e}); run with IDEMSTAGE_BLESS=1 to write it \
             from {}, then review it",
            expected.display(),
            actual.display()
        )),
    }
}

fn files_with_extension(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|entry| entry.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    files.sort();
    files
}

/// The major version of the server under `DATABASE_URL`, e.g. `15`.
async fn server_major() -> String {
    #[derive(diesel::QueryableByName)]
    struct Version {
        #[diesel(sql_type = diesel::sql_types::Text)]
        major: String,
    }
    let mut conn = idemstage_persistence::connect(&idemstage_testkit::server_url())
        .await
        .expect("connect to DATABASE_URL");
    let version: Version = diesel_async::RunQueryDsl::get_result(
        diesel::sql_query(
            "SELECT (current_setting('server_version_num')::int / 10000)::text AS major",
        ),
        &mut conn,
    )
    .await
    .expect("server version");
    version.major
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn specs_give_their_expected_output() {
    let tester = match find_isolationtester() {
        Ok(Some(tester)) => tester,
        Ok(None) => panic!(
            "PostgreSQL's isolationtester was not found (not in {TESTER_ENV}, not on PATH, not \
             under /usr/lib/postgresql/*/lib/pgxs/src/test/isolation/). It comes with the \
             client package of the server's major version: `apt-get install \
             postgresql-client-{}` (Debian); or set {TESTER_ENV} to the binary.",
            server_major().await
        ),
        Err(e) => panic!("{e}"),
    };
    let bless = std::env::var(BLESS_ENV).is_ok_and(|v| v == "1");
    let specs = files_with_extension(&isolation_dir().join("specs"), "spec");
    assert!(!specs.is_empty(), "no specs in tests/isolation/specs");
    let mut failures = Vec::new();
    for spec in &specs {
        if let Err(e) = check_spec(&tester, spec, bless).await {
            failures.push(e);
        }
    }
    // An expected output without its spec is a leftover of a renamed or removed spec.
    for out in files_with_extension(&isolation_dir().join("expected"), "out") {
        let stem = out.file_stem().unwrap_or_default();
        if !specs.iter().any(|s| s.file_stem() == Some(stem)) {
            failures.push(format!("{} has no spec", out.display()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn placeholders_become_the_statements_and_unknown_names_fail() {
    let known = statement_map();
    let spec = "setup { PREPARE c(text, int, jsonb) AS {{job_complete}}; }\n\
                step s { SELECT '{{1,2},{3,4}}'::int[]; }";
    let rendered = render(spec, &known).unwrap();
    assert!(rendered.contains(&known["job_complete"]));
    assert!(rendered.contains("'{{1,2},{3,4}}'"));
    assert!(!rendered.contains("{{job_complete}}"));

    let err = render("step s { {{job_complete}} {{no_such_statement}} }", &known).unwrap_err();
    assert!(err.contains("no_such_statement"), "{err}");
}

#[test]
fn timestamps_are_masked_and_their_columns_realigned() {
    let output = "\
step s2: EXECUTE job_fetch('q', 1);
id|attempt|lease_expires_at             |n |last_error
--+-------+-----------------------------+--+----------
j1|      2|2026-12-01 07:02:51.591833+00|10|a|b       
j2|      3|2026-12-01 07:02:51.5+00     | 7|          
(2 rows)

x
-
1
(1 row)

at 2026-12-01 07:02:51+00:00, not 2026-12-01";
    assert_eq!(
        normalize(output),
        "\
step s2: EXECUTE job_fetch('q', 1);
id|attempt|lease_expires_at|n |last_error
--+-------+----------------+--+----------
j1|      2|<timestamp>     |10|a|b       
j2|      3|<timestamp>     | 7|          
(2 rows)

x
-
1
(1 row)

at <timestamp>, not 2026-12-01"
    );
}
