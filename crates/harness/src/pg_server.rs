//! `Server`: one throwaway PostgreSQL server and its directory, the part
//! [`crate::PrivateCluster`] and [`crate::ReplicatedCluster`] share: finding the
//! server binaries, running them as an unprivileged user when we are root, and
//! `pg_ctl` with the server's settings on its command line.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// One server: `dir` holds `data/` (PGDATA), `postgres.log` and the Unix socket.
/// Stopped (immediate) and its directory deleted on drop.
pub(crate) struct Server {
    dir: PathBuf,
    bin: PathBuf,
    port: u16,
    run_as: Option<(u32, u32)>,
    /// `-c name=value ...`, on the postmaster's command line at every start (so a
    /// restart keeps them, and no config file is edited).
    settings: String,
}

impl Server {
    /// A fresh directory (`idemstage-<kind>-<ulid>` in the temp dir, owned by the
    /// server user) and a free port; nothing runs yet: [`Server::initdb`] (or a
    /// `pg_basebackup` into `data`), then [`Server::pg_ctl`] `start`.
    pub(crate) fn new(kind: &str, settings: &str) -> Server {
        use std::os::unix::fs::PermissionsExt;
        let bin = pg_bin_dir().expect(
            "PostgreSQL server binaries (initdb, pg_ctl) not found on PATH or under \
             /usr/lib/postgresql/*/bin",
        );
        // PostgreSQL refuses to run as root.
        let run_as = server_user().map(|(_, ids)| ids);
        let dir = temp_dir(kind);
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).expect("chown cluster dir");
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        Server {
            dir,
            bin,
            port: free_port(),
            run_as,
            settings: settings.to_owned(),
        }
    }

    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// Picks another free port (before the first start): two servers of one test
    /// must not draw the same.
    pub(crate) fn repick_port(&mut self) {
        self.port = free_port();
    }

    /// URL of database `db` as the superuser `postgres`.
    pub(crate) fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// `initdb` into `data` (superuser `postgres`, trust authentication: the
    /// default `pg_hba.conf` also lets 127.0.0.1 connect for replication).
    pub(crate) fn initdb(&self) {
        self.run(
            "initdb",
            &[
                "-D",
                "data",
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
                "--no-instructions",
            ],
        );
    }

    /// `pg_ctl <action>`, waiting (`-w`, 60 s) for it to take effect, with the
    /// port, socket and settings on the postmaster's command line.
    pub(crate) fn pg_ctl(&self, action: &[&str]) {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 {}",
            self.port,
            self.dir.display(),
            self.settings
        );
        let mut args = vec![
            "-D",
            "data",
            "-l",
            "postgres.log",
            "-w",
            "-t",
            "60",
            "-o",
            &opts,
        ];
        args.extend_from_slice(action);
        self.run("pg_ctl", &args);
    }

    /// Runs a server binary in the server's directory (as the server user when we
    /// are root); panics with its output and the server log unless it succeeds.
    /// Returns its stdout.
    pub(crate) fn run(&self, tool: &str, args: &[&str]) -> String {
        self.try_run(tool, args).unwrap_or_else(|failure| {
            panic!(
                "{tool} {args:?} failed: {failure}\n{}",
                std::fs::read_to_string(self.dir.join("postgres.log")).unwrap_or_default()
            )
        })
    }

    /// [`Server::run`], the failure returned (status and output) instead.
    pub(crate) fn try_run(&self, tool: &str, args: &[&str]) -> Result<String, String> {
        use std::os::unix::process::CommandExt;
        let mut cmd = std::process::Command::new(self.bin.join(tool));
        cmd.args(args).current_dir(&self.dir).env("HOME", &self.dir);
        if let Some((uid, gid)) = self.run_as {
            cmd.uid(uid).gid(gid);
        }
        let out = cmd.output().unwrap_or_else(|e| panic!("run {tool}: {e}"));
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            Ok(stdout)
        } else {
            Err(format!(
                "({}) {stdout}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// One statement through `psql` on database `postgres`: its rows unaligned,
    /// without headers, trimmed. Panics with psql's error and the server log if it
    /// fails.
    pub(crate) fn psql(&self, sql: &str) -> String {
        let url = self.url("postgres");
        self.run("psql", &psql_args(&url, sql)).trim().to_owned()
    }

    /// [`Server::psql`], `None` if it fails (e.g. the server is down).
    pub(crate) fn try_psql(&self, sql: &str) -> Option<String> {
        let url = self.url("postgres");
        self.try_run("psql", &psql_args(&url, sql))
            .ok()
            .map(|out| out.trim().to_owned())
    }

    /// Polls `sql` until it returns `want` (every 50 ms, at most `secs`); panics
    /// with the last answer and the server log at the deadline.
    pub(crate) fn wait_for(&self, what: &str, sql: &str, want: &str, secs: u64) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let got = self.try_psql(sql);
            if got.as_deref() == Some(want) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out after {secs} s waiting for {what}: `{sql}` returned {got:?}, not \
                 {want:?}\n--- {} ---\n{}",
                self.dir.join("postgres.log").display(),
                std::fs::read_to_string(self.dir.join("postgres.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Not `run`: a server that is already down makes pg_ctl fail, and a drop
        // must not panic.
        let _ = self.try_run("pg_ctl", &["-D", "data", "-m", "immediate", "-w", "stop"]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// -X: no ~/.psqlrc; -w: never prompt for a password; -At: bare rows.
fn psql_args<'a>(url: &'a str, sql: &'a str) -> [&'a str; 11] {
    [
        "-X",
        "-w",
        "-A",
        "-t",
        "-q",
        "-v",
        "ON_ERROR_STOP=1",
        "-d",
        url,
        "-c",
        sql,
    ]
}

/// A fresh directory `idemstage-<kind>-<ulid>` in the temp dir.
pub(crate) fn temp_dir(kind: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "idemstage-{kind}-{}",
        ulid::Ulid::new().to_string().to_lowercase()
    ));
    std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    dir
}

/// As root, the user a server runs as (it refuses root): `postgres`, else
/// `nobody`, with its uid and gid; `None` when not root.
pub(crate) fn server_user() -> Option<(&'static str, (u32, u32))> {
    is_root().then(|| {
        ["postgres", "nobody"]
            .into_iter()
            .find_map(|name| passwd_user(name).map(|ids| (name, ids)))
            .expect("running as root, but there is no postgres or nobody user")
    })
}

pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

fn pg_bin_dir() -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let has_tools = |dir: &Path| {
        ["initdb", "pg_ctl"].iter().all(|t| {
            std::fs::metadata(dir.join(t))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    };
    if let Some(path) = std::env::var_os("PATH") {
        if let Some(dir) = std::env::split_paths(&path).find(|d| has_tools(d)) {
            // A PATH dir may hold symlinks to initdb and pg_ctl only: the other
            // tools (pg_basebackup, psql) of the same version sit beside their
            // target.
            return Some(
                std::fs::canonicalize(dir.join("initdb"))
                    .ok()
                    .and_then(|t| t.parent().map(Path::to_path_buf))
                    .filter(|d| has_tools(d))
                    .unwrap_or(dir),
            );
        }
    }
    std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .filter_map(|e| {
            let version: u32 = e.file_name().to_str()?.split('.').next()?.parse().ok()?;
            let bin = e.path().join("bin");
            has_tools(&bin).then_some((version, bin))
        })
        .max_by_key(|(v, _)| *v)
        .map(|(_, b)| b)
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .is_some_and(|euid| euid == "0")
}

fn passwd_user(name: &str) -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let mut f = line.split(':');
        if f.next()? != name {
            return None;
        }
        f.next()?;
        Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
    })
}
