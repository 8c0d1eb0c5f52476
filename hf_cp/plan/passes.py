"""The forward and backward passes every rank runs in a wave, when the parameters are sharded.

Under FSDP2 and DeepSpeed ZeRO-3 a pass is itself a sequence of world-wide collectives: every
forward all-gathers each layer's parameters, every backward all-gathers them again and
reduce-scatters their gradients. Ranks must therefore run the same sequence of pass *kinds*,
not just the same number of backwards (what ZeRO-2 needs, StepPlan.wave_backward_calls). A
forward on one rank against a backward on another pairs an all-gather with a reduce-scatter:
a hang, or, with equal shapes, silently mixed parameters.

A rank's own passes in a wave are written as a string over f (a forward without a graph), F (a
forward that keeps its graph) and B (a backward of an earlier F):
- a micro-batch with work: "FB";
- a ChunkFlow sample of N chunks keeping K: N-K forwards without a graph and K with one, then
  the chunks last first, the kept ones backward at once ("B") and the others recomputed first
  ("FB");
- nothing: "".
f and F issue the same collectives; they are told apart so that graphs stay balanced.
`merge_passes` builds the one sequence every rank of the wave runs; each rank runs its own
passes at the places of their kind and fills the rest with zero-weight dummy passes of the
place's kind (a dummy F keeps its graph until a dummy B takes it).
"""

from __future__ import annotations

from typing import Sequence

FORWARD_NO_GRAPH = "f"
FORWARD = "F"
BACKWARD = "B"
KINDS = (FORWARD_NO_GRAPH, FORWARD, BACKWARD)
MICRO_BATCH_PASSES = FORWARD + BACKWARD


def chunked_passes(num_chunks: int, keep: int) -> str:
    """The passes of one ChunkFlow sample (train/chunkflow.run_chunked_sample's schedule)."""
    if num_chunks < 1 or keep < 1:
        raise ValueError(f"a chunked sample needs at least one chunk and keep >= 1, got {num_chunks}, {keep}")
    first_kept = max(0, num_chunks - keep)
    backwards = "".join(BACKWARD if i >= first_kept else MICRO_BATCH_PASSES for i in reversed(range(num_chunks)))
    return FORWARD_NO_GRAPH * first_kept + FORWARD * (num_chunks - first_kept) + backwards


def check_passes(passes: str, what: str = "passes") -> None:
    """A pass sequence is balanced: every backward takes an earlier forward with a graph, and none
    is left."""
    open_forwards = 0
    for i, kind in enumerate(passes):
        if kind == FORWARD:
            open_forwards += 1
        elif kind == BACKWARD:
            if open_forwards == 0:
                raise ValueError(f"{what} {passes!r}: the backward at {i} has no forward before it")
            open_forwards -= 1
        elif kind != FORWARD_NO_GRAPH:
            raise ValueError(f"{what} {passes!r}: {kind!r} at {i} is none of {', '.join(KINDS)}")
    if open_forwards:
        raise ValueError(f"{what} {passes!r}: {open_forwards} forward(s) without a backward")


def most_open_graphs(passes: str) -> int:
    """The most forward graphs a pass sequence holds open at once (an F opens one, a B closes one)."""
    open_now = most = 0
    for kind in passes:
        open_now += 1 if kind == FORWARD else -1 if kind == BACKWARD else 0
        most = max(most, open_now)
    return most


def merge_passes(own_passes: Sequence[str]) -> str:
    """The one pass sequence a wave runs on every rank, given each rank's own (balanced) passes.

    Greedy: the next pass is an f while some rank's next own pass is one, else an F while some
    rank's is one, else a B. Every rank can follow it with dummies of the place's kind: a dummy
    forward is always possible, and at a B every rank holds an open graph, its own or a dummy's.
    (Every rank runs an F, own or dummy, at each F and a B at each B, so on each rank open own
    graphs + open dummies = F places - B places so far; a B place means some rank owes a
    backward, so that count is positive, and a rank owing none holds that many dummies.) Ranks
    with the same own passes run them at the same places, so the members of a CP group meet in
    their collectives. At least one micro-batch's worth ("FB")."""
    for r, p in enumerate(own_passes):
        check_passes(p, f"rank {r}'s passes")
    pos = [0] * len(own_passes)
    out = []
    while True:
        nexts = [p[i] for p, i in zip(own_passes, pos) if i < len(p)]
        if not nexts:
            break
        kind = next(k for k in KINDS if k in nexts)
        out.append(kind)
        for r, p in enumerate(own_passes):
            if pos[r] < len(p) and p[pos[r]] == kind:
                pos[r] += 1
    # the dummies' graphs still open (the same count on every rank, all own passes being done)
    out.extend(BACKWARD * (out.count(FORWARD) - out.count(BACKWARD)))
    merged = "".join(out)
    return merged or MICRO_BATCH_PASSES


class PassCursor:
    """One rank following a wave's merged passes: `before(kind)` is called before each of its own
    passes and runs the dummy passes that come first; `finish()` runs the ones left after its
    last. `dummy_forward(keep_graph)` returns an opaque handle that `dummy_backward(handle)`
    consumes (when keep_graph)."""

    def __init__(self, passes: str, dummy_forward, dummy_backward, where: str = "wave"):
        check_passes(passes, where)
        self.passes, self.where = passes, where
        self.dummy_forward, self.dummy_backward = dummy_forward, dummy_backward
        self.pos = 0
        self.open_dummies: list = []
        self.dummy_count = 0

    def _run_dummy(self, kind: str) -> None:
        if kind == FORWARD_NO_GRAPH:
            self.dummy_forward(False)
        elif kind == FORWARD:
            self.open_dummies.append(self.dummy_forward(True))
        else:
            if not self.open_dummies:
                raise RuntimeError(
                    f"{self.where}: a dummy backward at pass {self.pos} of {self.passes!r} has no dummy forward "
                    f"open; this rank's own passes do not fit the wave's"
                )
            self.dummy_backward(self.open_dummies.pop())
        self.dummy_count += 1

    def before(self, kind: str) -> None:
        while self.pos < len(self.passes) and self.passes[self.pos] != kind:
            self._run_dummy(self.passes[self.pos])
            self.pos += 1
        if self.pos >= len(self.passes):
            raise RuntimeError(
                f"{self.where}: this rank runs a {kind!r} pass beyond the wave's passes {self.passes!r}; the plan "
                f"and the executor disagree on its work"
            )
        self.pos += 1

    def finish(self) -> None:
        while self.pos < len(self.passes):
            self._run_dummy(self.passes[self.pos])
            self.pos += 1
        if self.open_dummies:
            raise RuntimeError(f"{self.where}: {len(self.open_dummies)} dummy forward(s) left without a backward")
