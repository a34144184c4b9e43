"""The findings F1-F14 (docs/findings.md) from the committed records of their matrices.

    python scripts/findings.py                                   # every figure, as JSON
    python scripts/findings.py --collect results/f1_stragglers   # a finished matrix -> docs/findings/f1_stragglers.json
    python scripts/findings.py --check                           # exit 1 if docs/findings.md differs from the records
    python scripts/findings.py --write                           # rewrite docs/findings.md's generated blocks

The figures and their statistics are :mod:`src.findings.figures`, their Markdown :mod:`src.findings.render`; a
matrix's record (what of each run is kept, a few KB) is :mod:`src.findings.record`. Exit status: 0 done,
1 the document differs (--check) or nothing to read, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from src.findings import figures as findings
from src.findings.document import check_document, update_document
from src.findings.record import collect_matrix, load_records, write_record
from src.findings.render import render


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", default=str(ROOT / "docs" / "findings"), help="folder of the matrices' records")
    parser.add_argument(
        "--doc", default=str(ROOT / "docs" / "findings.md"), help="the document with the generated blocks"
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument(
        "--collect", nargs="+", metavar="MATRIX_DIR", help="write the records of these finished matrices"
    )
    action.add_argument("--check", action="store_true", help="compare the document's blocks with the records")
    action.add_argument("--write", action="store_true", help="rewrite the document's blocks from the records")
    args = parser.parse_args(argv)
    records_dir = Path(args.records)
    if args.collect:
        missing = [folder for folder in args.collect if not Path(folder).is_dir()]
        if missing:
            parser.error(f"--collect: not a folder: {', '.join(missing)}")
        for folder in args.collect:
            record = collect_matrix(Path(folder))
            print(f"{write_record(record, records_dir)}: {len(record['runs'])} runs")
        return 0
    records = load_records(records_dir) if records_dir.is_dir() else {}
    if not records:
        print(f"error: --records: no matrix records (*.json) in {records_dir}", file=sys.stderr)
        return 1
    figures = findings.compute(records)
    if not (args.check or args.write):
        print(json.dumps(figures, indent=2))
        return 0
    doc = Path(args.doc)
    if not doc.is_file():
        print(f"error: --doc: {doc} not found", file=sys.stderr)
        return 1
    blocks = render(figures)
    if args.write:
        doc.write_text(update_document(doc.read_text(), blocks))
        print(f"{doc}: {len(blocks)} blocks written")
        return 0
    problems = check_document(doc.read_text(), blocks)
    for problem in problems:
        print(f"{doc}: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
