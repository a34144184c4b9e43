"""Run a matrix of experiments (axes crossed, resumable) under ``results/<matrix>/`` (:mod:`src.launch.matrix`).

python scripts/run_matrix.py --config configs/matrix_cifar_full.yaml --list
python scripts/run_matrix.py --config configs/experiments/matrix_smoke.yaml
python scripts/run_matrix.py --help
"""

import sys

from src.launch.matrix import main

if __name__ == "__main__":
    sys.exit(main())
