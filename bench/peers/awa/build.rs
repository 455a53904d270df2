//! `AWA_VERSION`: the awa version Cargo.lock resolved, for the report.
fn main() {
    println!("cargo:rerun-if-changed=Cargo.lock");
    let lock = std::fs::read_to_string("Cargo.lock").unwrap_or_default();
    let version = lock
        .split("[[package]]")
        .find(|p| p.lines().any(|l| l.trim() == "name = \"awa\""))
        .and_then(|p| p.lines().find_map(|l| l.trim().strip_prefix("version = ")))
        .map(|v| v.trim_matches('"').to_owned())
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=AWA_VERSION={version}");
}
