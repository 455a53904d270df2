//! `PrivateCluster`: a throwaway PostgreSQL server of one test's own.

/// A throwaway PostgreSQL cluster of the test's own, for tests that must restart
/// the server (the shared server of `TestDb` cannot be restarted under other tests).
/// Started from the local server binaries (`initdb`, `pg_ctl` on PATH or under
/// `/usr/lib/postgresql/*/bin`); as root the server runs as the `postgres` (or
/// `nobody`) user, like xtask's cluster. Stopped and deleted on drop.
pub struct PrivateCluster {
    dir: std::path::PathBuf,
    bin: std::path::PathBuf,
    port: u16,
    run_as: Option<(u32, u32)>,
}

impl PrivateCluster {
    pub fn start() -> PrivateCluster {
        use std::os::unix::fs::PermissionsExt;
        let bin = pg_bin_dir().expect(
            "PostgreSQL server binaries (initdb, pg_ctl) not found on PATH or under \
             /usr/lib/postgresql/*/bin",
        );
        let run_as = is_root().then(|| {
            passwd_user("postgres")
                .or_else(|| passwd_user("nobody"))
                .expect("running as root, but there is no postgres or nobody user")
        });
        let dir = std::env::temp_dir().join(format!(
            "idemstage-private-{}",
            ulid::Ulid::new().to_string().to_lowercase()
        ));
        std::fs::create_dir(&dir).expect("create cluster directory");
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).expect("chown cluster dir");
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let cluster = PrivateCluster {
            dir,
            bin,
            port,
            run_as,
        };
        cluster.run(
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
        cluster.pg_ctl(&["start"]);
        cluster
    }

    /// URL of database `db` (the cluster has `postgres`).
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// `pg_ctl restart -m fast`: every connection is closed, the server is back
    /// when this returns.
    pub fn restart(&self) {
        self.pg_ctl(&["-m", "fast", "restart"]);
    }

    fn pg_ctl(&self, action: &[&str]) {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off \
             -c synchronous_commit=off -c full_page_writes=off -c max_connections=200",
            self.port,
            self.dir.display()
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

    fn run(&self, tool: &str, args: &[&str]) {
        use std::os::unix::process::CommandExt;
        let mut cmd = std::process::Command::new(self.bin.join(tool));
        cmd.args(args).current_dir(&self.dir).env("HOME", &self.dir);
        if let Some((uid, gid)) = self.run_as {
            cmd.uid(uid).gid(gid);
        }
        let out = cmd.output().unwrap_or_else(|e| panic!("run {tool}: {e}"));
        assert!(
            out.status.success(),
            "{tool} {args:?} failed: {}{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(self.dir.join("postgres.log")).unwrap_or_default()
        );
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        use std::os::unix::process::CommandExt;
        let mut cmd = std::process::Command::new(self.bin.join("pg_ctl"));
        cmd.args(["-D", "data", "-m", "immediate", "-w", "stop"])
            .current_dir(&self.dir)
            .env("HOME", &self.dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        if let Some((uid, gid)) = self.run_as {
            cmd.uid(uid).gid(gid);
        }
        let _ = cmd.status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn pg_bin_dir() -> Option<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let has_tools = |dir: &std::path::Path| {
        ["initdb", "pg_ctl"].iter().all(|t| {
            std::fs::metadata(dir.join(t))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    };
    if let Some(path) = std::env::var_os("PATH") {
        if let Some(dir) = std::env::split_paths(&path).find(|d| has_tools(d)) {
            return Some(dir);
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

pub(crate) fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .is_some_and(|euid| euid == "0")
}

pub(crate) fn passwd_user(name: &str) -> Option<(u32, u32)> {
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
