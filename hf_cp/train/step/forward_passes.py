"""The forward-only passes of a planned step, one rank's side: planned evaluation, every
answer's summed log-prob (the sequence objectives' no-gradient passes, policy and reference) and
the MoE router's census. None joins a gradient reduction, so a rank without work in a wave skips
it, except under sharded parameters (FSDP2, ZeRO-3), where every forward gathers parameters and
every rank runs the wave's largest number of forwards (aligned dummies).

`ForwardOnlyPasses` is StepExecutor's base (step/executor.py): it uses the executor's contexts,
dummy forward, LM-head paths (wave_loss, wave_token_logps, loss_head) and clock.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch

from hf_cp.attention.context import cp_context
from hf_cp.plan.passes import BACKWARD
from hf_cp.train.data.answer_slots import answer_sums
from hf_cp.train.data.collator import ChunkedRows, MicroBatch, RankStep
from hf_cp.train.step.agreement import collective_scope
from hf_cp.train.step.chunk_vision import ChunkVision
from hf_cp.train.step.chunkflow import SampleChunk, evaluate_chunked_sample, sample_chunks, token_loss
from hf_cp.train.step.loss import lm_head_computing
from hf_cp.train.step.router_balance import RouterCensus, census_of, router_tallies
from hf_cp.train.step.totals import WaveTotals

CHUNKED_ROUTER = (
    "step {step}: samples {samples} run as dependent chunks (ChunkFlow), and the MoE router's load-balancing term "
    "over the step is not computed on chunks; plan this data with another balancer, or set output_router_logits=False"
)
CHUNKED_OBJECTIVE = (
    "step {step}: samples {samples} run as dependent chunks (ChunkFlow); a sequence-level loss (DPO, GRPO) "
    "needs shared-prompt samples, which are never chunked: plan this data with another balancer"
)


def sample_rows(mb: MicroBatch) -> int:
    """The micro-batch's tokens that belong to samples (its row less trailing padding)."""
    return int(mb.input_ids.shape[1]) - mb.padding_tokens


