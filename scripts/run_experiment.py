"""Run one experiment into ``results/<name>/`` (what it runs and writes: :mod:`src.launch.experiment`).

python scripts/run_experiment.py --config configs/experiments/smoke.yaml
python scripts/run_experiment.py --help
"""

import sys

from src.launch.experiment import main

if __name__ == "__main__":
    sys.exit(main())
