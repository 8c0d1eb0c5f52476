"""Random valid StepPlans for property tests (any placement a balancer could legally choose)."""

import random

from hf_cp.modes.segments import WHOLE_DOCUMENT_MODES, ShardMode
from hf_cp.plan.step_plan import Group, StepPlan, Wave


def random_valid_plan(lengths, cluster, seed, ulysses_ok=lambda g: True):
    rng = random.Random(seed)
    ids = list(range(len(lengths)))
    plan = StepPlan(
        world_size=cluster.world_size,
        max_tokens_per_rank=cluster.max_tokens_per_rank,
        sample_ids=ids,
        lengths=list(lengths),
    )
    lens = plan.length_of()
    waves = []  # list of dict: block tuple -> Group
    order = ids[:]
    rng.shuffle(order)
    for s in order:
        n = lens[s]
        sizes = [g for g in cluster.group_sizes if g * cluster.max_tokens_per_rank >= n]
        g = rng.choice(sizes)
        block = rng.choice(cluster.blocks(g))
        w = rng.randint(0, len(waves))
        local = g == 1 or (n <= cluster.max_tokens_per_rank and rng.random() < 0.4)
        modes = [m for m in WHOLE_DOCUMENT_MODES if m != ShardMode.ULYSSES or ulysses_ok(g)]
        mode = rng.choice(modes)
        placed = False
        if w < len(waves):
            wave = waves[w]
            overlap = [b for b in wave if set(b) & set(block)]
            if overlap == [block] or not overlap:
                grp = wave.get(block) or Group(ranks=block, mode=mode)
                if grp.distributed and not local:
                    mode = grp.mode
                trial = Group(
                    ranks=block,
                    distributed=list(grp.distributed),
                    mode=grp.mode if grp.distributed else mode,
                    local={r: list(v) for r, v in grp.local.items()},
                )
                if local:
                    trial.local.setdefault(rng.choice(block), []).append(s)
                else:
                    trial.distributed.append(s)
                if all(plan.rank_tokens(trial, r, lens) <= cluster.max_tokens_per_rank for r in block):
                    wave[block] = trial
                    placed = True
        if not placed:
            grp = Group(ranks=block, mode=mode)
            if local:
                grp.local[rng.choice(block)] = [s]
            else:
                grp.distributed.append(s)
            waves.append({block: grp})
    plan.waves = [Wave(list(w.values())) for w in waves]
    return plan
