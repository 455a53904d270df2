//! `PgBouncer`: Debian's pgbouncer in transaction mode in front of a test server.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A pgbouncer of the test's own, in transaction mode (`pool_mode =
/// transaction`), in front of the server of the URL it was started for: every
/// database, the users `postgres`, [`TEST_WORKER`](crate::TEST_WORKER) and
/// [`TEST_OPERATOR`](crate::TEST_OPERATOR), `auth_type = trust` (the test
/// servers trust loopback). Each (database, user) gets `server_pool_size` server
/// sessions, so its clients really share them.
///
/// It resets every server session after every transaction (`server_reset_query =
/// DEALLOCATE ALL`, `server_reset_query_always = 1`): a statement prepared outside
/// a transaction is gone before it can be executed, so code that is not safe
/// behind a transaction pooler fails at once, not now and then. Killed and its
/// directory removed on drop.
pub struct PgBouncer {
    dir: PathBuf,
    port: u16,
    child: Child,
}

impl PgBouncer {
    /// Starts one in front of the server of `server_url` (its host and port), with
    /// `server_pool_size` server sessions per (database, user). Panics with the
    /// reason if pgbouncer is missing or does not come up (Debian: `apt-get install
    /// pgbouncer`; `.ci/run` installs it).
    pub fn start(server_url: &str, server_pool_size: u32) -> PgBouncer {
        use std::os::unix::fs::PermissionsExt;
        let bin = pgbouncer_bin().expect(
            "pgbouncer not found on PATH or in /usr/sbin (Debian: apt-get install pgbouncer)",
        );
        let (host, server_port) = host_port(server_url);
        let dir = crate::pg_server::temp_dir("pgbouncer");
        // Readable by the user it drops to as root.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let port = crate::pg_server::free_port();
        let users: String = ["postgres", crate::TEST_WORKER, crate::TEST_OPERATOR]
            .iter()
            .map(|u| format!("\"{u}\" \"\"\n"))
            .collect();
        std::fs::write(dir.join("users.txt"), users).unwrap();
        std::fs::write(
            dir.join("pgbouncer.ini"),
            format!(
                "[databases]\n\
                 * = host={host} port={server_port}\n\
                 [pgbouncer]\n\
                 listen_addr = 127.0.0.1\n\
                 listen_port = {port}\n\
                 unix_socket_dir =\n\
                 auth_type = trust\n\
                 auth_file = {users}\n\
                 pool_mode = transaction\n\
                 default_pool_size = {server_pool_size}\n\
                 max_client_conn = 1000\n\
                 ignore_startup_parameters = extra_float_digits,options\n\
                 server_reset_query = DEALLOCATE ALL\n\
                 server_reset_query_always = 1\n",
                users = dir.join("users.txt").display(),
            ),
        )
        .unwrap();
        let mut cmd = Command::new(bin);
        // pgbouncer refuses to run as root; -u drops to that user.
        if let Some((user, _)) = crate::pg_server::server_user() {
            cmd.args(["-u", user]);
        }
        let child = cmd
            .arg(dir.join("pgbouncer.ini"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(
                std::fs::File::create(dir.join("pgbouncer.log"))
                    .map(Stdio::from)
                    .unwrap_or_else(|_| Stdio::null()),
            )
            .spawn()
            .expect("start pgbouncer");
        let mut bouncer = PgBouncer { dir, port, child };
        bouncer.wait_until_listening();
        bouncer
    }

    /// `url` (a URL of the server it fronts: user, password, database, parameters)
    /// with its host and port replaced by the pgbouncer's.
    pub fn url(&self, url: &str) -> String {
        rehost(url, self.port)
    }

    /// What pgbouncer logged so far (for a failing test's message).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }

    fn wait_until_listening(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("pgbouncer exited ({status}): {}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "pgbouncer not listening: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `url` with its host and port replaced by 127.0.0.1:`port`.
fn rehost(url: &str, port: u16) -> String {
    let after_scheme = url.find("://").map(|i| i + 3).unwrap_or(0);
    let rest = &url[after_scheme..];
    let host_start = rest.find('@').map(|i| i + 1).unwrap_or(0);
    let host_end = rest[host_start..]
        .find(['/', '?'])
        .map(|i| host_start + i)
        .unwrap_or(rest.len());
    format!(
        "{}{}127.0.0.1:{}{}",
        &url[..after_scheme],
        &rest[..host_start],
        port,
        &rest[host_end..]
    )
}

/// Host and port of a `postgres://` URL (port 5432 if none).
fn host_port(url: &str) -> (String, u16) {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    match authority.rsplit_once(':') {
        Some((host, port)) => (host.to_owned(), port.parse().expect("port in URL")),
        None => (authority.to_owned(), 5432),
    }
}

fn pgbouncer_bin() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>());
    on_path
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")])
        .map(|d| d.join("pgbouncer"))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    #[test]
    fn host_and_port_come_from_the_authority() {
        assert_eq!(
            super::host_port("postgres://u:p@127.0.0.1:6000/db?x=1"),
            ("127.0.0.1".to_owned(), 6000)
        );
        assert_eq!(
            super::host_port("postgres://localhost/db"),
            ("localhost".to_owned(), 5432)
        );
    }

    #[test]
    fn rehost_keeps_user_database_and_parameters() {
        assert_eq!(
            super::rehost("postgres://u:p@127.0.0.1:6000/db?x=1", 7000),
            "postgres://u:p@127.0.0.1:7000/db?x=1"
        );
        assert_eq!(
            super::rehost("postgres://localhost/db", 7000),
            "postgres://127.0.0.1:7000/db"
        );
    }
}
