#!/usr/bin/env bash
# `make image`: build components/Dockerfile as IMAGE (default recd-components:<version>).
#
# With docker where a daemon answers; else with podman, installed from the distribution's
# packages where missing (as `make` installs the rest). Where the default base image cannot
# be pulled (no registry), the base is built from the distribution's archive: a minimal
# Debian bookworm (debootstrap) with its Python 3.11, said so on the way. The host's pip
# configuration (config files, the CA bundle and the local wheel and index directories they
# name) is mounted read-only into the build, so proxied and air-gapped sites build as they
# install; none of it is copied into the image. Where the torch wheel lies in a local
# find-links directory, it is installed from there instead of the torch index.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE=${IMAGE:-recd-components:$VERSION}
VARIANT=${VARIANT:-cpu}
BASE=${PYTHON_IMAGE:-docker.io/library/python:3.11.14-slim-bookworm}
LOCAL_BASE=localhost/recd-python:3.11-bookworm
WORK=build/image
PIP=${PIP:-.venv/bin/pip}
args=(-f components/Dockerfile --build-arg "VARIANT=$VARIANT"
      --label "org.opencontainers.image.version=$VERSION"
      --label "org.opencontainers.image.revision=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)")
say() { echo "make image: $*"; }

if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
  say "docker build of $IMAGE"
  exec docker build "${args[@]}" --build-arg "PYTHON_IMAGE=$BASE" -t "$IMAGE" .
fi

if ! command -v podman >/dev/null 2>&1; then
  say "no docker daemon and no podman: installing podman (Debian packages)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null
fi
mkdir -p "$WORK"
if [ -z "${CONTAINERS_CONF:-}" ]; then
  # runc (crun fails in hybrid cgroup hosts) and limits a container may set without privileges
  printf '[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]\n[engine]\nruntime = "runc"\n' \
    > "$WORK/containers.conf"
  export CONTAINERS_CONF=$PWD/$WORK/containers.conf
fi

if podman image exists "$BASE" || podman pull -q "$BASE" >/dev/null 2>&1; then
  args+=(--build-arg "PYTHON_IMAGE=$BASE")
else
  say "$BASE cannot be pulled here: using a base built from Debian's archive ($LOCAL_BASE)"
  if ! podman image exists "$LOCAL_BASE"; then
    command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; }
    rm -rf "$WORK/rootfs"
    say "debootstrap --variant=minbase bookworm (about 2 minutes)"
    debootstrap --variant=minbase bookworm "$WORK/rootfs" >"$WORK/debootstrap.log" 2>&1 \
      || { tail -20 "$WORK/debootstrap.log"; exit 1; }
    tar -C "$WORK/rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - localhost/debian:bookworm >/dev/null
    rm -rf "$WORK/rootfs"
    printf '%s\n' 'FROM localhost/debian:bookworm' \
      'RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python-is-python3 ca-certificates && rm -rf /var/lib/apt/lists/*' \
      | podman build -q -t "$LOCAL_BASE" -f - "$WORK" >/dev/null
  fi
  args+=(--build-arg "PYTHON_IMAGE=$LOCAL_BASE")
fi

# the host's pip configuration and what it names, read-only, at the same paths
mounts=()
mount_ro() { [ -e "$1" ] && mounts+=(-v "$1:$1:ro"); return 0; }
for f in /etc/pip.conf /etc/xdg/pip/pip.conf "$HOME/.config/pip/pip.conf" "$HOME/.pip/pip.conf"; do
  mount_ro "$f"
done
torch_local=""
if [ -x "$PIP" ]; then
  while IFS= read -r value; do
    for path in $value; do
      path=${path#file://}
      # a local index (…/simple) links to files beside it: mount its parent
      case "$path" in */simple | */simple/) mount_ro "$(dirname "$path")" ;; /*) mount_ro "$path" ;; esac
      if [ -d "$path" ] && ls "$path"/torch-2.13.0* >/dev/null 2>&1; then torch_local=yes; fi
    done
  done < <("$PIP" config list 2>/dev/null | sed -n "s/^[^=]*='\(.*\)'$/\1/p")
fi
if [ -n "$torch_local" ] && [ "$VARIANT" = cpu ]; then
  say "the torch 2.13.0 wheel is on disk: installed from there"
  args+=(--build-arg TORCH_INDEX=)
fi

# room to build: a cold build writes the 1.8 GB environment about three times (the build
# stage, the runtime copy, the blob committed through TMPDIR); a full disk fails late and
# takes the host's other work with it, so say so first
need_gb=${IMAGE_BUILD_FREE_GB:-6}
for dir in "$(podman info --format '{{.Store.GraphRoot}}')" "${TMPDIR:-/var/tmp}"; do
  free_gb=$(df -Pk "$dir" | awk 'NR==2 {print int($4 / 1048576)}')
  if [ "$free_gb" -lt "$need_gb" ]; then
    say "only ${free_gb} GB free under $dir; a build needs about ${need_gb} GB (\`podman image prune\` reclaims old builds)"
    exit 1
  fi
done

say "podman build of $IMAGE"
podman build --force-rm "${args[@]}" "${mounts[@]}" -t "$IMAGE" .
# the builds this one replaced (untagged now): each holds its own copy of recd's layers
podman image prune -f --filter "label=org.opencontainers.image.title=recd-components" >/dev/null
podman image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' "$IMAGE"
