#!/usr/bin/env bash
# Makes a base image for docker/Dockerfile without any image registry: Debian bookworm
# (debootstrap --variant=minbase, from the Debian mirror apt uses) with Python 3.11 as `python`,
# imported into the local Docker engine. Does nothing when the image already exists.
#
#   docker/build_local_base.sh [IMAGE]        (default dts-local-base:bookworm-py311)
#
# Needs root, debootstrap and a running Docker engine. Takes about a minute of CPU time (3 to 5
# minutes of wall time on a busy 2-core machine); downloading the ~40 MB of packages is a small part.
# $DTS_DEBIAN_MIRROR overrides the mirror (default http://deb.debian.org/debian).
set -euo pipefail

image="${1:-dts-local-base:bookworm-py311}"
mirror="${DTS_DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if docker image inspect "$image" >/dev/null 2>&1; then
    echo "build_local_base: $image already exists"
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "build_local_base: debootstrap needs root" >&2
    exit 2
fi
if ! command -v debootstrap >/dev/null; then
    echo "build_local_base: debootstrap is not installed (apt-get install debootstrap)" >&2
    exit 2
fi

root="$(mktemp -d /tmp/dts-local-base.XXXXXX)"
trap 'rm -rf "$root"' EXIT
echo "build_local_base: debootstrap bookworm from $mirror into $root"
if ! debootstrap --variant=minbase --include=python3,python-is-python3 \
        bookworm "$root" "$mirror" >"$root.log" 2>&1; then
    tail -n 20 "$root.log" >&2
    echo "build_local_base: debootstrap failed (full log: $root.log)" >&2
    exit 1
fi
rm -f "$root.log"
# The image needs no package lists or downloaded .debs.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb

tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python"]' \
    --message "debootstrap --variant=minbase --include=python3,python-is-python3 bookworm $mirror" \
    - "$image" >/dev/null
echo "build_local_base: made $image ($(docker run --rm "$image" python --version))"
