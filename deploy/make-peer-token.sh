#!/bin/sh
# A random peer token for the prefill->decode hop (--peer-token-file on both nodes):
#   deploy/make-peer-token.sh [FILE]     (default: deploy/secrets/peer-token; an existing file is replaced)
# 32 random bytes as 64 hex digits, written with umask 077 (mode 0600, readable by this user
# only). Hand the same file to both nodes, e.g. on Kubernetes:
#   kubectl -n pdspec create secret generic pdspec-peer-token --from-file=token=FILE
# docker-compose.yml needs none of this: its peer-token service makes one in a volume.
# Rotation: docs/security.md.
set -eu
OUT=${1:-$(dirname "$0")/secrets/peer-token}
umask 077
mkdir -p "$(dirname "$OUT")"
TMP="$OUT.tmp.$$"
trap 'rm -f "$TMP"' EXIT
od -An -N32 -tx1 /dev/urandom | tr -d ' \n' > "$TMP"
echo >> "$TMP"
mv "$TMP" "$OUT"
echo "$OUT"