class ForwardOnlyPasses:
    """Evaluation, answer log-probs and the router census of a step (see the module's docstring)."""

    def chunked_inputs(self, c: ChunkedRows) -> Tuple[List[SampleChunk], Optional[ChunkVision]]:
        """A chunked sample's chunks on the device and, in a vision run, its ChunkVision (its items
        encoded now, once; M-RoPE positions cut with the chunks)."""
        ids, tgts = c.input_ids.to(self.device), c.shift_labels.to(self.device)
        if self.vision is None:
            return sample_chunks(ids, tgts, c.chunk_sizes), None
        if c.vision is None:
            raise RuntimeError(
                f"a vision run's chunked sample {c.sample} carries no vision rows: its collator was built without them"
            )
        rope = c.vision.rope_positions.to(self.device)
        return sample_chunks(ids, tgts, c.chunk_sizes, rope), ChunkVision(
            self.vision, c.vision, c.chunk_sizes, self.device
        )

    def evaluate(self, model: torch.nn.Module, step: RankStep) -> WaveTotals:
        """Forward only, every wave with work on this rank (call under torch.no_grad())."""
        totals = WaveTotals(loss=torch.zeros((), device=self.device))
        self.loss_head()  # decided now, on every rank: its check runs a forward, a collective when sharded
        for w, mb in enumerate(step.waves):
            if self.aligned_passes:  # sharded parameters: as many forwards on every rank
                self._evaluation_dummies(model, step, w, mb)
            if mb is None:  # forward only: no gradient reduction to join
                continue
            if mb.chunked:  # one rank, no collectives: each sample's chunks in order over the K/V store
                loss_fn = token_loss(self.loss_head(), self.loss_chunk_tokens)
                for c in mb.chunked:
                    chunks, inputs = self.chunked_inputs(c)
                    totals.loss_sum += float(evaluate_chunked_sample(model, chunks, loss_fn, inputs))
                totals.valid += mb.num_valid
                totals.tokens += mb.num_tokens
                continue
            ctx = self._context(mb)
            with (
                cp_context(ctx),
                collective_scope(step.index + 1, w, ctx.group_ranks, "evaluation micro-batch", "evaluation batch"),
            ):
                totals.loss_sum += float(self.wave_loss(model, mb))
            totals.valid += mb.num_valid
            totals.tokens += mb.num_tokens
        return totals

    def _evaluation_dummies(self, model: torch.nn.Module, step: RankStep, w: int, mb: Optional[MicroBatch]) -> None:
        """Forward-only waves with sharded parameters: every rank runs the wave's largest number of
        forwards (a micro-batch one, a chunked sample one per chunk), this rank's own ones plus
        dummies (all forwards alike: their order does not matter)."""
        own_passes = step.plan.rank_passes(w)
        forwards = [p.count(BACKWARD) for p in own_passes]  # a backward per chunk, one per micro-batch
        mine = forwards[self.rank]
        for _ in range(max(forwards) - mine):
            self._dummy_forward(model, step.index + 1, w, graph=False)

    def answer_logps(
        self, model: torch.nn.Module, step: RankStep, head: Union[str, Optional[torch.nn.Linear]] = "policy"
    ) -> torch.Tensor:
        """This rank's part of every answer's summed log-prob (RankStep.answer_slots), forward only
        (call under torch.no_grad()); summed over the world they are the answers' log-probs.
        `head`: the LM head the chunked path bypasses ("policy": the trained model's; pass another
        model's own head, or None for full logits)."""
        t0 = self.now()
        sums = torch.zeros(len(step.answer_slots), dtype=torch.float64, device=self.device)
        for w, mb in enumerate(step.waves):
            if self.aligned_passes:  # sharded parameters (policy or reference): as many forwards on every rank
                self._evaluation_dummies(model, step, w, mb)
            if mb is None:  # forward only: no gradient reduction to join
                continue
            if mb.chunked:
                raise ValueError(CHUNKED_OBJECTIVE.format(step=step.index + 1, samples=mb.local_ids))
            ctx = self._context(mb)
            with cp_context(ctx), collective_scope(step.index + 1, w, ctx.group_ranks, "log-prob micro-batch"):
                own, extra = self.wave_token_logps(model, mb, head)
            sums += answer_sums(mb, own, extra, len(step.answer_slots)).double()
        self.forward_only_ms += (self.now() - t0) * 1e3
        return sums

    # ------------------------------------------------------------------ the MoE router's term
    def router_census(self, model: torch.nn.Module, step: RankStep) -> Optional[RouterCensus]:
        """A forward without gradient (and without the LM head) over this rank's waves, then one
        all-reduce: the step's expert selections, which each wave's router term weighs by
        (step/router_balance.py). None without a router term."""
        if self.router is None:
            return None
        t0 = self.now()
        per_wave = {}
        with torch.no_grad():
            for w, mb in enumerate(step.waves):
                if self.aligned_passes:  # sharded parameters: as many forwards on every rank
                    self._evaluation_dummies(model, step, w, mb)
                if mb is None:
                    continue
                if mb.chunked:
                    raise ValueError(CHUNKED_ROUTER.format(step=step.index + 1, samples=[c.sample for c in mb.chunked]))
                ctx = self._context(mb)
                with cp_context(ctx), collective_scope(step.index + 1, w, ctx.group_ranks, "router census micro-batch"):
                    logits = self._router_logits(model, mb)
                per_wave[w] = router_tallies(logits, self.router, sample_rows(mb))
        everyone = tuple(range(self.world_size))
        with collective_scope(step.index + 1, len(step.waves), everyone, "router census"):
            census = census_of(self.router, per_wave, self.world_size, device=self.device)
        self.forward_only_ms += (self.now() - t0) * 1e3
        return census

    def _router_logits(self, model: torch.nn.Module, mb: MicroBatch) -> Tuple[torch.Tensor, ...]:
        ids, pos = mb.input_ids.to(self.device), mb.position_ids.to(self.device)
        head = self.loss_head()
        if head is None:
            return self._forward(model, mb, ids, pos, output_router_logits=True).router_logits
        with lm_head_computing(head, lambda hidden, weight, bias: hidden.new_zeros(())):
            return self._forward(model, mb, ids, pos, output_router_logits=True).router_logits
