//! Project automation, run as `cargo xtask <command>` (matklad's xtask pattern:
//! plain Rust instead of shell scripts; `anyhow`, and `serde_json` and `plotters`
//! for the pressure cells' reports and pictures).

mod bench;
mod pg;
mod pressure;
mod pressure_plot;

use std::{
    env,
    os::unix::process::ExitStatusExt,
    path::{Path, PathBuf},
    process::{Command, ExitCode, ExitStatus},
};

use anyhow::{Context, Result};

const USAGE: &str = "\
Usage: cargo xtask <command> [args...]

Commands:
  db start       start the disposable PostgreSQL cluster (idempotent), print its URL
  db start --standby [--async]
                 the same as a primary with a streaming hot standby (cloned afresh;
                 synchronous replication unless --async); prints the multi-host URL
                 (target_session_attrs=read-write) that finds the primary after a
                 failover
  db stop        stop the disposable cluster (and its standby; ok if not running)
  db status      show running/stopped, URL and data directory
  db url         print the URL only (exit 1 if not running)
  migrate [args] run `idemstage migrate [args]` against the database
  test [args]    run `cargo test --workspace [args]` against the database server
  demo [args]    run `idemstage demo [args]` (release) on database idemstage_demo;
                 with --console the web console stays up on its data afterwards
                 (URL and a fresh token printed) until Ctrl-C
  bench [args]   benchmarks and their references (pgbench; pg-boss, graphile-worker
                 and awa in bench/peers) in one run on database idemstage_bench,
                 once per durability mode; writes target/bench/report.json.
                 --durable off|on|both (default both; with DATABASE_URL: the
                 server's own settings, once)
                 args (passed on): --duration-s S --concurrency N --jobs N --items N
  pressure [--cells idle_in_tx,active_readers,sustained_high_load,event_burst,clean]
           [--items-per-s R | --jobs-per-s R] [--together]
           [--clean-s N] [--stress-s N] [--recovery-s N]
           [--workloads pipeline,queue,fan-out] [--no-awa]
           [--pressure-prefetch N] [--pressure-retention-s S]
                 the pressure cells (clean -> stress -> recovery at a fixed offered
                 rate, default half our pipeline workers' measured peak) for ours
                 (the example pipeline, a no-op queue) and awa's no-op queue on
                 database idemstage_pressure_bench; writes target/bench/pressure/
                 <cell>.json and <cell>.svg. --together: a cell's runs start at
                 once, each on its own database, at --jobs-per-s R each
  soak [--minutes N]
                 run the soak test (release): N minutes (default 10) of random
                 faults (SIGKILL, SIGSTOP, terminated connections) against 3
                 `idemstage worker` processes, then every invariant checked
  soak --pressure [--minutes N] [--workloads pipeline,queue] [--no-awa]
                 the long pressure run: N minutes (default 120) at 200 jobs/s,
                 ours (pipeline, queue) and awa at the same time, each on its
                 own database, dead tuples every 30 s (cargo xtask pressure's
                 clean cell with --together)
  help           show this text

Database selection:
  If DATABASE_URL is set, that server is used and nothing is started or stopped.
  Otherwise a disposable cluster is started from local PostgreSQL server binaries
  (PATH, else the newest /usr/lib/postgresql/*/bin). A cluster started by a command
  is stopped when the command ends; one started with `db start` is left running.
  IDEMSTAGE_PG_DURABLE=1 starts the cluster with fsync/synchronous_commit/
  full_page_writes left on (for benchmarks).
";

fn main() -> ExitCode {
    match run() {
        // Child exit codes are 0..=255 on Unix; anything else is our own failure.
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(err) => {
            eprintln!("xtask: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<i32> {
    let args: Vec<String> = env::args().skip(1).collect();
    let (cmd, rest) = match args.split_first() {
        Some((cmd, rest)) => (cmd.as_str(), rest),
        None => ("help", &[][..]),
    };
    match cmd {
        "db" => db(rest),
        "migrate" => with_database("postgres", |url| {
            run_status(
                cargo()
                    .args(["run", "-p", "idemstage-dev", "--bin", "idemstage", "--"])
                    .arg("migrate")
                    .args(rest)
                    .env("DATABASE_URL", url),
            )
        }),
        // Tests create their own databases, so they get the maintenance db.
        "test" => {
            let mut totals = TestTotals::default();
            let code = with_database("postgres", |url| {
                run_tests(
                    cargo()
                        .args(["test", "--workspace", "--no-fail-fast"])
                        .args(rest)
                        .env("DATABASE_URL", url),
                    &mut totals,
                )
            })?;
            // Last, after the server is stopped: one closing line for the whole run
            // (cargo's own last line is a doc-test summary that may count 0).
            println!("tests: {} passed, {} failed", totals.passed, totals.failed);
            Ok(code)
        }
        // Ours and the references (pgbench, pg-boss) on one server, in one run.
        "bench" => bench::main(rest),
        "pressure" => pressure::main(rest),
        // Each long-running mode gets its own database so they cannot disturb
        // each other or the test/migrate database.
        "soak" => {
            let pressure = rest.first().is_some_and(|a| a == "--pressure");
            let rest = if pressure { &rest[1..] } else { rest };
            // `--pressure` passes `--workloads W` and `--no-awa` on to the cells.
            let mut minutes: Option<u64> = None;
            let mut passed: Vec<String> = Vec::new();
            let mut i = 0;
            while i < rest.len() {
                let value = rest.get(i + 1);
                match (rest[i].as_str(), value) {
                    ("--minutes", Some(n)) => match n.parse::<u64>() {
                        Ok(n) if n > 0 => minutes = Some(n),
                        _ => {
                            eprintln!("xtask: --minutes needs a positive whole number");
                            return Ok(2);
                        }
                    },
                    ("--workloads", Some(w)) if pressure => {
                        passed.extend(["--workloads".to_owned(), w.clone()]);
                    }
                    ("--no-awa", _) if pressure => {
                        passed.push("--no-awa".to_owned());
                        i += 1;
                        continue;
                    }
                    _ => {
                        eprintln!(
                            "xtask: usage: cargo xtask soak [--minutes N] | \
                             soak --pressure [--minutes N] [--workloads W] [--no-awa]"
                        );
                        return Ok(2);
                    }
                }
                i += 2;
            }
            let minutes = minutes.unwrap_or(if pressure { 120 } else { 10 });
            if pressure {
                // The public benchmark's long run: 200 jobs/s to every workload
                // (the pipeline: 50 items of four stages) for the whole soak, ours
                // and awa's at the same time on one server, each on a database of
                // its own, dead tuples sampled every 30 s.
                let soak: Vec<String> = [
                    "--cells",
                    "clean",
                    "--together",
                    "--jobs-per-s",
                    "200",
                    "--clean-s",
                    "60",
                    "--recovery-s",
                    "60",
                    "--sample-every-s",
                    "30",
                    "--stress-s",
                ]
                .iter()
                .map(|s| (*s).to_owned())
                .chain([(minutes * 60).to_string()])
                .chain(passed)
                .collect();
                return pressure::main(&soak);
            }
            // The soak test creates its own database, like every test.
            with_database("postgres", |url| {
                run_status(
                    cargo()
                        .args(["test", "--release", "-p", "idemstage-dev", "--test", "it"])
                        .args(["soak::", "--", "--nocapture"])
                        .env("IDEMSTAGE_SOAK_SECS", (minutes * 60).to_string())
                        .env("DATABASE_URL", url),
                )
            })
        }
        "demo" => {
            // `cargo xtask demo --console [-- demo args]`: the console stays up on
            // the demo's data after the report.
            let console = rest.iter().any(|a| a == "--console");
            let rest: Vec<String> = rest.iter().filter(|a| *a != "--console").cloned().collect();
            with_database(&format!("idemstage_{cmd}"), |url| {
                let code = run_status(
                    cargo()
                        .args(["run", "--release", "-p", "idemstage-dev"])
                        .args(["--bin", "idemstage", "--", cmd])
                        // `cargo xtask demo -- --items 10` works like without `--`.
                        .args(rest.strip_prefix(&["--".to_owned()][..]).unwrap_or(&rest))
                        .env("DATABASE_URL", url),
                )?;
                // 0: sound, 1: an invariant broken (worth a look); else no data.
                if !console || code > 1 {
                    return Ok(code);
                }
                demo_console(url)?;
                Ok(code)
            })
        }
        "help" | "-h" | "--help" => {
            print!("{USAGE}");
            Ok(0)
        }
        other => {
            eprintln!("xtask: unknown command `{other}`\n\n{USAGE}");
            Ok(2)
        }
    }
}

/// `idemstage console` on the demo's database with a random token, on
/// 127.0.0.1:8080 (or a free port if that is taken), until Ctrl-C.
fn demo_console(url: &str) -> Result<()> {
    let mut bytes = [0u8; 24];
    std::io::Read::read_exact(
        &mut std::fs::File::open("/dev/urandom").context("open /dev/urandom")?,
        &mut bytes,
    )
    .context("read /dev/urandom")?;
    let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let port = std::net::TcpListener::bind("127.0.0.1:8080")
        .or_else(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .and_then(|l| l.local_addr())
        .context("find a free port for the console")?
        .port();
    println!();
    println!("xtask: the console on the demo's data: http://127.0.0.1:{port}/");
    println!("xtask: access token: {token}");
    println!("xtask: (log in with it in a browser, or curl -H 'Authorization: Bearer {token}' ...); Ctrl-C stops it");
    run_status(
        cargo()
            .args([
                "run",
                "--release",
                "-p",
                "idemstage-dev",
                "--bin",
                "idemstage",
                "--",
            ])
            .args(["console", "--listen", &format!("127.0.0.1:{port}")])
            .env("DATABASE_URL", url)
            .env("IDEMSTAGE_CONSOLE_TOKEN", &token),
    )?;
    Ok(())
}

fn db(args: &[String]) -> Result<i32> {
    if let Some(code) = pg::standby::db(args)? {
        return Ok(code);
    }
    let sub = match args {
        [sub] => sub.as_str(),
        _ => "",
    };
    if !matches!(sub, "start" | "stop" | "status" | "url") {
        eprintln!("xtask: usage: cargo xtask db start [--standby [--async]]|stop|status|url");
        return Ok(2);
    }
    let cluster = pg::Cluster::discover()?;
    if env::var_os("DATABASE_URL").is_some_and(|u| !u.is_empty()) && sub != "url" {
        eprintln!(
            "xtask: note: DATABASE_URL is set, so other xtask commands use it, not this cluster"
        );
    }
    match sub {
        "start" => {
            let started = cluster.start()?;
            let verb = if started.by_us {
                "started"
            } else {
                "already running"
            };
            eprintln!(
                "xtask: disposable PostgreSQL {} {verb} (data: {})",
                cluster.version(),
                cluster.data_dir().display()
            );
            println!("{}", cluster.url(started.port, "postgres"));
        }
        "stop" => {
            if cluster.stop()? {
                eprintln!("xtask: stopped disposable PostgreSQL");
            } else {
                eprintln!("xtask: disposable PostgreSQL was not running");
            }
        }
        "status" => {
            let running = cluster.is_running()?;
            let url = match cluster.port(running) {
                Some(port) => cluster.url(port, "postgres"),
                None => "(none yet)".to_owned(),
            };
            println!("status: {}", if running { "running" } else { "stopped" });
            println!("url:    {url}");
            println!("data:   {}", cluster.data_dir().display());
            if let Some(url) = pg::standby::multi_host_url_if_running(&cluster)? {
                println!("with a standby: {url}");
            }
        }
        _ => {
            let port = if cluster.is_running()? {
                cluster.port(true)
            } else {
                None
            };
            let Some(port) = port else {
                eprintln!("xtask: disposable PostgreSQL is not running (start it with `cargo xtask db start`)");
                return Ok(1);
            };
            println!("{}", cluster.url(port, "postgres"));
        }
    }
    Ok(0)
}

/// Runs `f` with the URL of database `db`: DATABASE_URL unchanged if set, else
/// the disposable cluster, started if needed and then stopped again afterwards.
fn with_database(db: &str, f: impl FnOnce(&str) -> Result<i32>) -> Result<i32> {
    with_database_durable(db, None, f)
}

/// [`with_database`], the disposable cluster started durable or not as `durable`
/// says (`None`: as `IDEMSTAGE_PG_DURABLE`). A cluster that is already running
/// keeps its settings: the caller checks them.
fn with_database_durable<T>(
    db: &str,
    durable: Option<bool>,
    f: impl FnOnce(&str) -> Result<T>,
) -> Result<T> {
    if let Some(url) = env::var("DATABASE_URL").ok().filter(|u| !u.is_empty()) {
        eprintln!("xtask: using DATABASE_URL (nothing is started or stopped)");
        return f(&url);
    }
    let cluster = pg::Cluster::discover()?;
    let started = match durable {
        Some(durable) => cluster.start_durable(durable)?,
        None => cluster.start()?,
    };
    // Armed before anything else can fail, so an early `?` still stops the cluster.
    let guard = StopGuard(started.by_us.then_some(&cluster));
    if started.by_us {
        // Ctrl-C hits the whole process group: let the child exit first and
        // then stop the cluster, instead of dying and leaving it running.
        pg::defer_sigint();
    }
    if db != "postgres" {
        cluster.create_database(started.port, db)?;
    }
    let url = cluster.url(started.port, db);
    eprintln!(
        "xtask: using disposable PostgreSQL {} at {url} (data: {}; {})",
        cluster.version(),
        cluster.data_dir().display(),
        if started.by_us {
            "stopped afterwards"
        } else {
            "already running, left running"
        }
    );
    let result = f(&url);
    let stopped = guard.stop();
    let value = result?;
    stopped?;
    Ok(value)
}

/// Stops the cluster it holds on `stop()` or, failing that, on drop (error
/// paths and panics), so a cluster this process started never outlives it.
struct StopGuard<'a>(Option<&'a pg::Cluster>);

impl StopGuard<'_> {
    fn stop(mut self) -> Result<()> {
        match self.0.take() {
            Some(cluster) => {
                cluster.stop()?;
                eprintln!("xtask: stopped disposable PostgreSQL");
                Ok(())
            }
            None => Ok(()),
        }
    }
}

impl Drop for StopGuard<'_> {
    fn drop(&mut self) {
        if let Some(cluster) = self.0.take() {
            if let Err(err) = cluster.stop() {
                eprintln!("xtask: error: stopping disposable PostgreSQL: {err:#}");
            }
        }
    }
}

fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

fn cargo() -> Command {
    // `cargo xtask` sets CARGO, so the same toolchain builds everything.
    let mut cmd = Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(project_root());
    cmd
}

/// Sums of cargo's `test result:` lines.
#[derive(Default)]
struct TestTotals {
    passed: u64,
    failed: u64,
}

impl TestTotals {
    /// Reads `test result: ok. 33 passed; 0 failed; ...`.
    fn add_line(&mut self, line: &str) {
        let Some(rest) = line.strip_prefix("test result: ") else {
            return;
        };
        for part in rest.split(';') {
            let mut words = part.split_whitespace().rev();
            let (Some(what), Some(n)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(n) = n.parse::<u64>() else { continue };
            match what {
                "passed" => self.passed += n,
                "failed" => self.failed += n,
                _ => {}
            }
        }
    }
}

/// Runs cargo test, passing its stdout through while counting results.
fn run_tests(cmd: &mut Command, totals: &mut TestTotals) -> Result<i32> {
    use std::io::{BufRead, BufReader, Write};
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("failed to run {:?}", cmd.get_program()))?;
    let stdout = child.stdout.take().expect("piped stdout");
    let mut out = std::io::stdout().lock();
    for line in BufReader::new(stdout).lines() {
        let line = line.context("reading cargo test output")?;
        totals.add_line(&line);
        writeln!(out, "{line}")?;
    }
    let status = child.wait().context("waiting for cargo test")?;
    Ok(exit_code(status))
}

fn run_status(cmd: &mut Command) -> Result<i32> {
    let status = cmd
        .status()
        .with_context(|| format!("failed to run {:?}", cmd.get_program()))?;
    Ok(exit_code(status))
}

/// Exit code as a shell would report it (128 + signal when killed).
fn exit_code(status: ExitStatus) -> i32 {
    status
        .code()
        .or_else(|| status.signal().map(|sig| 128 + sig))
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::TestTotals;

    #[test]
    fn test_result_lines_are_summed() {
        let mut t = TestTotals::default();
        t.add_line("test result: ok. 33 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 32.42s");
        t.add_line("test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.1s");
        t.add_line("running 3 tests");
        assert_eq!((t.passed, t.failed), (35, 1));
    }
}
