"""Run one experiment into ``results/<name>/`` (what it runs and writes: :mod:`src.experiment`).

python scripts/run_experiment.py --config configs/experiments/smoke.yaml
python scripts/run_experiment.py --help
"""

import sys

from src.experiment import main

if __name__ == "__main__":
    sys.exit(main())
