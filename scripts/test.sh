#!/usr/bin/env bash
# Sets up and runs the whole test suite, as root: packages, the static agent,
# unit tests, then the end-to-end tests (real daemon, real OpenSSH tools; they
# build their own images). Arguments after the script name filter e2e tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
PROFILE=debug scripts/build.sh
cargo test --locked --workspace --lib --bins
export MOAT_AGENT="$PWD/target/agent/debug/moat-agent"
cargo test --locked -p moat --test e2e -- "$@"
