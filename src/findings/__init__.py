"""The spec's findings from committed records: figures, paired statistics, rendering into docs/findings.md."""
