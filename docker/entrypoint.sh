#!/usr/bin/env bash
# Container entrypoint: runs one role of a parameter-server run, chosen by the environment.
#
#   DTS_ROLE             server | worker (required)
#   DTS_SERVER_ADDRESS   server: address to bind (default 0.0.0.0:50051; with DTS_SHARD_ADDRESSES, 0.0.0.0 on the
#                        port of this shard's entry);
#                        worker: where the server is (default parameter_server:50051; with DTS_SHARD_ADDRESSES,
#                        not passed: the runner takes the list's first entry, shard 0)
#   DTS_WORKER_ID        worker: its id, 0..workers-1 (required for workers)
#   DTS_SHARD_ADDRESSES  optional: a sharded run (several server shards): every shard's host:port, comma-separated,
#                        shard 0 first, the same list on every container; passed on as --shard-addresses (which
#                        sets --servers to its length)
#   DTS_SHARD            server: this server's shard, 0..shards-1 (default 0; needs DTS_SHARD_ADDRESSES), passed
#                        on as --shard
#   DTS_AUTH_TOKEN       shared secret every RPC carries (read by the Python code itself)
#   DTS_TRANSPORT        optional: grpc (default) or tcp, passed on as --transport (the same on every
#                        container; the healthcheck reads it too)
#   DTS_TLS_CERT, DTS_TLS_KEY, DTS_TLS_CA
#                        optional PEM files, passed on as --tls-cert, --tls-key, --tls-ca
#                        (docker/compose.tls.yml sets them)
#   DTS_PROCESSES_PER_HOST
#                        optional: how many training processes share this host's cores; unless
#                        OMP_NUM_THREADS is set, each gets nproc / this many torch threads
#                        (docker-compose.yml sets 3: oversubscribed cores slow a run down several times)
#   extra arguments      passed on to run_parameter_server_training.py (e.g. --workers 2 --dataset mnist)
#
# Workers only need the address and the token: the server tells them the run's settings.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -n "${DTS_PROCESSES_PER_HOST:-}" && -z "${OMP_NUM_THREADS:-}" ]]; then
  if [[ ! "$DTS_PROCESSES_PER_HOST" =~ ^[1-9][0-9]*$ ]]; then
    echo "entrypoint: DTS_PROCESSES_PER_HOST must be a positive integer, got '${DTS_PROCESSES_PER_HOST}'" >&2
    exit 2
  fi
  threads=$(( $(nproc) / DTS_PROCESSES_PER_HOST ))
  export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
fi

transport=()
[[ -n "${DTS_TRANSPORT:-}" ]] && transport+=(--transport "$DTS_TRANSPORT")

tls=()
[[ -n "${DTS_TLS_CERT:-}" ]] && tls+=(--tls-cert "$DTS_TLS_CERT")
[[ -n "${DTS_TLS_KEY:-}" ]] && tls+=(--tls-key "$DTS_TLS_KEY")
[[ -n "${DTS_TLS_CA:-}" ]] && tls+=(--tls-ca "$DTS_TLS_CA")

role="${DTS_ROLE:-}"

# A sharded run: the list of every shard's address (shard 0 first) and, on a server, its own shard.
shards=()
server_bind="${DTS_SERVER_ADDRESS:-0.0.0.0:50051}"
worker_target=(--server-address "${DTS_SERVER_ADDRESS:-parameter_server:50051}")
if [[ -n "${DTS_SHARD:-}" && -z "${DTS_SHARD_ADDRESSES:-}" ]]; then
  echo "entrypoint: DTS_SHARD needs DTS_SHARD_ADDRESSES (every shard's host:port, shard 0 first)" >&2
  exit 2
fi
if [[ -n "${DTS_SHARD_ADDRESSES:-}" ]]; then
  IFS=',' read -r -a shard_list <<< "$DTS_SHARD_ADDRESSES"
  for entry in "${shard_list[@]}"; do
    if [[ ! "$entry" =~ ^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):[0-9]+$ || "$DTS_SHARD_ADDRESSES" == *, ]]; then
      echo "entrypoint: DTS_SHARD_ADDRESSES must be host:port entries separated by commas, shard 0 first," \
           "got '${DTS_SHARD_ADDRESSES}'" >&2
      exit 2
    fi
  done
  shard="${DTS_SHARD:-0}"
  if [[ ! "$shard" =~ ^(0|[1-9][0-9]*)$ ]] || (( shard >= ${#shard_list[@]} )); then
    echo "entrypoint: DTS_SHARD must be one of 0..$(( ${#shard_list[@]} - 1 )) (an entry of DTS_SHARD_ADDRESSES)," \
         "got '${shard}'" >&2
    exit 2
  fi
  if [[ "$role" == worker && -n "${DTS_SHARD:-}" ]]; then
    echo "entrypoint: DTS_SHARD is for DTS_ROLE=server (a worker connects to every shard of DTS_SHARD_ADDRESSES)" >&2
    exit 2
  fi
  shards=(--shard-addresses "$DTS_SHARD_ADDRESSES")
  # A server binds every interface on its own entry's port; a worker reaches shard 0 at the list's first entry.
  server_bind="${DTS_SERVER_ADDRESS:-0.0.0.0:${shard_list[shard]##*:}}"
  [[ -z "${DTS_SERVER_ADDRESS:-}" ]] && worker_target=()
  [[ "$role" == server ]] && shards+=(--shard "$shard")
fi

case "$role" in
  server)
    exec python run_parameter_server_training.py --role server \
      --server-address "$server_bind" "${shards[@]}" "${transport[@]}" "${tls[@]}" "$@"
    ;;
  worker)
    if [[ -z "${DTS_WORKER_ID:-}" ]]; then
      echo "entrypoint: DTS_WORKER_ID must be set for DTS_ROLE=worker" >&2
      exit 2
    fi
    exec python run_parameter_server_training.py --role worker --worker-id "$DTS_WORKER_ID" \
      "${worker_target[@]}" "${shards[@]}" "${transport[@]}" "${tls[@]}" "$@"
    ;;
  *)
    echo "entrypoint: DTS_ROLE must be 'server' or 'worker', got '${role}'" >&2
    exit 2
    ;;
esac
