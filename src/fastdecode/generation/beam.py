"""Beam search over the step primitives, with Hugging Face ``generate(num_beams=K)`` semantics.

Per step: log-softmax, the shared processors (n-gram blocking, min-new-tokens, forced tokens) on
log-probabilities, add each beam's running score, keep the top ``max(2, 1 + #EOS) * K`` candidates
of each sample (so that K stay open even when some end), continue the best K that did not end,
and offer the best K of the candidates that ended to the sample's finished set, scored with the
length penalty on the *generated* length. Stopping follows transformers' heuristic for
``early_stopping`` True / False / "never". Everything is batched tensors: one host sync per step
(whether to continue).

The prompt's K/V are stored once per sample and shared by its beams by reference (FastSeq), on
the slot cache's per-sequence verbs: a reorder copies block tables, never K/V (copy-on-write of a
shared block at a beam's first write into it).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..config import GenerationConfig
from ..constraints import CompiledGrammar
from ..engine.plan import StepPlan, attention_terms
from ..engine.slots import BLOCK_SIZE, SlotCache
from ..layers import ops
from ..layers.products import Products
from ..layers.threads import one_thread
from .decode import SequenceResult
from .sampling import TokenSelector
from .step import Started

NEG = -1.0e9  # transformers' "impossible" score (finite, so sums stay ordered)


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
        blocks_for = lambda tokens: -(-tokens // size)  # noqa: E731
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
        products = Products.of_rows(prompt, torch.get_num_threads(), device)  # the caller's threads
        plan = StepPlan.for_rows(self.cache, rows, self.windows, self.score_bias, self.model.dtype, products, shared)
        tokens = torch.as_tensor(tokens, device=device)[None]  # [1, N]
        positions = torch.as_tensor(positions, device=device)[None]  # [1, N]
        return self._run_model(tokens, positions, plan, logits_at.to(device), len(rows))[0]  # [rows, V]

    def _run_model(self, tokens: torch.Tensor, positions: torch.Tensor, plan: StepPlan, logits_at: torch.Tensor,
                   num_rows: int) -> torch.Tensor:
        """The model's forward over flat tokens, positions [1, N] -> logits [1, rows, V]."""
        return self.model.forward(tokens, positions, plan, None, logits_at=logits_at)

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


def start_beam_decoder_only(model, prompts: list[list[int]], config: GenerationConfig) -> Started:
    engine = DecoderBeamEngine(model, config.num_beams, config.max_new_tokens)
    next_positions = torch.tensor([len(p) for p in prompts], device=model.device)  # [B]
    return Started(engine, engine.start(prompts), next_positions, prompts)


