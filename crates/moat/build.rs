//! Builds the static moat-agent and embeds it in `moat`, so that a plain
//! `cargo build` or `cargo install --path crates/moat` gives a moat whose boxes
//! start. (A dynamic agent would not run in images without libc.)

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let agent_dir = manifest.join("../moat-agent");
    println!("cargo:rerun-if-changed={}", agent_dir.join("src").display());
    println!("cargo:rerun-if-changed={}", agent_dir.join("Cargo.toml").display());
    println!("cargo:rerun-if-env-changed=MOAT_EMBED_AGENT");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let target_dir = out.join("agent-target");
    let embedded = out.join("moat-agent");
    // Its own target dir: no lock shared with the build that runs this script.
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args(["rustc", "--release", "--offline", "-p", "moat-agent", "--bin", "moat-agent", "--manifest-path"])
        .arg(agent_dir.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir)
        .args(["--", "-C", "target-feature=+crt-static", "-C", "strip=debuginfo"])
        // Flags meant for the outer build (coverage, sanitizers) are not the agent's.
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("RUSTFLAGS")
        .status()
        .expect("run cargo for moat-agent");
    assert!(status.success(), "building the static moat-agent failed");
    std::fs::copy(target_dir.join("release/moat-agent"), &embedded).expect("copy moat-agent");
    println!("cargo:rustc-env=MOAT_EMBEDDED_AGENT={}", embedded.display());
}
