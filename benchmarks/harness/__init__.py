"""The shared benchmark harness: worker processes (workers.py), alternating A/B repetitions, medians
with their min-max and markdown tables (stats.py), load sampling, the contention line (machine.py)
and the memory-bandwidth limit (bandwidth.py). Scripts import it as one module: ``import harness``.

Every script in benchmarks/ builds on it. Two ways to run engines side by side:

* in worker processes (``Worker`` in the parent, ``serve_worker`` in the child, a JSON line per
  request): each engine's peak RSS is its own and one engine's threads never share a process with
  another's. The parent never imports torch, so that its RSS is not inherited by the workers
  (Linux carries a parent's ``ru_maxrss`` into a child's).
* in one process (``alternate``): a few callables timed in turn, for engines that share a model.

Either way engines alternate inside every repetition (A, B, A, B...), so drift in machine load
hits all of them alike, and results are medians with the min-max range. ``Contention`` measures
how many cores other processes kept busy meanwhile: read the numbers with it in mind.
"""

from .bandwidth import BANDWIDTH_LABELS, limit_tokens_per_s, measure_bandwidth
from .machine import (EMBEDDED_FILE, EMBEDDED_PACKAGE, Contention, cpu_count, cpu_seconds, embedded_model_path,
                      machine_line, memory_kib, own_and_children_cpu_seconds, quiet_env, reset_peak_rss,
                      system_busy_seconds, wait_for_quiet)
from .stats import alternate, fmt_ratio, median, not_run, percentile, ratio, spread, table, timed
from .workers import (Worker, WorkerError, add_worker_arguments, alternate_workers, close_all, run_in_tree,
                      serve_worker, start_workers, stop_process)

__all__ = ["BANDWIDTH_LABELS", "EMBEDDED_FILE", "EMBEDDED_PACKAGE", "Contention", "Worker", "WorkerError",
           "add_worker_arguments", "alternate", "alternate_workers", "close_all", "cpu_count", "cpu_seconds",
           "embedded_model_path", "fmt_ratio", "limit_tokens_per_s", "machine_line", "measure_bandwidth", "median",
           "memory_kib", "not_run", "own_and_children_cpu_seconds", "percentile", "quiet_env", "ratio",
           "reset_peak_rss", "run_in_tree", "serve_worker", "spread", "start_workers", "stop_process",
           "system_busy_seconds", "table", "timed", "wait_for_quiet"]
