//! A disposable PostgreSQL cluster built from the local server binaries.
//!
//! Layout of the cluster directory: `data/` (PGDATA), `sock/` (Unix socket
//! dir), `postgres.log`, `port` (the TCP port, reused across starts).

use std::{
    env, fs, io,
    net::{SocketAddr, TcpListener, TcpStream},
    os::unix::{
        ffi::OsStrExt,
        fs::{MetadataExt, PermissionsExt},
        process::CommandExt,
    },
    path::{Path, PathBuf},
    process::{Command, Output},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::project_root;

pub mod standby;

pub struct Cluster {
    bin_dir: PathBuf,
    dir: PathBuf,
    /// Set when we are root: PostgreSQL refuses to run as root, so the server
    /// tools run as this user instead.
    run_as: Option<User>,
}

struct User {
    uid: u32,
    gid: u32,
}

pub struct Started {
    pub port: u16,
    /// False if it was already running (then the caller must leave it running).
    pub by_us: bool,
}

impl Cluster {
    /// Finds the server binaries and decides where the cluster lives; touches nothing.
    pub fn discover() -> Result<Cluster> {
        let Some(bin_dir) = find_bin_dir() else {
            bail!(
                "PostgreSQL server binaries (initdb, pg_ctl) not found on PATH or under \
                 /usr/lib/postgresql/*/bin. Install them (Debian/Ubuntu: apt-get install \
                 postgresql) or set DATABASE_URL to a reachable server."
            );
        };
        let root = project_root();
        if !is_root() {
            let dir = root.join("target").join("pg");
            return Ok(Cluster {
                bin_dir,
                dir,
                run_as: None,
            });
        }
        // As root the checkout may sit where the unprivileged server user cannot
        // enter, so use the temp dir, keyed by the checkout path so that several
        // checkouts get separate clusters. FNV-1a because std's hasher is not
        // stable across Rust versions, and the name must be.
        let user = lookup_user("postgres")
            .or_else(|| lookup_user("nobody"))
            .context("running as root, but /etc/passwd has neither a `postgres` nor a `nobody` user to run PostgreSQL as")?;
        let hash = fnv1a64(root.as_os_str().as_bytes());
        let dir = env::temp_dir().join(format!("idemstage-pg-{hash:016x}"));
        Ok(Cluster {
            bin_dir,
            dir,
            run_as: Some(user),
        })
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn sock_dir(&self) -> PathBuf {
        self.dir.join("sock")
    }

    fn log_file(&self) -> PathBuf {
        self.dir.join("postgres.log")
    }

    fn port_file(&self) -> PathBuf {
        self.dir.join("port")
    }

    pub fn url(&self, port: u16, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{port}/{db}")
    }

    /// Major version from PG_VERSION, for messages only.
    pub fn version(&self) -> String {
        fs::read_to_string(self.data_dir().join("PG_VERSION"))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|_| "(version unknown)".to_owned())
    }

    pub fn is_running(&self) -> Result<bool> {
        if !self.data_dir().join("PG_VERSION").exists() {
            return Ok(false);
        }
        let status = self
            .server_tool("pg_ctl")
            .arg("-D")
            .arg(self.data_dir())
            .arg("status")
            .output()
            .context("failed to run pg_ctl status")?
            .status;
        Ok(status.success())
    }

    /// The port of the running server (from postmaster.pid, which cannot be
    /// stale while it runs), else the one recorded for the next start.
    pub fn port(&self, running: bool) -> Option<u16> {
        let from_pid_file = || {
            let pid_file = fs::read_to_string(self.data_dir().join("postmaster.pid")).ok()?;
            pid_file.lines().nth(3)?.trim().parse().ok()
        };
        running
            .then(from_pid_file)
            .flatten()
            .or_else(|| read_port_file(&self.port_file()))
    }

    /// Starts the cluster unless it is already running (initialising it first if
    /// needed), durable as `IDEMSTAGE_PG_DURABLE=1` says.
    pub fn start(&self) -> Result<Started> {
        self.start_durable(env::var("IDEMSTAGE_PG_DURABLE").as_deref() == Ok("1"))
    }

    /// Starts the cluster unless it is already running, with fsync,
    /// synchronous_commit and full_page_writes on if `durable`, else off. A running
    /// cluster is left as it is: the caller checks its settings.
    pub fn start_durable(&self, durable: bool) -> Result<Started> {
        self.start_with(durable, "")
    }

    /// [`Cluster::start_durable`] with `settings` (`-c name=value ...`) after the
    /// others on the postmaster's command line, where they win.
    fn start_with(&self, durable: bool, settings: &str) -> Result<Started> {
        if self.is_running()? {
            let port = self
                .port(true)
                .context("cluster is running but its port is unknown")?;
            return Ok(Started { port, by_us: false });
        }
        self.prepare_dirs()?;
        self.init_if_needed()?;
        let port = self.choose_port()?;
        if let Err(err) = self.pg_ctl_start(port, durable, settings) {
            // A postmaster killed with -9 leaves postmaster.pid behind; PostgreSQL
            // usually copes, but not if e.g. the pid was reused meanwhile.
            if !self.remove_stale_pid_file()? {
                return Err(err);
            }
            // Give orphaned backends of the killed server a moment to exit.
            thread::sleep(Duration::from_secs(1));
            self.pg_ctl_start(port, durable, settings)
                .context("start failed again after removing a stale postmaster.pid")?;
        }
        wait_for_tcp(port)?;
        Ok(Started { port, by_us: true })
    }

    /// Stops the cluster (and its standby first, if one runs: `db start
    /// --standby`); returns whether it was running.
    pub fn stop(&self) -> Result<bool> {
        standby::stop(self)?;
        if !self.is_running()? {
            return Ok(false);
        }
        let out = self
            .server_tool("pg_ctl")
            .arg("-D")
            .arg(self.data_dir())
            .args(["-m", "fast", "-w", "-t", "60", "stop"])
            .output()
            .context("failed to run pg_ctl stop")?;
        if !out.status.success() {
            bail!(
                "pg_ctl stop failed: {}{}",
                output_text(&out),
                self.log_tail()
            );
        }
        Ok(true)
    }

    /// Creates database `name` if it does not exist yet.
    pub fn create_database(&self, port: u16, name: &str) -> Result<()> {
        let url = self.url(port, "postgres");
        let exists = format!("SELECT 1 FROM pg_database WHERE datname = '{name}'");
        if self.psql(&url, &exists)?.trim() == "1" {
            return Ok(());
        }
        self.psql(&url, &format!("CREATE DATABASE \"{name}\""))?;
        Ok(())
    }

    fn psql(&self, url: &str, sql: &str) -> Result<String> {
        let bundled = self.bin_dir.join("psql");
        let program = if bundled.exists() {
            bundled
        } else {
            "psql".into()
        };
        // A client over TCP: no need to drop root privileges. -X: ignore ~/.psqlrc.
        let out = Command::new(&program)
            .args(["-X", "-A", "-t", "-q", "-v", "ON_ERROR_STOP=1"])
            .arg(url)
            .arg("-c")
            .arg(sql)
            .output()
            .with_context(|| format!("failed to run {}", program.display()))?;
        if !out.status.success() {
            bail!("psql `{sql}` failed: {}", output_text(&out));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// A command for a server binary, run as the unprivileged owner if we are root.
    fn server_tool(&self, name: &str) -> Command {
        let mut cmd = Command::new(self.bin_dir.join(name));
        if let Some(user) = &self.run_as {
            // std applies setgroups/setgid before setuid regardless of call order.
            // HOME and cwd must be somewhere the dropped user can access.
            cmd.gid(user.gid)
                .uid(user.uid)
                .env("HOME", &self.dir)
                .current_dir(&self.dir);
        }
        cmd
    }

    fn prepare_dirs(&self) -> Result<()> {
        let Some(user) = &self.run_as else {
            return fs::create_dir_all(self.sock_dir())
                .with_context(|| format!("failed to create {}", self.sock_dir().display()));
        };
        // The path in the shared temp dir is predictable: refuse a directory (or
        // symlink) planted by another user rather than run a server inside it.
        match fs::symlink_metadata(&self.dir) {
            Ok(meta) => {
                if !meta.is_dir() || (meta.uid() != 0 && meta.uid() != user.uid) {
                    bail!(
                        "{} exists but is not a directory owned by root or uid {}; remove it",
                        self.dir.display(),
                        user.uid
                    );
                }
            }
            Err(err) if err.kind() == io::ErrorKind::NotFound => fs::create_dir(&self.dir)
                .with_context(|| format!("failed to create {}", self.dir.display()))?,
            Err(err) => {
                return Err(err)
                    .with_context(|| format!("failed to inspect {}", self.dir.display()))
            }
        }
        for dir in [self.dir.clone(), self.sock_dir()] {
            if !dir.exists() {
                fs::create_dir(&dir)
                    .with_context(|| format!("failed to create {}", dir.display()))?;
            }
            std::os::unix::fs::chown(&dir, Some(user.uid), Some(user.gid))
                .with_context(|| format!("failed to chown {}", dir.display()))?;
            fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))
                .with_context(|| format!("failed to chmod {}", dir.display()))?;
        }
        Ok(())
    }

    fn init_if_needed(&self) -> Result<()> {
        let data = self.data_dir();
        if data.join("PG_VERSION").exists() {
            return Ok(());
        }
        // Leftovers of an interrupted initdb would make it refuse the non-empty dir.
        if data.exists() {
            fs::remove_dir_all(&data)
                .with_context(|| format!("failed to remove incomplete {}", data.display()))?;
        }
        let out = self
            .server_tool("initdb")
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8"])
            .args(["--no-sync", "--no-instructions"])
            .output()
            .context("failed to run initdb")?;
        if !out.status.success() {
            bail!("initdb failed: {}", output_text(&out));
        }
        Ok(())
    }

    /// Reuses the recorded port unless something else took it meanwhile.
    fn choose_port(&self) -> Result<u16> {
        let port = match read_port_file(&self.port_file()) {
            Some(port) if TcpListener::bind(("127.0.0.1", port)).is_ok() => port,
            _ => TcpListener::bind("127.0.0.1:0")
                .and_then(|listener| listener.local_addr())
                .context("failed to find a free TCP port")?
                .port(),
        };
        fs::write(self.port_file(), format!("{port}\n"))
            .with_context(|| format!("failed to write {}", self.port_file().display()))?;
        Ok(port)
    }

    fn pg_ctl_start(&self, port: u16, durable: bool, settings: &str) -> Result<()> {
        // pg_ctl hands -o to /bin/sh, hence the quoting. Unix socket paths are
        // limited to 107 bytes; with a deeper directory, go without the socket
        // (we connect over TCP anyway) rather than fail to start.
        let sock = self.sock_dir();
        let sock = if sock.as_os_str().len() + "/.s.PGSQL.65535".len() < 108 {
            sh_quote(&sock.to_string_lossy())
        } else {
            "''".to_owned()
        };
        let mut opts = format!(
            "-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c max_connections=500 \
             -c shared_buffers=256MB"
        );
        // Durability is pointless for a throwaway cluster, except when benchmarking.
        if !durable {
            opts.push_str(" -c fsync=off -c synchronous_commit=off -c full_page_writes=off");
        }
        if !settings.is_empty() {
            opts.push(' ');
            opts.push_str(settings);
        }
        let out = self
            .server_tool("pg_ctl")
            .arg("-D")
            .arg(self.data_dir())
            .arg("-l")
            .arg(self.log_file())
            .args(["-w", "-t", "60", "-o", &opts, "start"])
            .output()
            .context("failed to run pg_ctl start")?;
        if !out.status.success() {
            bail!(
                "pg_ctl start failed: {}{}",
                output_text(&out),
                self.log_tail()
            );
        }
        Ok(())
    }

    /// Removes postmaster.pid if the process it names is gone; returns whether it did.
    fn remove_stale_pid_file(&self) -> Result<bool> {
        let pid_file = self.data_dir().join("postmaster.pid");
        let Ok(contents) = fs::read_to_string(&pid_file) else {
            return Ok(false);
        };
        // Without /proc we cannot tell, and deleting a live server's lock file
        // would let two servers share one data dir.
        if !Path::new("/proc/self").exists() {
            return Ok(false);
        }
        let pid = contents
            .lines()
            .next()
            .and_then(|l| l.trim().parse::<u32>().ok());
        if pid.is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists()) {
            return Ok(false);
        }
        fs::remove_file(&pid_file)
            .with_context(|| format!("failed to remove {}", pid_file.display()))?;
        eprintln!("xtask: removed stale {}", pid_file.display());
        Ok(true)
    }

    fn log_tail(&self) -> String {
        let log = fs::read_to_string(self.log_file()).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines[lines.len().saturating_sub(30)..].join("\n");
        format!(
            "\n--- last lines of {} ---\n{tail}",
            self.log_file().display()
        )
    }
}

