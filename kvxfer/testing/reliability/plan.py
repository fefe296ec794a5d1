"""The soak's request plan: a pure function of its parameters (no torch), computed the same
way in the parent and in both workers, so nothing but the parameters travels.

A request is ``(room, pages, cuts, abort)``:

* ``pages`` in ``[1, max_pages]``; ``cuts`` the end page of each chunk prefill sends
  (random chunking: 1..4 chunks, the last one ends at ``pages`` and carries the state slot);
* ``abort`` is None or ``(side, point, arg)`` — about ``abort_rate`` of the requests, half
  aborted by each side, at a point that leaves the room in any state:

  - prefill: ``("before_init", 0)`` (sender created, nothing declared),
    ``("after_chunk", c)`` (right after chunk ``c`` was handed to ``send()``; for the last
    chunk this races the final write), ``("lag", k)`` (``k`` + 1 requests later);
  - decode: ``("before_init", 0)``, ``("before_meta", 0)`` (connected, no destination yet),
    ``("lag", k)`` (metadata sent, aborted ``k`` + 1 requests later), and
    ``("meta_after_release", 0)``: aborted before its metadata, and ``send_metadata()`` called
    once its ``on_done`` ran — a scheduler that loses the race against a failure on the
    manager's loop; the call must not touch the items it names any more.
"""

from __future__ import annotations

import random
from typing import List, NamedTuple, Optional, Tuple


class Request(NamedTuple):
    room: int
    pages: int
    cuts: Tuple[int, ...]
    abort: Optional[Tuple[str, str, int]]


def make_plan(
    requests: int, seed: int = 0, max_pages: int = 16, abort_rate: float = 0.1
) -> List[Request]:
    rng = random.Random(seed)
    rooms = rng.sample(range(1, 1 << 62), requests)
    out = []
    for room in rooms:
        pages = rng.randint(1, max_pages)
        n_chunks = rng.randint(1, min(4, pages))
        cuts = tuple(sorted(rng.sample(range(1, pages), n_chunks - 1))) + (pages,)
        abort = None
        x = rng.random()
        if x < abort_rate:
            if x < abort_rate / 2:
                point = rng.choice(("before_init", "after_chunk", "lag"))
                arg = rng.randrange(n_chunks) if point == "after_chunk" else rng.randint(0, 3)
                abort = ("prefill", point, arg if point != "before_init" else 0)
            else:
                point = rng.choice(("before_init", "before_meta", "lag", "meta_after_release"))
                abort = ("decode", point, rng.randint(0, 3) if point == "lag" else 0)
        out.append(Request(room, pages, cuts, abort))
    return out
