#!/usr/bin/env bash
# Runs playbook.yml against two boxes, then checks that no literal ~NAME
# directory was left in either (Ansible asks the shell for ~USER).
# Usage: HOST PORT KEY BOX1 BOX2
set -euo pipefail
host=$1 port=$2 key=$3
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
ssh_opts=(-F /dev/null -o IdentitiesOnly=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null
  -o LogLevel=ERROR -o BatchMode=yes -o ConnectTimeout=20 -i "$key" -p "$port")
# End Ansible's ControlPersist masters with the script.
trap 'for s in "$tmp"/cm-*; do [ -S "$s" ] && ssh -o ControlPath="$s" -O exit x 2>/dev/null; done; rm -rf "$tmp"' EXIT
{
  echo "[boxes]"
  for box in "$4" "$5"; do
    echo "$box ansible_host=$host ansible_port=$port ansible_user=$box ansible_ssh_private_key_file=$key ansible_python_interpreter=/usr/bin/python3"
  done
} > "$tmp/inventory"
export ANSIBLE_HOST_KEY_CHECKING=False ANSIBLE_RETRY_FILES_ENABLED=False ANSIBLE_LOCAL_TEMP="$tmp/local"
export ANSIBLE_SSH_ARGS="-F /dev/null -o IdentitiesOnly=yes -o UserKnownHostsFile=/dev/null -o ControlMaster=auto -o ControlPersist=30s -o ControlPath=$tmp/cm-%C"
timeout 240 ansible-playbook -i "$tmp/inventory" "$here/playbook.yml"
for box in "$4" "$5"; do
  left=$(timeout 60 ssh "${ssh_opts[@]}" "$box@$host" 'ls -a /root')
  if grep -q '^~' <<<"$left"; then
    echo "a literal ~ directory was left in $box:/root: $left" >&2
    exit 1
  fi
done
echo "ansible: playbook ok on $4 and $5"
