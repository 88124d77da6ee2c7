#!/usr/bin/env bash
# Sets up a fresh Debian machine and starts moat in the foreground:
# packages, build, the default image, then `moat serve` with its defaults
# (127.0.0.1:2222, state in /var/lib/moat, keys from ~/.ssh/authorized_keys).
# Extra arguments go to `moat serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
INSTALL=1 scripts/build.sh
if [ ! -s "${HOME:-/root}/.ssh/authorized_keys" ]; then
  echo "note: ${HOME:-/root}/.ssh/authorized_keys is empty; add your public key there (or pass --authorized-keys FILE)" >&2
fi
# Build the image into the state dir `moat serve` will use, not the default one.
image_args=()
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --state-dir) image_args=(--state-dir "${args[i + 1]:-}") ;;
    --state-dir=*) image_args=("${args[i]}") ;;
  esac
done
moat image build debian "${image_args[@]}"
exec moat serve "$@"
