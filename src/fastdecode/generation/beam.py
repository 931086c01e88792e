"""Beam search over the step primitives, with Hugging Face ``generate(num_beams=K)`` semantics.

Per step: log-softmax, the shared processors (n-gram blocking, min-new-tokens, forced tokens) on
log-probabilities, add each beam's running score, keep the top ``max(2, 1 + #EOS) * K`` candidates
of each sample (so that K stay open even when some end), continue the best K that did not end,
and offer the best K of the candidates that ended to the sample's finished set, scored with the
length penalty on the *generated* length. Stopping follows transformers' heuristic for
``early_stopping`` True / False / "never". Everything is batched tensors: one host sync per step
(whether to continue).

The engine keeps the prompt once per sample and only the generated tokens per beam
(cache/beam.py, the FastSeq layout), so a reorder copies only the generated K/V.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..cache.beam import BeamKVCache
from ..config import GenerationConfig
from .decode import SequenceResult, left_pad
from .sampling import TokenSelector
from .step import CachedEngine, Started

NEG = -1.0e9  # transformers' "impossible" score (finite, so sums stay ordered)


class DecoderBeamEngine:
    """Decoder-only engine for beam search: prefill B prompts once, decode B*K beams."""

    def __init__(self, model, num_beams: int, max_new_tokens: int):
        self.model = model
        self.num_beams = num_beams
        self.max_new_tokens = max_new_tokens
        self.cache: BeamKVCache | None = None

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, valid, positions [B, S_p] (left-padded) -> logits [B, V]; the prompt K/V become the
        shared segment as they are (no copy, no repeat)."""
        B, S_p = tokens.shape
        prefill = CachedEngine(self.model, B, S_p)
        logits = prefill.prefill(tokens, valid, positions)
        self.cache = BeamKVCache(prefill.cache.keys, prefill.cache.values, valid, positions, self.num_beams,
                                 max(self.max_new_tokens, 1))
        return logits

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions [B*K] -> logits [B*K, V]."""
        K = self.num_beams
        self.cache.append_slot(positions.view(-1, K)[:, 0])  # [B]: beams of a sample share positions
        return self.model.forward(tokens[:, None], positions[:, None], self.cache, None)[:, -1]

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.cache.keep_rows(rows)

    def keep_samples(self, samples: torch.Tensor) -> None:
        """Drop settled samples' shared prompt K/V (their beams go with the next ``keep_rows``)."""
        self.cache.keep_samples(samples)


def start_beam_decoder_only(model, prompts: list[list[int]], config: GenerationConfig) -> Started:
    tokens, valid, positions = left_pad(prompts, model.device)
    engine = DecoderBeamEngine(model, config.num_beams, config.max_new_tokens)
    return Started(engine, engine.prefill(tokens, valid, positions), positions[:, -1] + 1, prompts)


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

    def __init__(self, model, prompts: list[list[int]], config: GenerationConfig, eos_ids: list[int]):
        self.model, self.prompts, self.config, self.eos_list = model, prompts, config, list(eos_ids)
        self.results: list[SequenceResult] = []
        self.selector = TokenSelector(config, eos_ids, model.config.vocab_size, model.device,
                                      forced_bos=getattr(model.config, "forced_bos_token_id", None),
                                      forced_eos=getattr(model.config, "forced_eos_token_id", ()))
        self.steps = 0
        self.engine = None  # kept after the search, so its cache sizes can be reported

    def stop(self, index: int, reason: str = "stop") -> None:  # stop strings are rejected up front
        pass

    def cache_bytes(self) -> tuple[int, int]:
        """(bytes stored once per sample, bytes stored per beam) of the engine's K/V caches."""
        engine = self.engine
        if isinstance(engine, DecoderBeamEngine):
            return engine.cache.shared_nbytes, engine.cache.per_beam_nbytes
        return engine.cross.nbytes, engine.cache.nbytes  # encoder-decoder: cross K/V, decoder self K/V

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
            logp = self.selector.process(torch.log_softmax(logits.float(), dim=-1), step)  # [B*K, V]
            total = (logp.view(B, K, V) + running[:, :, None]).view(B, K * V)
            top_lp, top_index = torch.topk(total, n_keep)  # [B, 2K]
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
            rows = rows.view(-1)  # [B*K]
            tokens = running_tokens[:, :, step].reshape(-1)  # [B*K]
            engine.keep_rows(rows)
            self.selector.keep_rows(rows)
            self.selector.record(tokens)
            logits = engine.decode(tokens, positions)
            positions = positions + 1
        for sample, original in enumerate(alive):
            final[original] = (fin_tokens[sample], fin_length[sample], fin_scores[sample])
        self.results = self._collect(*(torch.stack(parts) for parts in zip(*final)))

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
