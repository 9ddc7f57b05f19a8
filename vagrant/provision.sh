#!/usr/bin/env bash
# Provisions the development VM (run by Vagrant as root; safe to run again):
#   1. Debian packages for building: build-essential, git, curl, pkg-config, python3-venv;
#   2. rustup with the project's toolchain (Rust 1.95.0) for root, who runs the tests;
#   3. `cargo xtask setup` in the repository: rust-src, bpf-linker, the test packages, the
#      Python venv and QEMU (see README.md, "Two commands").
set -euo pipefail

RUST_VERSION="${RUST_VERSION:-1.95.0}"
PROXY_DIR="${PROXY_DIR:-/home/vagrant/proxy}"
export DEBIAN_FRONTEND=noninteractive

echo "==> Debian packages"
apt-get update -q
apt-get install -y -q --no-install-recommends \
    build-essential git curl ca-certificates pkg-config python3 python3-venv rsync xz-utils

echo "==> Rust ${RUST_VERSION} (rustup, for root)"
export PATH="/root/.cargo/bin:${PATH}"
if ! command -v rustup >/dev/null; then
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs \
        | sh -s -- -y --profile minimal --default-toolchain "${RUST_VERSION}"
fi
rustup toolchain install "${RUST_VERSION}" --profile minimal --component rustfmt,clippy
rustup default "${RUST_VERSION}"

echo "==> cargo xtask setup"
if [ ! -f "${PROXY_DIR}/Cargo.toml" ]; then
    echo "provision.sh: no repository at ${PROXY_DIR} (the rsync synced folder)" >&2
    exit 1
fi
cd "${PROXY_DIR}"
cargo xtask setup

cat <<DONE
==> ready. Run the tests as root:
    vagrant ssh -c 'sudo -i bash -lc "cd ${PROXY_DIR} && cargo xtask test"'
DONE
