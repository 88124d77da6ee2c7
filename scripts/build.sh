#!/usr/bin/env bash
# Builds moat and the static in-box agent:
#   target/$PROFILE/moat and target/agent/$PROFILE/moat-agent (PROFILE=release by default).
# With INSTALL=1, installs them as /usr/local/bin/moat and /usr/local/lib/moat/moat-agent,
# where `moat serve` finds the agent by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${PROFILE:-release}
flag=$([ "$profile" = release ] && echo --release || true)
cargo build $flag --locked -p moat
# The agent runs inside boxes whose images may have no libc: link it statically.
# Its own target dir keeps the workspace build from overwriting it with a dynamic one.
cargo rustc $flag --locked -p moat-agent --bin moat-agent --target-dir target/agent -- -C target-feature=+crt-static
if [ "${INSTALL:-}" = 1 ]; then
  install -D -m 0755 "target/$profile/moat" /usr/local/bin/moat
  install -D -m 0755 "target/agent/$profile/moat-agent" /usr/local/lib/moat/moat-agent
  echo "installed /usr/local/bin/moat and /usr/local/lib/moat/moat-agent"
fi
