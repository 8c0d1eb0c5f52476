"""The step executor: one rank's waves of a planned step, for training and for evaluation.

Training runs one forward+backward per wave on *every* rank, so every rank issues the same
number of backward calls per step: DeepSpeed ZeRO-2 (and DDP) reduce gradients inside
backward, and a rank that skipped one would deadlock the others. A rank with no work in a wave
runs a zero-weight dummy micro-batch instead, joining the reduction with zero gradient. The
gradient-accumulation boundary is set at the last wave only. Evaluation runs forward only:
no gradient reduction to join, so a rank without work in a wave skips it.

When the parameters are sharded (FSDP2, ZeRO-3) every pass is itself a chain of world-wide
collectives, so a wave follows RankStep.wave_passes instead: the same sequence of forwards and
backwards on every rank, each rank's own passes at their places and zero-weight dummy passes
elsewhere (plan/passes.py); evaluation then runs as many forwards on every rank.

Loss of a step = sum of token losses / valid targets of the whole global batch (known from the
plan). Data-parallel reduction averages over the world, so each rank scales its summed loss by
world / global_valid_tokens: the averaged gradient is exactly the single-process gradient of
the global batch.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace
from typing import Callable, ContextManager, Iterator, Optional, Tuple, Union

import torch

from hf_cp.attention.context import CPContext, cp_context
from hf_cp.plan.passes import BACKWARD, FORWARD, PassCursor, most_open_graphs
from hf_cp.train.data.collator import IGNORE_INDEX, MicroBatch, RankStep
from hf_cp.train.step.agreement import collective_scope
from hf_cp.train.step.chunkflow import run_chunked_sample, token_loss
from hf_cp.train.step.forward_passes import CHUNKED_OBJECTIVE, ForwardOnlyPasses, sample_rows
from hf_cp.train.step.groups import CPGroups
from hf_cp.train.step.loss import (
    chunkable_head,
    chunked_lm_head_loss,
    chunked_lm_head_token_logps,
    head_output_is_logits,
    liger_lm_head_loss,
    lm_head_computing,
    logits_loss,
    logits_token_logps,
)
from hf_cp.train.step.router_balance import RouterBalance, RouterCensus, router_tallies
from hf_cp.train.step.totals import WaveTotals
from hf_cp.train.step.vision_tower import VisionTower

logger = logging.getLogger(__name__)

HEAD_CHECK_TOKENS = 8  # the LM-head check's one short forward (loss.head_output_is_logits)

# A sequence-level objective's share of one micro-batch: (micro-batch, per-token log-probs of its
# rows [T] (0 where no target), of its extra targets [k]) -> this rank's part of the step's loss,
# already normalised for the whole step (the executor only multiplies by the world size, for the
# data-parallel average). DPO and GRPO build one per step (train/objectives/dpo.py, train/objectives/grpo.py).
TokenObjective = Callable[[MicroBatch, torch.Tensor, torch.Tensor], torch.Tensor]


class StepExecutor(ForwardOnlyPasses):
    """Runs a RankStep's waves on one rank.

    `backward(loss, last)` is the trainer's backward (DeepSpeed, DDP or plain autograd), with
    `last` marking the gradient-accumulation boundary. `groups` is the CP group registry.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        groups: CPGroups,
        world_size: int,
        rank: int,
        device: torch.device,
        loss_chunk_tokens: int,
        backward: Callable[[torch.Tensor, bool], None],
        wave_context: Optional[Callable[[bool], ContextManager]] = None,
        logit_temperature: float = 1.0,
        aligned_passes: bool = False,
        max_open_graphs: Optional[int] = None,
        liger_loss: bool = False,
        router: Optional[RouterBalance] = None,
        vision: Optional[VisionTower] = None,
    ):
        self.model = model
        self.groups = groups
        self.world_size = world_size
        self.rank = rank
        self.device = device
        self.loss_chunk_tokens = loss_chunk_tokens
        self.backward = backward
        # entered around a whole wave (forward and backward), `last` marking the accumulation
        # boundary: DDP's no_sync must cover the forward too, where DDP decides to reduce
        self.wave_context = wave_context or (lambda last: contextlib.nullcontext())
        # per-token log-probs (wave_token_logps) are those of logits / logit_temperature
        self.logit_temperature = float(logit_temperature)
        # parameters sharded (FSDP2, ZeRO-3): every rank runs each wave's passes in one sequence
        self.aligned_passes = bool(aligned_passes)
        # ZeRO-3 computes wrong gradients when several forward graphs are open at once (measured:
        # ChunkFlow keeping 4 chunks, gradients 30-70% off); FSDP2 handles it (None: no limit)
        self.max_open_graphs = max_open_graphs
        # use_liger_kernel (CUDA): Liger's fused linear cross-entropy in place of the chunked loss
        self.liger_loss = bool(liger_loss)
        # the MoE router's load-balancing term over the whole step (step/router_balance.py), or None
        self.router = router
        self._head: Optional[torch.nn.Linear] = None  # set when the chunked loss applies
        self._head_checked = False
        # wall ms of forward-only passes (answer_logps, router_census) since the step began (start_step)
        self.forward_only_ms = 0.0
        self._backward_end: Optional[float] = None
        # perf_counter -> seconds since the epoch, so that ranks on one host share a time axis
        self._epoch_offset = time.time() - time.perf_counter()
        self._hook = model.get_input_embeddings().register_forward_hook(self._embedding_hook)
        # a vision-language run: the tower encodes the micro-batch's images and clips, whose rows
        # replace its placeholder tokens' embeddings inside the model's forward (step/vision_tower.py)
        self.vision = vision

    @contextlib.contextmanager
    def using_vision(self, tower: Optional[VisionTower]) -> Iterator[None]:
        """Passes inside run `tower` in place of the run's own: another model's on the same
        micro-batches (a DPO reference model's, whose embedding its hook sits on: it encodes the
        images again with its own weights). None, or a text-only run: no change."""
        if tower is None or self.vision is None:
            yield
            return
        own, self.vision = self.vision, tower
        try:
            yield
        finally:
            self.vision = own

    # ------------------------------------------------------------------ timing
    def start_step(self) -> None:
        """A training step begins: forward-only passes from here on are its own (train() hands
        their time to the step's totals); an evaluation's since the last step is not."""
        self.forward_only_ms = 0.0

    def _embedding_hook(self, module, inputs, output):
        # the embedding output's gradient is the last big piece of backward: its arrival marks
        # the end of this rank's compute, before the data-parallel gradient reduction waits
        if torch.is_grad_enabled() and output.requires_grad:
            output.register_hook(self._mark_backward_end)

    def _mark_backward_end(self, grad):
        self._backward_end = self.now()
        return None

    def now(self) -> float:
        # GPU kernels run asynchronously: wait for them so the clock measures compute
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _mark_wave(self, totals: WaveTotals, t0: float) -> None:
        end = self.now()
        off = self._epoch_offset
        totals.wave_timeline.append((off + t0, off + (self._backward_end or end), off + end))

    # ------------------------------------------------------------------ waves
    def _context(self, mb: MicroBatch):
        ctx = mb.context
        if ctx.group_size > 1:
            ctx = replace(ctx, group=self.groups.get(ctx.group_ranks))
        return ctx

    def train(self, model: torch.nn.Module, step: RankStep, objective: Optional[TokenObjective] = None) -> WaveTotals:
        """Forward+backward of every wave; the loss handed to backward is scaled so that the
        data-parallel average is the gradient of (sum of token losses / global valid targets),
        or, with `objective`, of the sum over ranks and waves of what it returns.

        Every rank runs the same number of backward passes in each wave (step.wave_backward_calls:
        a chunked sample runs one per dependent chunk), padding with zero-weight micro-batches;
        the accumulation boundary is the last backward of the last wave."""
        scale = self.world_size / step.global_valid_tokens if step.global_valid_tokens else 0.0
        totals = WaveTotals(loss=torch.zeros((), device=self.device))
        self.loss_head()  # decided now, on every rank: its check runs a forward, a collective when sharded
        if objective is not None and self.router is not None:
            raise ValueError(_ROUTER_OBJECTIVE)
        census = self.router_census(model, step)  # None without a router term
        totals.router_loss = census.value if census is not None else 0.0
        totals.forward_only_ms, self.forward_only_ms = self.forward_only_ms, 0.0
        if self.aligned_passes:
            return self._train_aligned(model, step, objective, scale, totals, census)
        n = len(step.waves)
        calls = step.wave_backward_calls or [1] * n
        for w, mb in enumerate(step.waves):
            last_wave = w == n - 1
            own = mb.backward_calls if mb is not None else 0
            pad = calls[w] - own
            if pad < 0:
                raise RuntimeError(
                    f"step {step.index + 1}, wave {w}: {own} backward passes, the plan allows {calls[w]}"
                )
            t0 = self.now()
            self._backward_end = None
            if mb is not None:
                ctx = self._context(mb)
                # chunked samples run on one rank under their chunk contexts, not a CP context
                with (
                    self.wave_context(last_wave and pad == 0),
                    cp_context(None if mb.chunked else ctx),
                    collective_scope(step.index + 1, w, ctx.group_ranks),
                ):
                    if mb.chunked and objective is not None:
                        raise ValueError(CHUNKED_OBJECTIVE.format(step=step.index + 1, samples=mb.local_ids))
                    if mb.chunked:
                        wave_sum, loss = self._chunked_wave(model, mb, scale, last_wave and pad == 0)
                    elif objective is not None:
                        wave_sum = objective(mb, *self.wave_token_logps(model, mb))
                        loss = wave_sum * self.world_size
                        self.backward(loss, last_wave and pad == 0)
                    else:
                        wave_sum, loss = self._token_wave(model, mb, scale, census, step.index + 1, w)
                        self.backward(loss, last_wave and pad == 0)
                self._count_wave(totals, mb, wave_sum, loss, t0)
            for k in range(pad):
                # no (more) work in this wave: zero-weight micro-batches keep the backward count equal
                self._dummy_backward(model, step.index + 1, w, last_wave and k == pad - 1)
            self._mark_wave(totals, t0)
        return totals

    def _count_wave(
        self, totals: WaveTotals, mb: MicroBatch, wave_sum: torch.Tensor, loss: torch.Tensor, t0: float
    ) -> None:
        """Add a wave's own work to this rank's totals (its compute up to the embedding's gradient)."""
        totals.compute_ms += ((self._backward_end or self.now()) - t0) * 1e3
        totals.loss_sum += float(wave_sum.detach())
        totals.valid += mb.num_valid
        totals.tokens += mb.num_tokens
        totals.loss = totals.loss + loss.detach()

    def _train_aligned(
        self,
        model: torch.nn.Module,
        step: RankStep,
        objective: Optional[TokenObjective],
        scale: float,
        totals: WaveTotals,
        census: Optional[RouterCensus] = None,
    ) -> WaveTotals:
        """train() with sharded parameters: each wave runs step.wave_passes[w] on every rank. The
        accumulation boundary is the last backward of the last wave, own or dummy."""
        n = len(step.waves)
        if len(step.wave_passes) != n:
            raise RuntimeError(f"step {step.index + 1}: {len(step.wave_passes)} pass sequences for {n} waves")
        for w, mb in enumerate(step.waves):
            t0 = self.now()
            self._backward_end = None
            self._aligned_wave(model, step, w, mb, objective, scale, totals, census)
            self._mark_wave(totals, t0)
        return totals

    def _aligned_wave(
        self,
        model: torch.nn.Module,
        step: RankStep,
        w: int,
        mb: Optional[MicroBatch],
        objective: Optional[TokenObjective],
        scale: float,
        totals: WaveTotals,
        census: Optional[RouterCensus] = None,
    ) -> None:
        """One wave of _train_aligned: this rank's own passes at their places in the wave's pass
        sequence (PassCursor), zero-weight dummy passes at the others."""
        passes = step.wave_passes[w]
        if self.max_open_graphs is not None and most_open_graphs(passes) > self.max_open_graphs:
            raise ValueError(
                f"step {step.index + 1}, wave {w}: its passes {passes!r} hold {most_open_graphs(passes)} forward graphs "
                f"open at once (ChunkFlow keeping several chunks), and DeepSpeed ZeRO-3 computes wrong gradients "
                f"beyond {self.max_open_graphs}: set cp_chunk_keep: 1 (chunkflow option keep=1), or use FSDP2"
            )
        # the step's accumulation boundary: the last backward of its last wave
        boundary = passes.rindex(BACKWARD) if w == len(step.waves) - 1 else -1

        def dummy_forward(graph: bool):
            return self._dummy_forward(model, step.index + 1, w, graph)

        def dummy_backward(zero_loss: torch.Tensor):  # cursor.pos: the dummy's own place
            self._dummy_backward_of(zero_loss, step.index + 1, w, cursor.pos == boundary)

        def own_backward_is_boundary() -> bool:  # cursor.pos - 1: the own pass just placed
            return cursor.pos - 1 == boundary

        cursor = PassCursor(passes, dummy_forward, dummy_backward, f"step {step.index + 1}, wave {w}")
        t0 = self.now()
        if mb is not None:
            ctx = self._context(mb)
            scope = (step.index + 1, w, ctx.group_ranks)
            if mb.chunked:
                if objective is not None:
                    raise ValueError(CHUNKED_OBJECTIVE.format(step=step.index + 1, samples=mb.local_ids))
                with collective_scope(*scope):
                    wave_sum, loss = self._chunked_wave(model, mb, scale, own_backward_is_boundary, cursor.before)
            else:
                cursor.before(FORWARD)
                with cp_context(ctx), collective_scope(*scope):
                    if objective is not None:
                        wave_sum = objective(mb, *self.wave_token_logps(model, mb))
                        loss = wave_sum * self.world_size
                    else:
                        wave_sum, loss = self._token_wave(model, mb, scale, census, step.index + 1, w)
                cursor.before(BACKWARD)
                with cp_context(ctx), collective_scope(*scope):
                    self.backward(loss, own_backward_is_boundary())
            self._count_wave(totals, mb, wave_sum, loss, t0)
        cursor.finish()

    def _dummy_forward(self, model: torch.nn.Module, step: int, wave: int, graph: bool):
        """A zero-weight one-token forward on every layer (its collectives join the others'); with
        `graph`, its output for a later _dummy_backward_of."""
        everyone = tuple(range(self.world_size))
        with (
            cp_context(None),
            collective_scope(step, wave, everyone, "dummy pass"),
            contextlib.nullcontext() if graph else torch.no_grad(),
        ):
            ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            out = self._forward(model, None, ids, torch.zeros_like(ids)).logits.sum()
        return out * 0.0 if graph else None

    def _dummy_backward_of(self, zero_loss: torch.Tensor, step: int, wave: int, last: bool) -> None:
        everyone = tuple(range(self.world_size))
        with cp_context(None), collective_scope(step, wave, everyone, "dummy pass"):
            self.backward(zero_loss, last)

    def _dummy_backward(self, model: torch.nn.Module, step: int, wave: int, last: bool) -> None:
        everyone = tuple(range(self.world_size))
        with self.wave_context(last), cp_context(None), collective_scope(step, wave, everyone, "dummy micro-batch"):
            ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            out = self._forward(model, None, ids, torch.zeros_like(ids))
            self.backward(out.logits.sum() * 0.0, last)

    def _chunked_wave(
        self,
        model: torch.nn.Module,
        mb: MicroBatch,
        scale: float,
        last: Union[bool, Callable[[], bool]],
        on_pass: Optional[Callable[[str], None]] = None,
    ):
        """ChunkFlow: every chunked sample of the micro-batch by the state-aware schedule, one
        backward per dependent chunk (train/step/chunkflow.py). `last`: whether the micro-batch's final
        backward is the accumulation boundary, or (aligned passes) a function telling it of each
        backward. Returns (summed loss, scaled loss)."""
        loss_fn = token_loss(self.loss_head(), self.loss_chunk_tokens)
        total = torch.zeros((), dtype=torch.float64)
        for k, c in enumerate(mb.chunked):
            if callable(last):
                backward = lambda loss, is_last: self.backward(loss, last())  # noqa: E731
            else:
                final = last and k == len(mb.chunked) - 1
                backward = lambda loss, is_last, final=final: self.backward(loss, final and is_last)  # noqa: E731
            chunks, inputs = self.chunked_inputs(c)
            total = total + run_chunked_sample(
                model, chunks, c.keep, scale, loss_fn=loss_fn, backward=backward, on_pass=on_pass, inputs=inputs
            )
        return total, total * scale

    def _token_wave(
        self,
        model: torch.nn.Module,
        mb: MicroBatch,
        scale: float,
        census: Optional[RouterCensus],
        step: int,
        wave: int,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """A wave's summed token cross-entropy and the loss handed to backward: scaled for the
        data-parallel average, plus (with a router term) this wave's share of the step's term."""
        if census is None:
            wave_sum = self.wave_loss(model, mb)
            return wave_sum, wave_sum * scale
        wave_sum, logits = self._wave_forward(model, mb, router=True)
        counts, sums, _ = router_tallies(logits, self.router, sample_rows(mb))
        if not torch.equal(counts.cpu(), census.wave_counts[wave].cpu()):
            raise RuntimeError(
                f"step {step}, wave {wave}: the router chose other experts in the training pass than in the census "
                f"pass before it ({counts.tolist()} against {census.wave_counts[wave].tolist()} selections): the "
                "model routes at random (dropout, noise) or its kernels are not deterministic, and the router term "
                "would be inexact; set output_router_logits=False"
            )
        return wave_sum, wave_sum * scale + census.share(self.router, sums) * self.world_size

    # ------------------------------------------------------------------ loss
    def wave_token_logps(
        self, model: torch.nn.Module, mb: MicroBatch, head: Union[str, Optional[torch.nn.Linear]] = "policy"
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per-token log p(target) of a micro-batch's rows [T] and extra targets [k] (fp32, 0 where
        the target is ignored), through the chunked LM head when the model allows it."""
        ids, pos, targets, extra_rows, extra_targets = self._device_rows(mb)
        if isinstance(head, str):
            head = self.loss_head()
        t = self.logit_temperature
        if head is None:
            logits = self._forward(model, mb, ids, pos).logits[0]
            logits = logits if t == 1.0 else logits / t
            return logits_token_logps(logits, targets, IGNORE_INDEX, extra_rows, extra_targets)

        def token_logps(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
            hidden = hidden[0]
            if t != 1.0:  # (h W^T + b) / t = (h / t) W^T + b / t
                hidden, bias = hidden / t, (None if bias is None else bias / t)
            own, extra = chunked_lm_head_token_logps(
                hidden,
                weight,
                targets,
                self.loss_chunk_tokens,
                bias=bias,
                ignore_index=IGNORE_INDEX,
                extra_rows=extra_rows,
                extra_targets=extra_targets,
            )
            return torch.cat([own, extra])  # one output tensor: [T + k]

        with lm_head_computing(head, token_logps):
            both = self._forward(model, mb, ids, pos).logits
        rows = targets.shape[0]
        return both[:rows], both[rows:]

    def _forward(self, model: torch.nn.Module, mb: Optional[MicroBatch], ids: torch.Tensor, pos: torch.Tensor, **kw):
        """The model's forward on a micro-batch's rows (None: a one-token dummy). A vision run
        passes position ids [4, 1, T]: the 1-D positions (the attention's), then the M-RoPE
        ones; its placeholder rows enter at the embedding (VisionTower.placing)."""
        if self.vision is None:
            return model(input_ids=ids, position_ids=pos, use_cache=False, **kw)
        if mb is not None and mb.vision is None:
            raise RuntimeError("a vision run's micro-batch carries no vision rows: its collator was built without them")
        rope = pos.expand(3, *pos.shape) if mb is None else mb.vision.rope_positions.to(self.device)[:, None]
        if mb is None:
            placing = self.vision.placing(None)
        else:
            placing = self.vision.placing(mb.vision, self._context(mb).group, mb.context.member)
        with placing:
            return model(input_ids=ids, position_ids=torch.cat([pos[None], rope]), use_cache=False, **kw)

    def _device_rows(self, mb: MicroBatch) -> Tuple[torch.Tensor, ...]:
        """A micro-batch's input ids, positions, shifted targets [T] and extra targets on the
        device (shared-prompt samples: a prompt's last token predicts every answer: extra rows)."""
        return (
            mb.input_ids.to(self.device),
            mb.position_ids.to(self.device),
            mb.shift_labels[0].to(self.device),
            mb.extra_rows.to(self.device),
            mb.extra_targets.to(self.device),
        )

    def wave_loss(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        """Summed token cross-entropy of one micro-batch (fp32), through the chunked LM-head
        loss when the model allows it, else from the full logits."""
        return self._wave_forward(model, mb)[0]

    def _wave_forward(
        self, model: torch.nn.Module, mb: MicroBatch, router: bool = False
    ) -> Tuple[torch.Tensor, Optional[Tuple[torch.Tensor, ...]]]:
        """wave_loss, and with `router` the forward's router logits (one [T, E] per MoE layer)."""
        ids, pos, targets, extra_rows, extra_targets = self._device_rows(mb)
        head = self.loss_head()
        extra = dict(output_router_logits=True) if router else {}
        if head is None:
            out = self._forward(model, mb, ids, pos, **extra)
            loss = logits_loss(out.logits[0], targets, IGNORE_INDEX, extra_rows, extra_targets)
            return loss, (out.router_logits if router else None)

        def loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
            if self.liger_loss:
                return liger_lm_head_loss(hidden[0], weight, targets, bias, IGNORE_INDEX, extra_rows, extra_targets)
            return chunked_lm_head_loss(
                hidden[0],
                weight,
                targets,
                self.loss_chunk_tokens,
                bias=bias,
                ignore_index=IGNORE_INDEX,
                extra_rows=extra_rows,
                extra_targets=extra_targets,
            )

        with lm_head_computing(head, loss):
            out = self._forward(model, mb, ids, pos, **extra)
        return out.logits, (out.router_logits if router else None)

    def loss_head(self) -> Optional[torch.nn.Linear]:
        """The LM head the chunked loss replaces (decided once), or None for full logits."""
        if self._head_checked:
            return self._head
        self._head_checked = True
        if self.loss_chunk_tokens > 0:
            head = chunkable_head(self.model)
            # one local document of this rank (the check's 8 tokens): no positions needed to find it
            with cp_context(
                CPContext(group=None, group_ranks=(self.rank,), member=0, local_lengths=(HEAD_CHECK_TOKENS,))
            ):
                plain = head is not None and head_output_is_logits(self.model, head, self.device, HEAD_CHECK_TOKENS)
            if plain:
                self._head = head
            elif self.rank == 0:
                logger.warning(
                    "hf_cp: %s; the loss uses the full logits (memory grows with tokens x vocabulary)",
                    "the model has no linear LM head"
                    if head is None
                    else "the model post-processes its LM head's output (scaling or soft-capping)",
                )
        return self._head


_ROUTER_OBJECTIVE = (
    "a sequence-level loss (DPO, GRPO) with the MoE router's load-balancing term: not computed; set "
    "output_router_logits=False"
)
