"""The report's names, shared by its builder (:mod:`src.reports.report`), its sections (:mod:`src.reports.sections`)
and its plots (:mod:`src.reports.plots`): the plots every report writes, its sections in order, and the
words for a figure a run did not record."""

PLOTS = ("accuracy_vs_time", "throughput", "time_split", "bytes_per_step", "staleness", "fault_timeline")
SECTIONS = (
    "How the numbers are measured",
    "Summary",
    "Accuracy over wall time",
    "Throughput and speedup",
    "Time to target accuracy",
    "Where the time goes",
    "Bytes on the wire",
    "Staleness",
    "Faults",
    "Per worker",
    "Per rank",
    "Benchmarks",
    "Timeline",
)
NOT_RECORDED = "not recorded"
