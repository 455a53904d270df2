//! The logs of the `idemstage` binary when they go to a file or a pipe.

use std::process::Command;

use idemstage_testkit::TestDb;

/// Redirected logs used to carry ANSI colour codes (`ESC[2m…`), which a log
/// collector shows as garbage: colours only on a terminal.
#[tokio::test]
async fn logs_written_to_a_pipe_carry_no_colour_codes() {
    let db = TestDb::new().await;
    let out = Command::new(env!("CARGO_BIN_EXE_idemstage"))
        .arg("status")
        .env("DATABASE_URL", db.url())
        .env("RUST_LOG", "debug")
        .output()
        .expect("run idemstage");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("DEBUG"), "no log line to look at: {stderr}");
    assert!(
        !stderr.contains('\u{1b}'),
        "colour codes in a pipe: {stderr:?}"
    );
}
