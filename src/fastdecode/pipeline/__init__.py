"""Asynchronous batch generation: reader -> tokenize -> generate -> detokenize -> writer.

``fastdecode batch`` (cli/batch.py, its body in cli/batch_run.py) and ``Generator.batch`` both run
``BatchRun`` (runner.py; its threads' stop flag and queue calls in stages.py, its settings in
settings.py); inputs.py parses lines, feeding.py hands inputs to one long-lived engine, records.py
builds the output records and keeps their order, output.py resumes and appends the .jsonl output.
"""

from __future__ import annotations

from .inputs import InputItem, items_from_lines, items_from_objects
from .runner import BatchRun, PipelineStats
from .settings import BatchSettings

__all__ = ["BatchRun", "BatchSettings", "InputItem", "PipelineStats", "items_from_lines",
           "items_from_objects"]
