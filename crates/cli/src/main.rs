//! The `idemstage` binary: the command line of `idemstage_cli::run`.

fn main() -> std::process::ExitCode {
    idemstage_cli::run()
}
