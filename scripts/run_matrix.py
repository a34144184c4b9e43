"""Run a matrix of experiments (axes crossed, resumable) under ``results/<matrix>/`` (:mod:`src.matrix`).

python scripts/run_matrix.py --config configs/experiments/matrix_smoke.yaml
python scripts/run_matrix.py --help
"""

import sys

from src.matrix import main

if __name__ == "__main__":
    sys.exit(main())