fn find_bin_dir() -> Option<PathBuf> {
    let has_tools =
        |dir: &Path| is_executable(&dir.join("initdb")) && is_executable(&dir.join("pg_ctl"));
    if let Some(path) = env::var_os("PATH") {
        if let Some(dir) = env::split_paths(&path).find(|dir| has_tools(dir)) {
            // A PATH dir may hold symlinks to initdb and pg_ctl only: psql and
            // pg_basebackup of the same version sit beside their target.
            return Some(
                fs::canonicalize(dir.join("initdb"))
                    .ok()
                    .and_then(|target| target.parent().map(Path::to_path_buf))
                    .filter(|real| has_tools(real))
                    .unwrap_or(dir),
            );
        }
    }
    // Debian/Ubuntu keep the server binaries off PATH, one dir per major version.
    fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .filter_map(|entry| {
            let version: Vec<u32> = entry
                .file_name()
                .to_str()?
                .split('.')
                .map(|part| part.parse().ok())
                .collect::<Option<_>>()?;
            let bin = entry.path().join("bin");
            has_tools(&bin).then_some((version, bin))
        })
        .max_by(|a, b| a.0.cmp(&b.0))
        .map(|(_, bin)| bin)
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.mode() & 0o111 != 0)
}

/// Effective uid from /proc; without /proc assume an ordinary user.
fn is_root() -> bool {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .is_some_and(|euid| euid == "0")
}

