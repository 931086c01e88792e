"""transformers reading a GGUF file (the golden tests' oracle), with the file's header parsed once.

transformers parses a GGUF file with ``gguf.GGUFReader`` for its config, again for its weights (and
twice more for a tokenizer: config, then vocabulary). The reader builds a numpy object for every
element of every metadata array: for Gemma 3's 262k-token vocabulary one parse takes longer than
decoding all the weights. ``gguf_parsed_once`` hands transformers the same (read-only) reader for
each of its parses of a file, so what transformers computes is unchanged; only the repeated
parsing goes. That one parse reads a plain ndarray view of the file's mapping (``read_gguf``): the
same bytes, without ``np.memmap``'s Python hooks on each of the millions of slices a parse takes
(Gemma 3's header: 18 -> 5 CPU s; Qwen2.5-Coder's 12 -> 4; fields and tensors checked equal).

transformers also maps tensor names module by module, and asks ``gguf.get_tensor_name_map(arch,
layers)`` for a fresh map at every module (~400 times for a 30-layer model, each formatting every
block's names anew: about a third of a small model's load). Within the block the map of an
(architecture, layer count) is built once and handed out again: it is only read (``get_name``).

gguf decodes a quantized tensor 16 rows at a time (``gguf.quants._apply_over_grouped_rows``): for a
1536-wide Q4_K row that is a few numpy calls per 24K values, and the calls cost more than the
arithmetic. Within the block it takes ``ROWS_PER_GROUP`` rows at a time: every block is decoded by
the same numpy operations on its own bytes, so the floats are the same (checked bit for bit on every
quantized tensor of the Qwen2.5-Coder, Gemma 3 and SmolLM2 files); Qwen's: 22.4 -> 13.5 CPU s.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import numpy as np
import pytest
import torch

ROWS_PER_GROUP = 256


@functools.cache
def _plain_reader_class():
    from gguf.gguf_reader import GGUFReader  # the class, also while gguf_parsed_once stands in for it

    class PlainGGUFReader(GGUFReader):
        """``gguf.GGUFReader`` whose ``data`` is a plain ndarray view of the file's np.memmap."""

        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.memmap) -> None:  # GGUFReader.__init__: self.data = np.memmap(path, ...)
            self.filename = mapped.filename
            self._plain = mapped.view(np.ndarray)  # keeps the memmap (its base), so the mapping stays

    return PlainGGUFReader


def read_gguf(path, mode="r"):
    """``gguf.GGUFReader(path, mode)``, parsed over a plain ndarray view of the mapping (the module's notes)."""
    return _plain_reader_class()(path, mode)


@contextlib.contextmanager
def gguf_parsed_once(*parsed):
    """Within the block, ``gguf.GGUFReader(path)`` parses each file once and returns that reader again
    (``parsed``: readers made before, of files opened read-only, returned for their files), a tensor-name
    map is built once, and quantized tensors are decoded ROWS_PER_GROUP rows at a time."""
    import gguf
    from gguf import quants

    name_map = gguf.get_tensor_name_map
    readers = {(os.path.realpath(getattr(reader, "filename", None) or reader.data.filename), "r"): reader
               for reader in parsed}
    name_maps = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = read_gguf(path, mode)
        return readers[key]

    def tensor_name_map(arch, n_blocks):
        if (arch, n_blocks) not in name_maps:
            name_maps[arch, n_blocks] = name_map(arch, n_blocks)
        return name_maps[arch, n_blocks]

    def over_grouped_rows(func, arr, otype, oshape):
        """gguf's ``_apply_over_grouped_rows`` with ROWS_PER_GROUP rows a group instead of 16."""
        rows = arr.reshape((-1, arr.shape[-1]))
        out = np.empty(shape=int(np.prod(oshape)), dtype=otype)
        groups = (rows.shape[0] // ROWS_PER_GROUP) or 1
        np.concatenate([func(group).ravel() for group in np.array_split(rows, groups)], axis=0, out=out)
        return out.reshape(oshape)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quants, "_apply_over_grouped_rows", over_grouped_rows)
        patch.setattr(gguf, "GGUFReader", reader)  # transformers imports both from gguf at each use
        patch.setattr(gguf, "get_tensor_name_map", tensor_name_map)
        yield


def hf_causal_lm(path: Path, *parsed):
    """transformers' model of the GGUF file at ``path`` (every block decoded to float32), in eval mode;
    ``parsed``: as ``gguf_parsed_once``'s."""
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with gguf_parsed_once(*parsed):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32)
    return model.eval()


def hf_tokenizer(path: Path, *parsed):
    """transformers' tokenizer built from the GGUF file's metadata; ``parsed``: as ``gguf_parsed_once``'s."""
    transformers = pytest.importorskip("transformers")
    with gguf_parsed_once(*parsed):
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
