#!/bin/sh
# Test/development certificates for pdspec's TLS and mTLS (deploy/docker-compose.tls.yml):
#   deploy/make-certs.sh [OUTDIR]        (default: deploy/certs; existing files are replaced)
# OUTDIR/
#   ca.pem, ca-key.pem              a CA that signs everything below (keep ca-key.pem offline)
#   decode.pem, decode-key.pem      decode server: SAN decode, localhost, 127.0.0.1, ::1
#   prefill.pem, prefill-key.pem    prefill server (gRPC and HTTP API): SAN prefill, localhost, 127.0.0.1, ::1
#   client.pem, client-key.pem      the prefill node's client certificate to an mTLS decode node
#                                   (also what the decode container's health check presents)
# ECDSA P-256 keys, valid DAYS (default 825) days. Keys are mode 0644 so the images' user
# (uid 10001) can read them from a bind mount: for production, issue certificates from your
# own PKI and hand keys over as secrets readable only by that user (docs/security.md).
set -eu
OUT=${1:-$(dirname "$0")/certs}
DAYS=${DAYS:-825}
mkdir -p "$OUT"
cd "$OUT"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

key ca-key.pem
openssl req -x509 -new -key ca-key.pem -sha256 -days "$DAYS" -subj "/CN=pdspec test CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out ca.pem

# sign NAME CN USAGE [SAN]
sign() {
    key "$1-key.pem"
    openssl req -new -key "$1-key.pem" -subj "/CN=$2" -out "$TMP/$1.csr"
    {
        echo "basicConstraints=critical,CA:FALSE"
        echo "keyUsage=critical,digitalSignature"
        echo "extendedKeyUsage=$3"
        if [ -n "${4:-}" ]; then echo "subjectAltName=$4"; fi
    } >"$TMP/$1.ext"
    openssl x509 -req -in "$TMP/$1.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial -CAserial "$TMP/ca.srl" \
        -sha256 -days "$DAYS" -extfile "$TMP/$1.ext" -out "$1.pem" 2>/dev/null
}

sign decode decode serverAuth "DNS:decode,DNS:localhost,IP:127.0.0.1,IP:::1"
sign prefill prefill serverAuth "DNS:prefill,DNS:localhost,IP:127.0.0.1,IP:::1"
sign client prefill-client clientAuth
chmod 0644 ./*.pem
chmod 0600 ca-key.pem
echo "certificates in $OUT: ca.pem decode.pem prefill.pem client.pem (+ *-key.pem)"
