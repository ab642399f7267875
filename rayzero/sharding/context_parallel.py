"""Context parallelism's sequence split and its attention: a sequence longer than one rank can
hold is split over the ranks of a cp group, and attention, the one place where tokens meet
tokens, runs across the split in one of two ways.

The split, balanced for causal attention (Megatron-Core's): a sequence of S tokens is cut into
2·cp chunks of S/(2·cp) tokens; rank i holds chunks i and 2·cp−1−i, so that every rank has as
many early (cheap) as late (expensive) queries and does the same attention work:

    cp 2, S 8 (chunks of 2):   rank 0 holds tokens 0 1 | 6 7     rank 1 holds tokens 2 3 | 4 5

A rank's tokens keep their global positions (`positions`): rotary and learned positions, the
causal mask and the documents of packed sequences all follow the tokens, not their local index.

Attention across the split (`q`, `k`, `v`: [batch, heads, local tokens, head dim]; grouped-query
attention has fewer key/value heads, each serving heads/kv_heads query heads as transformers'
`repeat_kv` expands them):

- `ring_attention` (Megatron's ring exchange): the key/value blocks go round the cp group point to
  point (only the key/value heads travel), while each rank computes its queries against the block
  it holds; the partial results are merged by their log-sum-exp. Chunk pairs the causal mask hides
  entirely are skipped, and pairs it leaves whole are computed without a mask. Backward sends
  the blocks round again, with their gradients accumulating as they go, and one last send brings
  each block's dK/dV home.
- `ulysses_attention` (DeepSpeed-Ulysses): an all-to-all turns the sequence split into a head
  split (each rank all tokens of heads/cp heads, and kv_heads/cp key/value heads), attention runs
  on the whole sequence, and the reverse all-to-all returns the rank's tokens of every head.

Masks: causal over global positions; `documents` (packed rows, optional: for each query, the
global index where its example starts, `data/microbatch.py`): a query attends only to the keys of
its own example, from that index to itself. Examples are runs of a row, so the keys a query may
see follow from its own example's start alone: no key's example travels with its block, and a
chunk pair whose keys all end before every query's example starts is skipped, as the causal mask's
are (read from the queries' starts once per call: a transfer to the host of 2 numbers a chunk).
A query with no key to attend gets zeros. The arithmetic is float32 whatever the inputs' dtype.

Attention dropout (`dropout_p`): the ring drops each chunk pair's probabilities with a mask drawn
from a generator of its own, seeded by (a seed drawn from the rank's dropout stream, the pair's
first query and key positions), so the backward draws the same mask again instead of keeping it,
and a recompute, which replays the stream, draws the same seed. Ulysses drops in its one
attention over the whole sequence, drawing from the stream itself.

Pure torch, no Ray: the cp group is an `Axis` (`comm.py`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rayzero.sharding.comm import summed

NEG = float("-inf")


class Traffic:
    """Bytes this process has sent to the other ranks of its cp group (the ring's blocks and
    gradients, the all-to-alls' shares for other ranks): what `benchmarks/long_context.py` holds
    against the formula."""

    sent = 0


traffic = Traffic()


# -- the split -------------------------------------------------------------------------------------
def positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions of the tokens rank `rank` of `cp` holds, in its local order."""
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens does not split into 2 x cp = {2 * cp} equal chunks")
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    last = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, last])


