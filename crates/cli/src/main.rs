//! The `idemstage` binary: the command line of `idemstage_cli::run`.

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    idemstage_cli::run()
}
