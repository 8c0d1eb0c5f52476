"""The collectives CP attention uses, each counting its calls and the bytes this rank sends.

Tests compare the counts against CostModel.ulysses_bytes_per_layer / ring_bytes_per_layer and
check that an all-local micro-batch issues none. Only bytes that leave the rank count (the
all-to-all slice a rank keeps for itself does not).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

Tensor = torch.Tensor


@dataclass
class CommStats:
    calls: Dict[str, int] = field(default_factory=dict)
    bytes_sent: int = 0
    items: Dict[str, int] = field(default_factory=dict)  # e.g. "kv_chunks": K/V chunks the block engine sent

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())


class CommCounter:
    def __init__(self):
        self._lock = threading.Lock()  # backward may run on an autograd worker thread
        self._calls: Counter = Counter()
        self._bytes = 0
        self._items: Counter = Counter()

    def record(self, op: str, nbytes: int) -> None:
        with self._lock:
            self._calls[op] += 1
            self._bytes += int(nbytes)

    def count(self, item: str, n: int) -> None:
        with self._lock:
            self._items[item] += int(n)

    def reset(self) -> None:
        with self._lock:
            self._calls.clear()
            self._bytes = 0
            self._items.clear()

    def snapshot(self) -> CommStats:
        with self._lock:
            return CommStats(dict(self._calls), self._bytes, dict(self._items))


COUNTER = CommCounter()


def _nbytes(t: Optional[Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class Pending:
    """Outstanding point-to-point requests; wait() before reading the received buffer."""

    def __init__(self, works: List):
        self._works = works

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []


def ring_exchange(send: Tensor, dst: int, recv: Tensor, src: int, group, tag: int) -> Pending:
    """Send `send` to global rank dst and receive into `recv` from global rank src, both
    non-blocking. Empty tensors are exchanged too, so every member takes part in every step
    (NCCL wants all members in a group's first batched P2P call; gloo accepts empty messages)."""
    ops = [
        dist.P2POp(dist.isend, send, dst, group=group, tag=tag),
        dist.P2POp(dist.irecv, recv, src, group=group, tag=tag),
    ]
    COUNTER.record("p2p", _nbytes(send))
    return Pending(dist.batch_isend_irecv(ops))


def all_to_all_rows(x: Tensor, send_rows: Sequence[int], recv_rows: Sequence[int], group, me: int) -> Tensor:
    """all_to_all_single along dim 0 with row splits; counted, not differentiable."""
    x = x.contiguous()
    out = x.new_empty((sum(recv_rows),) + tuple(x.shape[1:]))
    row_bytes = int(torch.Size(x.shape[1:]).numel()) * x.element_size()
    COUNTER.record("all_to_all", (sum(send_rows) - send_rows[me]) * row_bytes)
    dist.all_to_all_single(out, x, output_split_sizes=list(recv_rows), input_split_sizes=list(send_rows), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all: the backward sends gradients back along the reversed splits.
    (torch.distributed.nn.functional's version is deprecated in torch 2.13 and would hide the
    backward exchange from the counter.)"""

    @staticmethod
    def forward(ctx, x, send_rows, recv_rows, group, me):
        ctx.args = (send_rows, recv_rows, group, me)
        return all_to_all_rows(x, send_rows, recv_rows, group, me)

    @staticmethod
    def backward(ctx, grad):
        send_rows, recv_rows, group, me = ctx.args
        return all_to_all_rows(grad, recv_rows, send_rows, group, me), None, None, None, None


def all_to_all(x: Tensor, send_rows: Sequence[int], recv_rows: Sequence[int], group, me: int) -> Tensor:
    return _AllToAll.apply(x, list(send_rows), list(recv_rows), group, me)


def exchange_bytes(
    send: Sequence[Tensor], recv_sizes: Sequence[int], group, me: int, device, op: str
) -> Tuple[Tensor, Pending]:
    """All-to-all-v of byte buffers (one per member, this member's own slot empty or not),
    started asynchronously: returns the receive buffer and the request to wait on. The block
    engine packs pieces of several dtypes into them; only bytes leaving the rank count."""
    sizes = [int(t.numel()) for t in send]
    buf = torch.cat(list(send)) if any(sizes) else torch.empty(0, dtype=torch.uint8, device=device)
    out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    COUNTER.record(op, sum(sizes) - sizes[me])
    work = dist.all_to_all_single(
        out, buf, output_split_sizes=list(recv_sizes), input_split_sizes=sizes, group=group, async_op=True
    )
    return out, Pending([work])