def split(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of `t` (the whole sequence along `dim`)."""
    if cp == 1:
        return t
    return t.index_select(dim, positions(t.shape[dim], cp, rank, t.device))


def unsplit(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's tokens (`parts[i]`: rank i's), in global order."""
    cp = len(parts)
    whole = torch.cat(parts, dim)
    order = torch.cat([positions(whole.shape[dim], cp, r, whole.device) for r in range(cp)])
    return whole.index_select(dim, torch.argsort(order))


# -- one block of attention ---------------------------------------------------------------------
def _runs(pos: torch.Tensor, chunk: int) -> list[tuple[slice, int, int]]:
    """A rank's chunks of `chunk` consecutive positions: (local slice, first position, last
    position). Two chunks that happen to be neighbours stay two (the causal skip is per chunk)."""
    p = pos.tolist()
    return [(slice(i, i + chunk), p[i], p[i + chunk - 1]) for i in range(0, len(p), chunk)]


def _allowed(q_pos, k_pos, q_doc, causal: bool):
    """Which keys each query may attend ([batch or 1, 1, Lq, Lk]), or None for all of them:
    causal over the positions, and with `q_doc` (each query's example start) within its example."""
    allowed = None
    if causal:
        allowed = (q_pos[:, None] >= k_pos[None, :])[None, None]
    if q_doc is not None:
        inside = (k_pos.to(q_doc.device)[None, None, :] >= q_doc[:, :, None])[:, None]
        allowed = inside if allowed is None else allowed.to(q_doc.device) & inside
    return allowed


def _starts(q_doc: torch.Tensor | None, chunk: int) -> list[tuple[int, int]] | None:
    """Each of a rank's chunks' (earliest, latest) example start over the rows, on the host."""
    if q_doc is None:
        return None
    first, last = q_doc[:, ::chunk].min(0).values, q_doc[:, chunk - 1::chunk].max(0).values
    return [tuple(p) for p in torch.stack([first, last], 1).tolist()]


def _pairs(q_pos, k_pos, q_doc, causal: bool, chunk: int, device=None, starts=None):
    """The (query chunk, key chunk, how) pairs with something to attend: pairs the causal mask
    hides entirely are left out, and with `q_doc` (`starts`: its chunks' bounds) those whose keys
    all precede every query's example; `how` is "full" for a pair the masks leave whole, "diagonal"
    for a chunk against itself within one example (causal within it), else the mask on `device`.
    `q_pos`, `k_pos`, `starts`: on the host (the chunks' bounds are read without a device sync)."""
    out = []
    for i, (qs, q_lo, q_hi) in enumerate(_runs(q_pos, chunk)):
        first, last = starts[i] if starts is not None else (None, None)
        for ks, k_lo, k_hi in _runs(k_pos, chunk):
            if causal and k_lo > q_hi:
                continue
            if first is not None and k_hi < first:  # the keys end before any query's example starts
                continue
            whole = not causal or k_hi <= q_lo
            one = last is None or last <= k_lo  # every query's example began by the first key
            if one and whole:
                out.append((qs, ks, "full"))
            elif one and (q_lo, q_hi) == (k_lo, k_hi):
                out.append((qs, ks, "diagonal"))
            else:
                out.append((qs, ks, _allowed(q_pos[qs], k_pos[ks], None if q_doc is None else q_doc[:, qs],
                                             causal and not whole).to(device)))
    return out


def _fused(q: torch.Tensor, how) -> bool:
    """Whether a pair runs in torch's fused CPU kernel (which also gives the log-sum-exp): a
    whole or diagonal pair of float32 tensors on the CPU; the rest (masks, other devices) in
    plain tensor operations."""
    return isinstance(how, str) and q.device.type == "cpu"


def _mask(how, q_pos, k_pos, device):
    """`how` as a boolean mask on `device` (or None) for the plain path."""
    if how == "full":
        return None
    if how == "diagonal":
        return _allowed(q_pos, k_pos, None, True).to(device)
    return how


def _scores(q, k, scale, allowed):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if allowed is None else s.masked_fill(~allowed, NEG)


def _probs(s, lse):
    """exp(s − lse), 0 where a query attends nothing (lse −inf)."""
    p = torch.exp(s - lse[..., None])
    return torch.nan_to_num(p, nan=0.0) if torch.isinf(lse).any() else p


@dataclass(frozen=True)
class Dropout:
    """Attention dropout in the ring: rate `p`, and the seed each chunk pair's mask derives from."""

    p: float
    seed: int

    def keep(self, shape, q_pos, k_pos, device) -> torch.Tensor:
        """The pair's scaled keep mask (0 or 1/(1-p)) of `shape`, the same at every call."""
        from rayzero.sharding.rng import stream_seed

        g = torch.Generator(device=device).manual_seed(stream_seed(self.seed, int(q_pos[0]), int(k_pos[0])))
        keep = torch.rand(shape, generator=g, device=device) >= self.p
        return keep.float().mul_(1.0 / (1.0 - self.p))


def _block_forward(q, k, v, scale, how, q_pos, k_pos, drop: Dropout | None = None):
    """(out, lse) of float32 queries against one block of float32 keys and values; with `drop`,
    out's probabilities dropped (lse, the normaliser, is not: the merge stays exact)."""
    if drop is None and _fused(q, how):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, how == "diagonal", scale=scale)
    s = _scores(q, k, scale, _mask(how, q_pos, k_pos, q.device))
    lse = torch.logsumexp(s, dim=-1)
    p = _probs(s, lse)
    if drop is not None:
        p = p * drop.keep(p.shape, q_pos, k_pos, q.device)
    return torch.matmul(p, v), lse