def beam_starter(model):
    """Encoder-decoder models start by encoding the source (generation/encdec.py)."""
    if model.config.is_encoder_decoder:
        from .encdec import start_beam_encoder_decoder

        return start_beam_encoder_decoder
    return start_beam_decoder_only


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, N, ...] rows picked per sample by index [B, M] -> [B, M, ...]."""
    index = index.view(*index.shape, *([1] * (x.dim() - 2))).expand(*index.shape, *x.shape[2:])
    return x.gather(1, index)


class BeamSearch:
    """Iterate to run (one empty event list per step: beams are only final at the end); then
    ``results`` holds ``num_return_sequences`` results per prompt, best first, each with its score."""

    def __init__(self, model, prompts: list[list[int]], config: GenerationConfig, eos_ids: list[int],
                 grammar: CompiledGrammar | None = None):
        self.model, self.prompts, self.config, self.eos_list = model, prompts, config, list(eos_ids)
        self.results: list[SequenceResult] = []
        self.selector = TokenSelector(config, eos_ids, model.config.vocab_size, model.device,
                                      forced_bos=getattr(model.config, "forced_bos_token_id", None),
                                      forced_eos=getattr(model.config, "forced_eos_token_id", ()),
                                      grammar=grammar)
        self.steps = 0
        self.engine = None  # kept after the search, so its cache sizes can be reported

    def stop(self, index: int, reason: str = "stop") -> None:  # stop strings are rejected up front
        pass

    def cache_bytes(self) -> tuple[int, int]:
        """(bytes stored once per sample, bytes stored per beam) of the engine's K/V caches (an
        encoder-decoder's cross K/V are part of the first)."""
        return self.engine.shared_nbytes, self.engine.per_beam_nbytes

    def run(self) -> list[SequenceResult]:
        for _ in self:
            pass
        return self.results

    def __iter__(self) -> Iterator[list]:
        cfg = self.config
        if cfg.max_new_tokens == 0:
            self.results = [SequenceResult([], "length", 0.0) for _ in self.prompts
                            for _ in range(cfg.num_return_sequences)]
            return
        with torch.inference_mode():
            yield from self._search()

    def _search(self) -> Iterator[list]:
        cfg, model = self.config, self.model
        device = model.device
        K, max_new, lp = cfg.num_beams, cfg.max_new_tokens, cfg.length_penalty
        engine, logits, next_positions, history = beam_starter(model)(model, self.prompts, cfg)
        self.engine = engine
        B, V = logits.shape
        eos = torch.tensor(self.eos_list, dtype=torch.long, device=device)
        n_keep = max(2, 1 + len(self.eos_list)) * K
        top_k_mask = torch.arange(n_keep, device=device) < K  # [2K] the first K candidates may finish
        sources = self.prompts if model.config.is_encoder_decoder else None
        self.selector.start([h for h in history for _ in range(K)], device,
                            None if sources is None else [s for s in sources for _ in range(K)])
        logits = logits.repeat_interleave(K, dim=0)  # [B*K, V]: every beam starts from the same prompt
        positions = next_positions.repeat_interleave(K)  # [B*K]
        offsets = (torch.arange(B, device=device) * K)[:, None]  # [B, 1] first row of each sample
        alive = list(range(B))  # original sample index of each sample still searching
        final: list = [None] * B  # per original sample: (tokens [K, max_new], lengths [K], scores [K])

        threads = torch.get_num_threads()  # the candidates op's (the loop's small ops run on one)
        running = torch.zeros(B, K, device=device)
        running[:, 1:] = NEG  # only one beam is real at the first step
        running_tokens = torch.zeros(B, K, max_new, dtype=torch.long, device=device)
        fin_tokens = torch.zeros_like(running_tokens)
        fin_length = torch.zeros(B, K, dtype=torch.long, device=device)
        fin_scores = torch.full((B, K), NEG, device=device)
        fin_done = torch.zeros(B, K, dtype=torch.bool, device=device)
        improvable = torch.ones(B, 1, dtype=torch.bool, device=device)  # early-stop heuristic unsatisfied
        for step in range(max_new):
            self.steps = step + 1
            with one_thread():  # small ops, on one thread (see ``decode``)
                top_lp, top_index = self._candidates(logits, running, step, n_keep, threads)  # [B, 2K]
                top_beam, top_token = top_index // V, top_index % V
                cand_tokens = _gather(running_tokens, top_beam)  # [B, 2K, max_new]
                cand_tokens[:, :, step] = top_token
                hits = torch.isin(top_token, eos) | (step + 1 >= max_new)  # [B, 2K]

                # The best K candidates that did not end continue.
                run_lp = top_lp + hits.float() * NEG
                keep = torch.topk(run_lp, K).indices  # [B, K]
                running = run_lp.gather(1, keep)
                running_tokens = _gather(cand_tokens, keep)
                origin = top_beam.gather(1, keep)  # [B, K] beam each continues

                # The best K candidates that ended are offered to the finished set (transformers' arithmetic).
                just = hits & top_k_mask
                offered = top_lp / ((step + 1) ** lp)
                offered = offered + (fin_done.all(dim=-1, keepdim=True) & (cfg.early_stopping is True)).float() * NEG
                offered = offered + (~improvable).float() * NEG
                offered = offered + (~just).float() * NEG
                merged = torch.cat((fin_scores, offered), dim=1)  # [B, 3K]
                best = torch.topk(merged, K).indices  # [B, K]
                fin_scores = merged.gather(1, best)
                fin_tokens = _gather(torch.cat((fin_tokens, cand_tokens), dim=1), best)
                fin_length = torch.cat((fin_length, torch.full_like(top_token, step + 1)), dim=1).gather(1, best)
                fin_done = torch.cat((fin_done, just), dim=1).gather(1, best)

                generated = step + 1
                best_length = max_new if cfg.early_stopping == "never" and lp > 0.0 else generated
                best_running = running[:, :1] / (best_length ** lp)
                worst = torch.where(fin_done, fin_scores.min(dim=1, keepdim=True).values, NEG)
                improvable = improvable & (best_running > worst).any(dim=-1, keepdim=True)
                # A sample is settled when nothing can enter its finished set any more (transformers keeps
                # computing it until the whole batch stops, to no effect): drop it, so it stops costing work.
                settled = ~improvable[:, 0] | (fin_done.all(dim=1) & (cfg.early_stopping is True))  # [B]
                go_on = improvable.any() & ~(fin_done.all() & (cfg.early_stopping is True)) & ~hits.all()
                go_on, any_settled = torch.stack((go_on, settled.any())).tolist()  # the step's one host sync
            yield []
            if not go_on:
                break
            rows = origin + offsets  # [B, K] row (in the current layout) each beam continues
            sources = rows  # [B', K] the same, in the layout after settled samples leave
            if any_settled:
                for sample in torch.nonzero(settled).flatten().tolist():
                    final[alive[sample]] = (fin_tokens[sample], fin_length[sample], fin_scores[sample])
                staying = torch.nonzero(~settled).flatten()  # [B'] samples still searching
                alive = [alive[i] for i in staying.tolist()]
                rows, positions = rows[staying], positions.view(B, K)[staying].reshape(-1)
                running, running_tokens = running[staying], running_tokens[staying]
                improvable, fin_done = improvable[staying], fin_done[staying]
                fin_tokens, fin_length, fin_scores = fin_tokens[staying], fin_length[staying], fin_scores[staying]
                engine.keep_samples(staying)
                B = staying.numel()
                offsets = (torch.arange(B, device=device) * K)[:, None]
                sources = origin[staying] + offsets
            tokens = running_tokens[:, :, step].reshape(-1)  # [B*K]
            engine.reorder_beams(sources.view(-1))  # [B*K]
            self.selector.select_rows(rows.view(-1))  # old layout: drops and reorders at once
            self.selector.record(tokens)
            logits = engine.decode(tokens, positions)
            positions = positions + 1
        for sample, original in enumerate(alive):
            final[original] = (fin_tokens[sample], fin_length[sample], fin_scores[sample])
        self.results = self._collect(*(torch.stack(parts) for parts in zip(*final)))

    def _candidates(self, logits: torch.Tensor, running: torch.Tensor, step: int, n_keep: int,
                    threads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sample's ``n_keep`` best continuations: scores and indices (beam * V + token) [B, n_keep]
        of log_softmax(logits [B*K, V]), processed, plus the beams' running scores [B, K]. When the step's
        processors only suppress tokens, one pass of the C++ op (layers/beam_search.cpp, samples split
        over ``threads`` of the kernel pool) instead of five [B*K, V] tensors and a sort of K*V scores per
        sample."""
        B, K = running.shape
        banned = self.selector.suppressed_only(step)
        op = beam_candidates_op() if banned is not None and logits.dtype == torch.float32 and logits.is_cpu else None
        if op is not None:
            return op(logits.contiguous(), running.reshape(-1).contiguous(), banned.cpu(), K, n_keep, threads)
        V = logits.shape[-1]
        logp = self.selector.process(torch.log_softmax(logits.float(), dim=-1), step)  # [B*K, V]
        total = (logp.view(B, K, V) + running[:, :, None]).view(B, K * V)
        return torch.topk(total, n_keep)

    def _collect(self, tokens: torch.Tensor, length: torch.Tensor, scores: torch.Tensor) -> list[SequenceResult]:
        """The first num_return_sequences finished hypotheses per sample (already best first)."""
        R = self.config.num_return_sequences
        eos = set(self.eos_list)
        tokens, length, scores = tokens[:, :R].tolist(), length[:, :R].tolist(), scores[:, :R].tolist()
        results = []
        for sample_tokens, sample_length, sample_scores in zip(tokens, length, scores):
            for seq, n, score in zip(sample_tokens, sample_length, sample_scores):
                seq = seq[:n]
                reason = "eos" if seq and seq[-1] in eos else "length"
                results.append(SequenceResult(seq, reason, score))
        return results


def beam_candidates_op():
    """``ops.beam_candidates`` where the extension is built, else None (the PyTorch step runs)."""
    return ops.beam_candidates if ops.available() else None
