"""fastdecode as a Ray Data stage: ``Dataset.map_batches(FastDecodePredictor, concurrency=N, num_cpus=k)``.

Ray runs N actors; each loads the model once (``__init__``) with k torch threads and maps batches
of rows to the records ``fastdecode batch`` writes (``__call__``). Inside an actor a Ray batch
goes through the same pipeline as a single-process run (``pipeline.BatchRun``: parsing checks,
tokenizing, length-bucketed batches run by the engine's scheduler, a retry alone for a prompt
that fails its batch, record building), so a Ray run writes exactly the records a single-process run writes, and a bad row
gives an error record instead of failing the batch.

Two row layouts:
- plain rows (``generate_dataset``, any Ray dataset): a prompt column (``field``: a string or a
  list of ``{"role", "content"}`` messages), an optional ``id`` and an optional ``line`` (int, the
  input's number: it names the input in its record). Output columns: ``id, line, prompt, output,
  num_tokens, finish_reason, error`` (null where they do not apply).
- encoded rows (``encoded=True``, what ``fastdecode batch --ray`` sends, see ``encode_items``):
  ``seq`` (the input's position), ``line`` and ``item`` (JSON of its id, prompt and parse error,
  so that ids and prompts of mixed JSON types fit one Arrow column). Output columns: ``seq`` and
  ``record`` (the record as ASCII JSON; the driver's ``OutputFile`` writes it as a local run does).

Ray restarts an actor whose process dies and re-runs the batch it held (``map_predictor``); a
batch's records leave the actor only when the whole batch is done, so a retried batch is never
written twice.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..pipeline.inputs import InputItem, item_from_object

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow
    import ray.data

RECORD_COLUMNS = ("id", "line", "prompt", "output", "num_tokens", "finish_reason", "error")


def encode_items(items: Sequence[InputItem], first_seq: int) -> "pyarrow.Table":
    """Parsed inputs -> one Arrow block of encoded rows, numbered from ``first_seq`` (input order)."""
    import pyarrow

    # ASCII JSON: a lone surrogate from a "\ud800" escape survives the trip (Arrow strings are UTF-8).
    payloads = [json.dumps({"id": item.id, "prompt": item.prompt, "error": item.error,
                            "response_format": item.response_format}) for item in items]
    return pyarrow.table({
        "seq": pyarrow.array(range(first_seq, first_seq + len(items)), pyarrow.int64()),
        "line": pyarrow.array([item.line for item in items], pyarrow.int64()),
        "item": pyarrow.array(payloads, pyarrow.string()),
    })


def decode_item(row: dict[str, Any]) -> InputItem:
    """An encoded row -> the InputItem the driver parsed (same id, prompt, error, line and constraint)."""
    fields = json.loads(row["item"])
    return InputItem(line=row["line"], id=fields["id"], prompt=fields["prompt"], error=fields["error"],
                     response_format=fields.get("response_format"))


def item_from_row(row: dict[str, Any], field: str) -> InputItem:
    """A plain row -> an item checked like a .jsonl line; an input without ``id`` keeps id None."""
    line = row.get("line")
    item = item_from_object(row, line if isinstance(line, int) else 0, field)
    if "id" not in row:
        item.id = None
    return item


def assigned_cpus() -> float:
    """CPUs Ray gave the current actor (``map_batches(num_cpus=k)``); 1 outside a Ray worker."""
    import ray

    if not ray.is_initialized():
        return 1
    return ray.get_runtime_context().get_assigned_resources().get("CPU", 1)


class FastDecodePredictor:
    """A callable class for ``Dataset.map_batches``: one model per actor, batches of rows -> records.

    ``batch_format="pyarrow"`` is expected (``generate_dataset`` sets it); the result is an Arrow
    table with one row per input row, in the same order. ``num_cpus``: torch threads (default: the
    CPUs Ray assigned to the actor).
    """

    def __init__(self, model: str | None = None, *, options: dict[str, Any] | None = None, field: str = "prompt",
                 chat: bool | None = None, num_cpus: int | None = None, batch_size: int | None = None,
                 max_batch_tokens: int | None = None, device: str = "cpu", dtype: str = "float32",
                 quantize: str | None = None, prompt_rows: str | None = None, encoded: bool = False):
        import torch

        from .. import load
        from ..config import GenerationConfig
        from ..pipeline import BatchSettings
        from ..pipeline.settings import resolve_chat

        torch.set_num_threads(max(1, int(num_cpus or assigned_cpus())))  # the actor's share, not the node's cores
        self.options = dict(options or {})
        GenerationConfig.from_options(**self.options)  # a bad option fails the actor's start, not every row
        self.generator = load(model, device=device, dtype=dtype, quantize=quantize, prompt_rows=prompt_rows)
        self.settings = BatchSettings(batch_size=batch_size, max_batch_tokens=max_batch_tokens,
                                      chat=resolve_chat(self.generator, chat))
        self.field = field
        self.encoded = encoded

    def records(self, items: list[InputItem]) -> list[dict[str, Any]]:
        """One record per item, in item order, through the single-process pipeline."""
        from ..pipeline import BatchRun

        if not items:
            return []
        settings = dataclasses.replace(self.settings, lookahead=len(items))  # the Ray batch is one window
        return list(BatchRun(self.generator, items, settings, self.options))

    def __call__(self, batch: "pyarrow.Table") -> "pyarrow.Table":
        import pyarrow

        rows = batch.to_pylist()
        if self.encoded:
            records = self.records([decode_item(row) for row in rows])
            return pyarrow.table({
                "seq": batch.column("seq"),
                "record": pyarrow.array([json.dumps(record) for record in records], pyarrow.string()),
            })
        records = self.records([item_from_row(row, self.field) for row in rows])
        return pyarrow.Table.from_pylist([{name: record.get(name) for name in RECORD_COLUMNS} for record in records])


def ray_batch_size(rows: int | None, actors: int, window: int) -> int:
    """Rows per Ray batch: at most one lookahead window, and at least ~4 batches per actor when
    the input size is known, so that actors finish close together."""
    if rows is None:
        return window
    return max(1, min(window, -(-rows // (4 * actors))))


def generate_dataset(ds: "ray.data.Dataset", model: str | None = None, *, actors: int = 1, cpus_per_actor: int = 1,
                     field: str = "prompt", chat: bool | None = None, batch_size: int | None = None,
                     max_batch_tokens: int | None = None, rows_per_call: int | None = None, device: str = "cpu",
                     dtype: str = "float32", quantize: str | None = None, **options: Any) -> "ray.data.Dataset":
    """``ds`` (rows with a ``field`` prompt, optional ``id`` / ``line``) -> a lazy Dataset of records.

    ``model``: a path every worker can read, or None for the embedded model (each worker finds
    its own installed copy); ``quantize``: as for ``load``. ``options``: generation options (HF names), as for
    ``Generator.generate``. ``rows_per_call``: rows per actor call (default: one lookahead window).
    Output rows keep the input order when the DataContext preserves order.
    """
    from ..config import GenerationConfig
    from ..pipeline import BatchSettings
    from ..validation import positive_int

    GenerationConfig.from_options(**options)  # fail here, in the driver, before any actor starts
    for name, value in (("actors", actors), ("cpus_per_actor", cpus_per_actor)):
        positive_int(value, name)
    settings = BatchSettings(batch_size=batch_size, max_batch_tokens=max_batch_tokens, lookahead=rows_per_call)
    return map_predictor(ds, dict(model=model, options=options, field=field, chat=chat, batch_size=batch_size,
                                  max_batch_tokens=max_batch_tokens, device=device, dtype=dtype, quantize=quantize),
                         actors, cpus_per_actor, settings.window)


def map_predictor(ds: "ray.data.Dataset", predictor_kwargs: dict[str, Any], actors: int, cpus_per_actor: int,
                  rows_per_call: int) -> "ray.data.Dataset":
    """The map_batches stage both entry points add: a fixed pool of ``actors`` actors.

    Ray Data creates them with ``max_restarts=-1`` and ``max_task_retries=-1`` (its defaults for
    actor pools): an actor whose process dies is restarted and the batch it held runs again.
    """
    import ray.data

    return ds.map_batches(
        FastDecodePredictor,
        fn_constructor_kwargs=predictor_kwargs,  # the actor reads its CPUs (torch threads) from Ray
        batch_format="pyarrow",
        batch_size=rows_per_call,
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_cpus=cpus_per_actor,
    )


def encoded_blocks(items: Iterable[InputItem], rows_per_block: int) -> Iterable["pyarrow.Table"]:
    """Encoded Arrow blocks of ``rows_per_block`` inputs each, numbered in input order."""
    block: list[InputItem] = []
    seq = 0
    for item in items:
        block.append(item)
        if len(block) == rows_per_block:
            yield encode_items(block, seq)
            seq += len(block)
            block = []
    if block:
        yield encode_items(block, seq)
