//! What a team's binary links and shows is the library, not ours: no seed, no
//! demo, no bench, no harness (issue 30, item 5).

use std::process::Command;

/// The help of `run_app`'s command line (a team's binary, e.g. `ocr-translate
/// --help`: its `main` is `run_app` alone) and of every subcommand names nothing
/// of ours.
#[test]
fn the_help_of_a_team_binary_names_no_demo_bench_or_seed() {
    let mut command = idemstage_cli::extend::command();
    let mut helps = vec![command.render_long_help().to_string()];
    for sub in command.get_subcommands_mut() {
        helps.push(sub.render_long_help().to_string());
    }
    let names: Vec<String> = command
        .get_subcommands()
        .map(|s| s.get_name().to_owned())
        .collect();
    for word in ["demo", "bench"] {
        assert!(
            !names.iter().any(|n| n == word),
            "subcommand {word}: {names:?}"
        );
    }
    for help in &helps {
        let lower = help.to_lowercase();
        for word in [
            "demo",
            "bench",
            "intake",
            "extract",
            "feasibility",
            "calculate",
            "built-in example",
            "crash-rate",
            "stage-delay",
        ] {
            assert!(!lower.contains(word), "`{word}` in:\n{help}");
        }
    }
}

/// `cargo tree -p ocr-translate -e normal` (the example team binary, on
/// idemstage-cli) has none of our own crates, nor what only demo and bench use.
#[test]
fn a_team_binary_links_none_of_ours() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(&root)
        .args([
            "tree",
            "-p",
            "ocr-translate",
            "-e",
            "normal",
            "--prefix",
            "none",
            "--offline",
        ])
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8(out.stdout).unwrap();
    assert!(tree.contains("idemstage-cli"), "{tree}");
    for line in tree.lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        for ours in [
            "idemstage-example",
            "idemstage-harness",
            "idemstage-dev",
            "idemstage-testkit",
            "mimalloc",
            "indicatif",
        ] {
            assert_ne!(name, ours, "ocr-translate links {ours}:\n{tree}");
        }
    }
}
