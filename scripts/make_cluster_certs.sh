#!/usr/bin/env bash
# Makes a cluster CA and one certificate per service for mutual TLS between nq-router,
# nq-worker and nq-streamer (services/common/internal_tls.h), with Debian's openssl.
#
#   bash scripts/make_cluster_certs.sh DIR [NAME ...]
#
# DIR gets ca.crt (give it to every service as --tls_ca), and for each of router, worker and
# streamer <service>.crt / <service>.key (--tls_cert / --tls_key). Every certificate is valid
# as server and as client and names localhost, 127.0.0.1, ::1, nq-<service> and each extra
# NAME (the host names or IPs the services are dialled by). Keys are ECDSA P-256, written 0600;
# certificates last 825 days. For a real deployment use your own CA or cert-manager; this is
# for test clusters and for trying the setup.
set -euo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: $0 DIR [NAME ...]" >&2
  exit 2
fi
command -v openssl >/dev/null || { echo "make_cluster_certs.sh: openssl not found (apt-get install openssl)" >&2; exit 1; }
dir="$1"
shift
mkdir -p "$dir"
umask 077

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 825 \
  -subj "/CN=NestQuant cluster CA" -keyout "$dir/ca.key" -out "$dir/ca.crt" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

for service in router worker streamer; do
  san="DNS:localhost,IP:127.0.0.1,IP:::1,DNS:nq-$service"
  for name in "$@"; do
    if [[ "$name" =~ ^[0-9.]+$ || "$name" == *:* ]]; then san+=",IP:$name"; else san+=",DNS:$name"; fi
  done
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=nq-$service" \
    -keyout "$dir/$service.key" -out "$dir/$service.csr" 2>/dev/null
  ext="$(mktemp)"
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nkeyUsage=critical,digitalSignature\nbasicConstraints=CA:FALSE\n' \
    "$san" >"$ext"
  openssl x509 -req -in "$dir/$service.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial \
    -days 825 -extfile "$ext" -out "$dir/$service.crt" 2>/dev/null
  rm -f "$ext" "$dir/$service.csr"
done
rm -f "$dir/ca.srl"
chmod 0644 "$dir"/*.crt
echo "$dir: ca.crt, and {router,worker,streamer}.{crt,key}"
