#!/usr/bin/env bash
# Builds moat: target/$PROFILE/moat (PROFILE=release by default), with the
# static in-box agent built and embedded by crates/moat/build.rs.
# With INSTALL=1, installs it as /usr/local/bin/moat.
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${PROFILE:-release}
flag=$([ "$profile" = release ] && echo --release || true)
cargo build $flag --locked -p moat
if [ "${INSTALL:-}" = 1 ]; then
  install -D -m 0755 "target/$profile/moat" /usr/local/bin/moat
  echo "installed /usr/local/bin/moat"
fi
