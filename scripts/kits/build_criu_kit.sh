#!/usr/bin/env bash
# Build CRIU 4.x from Debian's source package on Debian bookworm and pack the
# `criu` binary plus every non-glibc shared library it links against into a
# self-contained folder (default: <repo>/.criu4-kit/) with a run.sh wrapper.
#
# Why: bookworm's criu 3.17.1 fails `criu check` on 6.x+ kernels
# ("vdso: Unexpected rt vDSO area bounds"); trixie's criu 4.1.1 binary needs
# glibc >= 2.38. Building on bookworm (glibc 2.36) gives a binary that runs on
# bookworm and on newer glibc hosts (e.g. Ubuntu glibc 2.39) alike.
#
# Usage (as root, needs apt + network to deb.debian.org):
#   scripts/kits/build_criu_kit.sh [KIT_DIR]
# Env: CRIU_VERSION (default 4.2.1: 4.1.x cannot dump a TCP socket on 6.16+ kernels), CRIU_SHA256 (optional check of the orig
#      tarball), WORK_DIR (default /tmp/criu-build), SKIP_APT=1 to skip apt.
set -euo pipefail

# apt-get, one at a time: the test suite's set-up steps (Redis, Slurm, the CRIU kit) may install side by side,
# and a second apt-get fails at once on dpkg's lock
apt_get() { flock /tmp/mxlaunch-apt.lock apt-get -o DPkg::Lock::Timeout=600 "$@"; }


REPO_ROOT=$(cd "$(dirname "$0")/../.." && pwd)
KIT_DIR=${1:-$REPO_ROOT/.criu4-kit}
CRIU_VERSION=${CRIU_VERSION:-4.2.1}
WORK_DIR=${WORK_DIR:-/tmp/criu-build}
POOL=http://deb.debian.org/debian/pool/main/c/criu
# sha256 of criu_4.1.1.orig.tar.xz, from trixie's Sources index
declare -A KNOWN_SHA=(
  [4.1.1]=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
  [4.2.1]=29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9
)
CRIU_SHA256=${CRIU_SHA256:-${KNOWN_SHA[$CRIU_VERSION]:-}}

log() { echo "[build_criu_kit] $*" >&2; }

# 1. build dependencies (bookworm)
if [[ ${SKIP_APT:-0} != 1 ]]; then
  log "installing build dependencies"
  export DEBIAN_FRONTEND=noninteractive
  apt_get update -qq
  apt_get install -y -qq --no-install-recommends \
    build-essential pkg-config curl xz-utils ca-certificates \
    libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev protobuf-compiler \
    python3-protobuf libnl-3-dev libnet1-dev libcap-dev libgnutls28-dev \
    libbsd-dev libnftables-dev uuid-dev >/dev/null
fi

# 2. sources. The pool directory listing is not always browsable, so fetch
#    the exact file names. The Debian packaging tarball only carries
#    packaging + a few patches; it is applied when reachable, else skipped.
mkdir -p "$WORK_DIR"
cd "$WORK_DIR"
ORIG=criu_${CRIU_VERSION}.orig.tar.xz
if [[ ! -s $ORIG ]]; then
  log "downloading $POOL/$ORIG"
  curl -fsS -o "$ORIG.part" "$POOL/$ORIG"
  mv "$ORIG.part" "$ORIG"
fi
if [[ -n $CRIU_SHA256 ]]; then
  echo "$CRIU_SHA256  $ORIG" | sha256sum -c - >&2
fi
SRC=$WORK_DIR/criu-$CRIU_VERSION
rm -rf "$SRC"
tar xf "$ORIG"

DEB_TAR=criu_${CRIU_VERSION}-1.debian.tar.xz
if [[ -s $DEB_TAR ]] || curl -fsS -o "$DEB_TAR" "$POOL/$DEB_TAR" 2>/dev/null; then
  log "applying Debian patches from $DEB_TAR"
  tar -C "$SRC" -xf "$DEB_TAR"
  if [[ -f $SRC/debian/patches/series ]]; then
    grep -v '^\s*#' "$SRC/debian/patches/series" | while read -r p _; do
      [[ -n $p ]] && patch -d "$SRC" -p1 --forward <"$SRC/debian/patches/$p" >&2
    done
  fi
else
  rm -f "$DEB_TAR"
  log "Debian packaging tarball not reachable; building pristine upstream source"
fi

# 3. build only the criu binary (no docs -> no asciidoc/xmlto needed)
log "building criu $CRIU_VERSION"
make -C "$SRC" -j"$(nproc)" criu >&2
BIN=$SRC/criu/criu
"$BIN" --version >&2

# 4. kit: criu + non-glibc shared libraries + run.sh
rm -rf "$KIT_DIR"
mkdir -p "$KIT_DIR/lib"
install -m 0755 "$BIN" "$KIT_DIR/criu"
# glibc's own libraries (and the vDSO / loader) come from the target host.
GLIBC_RE='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libresolv|libutil|libanl|libnsl|libmvec|libBrokenLocale|libcrypt)\.so'
ldd "$BIN" | awk '/=> \//{print $1, $3}' | while read -r name path; do
  if [[ $name =~ $GLIBC_RE ]]; then continue; fi
  cp -L "$path" "$KIT_DIR/lib/$name"
done
cat >"$KIT_DIR/run.sh" <<'EOF'
#!/bin/sh
# Run the bundled CRIU with its bundled libraries.
KIT=$(cd "$(dirname "$0")" && pwd)
LD_LIBRARY_PATH="$KIT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$KIT/criu" "$@"
EOF
chmod 0755 "$KIT_DIR/run.sh"
{
  echo "criu $CRIU_VERSION built $(date -u +%FT%TZ) on $(. /etc/os-release; echo "$PRETTY_NAME"), $(ldd --version | head -1)"
  echo "max GLIBC symbol version required:"
  objdump -T "$KIT_DIR/criu" "$KIT_DIR"/lib/*.so* 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -Vu | tail -1
} >"$KIT_DIR/BUILD_INFO"

# sanity: every library resolvable from the kit
if LD_LIBRARY_PATH="$KIT_DIR/lib" ldd "$KIT_DIR/criu" | grep -q 'not found'; then
  LD_LIBRARY_PATH="$KIT_DIR/lib" ldd "$KIT_DIR/criu" >&2
  log "ERROR: unresolved libraries"; exit 1
fi
"$KIT_DIR/run.sh" --version >&2
log "kit ready: $KIT_DIR ($(du -sh "$KIT_DIR" | cut -f1))"
ls -la "$KIT_DIR" "$KIT_DIR/lib" >&2
