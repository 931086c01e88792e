"""The arithmetic of one beam search, with Hugging Face ``generate(num_beams=K)`` semantics.

Per step: log-softmax, the shared processors (n-gram blocking, min-new-tokens, forced tokens) on
log-probabilities, add each beam's running score, keep the top ``max(2, 1 + #EOS) * K`` candidates
(so that K stay open even when some end), continue the best K that did not end, and offer the
best K of the candidates that ended to the finished set, scored with the length penalty on the
*generated* length. Stopping follows transformers' heuristic for ``early_stopping`` True / False /
"never". Everything is tensors: one host sync per step (whether to go on). After the candidates
(``_candidates``: one C++ pass over the logits where only bans process the step), the bookkeeping is one
C++ op on the state in place (layers/beam_update.cpp, ``_update_with_op``) where the extension is built,
else ~35 small tensor ops (``_update_torch``): the same bits.

``BeamScores`` holds one request's state (its K running beams, its finished set); the engine's
beam group (engine/beam_group.py) calls ``advance`` with its beams' logits after each forward and
moves the beams' blocks as it answers.
"""

from __future__ import annotations

import numpy as np
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

    def advance(self, logits: torch.Tensor, selector: TokenSelector,
                candidates: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[bool, torch.Tensor, torch.Tensor]:
        """The beams' next-token logits [K, V] -> (whether the search goes on, the beam each new
        beam continues [K], the new beams' last tokens [K]), on the device the scores live on (the
        logits may be on another: a GPU's, whose candidates are chosen there). ``candidates``: the step's
        (scores, indices) [1, 2K] where ``shared_candidates`` chose them with other searches'."""
        step, V = self.step, logits.shape[-1]
        with one_thread():  # small ops, on one thread (a block copy's barrier waits on busy kernel threads)
            # [1, 2K], on the logits' device
            top_lp, top_index = candidates if candidates is not None else self._candidates(logits, selector, step)
            host = self.running.device  # (a GPU's candidates come over to the host)
            top_lp, top_index = top_lp.to(host), top_index.to(host)
            update = beam_update_op() if host.type == "cpu" else None
            if update is not None:
                go_on, origin, tokens = self._update_with_op(update, top_lp, top_index, V, step)
            else:
                go_on, origin, tokens = self._update_torch(top_lp, top_index, V, step)
        self.step = step + 1
        return go_on, origin, tokens

    def _divisors(self, step: int) -> tuple[float, float]:
        """(the length penalty's divisor of the scores offered at ``step``, that of the best running score
        in the early-stopping heuristic)."""
        cfg = self.config
        lp, generated = cfg.length_penalty, step + 1
        best_length = cfg.max_new_tokens if cfg.early_stopping == "never" and lp > 0.0 else generated
        return generated**lp, best_length**lp

    def _update_with_op(self, update, top_lp: torch.Tensor, top_index: torch.Tensor, V: int,
                        step: int) -> tuple[bool, torch.Tensor, torch.Tensor]:
        """``_update_torch`` as one C++ op (layers/beam_update.cpp) on the state in place: the same bits."""
        cfg, K = self.config, self.config.num_beams
        offer_divisor, best_divisor = self._divisors(step)
        out = update(top_lp, top_index, self.eos, V, step, cfg.max_new_tokens, offer_divisor, best_divisor,
                     cfg.early_stopping is True, self.running, self.running_tokens, self.fin_tokens,
                     self.fin_length, self.fin_scores, self.fin_done, self.improvable)  # [2K + 1]
        return bool(out[2 * K]), out[:K], out[K : 2 * K]  # the step's one host sync

    def _update_torch(self, top_lp: torch.Tensor, top_index: torch.Tensor, V: int,
                      step: int) -> tuple[bool, torch.Tensor, torch.Tensor]:
        """The step's candidates (scores [1, 2K] best first, indices beam * V + token) -> (whether the search
        goes on, the beam each new beam continues [K], the new beams' last tokens [K]), the running beams
        and the finished set updated. "The K best" of some scores: a stable descending sort's first K (equal
        scores in their order of position, as the C++ op picks them; torch.topk leaves that order open)."""
        cfg = self.config
        K, max_new = cfg.num_beams, cfg.max_new_tokens
        offer_divisor, best_divisor = self._divisors(step)
        top_beam, top_token = top_index // V, top_index % V
        cand_tokens = _gather(self.running_tokens, top_beam)  # [1, 2K, max_new]
        cand_tokens[:, :, step] = top_token
        hits = torch.isin(top_token, self.eos) | (step + 1 >= max_new)  # [1, 2K]

        # The best K candidates that did not end continue.
        run_lp = top_lp + hits.float() * NEG
        keep = _best(run_lp, K)  # [1, K]
        self.running = run_lp.gather(1, keep)
        self.running_tokens = _gather(cand_tokens, keep)
        origin = top_beam.gather(1, keep)  # [1, K] beam each continues

        # The best K candidates that ended are offered to the finished set (transformers' arithmetic).
        just = hits & self.top_k_mask
        offered = top_lp / offer_divisor
        offered = offered + (self.fin_done.all(dim=-1, keepdim=True) & (cfg.early_stopping is True)).float() * NEG
        offered = offered + (~self.improvable).float() * NEG
        offered = offered + (~just).float() * NEG
        merged = torch.cat((self.fin_scores, offered), dim=1)  # [1, 3K]
        best = _best(merged, K)  # [1, K]
        self.fin_scores = merged.gather(1, best)
        self.fin_tokens = _gather(torch.cat((self.fin_tokens, cand_tokens), dim=1), best)
        self.fin_length = torch.cat((self.fin_length, torch.full_like(top_token, step + 1)), dim=1).gather(1, best)
        self.fin_done = torch.cat((self.fin_done, just), dim=1).gather(1, best)

        best_running = self.running[:, :1] / best_divisor
        worst = torch.where(self.fin_done, self.fin_scores.min(dim=1, keepdim=True).values, NEG)
        self.improvable = self.improvable & (best_running > worst).any(dim=-1, keepdim=True)
        # Settled when nothing can enter the finished set any more (transformers keeps computing a
        # settled sample until the whole batch stops, to no effect): the group ends.
        go_on = (self.improvable.any() & ~(self.fin_done.all() & (cfg.early_stopping is True))
                 & ~hits.all())
        return bool(go_on), origin[0], self.running_tokens[0, :, step]  # the step's one host sync

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


def shared_candidates(searches: list[tuple[BeamScores, TokenSelector, int]],
                      logits: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The candidates of several beam searches' step in one call of the C++ op, its samples split over the
    threads (one search's K rows were one thread's work): ``searches`` (policy, selector, first row of its
    K beams in ``logits`` [S, V]) -> each one's (scores, indices) [1, 2K], the bits ``_candidates`` gives it
    alone (the op's samples are independent). None where they cannot share: fewer than two, the extension
    missing, other than float32 CPU logits, rows not side by side, different K or candidate counts, a
    processor other than bans, or different bans common to all rows (each row's own may differ)."""
    op = beam_candidates_op()
    if len(searches) < 2 or op is None or logits.dtype != torch.float32 or not logits.is_cpu:
        return None
    policies = [policy for policy, _, _ in searches]
    if not all(isinstance(p, BeamScores) for p in policies):  # (a request's own policy: Whisper's search)
        return None
    first, K, keep, V = searches[0][2], policies[0].config.num_beams, policies[0].n_keep, logits.shape[-1]
    if any(p.config.num_beams != K or p.n_keep != keep or row != first + i * K
           for i, (p, _, row) in enumerate(searches)):
        return None
    bans = [selector.bans_only(policy.step, V) for policy, selector, _ in searches]
    if any(b is None for b in bans):
        return None
    common = bans[0][0].cpu()
    common_ids = common.tolist()
    if any(b[0].tolist() != common_ids for b in bans[1:]):
        return None
    row_banned = None
    if any(b[1] is not None for b in bans):  # each beam's own ids, V where none: [G * K, W]
        own = [None if b[1] is None else b[1].cpu().numpy() for b in bans]  # [K, W_g] each
        padded = np.full((len(bans) * K, max(1, *(a.shape[1] for a in own if a is not None))), V, dtype=np.int64)
        for g, ids in enumerate(own):
            if ids is not None:
                padded[g * K : (g + 1) * K, : ids.shape[1]] = ids
        row_banned = torch.from_numpy(padded)
    with one_thread():
        running = torch.cat([p.running.reshape(-1) for p in policies])  # [G * K]
        rows = logits[first : first + len(searches) * K]  # [G * K, V]
        scores, index = op(rows.contiguous(), running, common, K, keep, policies[0].threads, row_banned)
        return [(scores[g : g + 1], index[g : g + 1]) for g in range(len(searches))]  # [1, keep] each


def _best(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Positions [1, count] of the ``count`` highest of scores [1, N], highest first, equal ones in order."""
    return torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :count]


def beam_update_op():
    """``ops.beam_update`` where the extension is built, else None (``BeamScores._update_torch`` runs)."""
    return ops.beam_update if ops.available() else None


def beam_candidates_op():
    """``ops.beam_candidates`` where the extension is built, else None (the PyTorch step runs)."""
    return ops.beam_candidates if ops.available() else None
