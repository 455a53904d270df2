//! The team's binary: the idemstage command line for the invoice pipeline.

fn main() -> std::process::ExitCode {
    idemstage_cli::run_app(
        idemstage_cli::App::new(invoice_pipeline::pipeline())
            .with_migrations(vec![invoice_pipeline::MIGRATIONS]),
    )
}
