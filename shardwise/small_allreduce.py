"""A sum over ranks for the small control messages they agree with, in log2(n) steps.

gloo's `all_reduce` runs a ring whatever the message size: 2(n-1) dependent steps, so the
48-byte agreement at the start of every step would cost ~2n network latencies at n ranks
(32,766 at 16,384 ranks), and an all-gather of one record per rank n-1. Recursive doubling
(Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in
MPICH", 2005) takes ceil(log2 p) rounds of one exchange each, p the largest power of two at
most n, plus one round before and one after when n is not a power of two: the first 2(n-p)
ranks pair up, the even one of each pair hands its vector to the odd one and gets the result
back at the end. Written with torch.distributed's isend/irecv on the control group, so it
runs wherever gloo does; int64 sums are exact, so every rank ends with the same bits.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.distributed as dist

TAG = 0x5357  # keeps these messages apart from any other point-to-point traffic on the group

Waiter = Callable[[dist.Work, str], None]


def exchanges(index: int, size: int) -> Iterator[tuple[int | None, int | None, bool]]:
    """The steps of rank `index` of `size`: (send to, receive from, add what is received)
    as group indices, None where a step has no send or no receive. Pure, for testing."""
    p = 1 << (size.bit_length() - 1)
    extra = size - p
    if index < 2 * extra:
        if index % 2 == 0:  # hands its vector in, takes the result back: no rounds of its own
            yield index + 1, None, False
            yield None, index + 1, False
            return
        yield None, index - 1, True
        virtual = index // 2
    else:
        virtual = index - extra
    mask = 1
    while mask < p:
        partner = virtual ^ mask
        real = partner * 2 + 1 if partner < extra else partner + extra
        yield real, real, True
        mask <<= 1
    if index < 2 * extra:
        yield index - 1, None, False


class SmallSum:
    """`tensor` (int64, a few elements) summed in place over `ranks` (the group's global
    ranks, this rank's position `index`); `start` posts the first step, `finish` the rest."""

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup, ranks: list[int], index: int):
        self.tensor, self.group, self.ranks = tensor, group, ranks
        self._steps = exchanges(index, len(ranks))
        self._posted: tuple | None = None

    def start(self) -> "SmallSum":
        self._post()
        return self

    def _post(self) -> None:
        step = next(self._steps, None)
        if step is None:
            self._posted = None
            return
        send, receive, add = step
        sent = self.tensor.clone()
        incoming = torch.empty_like(self.tensor) if receive is not None else None
        works = []
        if send is not None:
            works.append(dist.isend(sent, dst=self.ranks[send], group=self.group, tag=TAG))
        if receive is not None:
            works.append(dist.irecv(incoming, src=self.ranks[receive], group=self.group, tag=TAG))
        self._posted = (works, sent, incoming, add, receive)

    def finish(self, wait: Waiter, what: str) -> torch.Tensor:
        """Complete every step, waiting with `wait(work, description)`; returns the sum."""
        while self._posted is not None:
            works, _, incoming, add, receive = self._posted
            for work in works:
                wait(work, what)
            if incoming is not None:
                self.tensor.copy_(self.tensor + incoming if add else incoming)
            self._post()
        return self.tensor
