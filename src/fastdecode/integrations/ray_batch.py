"""``fastdecode batch --ray``: the driver side. Parse inputs here, generate on Ray actors, write here.

The driver parses the input with the single-process reader (same line numbers, ids and error
items), puts it into Ray's object store as Arrow blocks of encoded rows (so the driver's own
memory holds references, not prompts), maps the blocks through ``FastDecodePredictor`` actors and
reads the records back. Generation starts once the whole input is in the object store (reading is
fast next to generating; a stdin that never closes never starts). Every row carries its input position (``seq``); records pass through a
``ReorderBuffer`` before they are written, so the output is in input order whatever order the
blocks finish in (the dataset also asks Ray to preserve block order, which keeps the buffer
empty), and a record delivered twice is an error, never a duplicate line. The output file is
written by the single-process writer (append + flush in input order), so a killed run resumes
exactly as ``fastdecode batch`` does.

Ray instances: ``local`` starts one for the run (loopback only, no dashboard, small object store,
logs and sockets in a temporary folder) and shuts it down; ``auto`` joins the cluster this
machine belongs to; anything else is a cluster address. A process already connected to Ray
(a notebook, a test) keeps its connection.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import RayUnavailableError
from ..pipeline.inputs import InputItem
from ..pipeline.records import ReorderBuffer
from ..validation import positive_int
from .ray import encoded_blocks, map_predictor, ray_batch_size

if TYPE_CHECKING:  # pragma: no cover
    import ray.data

LOCAL_OBJECT_STORE_BYTES = 128 * 2**20  # prompts and records only: weights never go through it
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray binds and advertises 127.0.0.1 only


@dataclass(frozen=True)
class RayOptions:
    """Where and how wide: ``address`` is "local", "auto" or a cluster address."""

    address: str = "local"
    actors: int = 1
    cpus_per_actor: int = 1

    def __post_init__(self) -> None:
        for name in ("actors", "cpus_per_actor"):
            positive_int(getattr(self, name), f"--{name.replace('_', '-')}")


def import_ray() -> Any:
    try:
        import ray
        import ray.data  # noqa: F401 - the Data library is the part we need
    except ImportError as exc:
        raise RayUnavailableError(
            f"--ray needs Ray Data: pip install 'fastdecode[ray]' ({exc})"
        ) from None
    return ray


@contextlib.contextmanager
def local_ray(num_cpus: int) -> Iterator[str]:
    """A private single-node Ray on 127.0.0.1 with ``num_cpus`` CPUs for the block; yields its address.

    No dashboard, a small object store, logs and sockets in a temporary folder removed at the end.
    """
    ray = import_ray()
    from ray._private import ray_constants

    saved = os.environ.get(LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_ENV] = "0"  # for the Ray processes started below
    ray_constants.ENABLE_RAY_CLUSTER = False  # for this process, which read the variable at import
    temp_dir = tempfile.mkdtemp(prefix="fdray-")  # short: Ray puts unix sockets under it
    try:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 object_store_memory=LOCAL_OBJECT_STORE_BYTES, _temp_dir=temp_dir, log_to_driver=False,
                 configure_logging=False)
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = saved[1]
        if saved[0] is None:
            os.environ.pop(LOOPBACK_ENV, None)
        else:
            os.environ[LOOPBACK_ENV] = saved[0]
        shutil.rmtree(temp_dir, ignore_errors=True)


@contextlib.contextmanager
def ray_connection(options: RayOptions) -> Iterator[None]:
    """Connected to Ray for the block's duration; a local instance is started and removed here."""
    ray = import_ray()
    if ray.is_initialized():
        yield
        return
    if options.address == "local":
        with local_ray(options.actors * options.cpus_per_actor):
            yield
        return
    try:
        ray.init(address=options.address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise RayUnavailableError(f"cannot connect to Ray at {options.address!r}: {exc}") from None
    try:
        yield
    finally:
        ray.shutdown()


def input_dataset(items: Iterable[InputItem], rows_per_block: int) -> tuple["ray.data.Dataset | None", int]:
    """(a Dataset of encoded input blocks in input order, its row count); (None, 0) for no input.

    Each block goes to the object store as soon as it is full, so the driver holds references and
    block metadata, not the input. This is ``ray.data.from_blocks`` (which takes the blocks
    themselves, all at once) fed one block at a time; ``from_arrow_refs`` would start a remote
    task per block to learn what is computed here for free.
    """
    ray = import_ray()
    from ray.data._internal.logical.interfaces import LogicalPlan
    from ray.data._internal.logical.operators import FromBlocks
    from ray.data._internal.stats import DatasetStats
    from ray.data.block import BlockMetadataWithSchema
    from ray.data.dataset import MaterializedDataset

    refs, metadata, total = [], [], 0
    for block in encoded_blocks(items, rows_per_block):
        refs.append(ray.put(block))
        metadata.append(BlockMetadataWithSchema.from_block(block))
        total += block.num_rows
    if not refs:
        return None, 0
    context = ray.data.DataContext.get_current().copy()
    stats = DatasetStats(metadata={"FromBlocks": metadata}, parent=None)
    return MaterializedDataset(LogicalPlan(FromBlocks(refs, metadata), context), context, stats), total


def ray_records(items: Iterable[InputItem], predictor_kwargs: dict[str, Any], options: RayOptions, window: int,
                expected_rows: int | None = None) -> Iterator[list[dict[str, Any]]]:
    """Records of ``items`` generated on Ray actors, in input order, in groups as they become ready
    (needs a Ray connection).

    ``predictor_kwargs``: FastDecodePredictor's arguments (model, options, chat...);
    ``window``: the most rows per Ray batch; ``expected_rows``: the input size when known.
    """
    rows_per_block = ray_batch_size(expected_rows, options.actors, window)
    ds, total = input_dataset(items, rows_per_block)
    if ds is None:
        return
    ds = map_predictor(ds, dict(predictor_kwargs, encoded=True), options.actors, options.cpus_per_actor,
                       rows_per_block)
    ds.context.execution_options.preserve_order = True
    ds.context.enable_progress_bars = False  # the CLI draws its own
    ds.context.print_on_execution_start = False
    reorder = ReorderBuffer()
    for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
        ready = []
        for seq, line in zip(batch.column("seq").to_pylist(), batch.column("record").to_pylist()):
            ready += reorder.push(seq, json.loads(line))
        if ready:
            yield ready
    if reorder.next_seq != total or len(reorder):
        raise RuntimeError(f"Ray returned {reorder.next_seq} of {total} records in order "
                           f"({len(reorder)} stranded): inputs were lost")


def quiet_ray_logs() -> None:
    """Ray Data logs each execution's plan and settings on stderr; the CLI shows its own progress."""
    import logging

    logging.getLogger("ray").setLevel(logging.WARNING)
    logging.getLogger("ray.data").setLevel(logging.ERROR)
