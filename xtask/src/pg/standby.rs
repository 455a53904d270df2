//! `db start --standby [--async]`: the disposable cluster as a primary with a
//! streaming hot standby (`pg_basebackup -R`), for trying failover by hand. The
//! standby lives in `<cluster dir>/standby/`, laid out like the primary's
//! directory, and is cloned afresh at every start (a copy left from an earlier
//! run, or one promoted meanwhile, would not follow the primary).

use std::{
    fs, thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use super::{wait_for_tcp, Cluster, User};

/// The standby's `application_name`: what the primary's
/// `synchronous_standby_names` names.
const STANDBY_NAME: &str = "idemstage_standby";

impl Cluster {
    /// The standby's cluster: same binaries and server user, its own directory.
    fn standby(&self) -> Cluster {
        Cluster {
            bin_dir: self.bin_dir.clone(),
            dir: self.dir.join("standby"),
            run_as: self.run_as.as_ref().map(|u| User {
                uid: u.uid,
                gid: u.gid,
            }),
        }
    }
}

/// Handles `db start --standby [--async]` (prints the multi-host URL on stdout);
/// `None` for any other `db` command line, which the caller handles.
pub fn db(args: &[String]) -> Result<Option<i32>> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let sync = match args.as_slice() {
        ["start", "--standby"] => true,
        ["start", "--standby", "--async"] | ["start", "--async", "--standby"] => false,
        _ => return Ok(None),
    };
    let cluster = &Cluster::discover()?;
    if std::env::var_os("DATABASE_URL").is_some_and(|u| !u.is_empty()) {
        eprintln!(
            "xtask: note: DATABASE_URL is set, so other xtask commands use it, not this cluster"
        );
    }
    let mode = if sync { "synchronous" } else { "asynchronous" };
    let standby = cluster.standby();
    let (primary_port, standby_port) = if cluster.is_running()? {
        let port = cluster
            .port(true)
            .context("cluster is running but its port is unknown")?;
        // The replication settings are on the primary's command line: a primary
        // started without them cannot just be given a standby.
        if !standby.is_running()? {
            bail!(
                "the disposable PostgreSQL is running without a standby; stop it first \
                 (`cargo xtask db stop`)"
            );
        }
        let names = cluster.psql(
            &cluster.url(port, "postgres"),
            "SHOW synchronous_standby_names",
        )?;
        if names.trim().is_empty() == sync {
            bail!(
                "the disposable PostgreSQL is running with a standby, but not {mode}; stop \
                 it first (`cargo xtask db stop`)"
            );
        }
        let standby_port = standby
            .port(true)
            .context("standby is running but its port is unknown")?;
        eprintln!("xtask: disposable PostgreSQL primary and {mode} standby already running");
        (port, standby_port)
    } else {
        let ports = start_pair(cluster, &standby, sync);
        if ports.is_err() {
            // Neither half of a pair that did not come up is left running.
            let _ = cluster.stop();
        }
        let ports = ports?;
        eprintln!(
            "xtask: disposable PostgreSQL {} started as a primary (data: {}) with a standby, \
             {mode} (data: {})",
            cluster.version(),
            cluster.data_dir().display(),
            standby.data_dir().display()
        );
        ports
    };
    println!("{}", multi_host_url(primary_port, standby_port, "postgres"));
    Ok(Some(0))
}

/// Stops the standby of `cluster` if one runs (before the primary: with it gone
/// first, the standby would only retry and log).
pub fn stop(cluster: &Cluster) -> Result<()> {
    let standby = cluster.standby();
    if standby.is_running()? {
        standby.stop()?;
        eprintln!("xtask: stopped the disposable PostgreSQL's standby");
    }
    Ok(())
}

/// The multi-host URL while the primary and its standby run (for `db status`).
pub fn multi_host_url_if_running(cluster: &Cluster) -> Result<Option<String>> {
    let standby = cluster.standby();
    if !cluster.is_running()? || !standby.is_running()? {
        return Ok(None);
    }
    Ok(cluster
        .port(true)
        .zip(standby.port(true))
        .map(|(primary, standby)| multi_host_url(primary, standby, "postgres")))
}

/// Starts the primary with the replication settings, clones the standby from it
/// and starts it; returns both ports once the primary sees the standby
/// streaming (as its synchronous standby if `sync`).
fn start_pair(primary: &Cluster, standby: &Cluster, sync: bool) -> Result<(u16, u16)> {
    // synchronous_commit must not stay `off` (the non-durable default): a commit
    // would not wait for the standby either. A standby that is not running yet
    // makes commits wait, but the standby is started before anything commits.
    let mut settings =
        "-c wal_level=replica -c max_wal_senders=10 -c synchronous_commit=on".to_owned();
    if sync {
        settings.push_str(&format!(" -c synchronous_standby_names={STANDBY_NAME}"));
    }
    // A standby left from an earlier run (or promoted meanwhile) goes first.
    stop(primary)?;
    let durable = std::env::var("IDEMSTAGE_PG_DURABLE").as_deref() == Ok("1");
    let primary_port = primary.start_with(durable, &settings)?.port;
    standby.prepare_dirs()?;
    let data = standby.data_dir();
    if data.exists() {
        fs::remove_dir_all(&data)
            .with_context(|| format!("failed to remove the old standby {}", data.display()))?;
    }
    let standby_port = standby.choose_port()?;
    // -R writes standby.signal and primary_conninfo, with this application_name.
    let source =
        format!("host=127.0.0.1 port={primary_port} user=postgres application_name={STANDBY_NAME}");
    let out = standby
        .server_tool("pg_basebackup")
        .arg("-D")
        .arg(&data)
        .args([
            "-R",
            "-X",
            "stream",
            "-c",
            "fast",
            "--no-sync",
            "-d",
            &source,
        ])
        .output()
        .context("failed to run pg_basebackup")?;
    if !out.status.success() {
        bail!("pg_basebackup failed: {}", super::output_text(&out));
    }
    // The standby's own settings name no synchronous standby: once promoted, its
    // commits would wait for one that does not exist.
    standby.pg_ctl_start(standby_port, durable, "-c hot_standby=on")?;
    wait_for_tcp(standby_port)?;
    let want = if sync { "sync" } else { "async" };
    let sql = format!(
        "SELECT sync_state FROM pg_stat_replication \
         WHERE application_name = '{STANDBY_NAME}' AND state = 'streaming'"
    );
    let url = primary.url(primary_port, "postgres");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if primary.psql(&url, &sql)?.trim() == want {
            return Ok((primary_port, standby_port));
        }
        if Instant::now() > deadline {
            bail!(
                "the standby did not start streaming ({want}) within 60 s:{}",
                standby.log_tail()
            );
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// Both servers, the primary first; a client keeps the first that accepts writes.
fn multi_host_url(primary_port: u16, standby_port: u16, db: &str) -> String {
    format!(
        "postgres://postgres@127.0.0.1:{primary_port},127.0.0.1:{standby_port}/{db}\
         ?target_session_attrs=read-write"
    )
}

#[cfg(test)]
mod tests {
    use super::multi_host_url;

    #[test]
    fn the_multi_host_url_names_the_primary_first_and_asks_for_a_writable_server() {
        assert_eq!(
            multi_host_url(5001, 5002, "postgres"),
            "postgres://postgres@127.0.0.1:5001,127.0.0.1:5002/postgres?target_session_attrs=read-write"
        );
    }
}
