"""Run one experiment into ``results/<name>/`` (what it runs and writes: :mod:`src.launch.experiment`).

python scripts/run_experiment.py --config configs/smoke_fmnist.yaml
python scripts/run_experiment.py --config configs/baselines/async_topk25_ef.yaml --set training.data_dir=DIR
python scripts/run_experiment.py --help
"""

import sys

from src.launch.experiment import main

if __name__ == "__main__":
    sys.exit(main())
