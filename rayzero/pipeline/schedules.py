"""Pipeline-parallel schedules: in what order each pipeline rank runs its forwards, backwards
and point-to-point messages, as plain lists; a checker for such lists; and a simulator that
times them. No torch, no Ray: a runner executes the lists, tests reason about them.

The model is cut into p * v stages. With p ranks on the pipeline axis and v chunks per rank,
chunk c of rank r is virtual stage s = c * p + r (Megatron's interleaving: rank 0 holds stages
0, p, 2p, ...). Stage 0 holds the embedding, stage p * v - 1 the head and the loss. A step runs
m micro-batches through every stage, forward and then backward.

A schedule is one list of `Action`s per rank. F and B are one micro-batch's forward and backward
through one chunk; zero_bubble splits B into I (the input gradient, which the stage below waits
for) and W (the weight gradient, which nobody waits for). SEND_F / RECV_F carry activations to
stage s + 1, SEND_B / RECV_B gradients to stage s - 1. Sends are queued (non-blocking), receives
block; each receive sits just before the compute that needs it, each send just after the compute
that made it. From one rank to another, messages are received in the order they were sent (a
single FIFO stream, as NCCL's point-to-point needs), which `validate` checks.

p = 4, m = 8 and F = 1, B = 2, I = W = 1 units of time, as `simulate(...).draw()` prints them:

    gpipe: all forwards, then all backwards (last micro-batch first); holds m micro-batches
        rank 0  FFFFFFFF.........BBBBBBBBBBBBBBBB
        rank 1  .FFFFFFFF......BBBBBBBBBBBBBBBB..
        rank 2  ..FFFFFFFF...BBBBBBBBBBBBBBBB....
        rank 3  ...FFFFFFFFBBBBBBBBBBBBBBBB......
    1f1b: p - r - 1 forwards to warm up, then one forward and one backward in turn; holds p - r
        rank 0  FFFF......BBFBBFBBFBBFBB.BB.BB.BB
        rank 1  .FFF....BBFBBFBBFBBFBBFBB.BB.BB..
        rank 2  ..FF..BBFBBFBBFBBFBBFBBFBB.BB....
        rank 3  ...FBBFBBFBBFBBFBBFBBFBBFBB......
    zero_bubble (ZB-H1): 1f1b's order of F and I; rank r runs each W r micro-batches late
        rank 0  FFFF...IWFIWFIWFIWFIWIWIWIW
        rank 1  .FFF..IFIWFIWFIWFIWFIWIWIWW
        rank 2  ..FF.IFIFIWFIWFIWFIWFIWIWWW
        rank 3  ...FIFIFIFIWFIWFIWFIWFIWWWW

interleaved_1f1b (v >= 2) follows Megatron-Core's forward_backward_pipelining_with_interleaving:
micro-batches go through chunk 0 in groups of p, then through chunk 1, and so on (so m must be a
multiple of p); rank r warms up with (p - r - 1) * 2 + (v - 1) * p forwards (at most m * v), then
alternates, backwards visiting the chunks in reverse.

The bubble is idle time over compute time per rank (`bubble_formula`); `simulate` reproduces
it exactly with free communication:

    gpipe, 1f1b       each rank waits (p-1)F while the first micro-batch comes down and (p-1)B
                      while the last gradient goes back up: (p-1)(F+B) idle per m(F+B) of work,
                      so (p-1)/m
    interleaved_1f1b  the same waits in chunk passes f, b that are 1/v of a rank's model:
                      (p-1)(f+b) idle per v*m(f+b), so (p-1)/(v*m)
    zero_bubble       the same waits with I in B's place, less the (p-1)W of late W's that fill
                      the tail: (p-1)(F+I-W) idle per m(F+I+W), exact while W <= min(F, I). With
                      F = I = W that is (p-1)/(3m), a third of 1f1b's (p-1)(F+B)/(m(F+B)) = (p-1)/m
                      with B = I + W

ZB-H1 costs no memory over 1f1b: rank r holds p - r micro-batches between F and I, as in 1f1b,
plus r whose W is late, p in all, which is 1f1b's peak (on its rank 0).
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from dataclasses import dataclass

OPS = ("F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
DEFAULT_COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # a send's cost is its latency: 0 unless given

_M = "micro-batches per step (train.global_batch_size / train.micro_batch_size / data-parallel size)"


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule: `op` on micro-batch `micro` in this rank's chunk `chunk`."""

    op: str
    micro: int
    chunk: int = 0

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"Action.op must be one of {', '.join(OPS)}; got {self.op!r}")

    def __str__(self) -> str:
        return f"{self.op}{self.micro}c{self.chunk}"


