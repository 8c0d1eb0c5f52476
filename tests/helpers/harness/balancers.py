"""Scripted balancers: deterministic plan shapes that exercise one CP mode (or ChunkFlow's
dependent chunks) and every execution path, for tests. Not registered (auto would pick them up
as members): pass them to CPTrainer(balancer=...), or name them in a job spec (`balancer_for`)."""

from __future__ import annotations

from hf_cp.modes.segments import ShardMode


class FixedModeBalancer:
    """Wave 0: the longest samples distributed over ranks [0, g) with `mode` (g the smallest
    registered group of at least 2 ranks that holds the longest sample), one local sample on
    each other rank. Then the leftovers, first-fit packed to the cap, one pack per wave on
    rank 0 alone, so every other rank idles in those waves.
    """

    def __init__(self, mode):
        self.mode = ShardMode(mode)
        self.name = f"fixed_{self.mode.value}"

    def plan(self, req):
        from hf_cp.balance import max_member_tokens
        from hf_cp.plan.bins import first_fit
        from hf_cp.plan.step_plan import Group, Wave

        cl = req.cluster
        W, cap = cl.world_size, cl.max_tokens_per_rank
        lens = dict(zip(req.sample_ids, req.lengths))
        order = sorted(req.sample_ids, key=lambda s: (-lens[s], s))
        plan = req.empty_plan(self.name)
        groups, rest = [], list(order)
        g = max(2, cl.smallest_group_for(lens[order[0]]) or 2) if W > 1 else 1
        if g > 1:
            dist = []
            while rest and max_member_tokens(self.mode, [lens[s] for s in dist + [rest[0]]], g) <= cap:
                dist.append(rest.pop(0))
                if len(dist) == 2:
                    break
            if dist:
                groups.append(Group(ranks=tuple(range(g)), distributed=dist, mode=self.mode))
        for r in range(g if g > 1 else 0, W):
            fits = [s for s in rest if lens[s] <= cap]
            if fits:
                rest.remove(fits[0])
                groups.append(Group(ranks=(r,), local={r: [fits[0]]}))
        if groups:
            plan.waves.append(Wave(groups))
        too_long = [s for s in rest if lens[s] > cap]
        for s in too_long:
            size = cl.smallest_group_for(lens[s])
            plan.waves.append(Wave([Group(ranks=tuple(range(size)), distributed=[s], mode=self.mode)]))
        short = [s for s in rest if lens[s] <= cap]
        if short:
            for pack in first_fit(short, [lens[s] for s in short], cap):
                plan.waves.append(Wave([Group(ranks=(0,), local={0: list(pack)})]))
        return plan


class SpreadEveryDocBalancer:
    """Every sample alone in its own wave, distributed over the whole world with `mode`:
    samples shorter than the split leave some members with an empty shard."""

    def __init__(self, mode):
        self.mode = ShardMode(mode)
        self.name = f"spread_{self.mode.value}"

    def plan(self, req):
        from hf_cp.plan.step_plan import Group, Wave

        plan = req.empty_plan(self.name)
        ranks = tuple(range(req.cluster.world_size))
        plan.waves = [Wave([Group(ranks=ranks, distributed=[s], mode=self.mode)]) for s in req.sample_ids]
        return plan


def chunk_size_for(length: int, chunks: int) -> int:
    """A chunk size with which a sample of `length` tokens is cut into exactly `chunks`
    dependent chunks (chunking.dependent_chunk_sizes: the count is ceil(length / size))."""
    from hf_cp.plan.chunks import dependent_chunk_sizes

    for size in range(-(-length // chunks), 0, -1):
        got = len(dependent_chunk_sizes(length, size))
        if got == chunks:
            return size
        if got > chunks:
            break
    raise ValueError(f"no chunk size cuts a {length}-token sample into exactly {chunks} chunks")


class ChunkedSampleBalancer:
    """ChunkFlow's execution shapes with an exact chunk count: wave 0 runs the step's longest
    sample as exactly `chunks` dependent chunks keeping `keep` on rank 0 (N = 1 included,
    which the chunkflow balancer never plans: it keeps a sample that fits one chunk whole), and
    on every other rank a pack of the next samples, first-fit to the cap (one backward against
    rank 0's N: the trainer pads them with zero-weight micro-batches). The leftovers follow,
    first-fit packed to the cap, one pack per rank and wave."""

    def __init__(self, chunks: int, keep: int):
        if chunks <= 0 or keep <= 0:
            raise ValueError(f"chunks and keep must be positive, got {chunks} and {keep}")
        self.chunks, self.keep = chunks, keep
        self.name = f"chunks_{chunks}_keep_{keep}"

    def plan(self, req):
        from hf_cp.plan.bins import first_fit
        from hf_cp.plan.step_plan import ChunkedSample, Group, Wave

        W, cap = req.cluster.world_size, req.cluster.max_tokens_per_rank
        lens = dict(zip(req.sample_ids, req.lengths))
        order = sorted(req.sample_ids, key=lambda s: (-lens[s], s))
        longest, rest = order[0], order[1:]
        chunked = ChunkedSample(longest, chunk_size_for(lens[longest], self.chunks), self.keep)
        first = [Group(ranks=(0,), chunked={0: [chunked]})]
        for r in range(1, W):
            pack, used = [], 0
            for s in list(rest):
                if used + lens[s] <= cap:
                    pack.append(s)
                    rest.remove(s)
                    used += lens[s]
            if pack:
                first.append(Group(ranks=(r,), local={r: pack}))
        plan = req.empty_plan(self.name)
        plan.waves.append(Wave(first))
        packs = first_fit(rest, [lens[s] for s in rest], cap) if rest else []
        for w in range(0, len(packs), W):
            plan.waves.append(Wave([Group(ranks=(r,), local={r: list(p)}) for r, p in enumerate(packs[w : w + W])]))
        return plan


class RankDependentBalancer:
    """What a solver's time limit can do: rank 1 plans every step with wlb, the others with
    dynamic_cp. Declared timing-dependent, so the trainer runs rank 0's plan on every rank
    instead of failing on the disagreement (a balancer that does not declare it fails)."""

    name = "rank_dependent"
    timing_dependent = True

    def plan(self, req):
        import os

        from hf_cp.balance import get_balancer

        # RANK: the launcher's, read in the forked planner worker too
        return get_balancer("wlb" if os.environ.get("RANK") == "1" else "dynamic_cp").plan(req)


def balancer_for(name: str):
    """Scripted balancers for names fixed_<mode>, spread_<mode>, chunks_<N>_keep_<K> and
    rank_dependent, else None (use the registry)."""
    if name == "rank_dependent":
        return RankDependentBalancer()
    if name.startswith("chunks_"):
        chunks, _, keep = name[len("chunks_") :].partition("_keep_")
        return ChunkedSampleBalancer(int(chunks), int(keep))
    if name.startswith("fixed_"):
        return FixedModeBalancer(name[len("fixed_") :])
    if name.startswith("spread_"):
        return SpreadEveryDocBalancer(name[len("spread_") :])
    return None
