//! The team's binary: the idemstage command line for the invoice pipeline.

fn main() -> std::process::ExitCode {
    idemstage_cli::run_app(
        idemstage_cli::App::new(invoice_pipeline::pipeline())
            .with_name(env!("CARGO_PKG_NAME"), env!("CARGO_PKG_VERSION"))
            .with_migrations(vec![invoice_pipeline::MIGRATIONS]),
    )
}