class DeadlockError(RuntimeError):
    """Every rank that has work left waits for something that never comes."""


def stage_of(rank: int, chunk: int, p: int) -> int:
    """The virtual stage that `chunk` of pipeline rank `rank` holds (Megatron's interleaving)."""
    return chunk * p + rank


def place_of(stage: int, p: int) -> tuple[int, int]:
    """(rank, chunk) holding virtual `stage`."""
    return stage % p, stage // p


def check(name: str, p: int, m: int, v: int = 1) -> str | None:
    """Why `p` ranks, `m` micro-batches per step and `v` chunks per rank cannot run schedule
    `name`, in words that name the config keys; None when they can."""
    if name not in SCHEDULES:
        return f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}"
    if p < 1 or v < 1 or m < 1:
        return (f"parallel.pp ({p}), parallel.pp_virtual_stages ({v}) and the {_M} ({m}) "
                "must all be at least 1")
    if name == "interleaved_1f1b":
        if v < 2:
            return (f"interleaved_1f1b needs parallel.pp_virtual_stages >= 2; got {v} "
                    "(1f1b runs one chunk per rank)")
        if p < 2:
            return "interleaved_1f1b needs parallel.pp >= 2; got 1"
        if m % p:
            return (f"interleaved_1f1b needs the {_M} to be a multiple of parallel.pp ({p}); got {m}")
        return None
    if v != 1:
        return (f"{name} runs one model chunk per rank: parallel.pp_virtual_stages must be 1, "
                f"got {v} (interleaved_1f1b runs several)")
    if name in ("1f1b", "zero_bubble") and m < p:
        return f"{name} needs at least parallel.pp ({p}) micro-batches per step; got {m} ({_M})"
    return None


def schedule(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Each pipeline rank's actions, in the order that rank runs them."""
    reason = check(name, p, m, v)
    if reason:
        raise ValueError(reason)
    order = _ORDERS[name]
    return [_with_messages(order(r, p, m, v), r, p, v) for r in range(p)]


def bubble_formula(name: str, p: int, m: int, v: int = 1) -> float:
    """Idle time over compute time per rank, in theory (see the module docstring)."""
    reason = check(name, p, m, v)
    if reason:
        raise ValueError(reason)
    if name == "interleaved_1f1b":
        return (p - 1) / (v * m)
    if name == "zero_bubble":
        return (p - 1) / (3 * m)
    return (p - 1) / m


def _gpipe(r: int, p: int, m: int, v: int) -> list[Action]:
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in reversed(range(m))]


def _1f1b(r: int, p: int, m: int, v: int) -> list[Action]:
    return _alternate([Action("F", i) for i in range(m)], [Action("B", i) for i in range(m)], p - r - 1)


