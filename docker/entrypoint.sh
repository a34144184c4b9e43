#!/usr/bin/env bash
# Container entrypoint: runs one role of a parameter-server run, chosen by the environment.
#
#   DTS_ROLE             server | worker (required)
#   DTS_SERVER_ADDRESS   server: address to bind (default 0.0.0.0:50051);
#                        worker: where the server is (default parameter_server:50051)
#   DTS_WORKER_ID        worker: its id, 0..workers-1 (required for workers)
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
case "$role" in
  server)
    exec python run_parameter_server_training.py --role server \
      --server-address "${DTS_SERVER_ADDRESS:-0.0.0.0:50051}" "${transport[@]}" "${tls[@]}" "$@"
    ;;
  worker)
    if [[ -z "${DTS_WORKER_ID:-}" ]]; then
      echo "entrypoint: DTS_WORKER_ID must be set for DTS_ROLE=worker" >&2
      exit 2
    fi
    exec python run_parameter_server_training.py --role worker --worker-id "$DTS_WORKER_ID" \
      --server-address "${DTS_SERVER_ADDRESS:-parameter_server:50051}" "${transport[@]}" "${tls[@]}" "$@"
    ;;
  *)
    echo "entrypoint: DTS_ROLE must be 'server' or 'worker', got '${role}'" >&2
    exit 2
    ;;
esac
