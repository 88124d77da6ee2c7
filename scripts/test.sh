#!/usr/bin/env bash
# Sets up and runs the whole test suite, as root: packages, formatting and
# clippy, the static agent, every test target of the workspace (unit tests,
# property tests of every parser of hostile bytes), then the end-to-end tests
# (real daemon, real OpenSSH tools; they build their own images). Arguments
# after the script name filter e2e tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
# Style and lints gate like tests do (the toolchain's own components).
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy rustfmt
cargo fmt --all --check
# The e2e target is `test = false` (see crates/moat/Cargo.toml), which
# --all-targets leaves out: it is named.
cargo clippy --locked --workspace --all-targets -- -D warnings
cargo clippy --locked -p moat --test e2e -- -D warnings
PROFILE=debug scripts/build.sh
# Every test target of the workspace (unit, property, integration), so that
# none can be forgotten; then the end-to-end tests, which need root.
cargo test --locked --workspace
cargo test --locked -p moat --test e2e -- "$@"
