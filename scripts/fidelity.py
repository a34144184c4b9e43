"""Compare virtual time with the real clock on one experiment: calibrate here, run both, print JSON.

    python scripts/fidelity.py --config configs/experiments/fidelity_straggler_2.yaml
    python scripts/fidelity.py --config CONFIG --seeds 0 1 2 --out results/fidelity/straggler_2

What it does and what the ratios mean: src/studies/fidelity.py. The table of docs/virtual_time.md was made
with this script, one config at a time, on a machine with nothing else running.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a parameter-server run config (YAML/JSON)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the real and virtual runs")
    parser.add_argument("--out", default="results/fidelity", help="where the runs write (default results/fidelity)")
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args(argv)

    from src.config import ConfigError, load_config
    from src.launch.cli import exit_status
    from src.studies.fidelity import compare

    try:
        config = load_config(args.config, overrides={"system.architecture": "parameter_server"})
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"config error: {problem}", file=sys.stderr)
        return 2

    def run() -> None:
        result = compare(config, args.out, seeds=tuple(args.seeds))
        text = json.dumps(result, indent=2)
        print(text)
        if args.output:
            with open(args.output, "w") as handle:
                handle.write(text + "\n")

    return exit_status(run, describe={})


if __name__ == "__main__":
    sys.exit(main())
