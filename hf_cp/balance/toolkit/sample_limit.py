"""The longest sample a balancer can train, and the one refusal every gate gives above it.

A whole-document balancer (CP groups, block placement) holds a sample on at most the largest
CP group: `cluster.largest_capacity` = largest group x cp_max_tokens_per_rank tokens. ChunkFlow
(issue 17) runs a long sample as dependent chunks on one rank, where its peak memory is K
chunks' activations plus the K/V state store of the whole sample; the longest sample it trains
is the longest whose chunks of at least its minimum chunk size fit one rank's memory under the
cost model (`longest_chunkable_sample`), whatever the world size.

A balancer states its limit with a method ``max_sample_tokens(cluster, cost, masked) -> int``
(`chunkflow`, `auto`); one without it trains what the largest group holds. The planner worker,
the dry run and `hf-cp plan` refuse a longer sample before planning with `check_sample_lengths`
(naming the sample, its tokens, the limit and what to change), and pass the limit to the
PlanRequest (`max_sample_tokens`), which otherwise refuses samples over the largest group.
Pure functions on plain data: torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

from hf_cp.balance.base import PlanRequest, SampleTooLongError
from hf_cp.balance.registry import get_balancer
from hf_cp.plan.chunks import largest_fitting_chunk, state_bytes
from hf_cp.samples.lengths import MAX_TOKENS

if TYPE_CHECKING:
    from hf_cp.cost.model import CostModel
    from hf_cp.plan.cluster import ClusterSpec


def shortest_allowed_chunk(length: int, chunk_size: int, min_chunk: int) -> int:
    """The shortest chunks ChunkFlow cuts a sample of `length` tokens into to fit one rank:
    `min_chunk` (short chunks run attention at low kernel efficiency), or less where the
    chunk size asks for shorter chunks anyway: half the chunk size (a sample just over it runs
    as two such halves), or the whole sample when it is shorter."""
    return min(min_chunk, -(-chunk_size // 2), length)


def chunk_fits(
    cost: CostModel,
    length: int,
    keep: int,
    max_tokens_per_rank: int,
    chunk_size: int,
    min_chunk: int,
    patches: int = 0,
) -> int:
    """The chunk size at which ChunkFlow runs a sample of `length` tokens as dependent chunks on
    one rank (the largest <= `chunk_size` whose K kept chunks and K/V state store fit the rank's
    memory, beside what `patches` patches of its images and clips hold: plan/chunks.chunked_vision_bytes),
    or 0 when that would need chunks shorter than shortest_allowed_chunk."""
    c = largest_fitting_chunk(cost, length, keep, max_tokens_per_rank, chunk_size, patches)
    return c if c > 0 and c >= shortest_allowed_chunk(length, chunk_size, min_chunk) else 0


def longest_chunkable_sample(
    cost: CostModel, keep: int, max_tokens_per_rank: int, chunk_size: int, min_chunk: int
) -> int:
    """The longest sample `chunk_fits` places as dependent chunks on one rank (0: none).

    The state store grows with the sample and the kept activations do not, so the limit is
    where the store leaves too little room for K chunks of the shortest allowed size (the same
    for every sample longer than the chunk size): below cap x activation bytes per token /
    state bytes per token, found by bisection on chunk_fits (a longer sample leaves less room
    for activations; the chunk sizes that fit are nearly contiguous, ceil(length / N) for the
    chunk counts N, so it flips from fitting to not fitting near one length)."""
    room = cost.memory_bytes(max_tokens_per_rank) - cost.memory_bytes(0)
    per_token = state_bytes(cost, 1)
    # at most the longest sample hf_cp reads (MAX_TOKENS): the bisection takes <= 53 steps, also
    # for a room of 1e300 bytes or more (inf)
    hi = int(min(room / per_token, MAX_TOKENS)) if per_token > 0 and room == room else 0
    if hi < 1 or not chunk_fits(cost, 1, keep, max_tokens_per_rank, chunk_size, min_chunk):
        return 0
    lo = 1  # chunk_fits(lo) holds; chunk_fits(hi + 1) does not (the store alone overflows)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chunk_fits(cost, mid, keep, max_tokens_per_rank, chunk_size, min_chunk):
            lo = mid
        else:
            hi = mid - 1
    return lo


def trains_length(balancer, n: int, cluster: ClusterSpec, cost: CostModel) -> bool:
    """Whether `balancer` trains a causal sample of `n` tokens up to its limit: a balancer
    whose limit has gaps below it (chunkflow: a few lengths just under it split into chunks
    that do not fit) says so with `trains_length(n, cluster, cost)`."""
    if n > sample_token_limit(balancer, cluster, cost):
        return False
    own = getattr(balancer, "trains_length", None)
    return n <= cluster.largest_capacity or own is None or bool(own(n, cluster, cost))


def sample_token_limit(balancer, cluster: ClusterSpec, cost: CostModel, masked: bool = False) -> int:
    """The longest sample `balancer` can train on `cluster` (a masked one when `masked`): its
    `max_sample_tokens(cluster, cost, masked)`, or what the largest CP group holds."""
    own = getattr(balancer, "max_sample_tokens", None)
    if own is None:
        return cluster.largest_capacity
    return int(own(cluster, cost, masked))


def _chunkflow_hint(n: int, cluster: ClusterSpec, cost: CostModel) -> str:
    """A clause pointing to chunkflow when its default settings would train `n` tokens."""

    try:
        limit = sample_token_limit(get_balancer("chunkflow"), cluster, cost)
    except (KeyError, ValueError):
        return ""
    if n > limit:
        return ""
    return (
        f"; or set cp_balancer: chunkflow (or auto with chunkflow among its members), which trains it as dependent "
        f"chunks on one rank: samples up to {limit} tokens at cp_chunk_keep 1, as long as the K/V state store of the "
        f"whole sample plus cp_chunk_keep x cp_chunk_size tokens of activations fit one rank's cap"
    )


def format_bytes(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def too_long_message(
    sample: str, n: int, balancer, name: str, cluster: ClusterSpec, cost: CostModel, masked: bool = False
) -> str:
    """Why `balancer` cannot train `sample` ("sample 7") of `n` tokens, and what to change."""
    limit = sample_token_limit(balancer, cluster, cost, masked)
    cap, g = cluster.max_tokens_per_rank, cluster.group_sizes[-1]
    head = f"{sample} has {n} tokens"
    fix = (
        "Raise cp_max_tokens_per_rank (--max-tokens-per-rank) or the world size, or drop or shorten it in the data "
        "(hf-cp preprocess --max-length --overlong drop/truncate for token data)"
    )
    if limit <= cluster.largest_capacity:
        hint = "" if masked else _chunkflow_hint(n, cluster, cost)
        return (
            f"{head}; the largest CP group ({g} ranks x {cap} tokens per rank) holds {cluster.largest_capacity}, "
            f"the longest {'masked ' if masked else ''}sample balancer {name!r} trains. {fix}{hint}"
        )
    store, room = state_bytes(cost, n), cost.memory_bytes(cap) - cost.memory_bytes(0)
    why = (
        f"its K/V state store alone ({format_bytes(store)}) exceeds a rank's memory at the cap of {cap} tokens "
        f"({format_bytes(room)} of activations)"
        if store >= room
        else f"its K/V state store ({format_bytes(store)}) plus cp_chunk_keep chunks of at least the minimum chunk "
        f"size must fit a rank's memory at the cap of {cap} tokens ({format_bytes(room)} of activations)"
    )
    return (
        f"{head}; balancer {name!r} trains samples of at most {limit} tokens, as dependent chunks on one rank "
        f"(ChunkFlow): {why}. Lower cp_chunk_keep, or chunkflow's min_chunk_size. {fix}"
    )


def check_sample_lengths(
    balancer,
    sample_ids: Sequence[int],
    lengths: Sequence[int],
    cluster: ClusterSpec,
    cost: CostModel,
    name: Optional[str] = None,
    masked: Iterable[int] = (),
    where: str = "",
    label: Optional[Callable[[int], str]] = None,
) -> int:
    """Raise SampleTooLongError naming the first sample `balancer` cannot train (the samples
    in `masked` against its limit for masked samples); return its limit for causal samples.
    `where` prefixes the message (a dataset, a step); `label(id)` names a sample (default
    "sample <id>")."""
    name = name or getattr(balancer, "name", type(balancer).__name__)
    masked = set(masked)
    limit = sample_token_limit(balancer, cluster, cost)
    masked_limit: Optional[int] = None  # computed only for a masked sample that needs it
    refused = []  # (tokens, id, masked) of every sample it cannot train
    for s, n in zip(sample_ids, lengths):
        if n <= min(limit, cluster.largest_capacity):
            continue
        is_masked = s in masked
        if is_masked and masked_limit is None:
            masked_limit = sample_token_limit(balancer, cluster, cost, masked=True)
        if n > (min(masked_limit, limit) if is_masked else limit) or (
            not is_masked and not trains_length(balancer, n, cluster, cost)
        ):
            refused.append((int(n), int(s), is_masked))
    if refused:
        n, s, is_masked = max(refused, key=lambda r: r[0])  # the longest (the first of equals) names the fix
        what = label(s) if label is not None else f"sample {s}"
        msg = too_long_message(what, n, balancer, name, cluster, cost, masked=is_masked)
        more = f" ({len(refused)} samples in all are too long)" if len(refused) > 1 else ""
        raise SampleTooLongError(f"{where}{msg}{more}")
    return limit


def check_request_lengths(balancer, req: PlanRequest, name: Optional[str] = None) -> None:
    """SampleTooLongError naming the first sample of the step `balancer` cannot train: for a
    request whose `max_sample_tokens` (another balancer's limit) lets longer samples through."""
    if max(req.lengths) <= req.cluster.largest_capacity:
        return  # every balancer trains what the largest group holds
    check_sample_lengths(
        balancer, req.sample_ids, req.lengths, req.cluster, req.cost, name, req.masks or (), f"step {req.step}: "
    )