def _merge(out, lse, part, part_lse):
    """Two partial attentions of the same queries, merged by their log-sum-exp (in place)."""
    new = torch.logaddexp(lse, part_lse)
    finite = torch.isfinite(new)
    a = torch.where(finite, torch.exp(lse - new), torch.zeros_like(new))
    b = torch.where(finite, torch.exp(part_lse - new), torch.zeros_like(new))
    out.mul_(a[..., None]).add_(part * b[..., None])
    lse.copy_(new)


def _block_backward(q, k, v, scale, how, q_pos, k_pos, out, lse, dout, delta, drop: Dropout | None = None):
    """(dq, dk, dv) of one block, from the whole attention's out, lse and delta = rowsum(dout · out)
    (the block's probabilities are exp(s − lse) of the whole row; with `drop`, the forward's mask
    drawn again)."""
    if drop is None and _fused(q, how):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(),
            0.0, how == "diagonal", scale=scale)
    p = _probs(_scores(q, k, scale, _mask(how, q_pos, k_pos, q.device)), lse)
    dp = torch.matmul(dout, v.transpose(-1, -2))
    if drop is None:
        dv = torch.matmul(p.transpose(-1, -2), dout)
    else:
        keep = drop.keep(p.shape, q_pos, k_pos, q.device)
        dv = torch.matmul((p * keep).transpose(-1, -2), dout)
        dp = dp * keep
    ds = p * (dp - delta[..., None])
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated for the query heads each serves (transformers' `repeat_kv`)."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """A gradient over the expanded heads, summed back onto the key/value heads."""
    if groups == 1:
        return grad
    b, h, n, d = grad.shape
    return grad.view(b, h // groups, groups, n, d).sum(2)


def attention(q, k, v, q_pos, k_pos, q_doc=None, causal: bool = True, scale: float | None = None,
              dropout_p: float = 0.0):
    """Attention of `q` against `k`, `v` on one rank (a whole sequence, or Ulysses' head split),
    with the masks described above (and dropout drawn from the default generator); differentiable
    by autograd. The reference the split ones equal."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    groups = q.shape[1] // k.shape[1]
    qf, kf, vf = q.float(), _expand(k, groups).float(), _expand(v, groups).float()
    s = _scores(qf, kf, scale, _allowed(q_pos, k_pos, q_doc, causal) if causal or q_doc is not None else None)
    lse = torch.logsumexp(s, dim=-1)
    p = _probs(s, lse)
    if dropout_p:
        p = torch.nn.functional.dropout(p, dropout_p)
    return torch.matmul(p, vf).to(q.dtype)


# -- the ring ------------------------------------------------------------------------------------
class _Ring:
    """Neighbours on the cp group: each step sends to the next rank and receives from the previous."""

    def __init__(self, axis):
        self.axis = axis
        ranks = dist.get_process_group_ranks(axis.group)
        self.next, self.prev = ranks[(axis.rank + 1) % axis.size], ranks[(axis.rank - 1) % axis.size]

    def start(self, tensors: list[torch.Tensor]):
        """Send `tensors` on, receive the previous rank's into new tensors: (received, works)."""
        got = [torch.empty_like(t) for t in tensors]
        traffic.sent += sum(t.numel() * t.element_size() for t in tensors)
        ops = [dist.P2POp(dist.isend, t, self.next, self.axis.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, g, self.prev, self.axis.group) for g in got]
        return got, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(works) -> None:
        for w in works:
            w.wait()


def _ring_steps(axis, k, v, seq_len: int, groups: int):
    """The blocks a rank holds in turn, one a step: (their positions, on the host; keys and values
    expanded to the query heads in float32). Only the key/value heads travel. The next block's
    exchange runs while the caller computes on this one, and is waited for when the caller asks
    for the next."""
    cp, rank, ring = axis.size, axis.rank, _Ring(axis)
    cur = [torch.stack([k, v]).contiguous()]
    for step in range(cp):
        works = None
        if step + 1 < cp:
            got, works = ring.start(cur)
        kf, vf = (_expand(t, groups).float() for t in cur[0])
        yield positions(seq_len, cp, (rank - step) % cp), kf, vf
        if works is not None:
            ring.finish(works)
            cur = got


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_doc, axis, seq_len: int, causal: bool, scale: float, drop: Dropout | None):
        cp, groups, chunk = axis.size, q.shape[1] // k.shape[1], seq_len // (2 * axis.size)
        q_pos = positions(seq_len, cp, axis.rank)  # on the host: the chunks' bounds, no device sync
        starts = _starts(q_doc, chunk)
        qf = q.float()
        out = torch.zeros(qf.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(qf.shape[:-1], NEG, dtype=torch.float32, device=q.device)
        for k_pos, kf, vf in _ring_steps(axis, k, v, seq_len, groups):
            for qs, ks, how in _pairs(q_pos, k_pos, q_doc, causal, chunk, q.device, starts):
                part, part_lse = _block_forward(qf[:, :, qs], kf[:, :, ks], vf[:, :, ks], scale, how,
                                                q_pos[qs], k_pos[ks], drop)
                _merge(out[:, :, qs], lse[:, :, qs], part, part_lse)
        ctx.save_for_backward(q, k, v, out, lse, q_doc)
        ctx.axis, ctx.seq_len, ctx.causal, ctx.scale, ctx.drop, ctx.starts = axis, seq_len, causal, scale, drop, starts
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, q_doc = ctx.saved_tensors
        axis, seq_len, causal, scale, starts = ctx.axis, ctx.seq_len, ctx.causal, ctx.scale, ctx.starts
        cp, groups, chunk, ring = axis.size, q.shape[1] // k.shape[1], seq_len // (2 * axis.size), _Ring(axis)
        q_pos = positions(seq_len, cp, axis.rank)
        qf, dout = q.float(), dout.float()
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(qf)
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)  # the held block's, so far
        sending = None  # the previous step's dK/dV on its way on, and the next block's coming in
        for k_pos, kf, vf in _ring_steps(axis, k, v, seq_len, groups):
            if sending is not None:
                ring.finish(sending[1])
                dkv = sending[0]
            dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
            for qs, ks, how in _pairs(q_pos, k_pos, q_doc, causal, chunk, q.device, starts):
                a, b, c = _block_backward(qf[:, :, qs], kf[:, :, ks], vf[:, :, ks], scale, how, q_pos[qs], k_pos[ks],
                                          out[:, :, qs], lse[:, :, qs], dout[:, :, qs], delta[:, :, qs], ctx.drop)
                dq[:, :, qs] += a
                dk[:, :, ks] += b
                dv[:, :, ks] += c
            dkv[0] += _fold(dk, groups)
            dkv[1] += _fold(dv, groups)
            (got,), works = ring.start([dkv])  # on with its block; after the last step, each block's comes home
            sending = (got, works, dkv)  # the sent tensor kept alive until its send is done
        ring.finish(sending[1])
        dkv = sending[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


def ring_attention(q, k, v, axis, seq_len: int, documents=None, causal: bool = True, scale: float | None = None,
                   dropout_p: float = 0.0):
    """Attention of this rank's queries against the whole sequence's keys and values, the blocks
    passed round the cp group `axis` (an `Axis`); `q`, `k`, `v` hold this rank's tokens of a
    sequence of `seq_len` (`positions`); `documents`: this rank's tokens' example starts (global
    indices), or None; `dropout_p`: attention dropout, its seed drawn from the default generator
    (the rank's stream)."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if documents is not None and not causal:
        raise ValueError("attention within packed examples is causal")
    if axis.size == 1:
        pos = torch.arange(seq_len, device=q.device)
        return attention(q, k, v, pos, pos, documents, causal, scale, dropout_p)
    drop = None
    if dropout_p:
        drop = Dropout(dropout_p, int(torch.randint(2**62, (), device=q.device)))
    return RingAttention.apply(q, k, v, documents, axis, seq_len, causal, scale, drop)


# -- Ulysses -------------------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """[batch, heads, local tokens, d] -> [batch, heads/cp, cp x local tokens, d] (rank order of
    the tokens), or back with `back`; its gradient is the other direction."""

    @staticmethod
    def forward(ctx, x, axis, back: bool):
        ctx.axis, ctx.back = axis, back
        return _all_to_all(x, axis, back)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), ctx.axis, not ctx.back), None, None


def _all_to_all(x: torch.Tensor, axis, back: bool) -> torch.Tensor:
    cp = axis.size
    traffic.sent += x.numel() * x.element_size() * (cp - 1) // cp  # its own share stays
    if not back:  # send head group j to rank j; receive every rank's tokens of this rank's heads
        b, h, n, d = x.shape
        send = x.reshape(b, cp, h // cp, n, d).permute(1, 0, 2, 3, 4).contiguous()
        got = torch.empty_like(send)
        dist.all_to_all_single(got, send, group=axis.group)
        return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * n, d)
    b, h, s, d = x.shape  # the reverse: every rank its tokens, of every head group
    n = s // cp
    send = x.reshape(b, h, cp, n, d).permute(2, 0, 1, 3, 4).contiguous()
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send, group=axis.group)
    return got.permute(1, 0, 2, 3, 4).reshape(b, cp * h, n, d)


def ulysses_attention(q, k, v, axis, seq_len: int, documents=None, causal: bool = True, scale: float | None = None,
                      dropout_p: float = 0.0):
    """Attention of this rank's tokens through a head split: an all-to-all gives each rank every
    token of heads/cp query heads and kv_heads/cp key/value heads (both divisible by cp), plain
    attention runs on them, and the reverse all-to-all brings back this rank's tokens; packed
    examples' starts (`documents`) are gathered over the group for the mask."""
    cp = axis.size
    if cp == 1:
        return ring_attention(q, k, v, axis, seq_len, documents, causal, scale, dropout_p)
    if q.shape[1] % cp or k.shape[1] % cp:
        raise ValueError(f"ulysses splits heads over cp {cp}: {q.shape[1]} heads and {k.shape[1]} key/value "
                         f"heads must both divide by it (ring splits any)")
    pos = torch.cat([positions(seq_len, cp, r, q.device) for r in range(cp)])  # the tokens' order after the exchange
    natural = torch.argsort(pos)
    qh, kh, vh = (_AllToAll.apply(t, axis, False).index_select(2, natural) for t in (q, k, v))
    groups = qh.shape[1] // kh.shape[1]
    mask = None
    if documents is not None:
        if not causal:
            raise ValueError("attention within packed examples is causal")
        parts = [torch.empty_like(documents) for _ in range(cp)]
        dist.all_gather(parts, documents.contiguous(), group=axis.group)
        whole = torch.cat(parts, dim=1).index_select(1, natural)
        order = torch.arange(seq_len, device=q.device)
        mask = _allowed(order, order, whole, True)
    # in the sequence's own order: the fused kernel's attention, no scores kept
    out = torch.nn.functional.scaled_dot_product_attention(
        qh, _expand(kh, groups), _expand(vh, groups), attn_mask=mask, dropout_p=dropout_p,
        is_causal=causal and mask is None, scale=scale)
    return _AllToAll.apply(out.index_select(2, pos), axis, True)


# -- sums over the whole sequence ------------------------------------------------------------------
# -- a rank's place in its cp group ----------------------------------------------------------------
@dataclass(frozen=True)
class ContextParallel:
    """What the model seam installs and the step runner uses: this rank's tokens of each sequence
    (`split`, `positions`) and attention across the split (`attend`) over the cp group `axis`."""

    axis: object  # the mesh's `cp` role (an `Axis`)
    mode: str  # "ring" or "ulysses"
    seq_len: int
    tp: int = 1  # the tensor-parallel size: a rank attends with its share of the heads

    def positions(self, device=None) -> torch.Tensor:
        return positions(self.seq_len, self.axis.size, self.axis.rank, device)

    def local_positions(self, t: int, device=None) -> torch.Tensor:
        """The global positions of a rank's `t` tokens, which must be its part of a whole sequence."""
        if t * self.axis.size != self.seq_len:
            raise ValueError(f"{t} tokens on a cp rank: its part of a sequence of {self.seq_len} over "
                             f"{self.axis.size} ranks is {self.seq_len // self.axis.size}")
        return self.positions(device)

    def split(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return split(t, self.axis.size, self.axis.rank, dim)

    def whole(self, part: torch.Tensor) -> torch.Tensor:
        """A sum over this rank's tokens of each sequence (a row's log-probability, say) made the
        whole sequence's: summed over the cp group. Every rank of the group then computes the
        same function of it (a pair loss), which counts once; its gradient goes back unchanged to
        each rank's part, the part its own tokens make."""
        return summed(part, self.axis)

    def check_heads(self, heads: int, kv_heads: int) -> None:
        """A ValueError for head counts `ulysses` cannot split over the cp group (a tensor-parallel
        rank's share of them: its heads, and its key/value heads or the one it keeps when there
        are fewer than tp)."""
        cp, tp = self.axis.size, self.tp
        local, local_kv = heads // tp, max(kv_heads // tp, 1)
        if self.mode == "ulysses" and (local % cp or local_kv % cp):
            where = f" a tensor-parallel rank's {local} heads / {local_kv} key/value heads" if tp > 1 else \
                f" {heads} heads / {kv_heads} key/value heads"
            raise ValueError(f"parallel.cp_mode: ulysses splits the attention heads over parallel.cp ({cp}), and"
                             f"{where} do not divide by it; use parallel.cp_mode=ring, which splits any")

    def kept_eager(self) -> "ContextParallel":
        """The same, its `attend` left out of `torch.compile`'s graphs (`train.compile`): the
        ring's and the all-to-all's collectives and autograd functions run as they are, and a
        compiled block is compiled in the pieces before and after its attention."""
        import torch

        out = dataclasses.replace(self)
        object.__setattr__(out, "attend", torch.compiler.disable(ContextParallel.attend.__get__(out)))
        return out

    def attend(self, q, k, v, dropout_p: float = 0.0, causal: bool = True, scale: float | None = None,
               documents=None):
        """Attention of this rank's tokens (`q`, `k`, `v`: [batch, heads, local tokens, head dim])
        against the whole sequence, with attention dropout `dropout_p` (training only: the caller
        passes 0 in eval); `documents` ([batch, local tokens], packed rows): where each token's
        example starts in the whole row, which its attention stays within."""
        fn = ring_attention if self.mode == "ring" else ulysses_attention
        return fn(q, k, v, self.axis, self.seq_len, documents, causal, scale, dropout_p)