fn lookup_user(name: &str) -> Option<User> {
    let passwd = fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let mut fields = line.split(':');
        if fields.next()? != name {
            return None;
        }
        let _password = fields.next()?;
        Some(User {
            uid: fields.next()?.parse().ok()?,
            gid: fields.next()?.parse().ok()?,
        })
    })
}

fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn read_port_file(path: &Path) -> Option<u16> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// pg_ctl -w already waited for readiness; this confirms TCP works for clients.
fn wait_for_tcp(port: u16) -> Result<()> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err() {
        if Instant::now() > deadline {
            bail!("PostgreSQL started but 127.0.0.1:{port} does not accept connections");
        }
        thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn output_text(out: &Output) -> String {
    format!(
        "({})\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Makes SIGINT a no-op for this process only (a caught signal is reset to the
/// default on exec, so children still get Ctrl-C): the child exits, we survive
/// and stop the cluster. Declared by hand because the only dependency is anyhow.
pub fn defer_sigint() {
    extern "C" fn ignore(_signal: i32) {}
    extern "C" {
        fn signal(signum: i32, handler: extern "C" fn(i32)) -> usize;
    }
    const SIGINT: i32 = 2;
    // SAFETY: installs an async-signal-safe (empty) handler; signal() is in libc,
    // which std links anyway.
    unsafe {
        signal(SIGINT, ignore);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a64_matches_reference_vectors() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn sh_quote_escapes_single_quotes() {
        assert_eq!(sh_quote("/a b/it's"), r"'/a b/it'\''s'");
    }
}
