#!/usr/bin/env bash
# Builds the retriever image (sisrl-retriever:latest) where no container registry and no PyTorch index can be
# reached: a Debian bookworm base made with debootstrap + `docker import` (once, a few minutes; reused after),
# and the torch wheel that pip finds for `torch==2.13.0` (Makefile `install`), copied into the build context.
#
#   docker/build-local.sh                  # then: docker compose up
#   docker/build-local.sh --rebuild-base   # make the base again (e.g. for Debian's security updates)
#
# It writes build/docker/local.env (the build args as compose variables), so a later rebuild is
#   docker compose --env-file build/docker/local.env up --build
# Needs: a running Docker daemon, `docker compose` (or docker-compose), root for debootstrap (installed with
# apt-get when missing). Environment: SISRL_DEBIAN_MIRROR, SISRL_BASE_IMAGE, SISRL_TORCH_SPEC (a pip
# requirement) or SISRL_LOCAL_TORCH_WHEEL (a wheel file anywhere, taken as it is).
set -euo pipefail
cd "$(dirname "$0")/.."

MIRROR=${SISRL_DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE=${SISRL_BASE_IMAGE:-sisrl-base:bookworm}
TORCH_SPEC=${SISRL_TORCH_SPEC:-torch==2.13.0}
STAGE=build/docker  # ignored by git (build/); .dockerignore lets only its wheel into the context
rebuild_base=0
for arg in "$@"; do
    case $arg in
        --rebuild-base) rebuild_base=1 ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "build-local.sh: unknown argument $arg (expected --rebuild-base)" >&2; exit 2 ;;
    esac
done

say() { echo "build-local.sh: $*" >&2; }

if docker compose version >/dev/null 2>&1; then compose=(docker compose)
elif command -v docker-compose >/dev/null; then compose=(docker-compose)
else say "neither \`docker compose\` nor docker-compose is installed"; exit 1; fi
if ! docker info >/dev/null 2>&1; then
    say "no Docker daemon answers (\`docker info\` fails); start one, e.g. \`sudo dockerd &\`"; exit 1
fi

build_base() {
    # minbase: Essential packages only, plus python3 and its venv module (the Dockerfile's /opt/venv),
    # ca-certificates, and passwd for the Dockerfile's useradd.
    if ! command -v debootstrap >/dev/null; then
        say "installing debootstrap"
        apt-get install -y -qq debootstrap >/dev/null
    fi
    root=$(mktemp -d /tmp/sisrl-base.XXXXXX)
    trap 'rm -rf "$root" "$root.log"' EXIT
    say "debootstrap bookworm from $MIRROR into $root (a few minutes)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
        bookworm "$root" "$MIRROR" >"$root.log" 2>&1 || { tail -n 20 "$root.log" >&2; exit 1; }
    # The host's CA bundle: it holds whatever authority this network's TLS is re-signed with, without which
    # every pip request in the build fails with CERTIFICATE_VERIFY_FAILED.
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' - "$BASE" >/dev/null
    say "base image $BASE ready"
}

if [ "$rebuild_base" = 1 ] || ! docker image inspect "$BASE" >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || { say "debootstrap needs root (or set SISRL_BASE_IMAGE to an image you have)"; exit 1; }
    build_base
fi

mkdir -p "$STAGE"
if [ -n "${SISRL_LOCAL_TORCH_WHEEL:-}" ]; then
    wheel=$SISRL_LOCAL_TORCH_WHEEL
    [ -f "$wheel" ] || { say "SISRL_LOCAL_TORCH_WHEEL=$wheel: no such file"; exit 1; }
else
    # pip resolves the spec as `make install` does (its find-links, cache or index); the tags are the image's
    # python 3.11 on glibc x86-64, whatever the host's python is.
    rm -f "$STAGE"/torch-*.whl
    python=python3
    [ -x .venv/bin/python ] && python=.venv/bin/python  # `make install`'s venv: the same pip settings
    "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
        --platform manylinux_2_28_x86_64 --dest "$STAGE" "$TORCH_SPEC"
    wheel=$(find "$STAGE" -maxdepth 1 -name 'torch-*.whl' | head -n 1)
fi
# The Dockerfile's TORCH_WHEEL is a path inside the build context: the wheel is staged there, alone.
if [ "$(cd "$(dirname "$wheel")" && pwd)" != "$PWD/$STAGE" ]; then
    rm -f "$STAGE"/torch-*.whl
    cp "$wheel" "$STAGE/"
fi
wheel=$STAGE/$(basename "$wheel")

cat >"$STAGE/local.env" <<EOF
# Written by docker/build-local.sh: the build args of a registry-free build (docker-compose.yml).
SISRL_BASE_IMAGE=$BASE
SISRL_TORCH_WHEEL=$wheel
EOF
say "building sisrl-retriever:latest on $BASE with $(basename "$wheel")"
# The same values in the environment too: compose lets the shell's variables win over an --env-file.
SISRL_BASE_IMAGE=$BASE SISRL_TORCH_WHEEL=$wheel "${compose[@]}" --env-file "$STAGE/local.env" build retriever
say "done: docker compose up   (rebuild: docker compose --env-file $STAGE/local.env up --build)"
