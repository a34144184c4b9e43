#!/usr/bin/env bash
# Container entrypoint: runs one role of a parameter-server run, chosen by the environment.
#
#   DTS_ROLE             server | worker (required)
#   DTS_SERVER_ADDRESS   server: address to bind (default 0.0.0.0:50051);
#                        worker: where the server is (default parameter_server:50051)
#   DTS_WORKER_ID        worker: its id, 0..workers-1 (required for workers)
#   DTS_AUTH_TOKEN       shared secret every RPC carries (read by the Python code itself)
#   extra arguments      passed on to run_parameter_server_training.py (e.g. --workers 2 --dataset mnist)
#
# Workers only need the address and the token: the server tells them the run's settings.
set -euo pipefail
cd "$(dirname "$0")/.."

role="${DTS_ROLE:-}"
case "$role" in
  server)
    exec python run_parameter_server_training.py --role server \
      --server-address "${DTS_SERVER_ADDRESS:-0.0.0.0:50051}" "$@"
    ;;
  worker)
    if [[ -z "${DTS_WORKER_ID:-}" ]]; then
      echo "entrypoint: DTS_WORKER_ID must be set for DTS_ROLE=worker" >&2
      exit 2
    fi
    exec python run_parameter_server_training.py --role worker --worker-id "$DTS_WORKER_ID" \
      --server-address "${DTS_SERVER_ADDRESS:-parameter_server:50051}" "$@"
    ;;
  *)
    echo "entrypoint: DTS_ROLE must be 'server' or 'worker', got '${role}'" >&2
    exit 2
    ;;
esac