def _interleaved(r: int, p: int, m: int, v: int) -> list[Action]:
    def unit(k: int, op: str) -> Action:  # Megatron's k-th forward (or backward) on every rank
        chunk = k % (p * v) // p
        return Action(op, k // (p * v) * p + k % p, chunk if op == "F" else v - 1 - chunk)

    units = range(m * v)
    warmup = (p - r - 1) * 2 + (v - 1) * p
    return _alternate([unit(k, "F") for k in units], [unit(k, "B") for k in units], warmup)


def _alternate(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """`warmup` forwards, then one forward and one backward in turn, then the backwards left."""
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):
        order += [f, b]
    return order + backwards[len(forwards) - warmup:]


def _zero_bubble(r: int, p: int, m: int, v: int) -> list[Action]:
    order = []
    for a in _alternate([Action("F", i) for i in range(m)], [Action("I", i) for i in range(m)], p - r - 1):
        order.append(a)
        if a.op == "I" and a.micro >= r:  # rank r runs each W r micro-batches late
            order.append(Action("W", a.micro - r))
    return order + [Action("W", i) for i in range(m - r, m)]


_ORDERS = {"gpipe": _gpipe, "1f1b": _1f1b, "interleaved_1f1b": _interleaved, "zero_bubble": _zero_bubble}


def _with_messages(order: list[Action], r: int, p: int, v: int) -> list[Action]:
    """Each receive just before the compute that needs it, each send just after its producer."""
    last = p * v - 1
    out = []
    for a in order:
        s = stage_of(r, a.chunk, p)
        if a.op == "F" and s > 0:
            out.append(Action("RECV_F", a.micro, a.chunk))
        if a.op in ("B", "I") and s < last:
            out.append(Action("RECV_B", a.micro, a.chunk))
        out.append(a)
        if a.op == "F" and s < last:
            out.append(Action("SEND_F", a.micro, a.chunk))
        if a.op in ("B", "I") and s > 0:
            out.append(Action("SEND_B", a.micro, a.chunk))
    return out


def _message(a: Action, r: int, p: int) -> tuple[int, int, str]:
    """(sender rank, receiver rank, message) of a SEND or RECV on rank `r`. The message names
    the direction, the micro-batch and the receiving stage, so both ends agree on it."""
    kind = a.op[-1]  # F: activations go to stage s + 1; B: gradients go to stage s - 1
    s = stage_of(r, a.chunk, p)
    step = 1 if kind == "F" else -1
    if a.op.startswith("SEND"):
        return r, place_of(s + step, p)[0], f"{kind}{a.micro}>stage{s + step}"
    return place_of(s - step, p)[0], r, f"{kind}{a.micro}>stage{s}"


def _needs(a: Action, s: int, last: int, backward: str) -> list[tuple[str, int, int]]:
    """What must be done on the same rank before `a` can run (op, micro, chunk)."""
    if a.op == "F":
        ops = ["RECV_F"] if s > 0 else []
    elif a.op in ("B", "I"):
        ops = ["F"] + (["RECV_B"] if s < last else [])
    elif a.op == "W":
        ops = ["I"]
    elif a.op.startswith("SEND"):
        ops = ["F" if a.op == "SEND_F" else backward]
    else:
        ops = []
    return [(op, a.micro, a.chunk) for op in ops]


def _backward_op(rank: list[Action]) -> str:
    return "I" if any(a.op in ("I", "W") for a in rank) else "B"


def validate(actions: list[list[Action]], p: int, m: int, v: int = 1) -> None:
    """Raise ValueError unless `actions` is a complete, well-ordered schedule for these sizes."""
    if len(actions) != p:
        raise ValueError(f"expected one list of actions per pipeline rank ({p}); got {len(actions)}")
    last = p * v - 1
    sent: dict[tuple, list[str]] = defaultdict(list)
    received: dict[tuple, list[str]] = defaultdict(list)
    for r, rank in enumerate(actions):
        backward = _backward_op(rank)
        if backward == "I" and any(a.op == "B" for a in rank):
            raise ValueError(f"rank {r} mixes B with I and W: a rank uses one or the other")
        want = Counter()
        for c in range(v):
            s = stage_of(r, c, p)
            ops = ["F", "B"] if backward == "B" else ["F", "I", "W"]
            ops += ["RECV_F", "SEND_B"] if s > 0 else []
            ops += ["SEND_F", "RECV_B"] if s < last else []
            want.update(Action(op, i, c) for op in ops for i in range(m))
        have = Counter(rank)
        if have != want:
            missing = sorted(map(str, want - have))
            extra = sorted(map(str, have - want))
            raise ValueError(f"rank {r}: missing {missing[:8]}, extra or repeated {extra[:8]}")
        done = set()
        for a in rank:
            need = _needs(a, stage_of(r, a.chunk, p), last, backward)
            late = [n for n in need if n not in done]
            if late:
                raise ValueError(f"rank {r} runs {a} before {Action(*late[0])}")
            done.add((a.op, a.micro, a.chunk))
            if a.op in ("SEND_F", "SEND_B", "RECV_F", "RECV_B"):
                src, dst, msg = _message(a, r, p)
                (sent if a.op.startswith("SEND") else received)[(src, dst)].append(msg)
    for link in sorted(set(sent) | set(received)):
        if sent[link] != received[link]:
            raise ValueError(f"rank {link[0]} sends to rank {link[1]} in the order {sent[link]} "
                             f"but rank {link[1]} receives in the order {received[link]}")


@dataclass(frozen=True)
class Timeline:
    """When each rank ran each compute action, from one `simulate`."""

    spans: tuple[tuple[tuple[float, float, Action], ...], ...]  # per rank: (start, end, action)
    busy: tuple[float, ...]  # per rank: time spent computing
    makespan: float  # when the last rank finished
    peaks: tuple[int, ...]  # per rank: see peak_in_flight

    def bubble(self, rank: int) -> float:
        """Idle time over compute time on `rank`: the quantity `bubble_formula` predicts."""
        return (self.makespan - self.busy[rank]) / self.busy[rank]

    def peak_in_flight(self, rank: int) -> int:
        """The most (micro-batch, chunk) forwards done on `rank` whose backward had not yet run
        all of it (B; or I and then W, which still needs the activations): what the schedule
        holds at its peak."""
        return self.peaks[rank]

    def draw(self, unit: float = 1.0) -> str:
        """One text row per rank, one character per `unit` of time: the op running, "." idle."""
        rows = []
        for r, spans in enumerate(self.spans):
            cells = ["."] * round(self.makespan / unit)
            for start, end, a in spans:
                cells[round(start / unit):round(end / unit)] = a.op * round((end - start) / unit)
            rows.append(f"rank {r}  " + "".join(cells))
        return "\n".join(rows)


def simulate(actions: list[list[Action]], cost: dict[str, float] | list[dict[str, float]] | None = None
             ) -> Timeline:
    """Run the ranks' actions in order with these costs (default `DEFAULT_COST`): one dict for
    every rank, or a list of one per rank (stages that cost differently). A compute starts when
    its rank is free and its inputs are there; a send takes no time on its rank and arrives
    `cost[op]` later (0 unless given); a receive waits for its message."""
    p = len(actions)
    costs = [{**DEFAULT_COST, **(c or {})} for c in (cost if isinstance(cost, list) else [cost] * p)]
    if len(costs) != p:
        raise ValueError(f"simulate: {len(costs)} cost dicts for {p} ranks")
    last = p * (1 + max((a.chunk for rank in actions for a in rank), default=0)) - 1
    backward = [_backward_op(rank) for rank in actions]
    clock, nxt, live = [0.0] * p, [0] * p, [0] * p
    peaks = [0] * p
    done: list[set] = [set() for _ in range(p)]
    spans: list[list] = [[] for _ in range(p)]
    links: dict[tuple, deque] = defaultdict(deque)

    def step(r: int) -> bool:
        a = actions[r][nxt[r]]
        if any(n not in done[r] for n in _needs(a, stage_of(r, a.chunk, p), last, backward[r])):
            return False
        if a.op.startswith("SEND"):
            src, dst, msg = _message(a, r, p)
            links[(src, dst)].append((msg, clock[r] + costs[r].get(a.op, 0.0)))
        elif a.op.startswith("RECV"):
            src, dst, msg = _message(a, r, p)
            queue = links[(src, dst)]
            if not queue:
                return False
            if queue[0][0] != msg:
                raise ValueError(f"rank {r} waits for {msg} from rank {src}, but the next "
                                 f"message on that link is {queue[0][0]}")
            clock[r] = max(clock[r], queue.popleft()[1])
        else:
            spans[r].append((clock[r], clock[r] + costs[r][a.op], a))
            clock[r] += costs[r][a.op]
            # a forward's activations are held until its last backward part: B, or W after I
            live[r] += 1 if a.op == "F" else -1 if a.op == ("W" if backward[r] == "I" else "B") else 0
            peaks[r] = max(peaks[r], live[r])
        done[r].add((a.op, a.micro, a.chunk))
        return True

    while any(nxt[r] < len(actions[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while nxt[r] < len(actions[r]) and step(r):
                nxt[r] += 1
                moved = True
        if not moved:
            stuck = [f"rank {r} at {actions[r][nxt[r]]}" for r in range(p) if nxt[r] < len(actions[r])]
            raise DeadlockError("no rank can go on: " + ", ".join(stuck))
    busy = tuple(sum(e - s for s, e, _ in rank) for rank in spans)
    makespan = max((rank[-1][1] for rank in spans if rank), default=0.0)
    return Timeline(tuple(map(tuple, spans)), busy, makespan, tuple(peaks))
