//! The team's binary: the whole idemstage command line (`migrate`, `enqueue`,
//! `worker`, `status`) for its pipeline and its migrations, in one call.

fn main() -> std::process::ExitCode {
    idemstage_cli::run_app(
        idemstage_cli::App::new(ocr_translate::pipeline())
            .with_name(env!("CARGO_PKG_NAME"), env!("CARGO_PKG_VERSION"))
            .with_migrations(vec![ocr_translate::MIGRATIONS]),
    )
}
