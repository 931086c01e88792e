"""The arithmetic of one beam search, with Hugging Face ``generate(num_beams=K)`` semantics.

Per step: log-softmax, the shared processors (n-gram blocking, min-new-tokens, forced tokens) on
log-probabilities, add each beam's running score, keep the top ``max(2, 1 + #EOS) * K`` candidates
(so that K stay open even when some end), continue the best K that did not end, and offer the
best K of the candidates that ended to the finished set, scored with the length penalty on the
*generated* length. Stopping follows transformers' heuristic for ``early_stopping`` True / False /
"never". Everything is tensors: one host sync per step (whether to go on).

``BeamScores`` holds one request's state (its K running beams, its finished set); the engine's
beam group (engine/beam_group.py) calls ``advance`` with its beams' logits after each forward and
moves the beams' blocks as it answers.
"""

from __future__ import annotations

import torch

from ..config import GenerationConfig
from ..decoding.sampling import TokenSelector
from ..layers import ops
from ..layers.threads import one_thread
from .sequence import SequenceResult

NEG = -1.0e9  # transformers' "impossible" score (finite, so sums stay ordered)


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, N, ...] rows picked per sample by index [B, M] -> [B, M, ...]."""
    index = index.view(*index.shape, *([1] * (x.dim() - 2))).expand(*index.shape, *x.shape[2:])
    return x.gather(1, index)


class BeamScores:
    """One request's running beams and finished hypotheses (a batch of one sample: ``[1, K, ...]``)."""

    def __init__(self, config: GenerationConfig, eos_ids: list[int], device: torch.device):
        K, max_new = config.num_beams, config.max_new_tokens
        self.config, self.eos_list = config, list(eos_ids)
        self.eos = torch.tensor(self.eos_list, dtype=torch.long, device=device)
        self.n_keep = max(2, 1 + len(self.eos_list)) * K
        self.top_k_mask = torch.arange(self.n_keep, device=device) < K  # [2K] the first K candidates may finish
        self.running = torch.zeros(1, K, device=device)
        self.running[:, 1:] = NEG  # only one beam is real at the first step
        self.running_tokens = torch.zeros(1, K, max(max_new, 1), dtype=torch.long, device=device)
        self.fin_tokens = torch.zeros_like(self.running_tokens)
        self.fin_length = torch.zeros(1, K, dtype=torch.long, device=device)
        self.fin_scores = torch.full((1, K), NEG, device=device)
        self.fin_done = torch.zeros(1, K, dtype=torch.bool, device=device)
        self.improvable = torch.ones(1, 1, dtype=torch.bool, device=device)  # early-stop heuristic unsatisfied
        self.step = 0
        self.threads = torch.get_num_threads()  # the candidates op's budget (the small ops run on one)

    def advance(self, logits: torch.Tensor, selector: TokenSelector) -> tuple[bool, torch.Tensor, torch.Tensor]:
        """The beams' next-token logits [K, V] -> (whether the search goes on, the beam each new
        beam continues [K], the new beams' last tokens [K]), on the device the scores live on (the
        logits may be on another: a GPU's, whose candidates are chosen there)."""
        cfg, step = self.config, self.step
        K, max_new, lp = cfg.num_beams, cfg.max_new_tokens, cfg.length_penalty
        V = logits.shape[-1]
        with one_thread():  # small ops, on one thread (a block copy's barrier waits on busy kernel threads)
            top_lp, top_index = self._candidates(logits, selector, step)  # [1, 2K], on the logits' device
            host = self.running.device  # (a GPU's candidates come over to the host)
            top_lp, top_index = top_lp.to(host), top_index.to(host)
            top_beam, top_token = top_index // V, top_index % V
            cand_tokens = _gather(self.running_tokens, top_beam)  # [1, 2K, max_new]
            cand_tokens[:, :, step] = top_token
            hits = torch.isin(top_token, self.eos) | (step + 1 >= max_new)  # [1, 2K]

            # The best K candidates that did not end continue.
            run_lp = top_lp + hits.float() * NEG
            keep = torch.topk(run_lp, K).indices  # [1, K]
            self.running = run_lp.gather(1, keep)
            self.running_tokens = _gather(cand_tokens, keep)
            origin = top_beam.gather(1, keep)  # [1, K] beam each continues

            # The best K candidates that ended are offered to the finished set (transformers' arithmetic).
            just = hits & self.top_k_mask
            offered = top_lp / ((step + 1) ** lp)
            offered = offered + (self.fin_done.all(dim=-1, keepdim=True) & (cfg.early_stopping is True)).float() * NEG
            offered = offered + (~self.improvable).float() * NEG
            offered = offered + (~just).float() * NEG
            merged = torch.cat((self.fin_scores, offered), dim=1)  # [1, 3K]
            best = torch.topk(merged, K).indices  # [1, K]
            self.fin_scores = merged.gather(1, best)
            self.fin_tokens = _gather(torch.cat((self.fin_tokens, cand_tokens), dim=1), best)
            self.fin_length = torch.cat((self.fin_length, torch.full_like(top_token, step + 1)), dim=1).gather(1, best)
            self.fin_done = torch.cat((self.fin_done, just), dim=1).gather(1, best)

            generated = step + 1
            best_length = max_new if cfg.early_stopping == "never" and lp > 0.0 else generated
            best_running = self.running[:, :1] / (best_length ** lp)
            worst = torch.where(self.fin_done, self.fin_scores.min(dim=1, keepdim=True).values, NEG)
            self.improvable = self.improvable & (best_running > worst).any(dim=-1, keepdim=True)
            # Settled when nothing can enter the finished set any more (transformers keeps computing a
            # settled sample until the whole batch stops, to no effect): the group ends.
            go_on = (self.improvable.any() & ~(self.fin_done.all() & (cfg.early_stopping is True))
                     & ~hits.all())
            go_on = bool(go_on)  # the step's one host sync
        self.step = step + 1
        return go_on, origin[0], self.running_tokens[0, :, step]

    def _candidates(self, logits: torch.Tensor, selector: TokenSelector, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``n_keep`` best continuations: scores and indices (beam * V + token) [1, n_keep] of
        log_softmax(logits [K, V]), processed, plus the beams' running scores [1, K]. When the
        step's processors only ban tokens (suppression, no-repeat-n-gram blocking), one pass of the
        C++ op (layers/beam_search.cpp) instead of five [K, V] tensors and a sort of K*V scores."""
        running, n_keep = self.running.to(logits.device), self.n_keep  # [1, K] (the host's on a GPU: copied over)
        B, K = running.shape
        V = logits.shape[-1]
        bans = selector.bans_only(step, V)
        op = beam_candidates_op() if bans is not None and logits.dtype == torch.float32 and logits.is_cpu else None
        if op is not None:
            common, per_row = bans
            return op(logits.contiguous(), running.reshape(-1).contiguous(), common.cpu(), K, n_keep, self.threads,
                      None if per_row is None else per_row.cpu().contiguous())
        logp = selector.process(torch.log_softmax(logits.float(), dim=-1), step)  # [K, V]
        total = (logp.view(B, K, V) + running[:, :, None]).view(B, K * V)
        return torch.topk(total, n_keep)

    def results(self) -> list[SequenceResult]:
        """The first num_return_sequences finished hypotheses (already best first)."""
        R = self.config.num_return_sequences
        eos = set(self.eos_list)
        tokens = self.fin_tokens[0, :R].tolist()
        lengths, scores = self.fin_length[0, :R].tolist(), self.fin_scores[0, :R].tolist()
        results = []
        for seq, n, score in zip(tokens, lengths, scores):
            seq = seq[:n]
            results.append(SequenceResult(seq, "eos" if seq and seq[-1] in eos else "length", score))
        return results


def beam_candidates_op():
    """``ops.beam_candidates`` where the extension is built, else None (the PyTorch step runs)."""
    return ops.beam_candidates if ops.available() else None
