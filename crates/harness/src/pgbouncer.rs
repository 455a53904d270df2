//! `PgBouncer`: Debian's pgbouncer in transaction mode in front of a test server.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A pgbouncer of the test's own, in transaction mode (`pool_mode =
/// transaction`), in front of the server of the URL it was started for: every
/// database, the user of that URL (else `postgres`), `postgres`,
/// [`TEST_WORKER`](idemstage_testkit::TEST_WORKER) and [`TEST_OPERATOR`](idemstage_testkit::TEST_OPERATOR).
/// Clients are trusted (`auth_type = trust`, loopback only); towards the server
/// pgbouncer logs in with the passwords of its `auth_file`: the URL's own, and
/// the test roles' (their names), so that it works in front of a server that
/// asks for passwords (a `DATABASE_URL` like `postgres://me:secret@host/db`) as
/// well as one that trusts loopback. Each (database, user) gets
/// `server_pool_size` server sessions, so its clients really share them.
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
        std::fs::write(dir.join("users.txt"), auth_file(server_url)).unwrap();
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

/// The `auth_file`: every user a test connects as, with the password pgbouncer
/// gives the server for it. Before the URL's user was listed, a `DATABASE_URL`
/// of another user than `postgres` was refused by pgbouncer itself ("trust"
/// authentication failed), and a password server refused the test roles.
fn auth_file(server_url: &str) -> String {
    let (user, password) = user_password(server_url);
    let test_roles = [
        idemstage_testkit::TEST_WORKER,
        idemstage_testkit::TEST_OPERATOR,
    ]
    .map(|r| (r.to_owned(), r.to_owned()));
    let mut users: Vec<(String, String)> = Vec::new();
    for (u, p) in [(
        user.unwrap_or_else(|| "postgres".into()),
        password.unwrap_or_default(),
    )]
    .into_iter()
    .chain([("postgres".to_owned(), String::new())])
    .chain(test_roles)
    {
        if !users.iter().any(|(known, _)| *known == u) {
            users.push((u, p));
        }
    }
    // A double quote inside a quoted field is written twice.
    let quote = |s: &str| format!("\"{}\"", s.replace('"', "\"\""));
    users
        .iter()
        .map(|(u, p)| format!("{} {}\n", quote(u), quote(p)))
        .collect()
}

/// The user and password of a `postgres://user:password@host/db` URL,
/// percent-decoded; `None` for a part the URL does not have.
fn user_password(url: &str) -> (Option<String>, Option<String>) {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    let Some((userinfo, _)) = authority.rsplit_once('@') else {
        return (None, None);
    };
    let (user, password) = match userinfo.split_once(':') {
        Some((u, p)) => (u, Some(p)),
        None => (userinfo, None),
    };
    let user = Some(percent_decode(user)).filter(|u| !u.is_empty());
    (user, password.map(percent_decode))
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
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
    fn the_auth_file_has_the_urls_user_and_password_and_the_test_roles() {
        assert_eq!(
            super::auth_file("postgres://me:s%40c%22r:t@127.0.0.1:6000/db?x=1"),
            "\"me\" \"s@c\"\"r:t\"\n\"postgres\" \"\"\n\
             \"idemstage_test_worker\" \"idemstage_test_worker\"\n\
             \"idemstage_test_operator\" \"idemstage_test_operator\"\n"
        );
        assert_eq!(
            super::user_password("postgres://127.0.0.1:6000/db"),
            (None, None)
        );
        assert!(super::auth_file("postgres://localhost/db").starts_with("\"postgres\" \"\"\n"));
        assert_eq!(
            super::user_password("postgres://u@h/db?password=x"),
            (Some("u".to_owned()), None)
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
