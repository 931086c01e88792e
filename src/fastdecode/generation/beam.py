"""The beam engine over a fixed batch of prompts (Whisper's search runs on it: speech/engine.py).

Text beam search runs in the one ``Engine`` as beam groups (engine/beam_group.py, its arithmetic
in engine/beam_scores.py); this engine remains for speech, whose search (speech/search.py) keeps
its own timestamp and temperature-fallback rules over fixed windows.

The prompt's K/V are stored once per sample and shared by its beams by reference (FastSeq), on
the slot cache's per-sequence verbs: a reorder copies block tables, never K/V (copy-on-write of a
shared block at a beam's first write into it).
"""

from __future__ import annotations

import torch

from ..engine.plan import StepPlan, attention_terms
from ..engine.slots import BLOCK_SIZE, SlotCache
from ..layers.products import Products
from ..layers.threads import one_thread


class DecoderBeamEngine:
    """Decoder-only beam search on the slot cache's per-sequence verbs (engine/slots.py).

    Each prompt is prefilled once into its own sequence; its K beams are ``seq_cp`` forks that
    share the prompt's blocks by reference (FastSeq: the prompt's K/V once per sample). A beam
    reorder is ``seq_keep``: block tables are copied, no K/V moves. A beam's first write into a
    block it shares (the prompt's partial last block, or a generated block after a reorder)
    copies that one block (``writable``: copy-on-write). Every forward runs through the engine's
    ``StepPlan``, so windows, ALiBi and every family behave as in the engine; in a decode step the
    prompt's shared blocks are read once per sample, the beams folded into the query axis."""

    def __init__(self, model, num_beams: int, max_new_tokens: int):
        self.model = model
        self.num_beams = num_beams
        self.max_new_tokens = max_new_tokens
        self.windows, self.score_bias = attention_terms(model)
        self.cache: SlotCache | None = None
        self.tables: list[list[int]] = []  # block table of each beam row
        self.lengths: list[int] = []  # tokens each beam row holds
        self.prompt_lengths: list[int] = []  # per original sample
        self.samples: list[int] = []  # original sample of each sample still searching
        self.shared_nbytes = self.per_beam_nbytes = 0

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Left-padded prompts: tokens, valid, positions [B, S_p] -> logits [B, V]."""
        return self.start([row[ok].tolist() for row, ok in zip(tokens, valid)])

    def start(self, prompts: list[list[int]]) -> torch.Tensor:
        """Prefill each prompt once (one forward) -> logits [B, V]; then fork K beams per prompt."""
        model, cfg, K = self.model, self.model.config, self.num_beams
        size = BLOCK_SIZE
        blocks_for = lambda tokens: -(-tokens // size)
        prompt_blocks = sum(blocks_for(len(p)) for p in prompts)
        # Per beam: a copy of the prompt's partial block and the blocks of its generated tokens.
        beam_blocks = K * sum(blocks_for(len(p) + self.max_new_tokens) - len(p) // size for p in prompts)
        # Sliding-window layers get pools of the same size (engine/slots.py): a beam hands back what
        # slides out of its window, but the prefill holds every prompt's blocks at once.
        self.cache = SlotCache(cfg.num_layers, prompt_blocks + beam_blocks, cfg.num_kv_heads, cfg.head_dim,
                               model.dtype, model.device, size, self.windows)
        self.shared_nbytes = prompt_blocks * self.cache.block_nbytes
        self.per_beam_nbytes = beam_blocks * self.cache.block_nbytes
        tables = [self.cache.take(len(p)) for p in prompts]
        flat = [token for p in prompts for token in p]
        positions = [position for p in prompts for position in range(len(p))]
        ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1  # [B] last token of each prompt
        logits = self._forward(flat, positions, [(t, 0, len(p)) for t, p in zip(tables, prompts)], ends, prompt=True)
        self.tables = [self.cache.seq_cp(table) for table in tables for _ in range(K)]
        for table in tables:
            self.cache.release(table)
        self.lengths = [len(p) for p in prompts for _ in range(K)]
        self.prompt_lengths, self.samples = [len(p) for p in prompts], list(range(len(prompts)))
        return logits

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions [B*K] -> logits [B*K, V] (positions are the rows' lengths)."""
        # On one thread: a copy-on-write block copy (~74K floats) is above PyTorch's parallel threshold, and
        # its OpenMP barrier waits for a core that the kernels' helper threads hold (layers/parallel.h):
        # measured ~8 ms per copy at 2 threads on a busy machine, 40 us on one.
        with one_thread():
            for table, length in zip(self.tables, self.lengths):
                self.cache.prepare(table, length, length + 1)  # sliding kinds hand back what left the window
        rows = [(table, length, 1) for table, length in zip(self.tables, self.lengths)]
        logits = self._forward(tokens, positions, rows, torch.arange(len(rows)), (self.num_beams, self._shared_blocks()))
        self.lengths = [length + 1 for length in self.lengths]
        return logits

    def _shared_blocks(self) -> int:
        """Blocks every sample's beams hold in common: the prompt's full blocks (never written
        again, and a reorder stays within a sample), the fewest of any sample."""
        K, size = self.num_beams, BLOCK_SIZE
        shared = min(self.prompt_lengths[sample] // size for sample in self.samples)
        for row, table in enumerate(self.tables):
            if table[:shared] != self.tables[row - row % K][:shared]:
                raise RuntimeError("beams of a sample no longer share their prompt blocks")
        return shared

    def _forward(self, tokens, positions, rows: list[tuple[list[int], int, int]], logits_at: torch.Tensor,
                 shared: tuple[int, int] = (1, 0), prompt: bool = False):
        """``prompt``: the rows are prompts (exact products), else generated beam tokens."""
        device = self.model.device
        products = Products.of_rows(prompt, torch.get_num_threads(), device, kernels=self.model.kernels)
        plan = StepPlan.for_rows(self.cache, rows, self.windows, self.score_bias, self.model.dtype, products, shared)
        tokens = torch.as_tensor(tokens, device=device)[None]  # [1, N]
        positions = torch.as_tensor(positions, device=device)[None]  # [1, N]
        return self._run_model(tokens, positions, plan, logits_at.to(device), len(rows))[0]  # [rows, V]

    def _run_model(self, tokens: torch.Tensor, positions: torch.Tensor, plan: StepPlan, logits_at: torch.Tensor,
                   num_rows: int) -> torch.Tensor:
        """The model's forward over flat tokens, positions [1, N] -> logits [1, rows, V]."""
        return self.model.forward(tokens, positions, plan, logits_at=logits_at)

    def reorder_beams(self, sources: torch.Tensor) -> None:
        """Beam row i continues row ``sources[i]`` (of its own sample) -> ``seq_keep``."""
        sources = sources.tolist()
        self.tables = self.cache.seq_keep(self.tables, sources)
        self.lengths = [self.lengths[source] for source in sources]

    def keep_samples(self, samples: torch.Tensor) -> None:
        """Only these samples [B'] go on searching: the other samples' beams release their blocks."""
        K = self.num_beams
        samples = samples.tolist()
        rows = [sample * K + beam for sample in samples for beam in range(K)]
        self.samples = [self.samples[sample] for sample in samples]
        self.tables = self.cache.seq_keep(self.tables, rows)
        self.lengths = [self.lengths[row] for row in rows]
