#!/usr/bin/env bash
# Sets up and runs the whole test suite, as root: packages, formatting and
# clippy, the static agent, unit tests (property tests of every parser of
# hostile bytes among them), then the end-to-end tests (real daemon, real OpenSSH tools; they
# build their own images). Arguments after the script name filter e2e tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
# Style and lints gate like tests do (the toolchain's own components).
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy rustfmt
cargo fmt --all --check
cargo clippy --locked --workspace --all-targets -- -D warnings
PROFILE=debug scripts/build.sh
cargo test --locked --workspace --lib --bins --test protocol_props --test grammar_props --test hostile_front_door
cargo test --locked -p moat --test e2e -- "$@"
