"""A rank's side of checkpointing: snapshot its shard and upload it in the background; load
(and reshard) its new shard from a committed checkpoint with ranged reads.

Flat-buffer coordinates make resharding arithmetic: a saved shard file holds the rank's owned
world ranges, concatenated. A checkpoint is read in global terms (`SavedIndex`): every
parameter's whole tensor, flattened, at an offset of its own; a saved piece is the run of
global elements it holds (for a tensor-parallel shard, the rows or columns of the whole tensor
its TP rank held). The new rank maps each range it now owns to global elements the same way,
through its own TP split, and reads just those bytes from the files that hold them. So a
checkpoint resumes at another world size, strategy or tensor-parallel size.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import torch

from rayzero.checkpoint.manifest import shard_name
from rayzero.checkpoint.shard_file import NAMES, ShardReader, write_shard
from rayzero.checkpoint.stages import stage_layouts
from rayzero.storage import Storage, StorageError, permanent
from rayzero.sharding.layout import Range
from rayzero.sharding.strategies import Strategy
from rayzero.sharding.tensor_parallel import Split

log = logging.getLogger(__name__)
READ_CHUNK = 16 << 20 >> 2  # elements per ranged read (16 MiB)
READ_THREADS = 8


def _pp(mesh) -> tuple[int, int]:
    """(pipeline stage, stages) of a mesh; (0, 1) for a mesh without a "pp" axis."""
    try:
        return mesh.coord("pp"), mesh.size("pp")
    except ValueError:
        return 0, 1


def layout_record(strategy: Strategy) -> dict:
    """The saved layout: enough to find any parameter element in the shard files. With
    pipeline stages, the layout of this rank's stage (`pp_rank`), which holds only its names."""
    lay = strategy.buffer.layout
    pp_rank, pp = _pp(strategy.mesh)
    return {
        "strategy": strategy.name,
        "world_size": strategy.mesh.world_size,
        "dp_outer": strategy.mesh.size("grad_replicate"),
        "outer_strategy": strategy.cfg.outer_strategy,
        "buckets": [[b.world.start, b.world.end] for b in lay.buckets],
        "param_order": list(strategy.buffer.names),
        "param_world": [[p.world.start, p.world.end] for p in lay.params],
        # tensor (and expert) parallelism: each split tensor's placement and global shape (the
        # manifest's `params` hold global shapes); a shard file's `tp_rank` (`ep_rank`) says
        # which slice it holds
        "tp": strategy.tp.record() if strategy.tp is not None else None,
        "pp_rank": pp_rank,
        "pp": pp,
    }


class ShardSaver:
    """Snapshots to host memory, then streams the shard from a background thread."""

    def __init__(self, strategy: Strategy, asynchronous: bool):
        self.strategy = strategy
        self.asynchronous = asynchronous
        self._thread: threading.Thread | None = None
        self._done: list[dict] = []
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.moved_at = time.monotonic()  # when the upload last handed a block to storage
        self.waiting = False  # the caller is blocked in wait()

    def _moved(self) -> None:
        self.moved_at = time.monotonic()

    def save(self, storage: Storage, step: int) -> float:
        """Wait for the previous upload, snapshot, start this one. Returns the seconds the
        caller was held (the training stall)."""
        t0 = time.perf_counter()
        self.wait()
        s = self.strategy
        opt = s.optimizer
        saved = s.pieces(saved=True)
        snapshot = {
            "main": _pick(torch.cat([m.detach().reshape(-1) for m in s.main_params]), saved).to("cpu", torch.float32),
            "exp_avg": _pick(opt.exp_avg.detach(), saved).to("cpu", copy=True),
            "exp_avg_sq": _pick(opt.exp_avg_sq.detach(), saved).to("cpu", copy=True),
        }
        rank, world = s.mesh.rank, s.mesh.world_size
        pp_rank = _pp(s.mesh)[0]  # the stage whose layout the pieces are in
        key = shard_name(rank, world)
        meta = {"step": str(step), "rank": str(rank)}
        pieces = [[r.start, r.end] for r, _ in saved]
        adam_steps = opt.step_count  # steps skipped by loss scaling do not count

        def upload():
            try:
                t = time.perf_counter()
                entry = _with_retries(storage, lambda: write_shard(storage, key, snapshot, meta, self._moved))
                with self._lock:
                    self._done.append({"step": step, "rank": rank, "tp_rank": s.mesh.coord("tp"),
                                       **({"ep_rank": s.mesh.coord("ep")} if s.mesh.size("ep") > 1 else {}),
                                       "pp_rank": pp_rank, "file": key,
                                       "pieces": pieces,
                                       "adam_steps": adam_steps, "upload_s": time.perf_counter() - t, **entry})
            except BaseException as e:  # reported to the controller on the next call
                self._error = e

        if self.asynchronous:
            self._thread = threading.Thread(target=upload, name=f"ckpt-upload-{step}", daemon=True)
            self._thread.start()
        else:
            upload()
            self._raise()
        return time.perf_counter() - t0

    def wait(self) -> None:
        if self._thread is not None:
            self.waiting = True
            try:
                self._thread.join()
            finally:
                self.waiting = False
            self._thread = None
        self._raise()

    def settle(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the upload in flight; whether none is left running. Its
        error, if any, stays for `reports` to raise."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return False
            self._thread = None
        return True

    def _raise(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            if isinstance(e, StorageError):  # the storage's failure, reported as one (which URI, what it said)
                raise UploadFailed(f"checkpoint upload failed: {e}") from e
            raise RuntimeError(f"checkpoint upload failed: {e}") from e

    def reports(self) -> list[dict]:
        """Uploads finished since the last call (and any upload error, raised)."""
        self._raise()
        with self._lock:
            out, self._done = self._done, []
        return out


class UploadFailed(StorageError):
    """A shard's upload failed for good: the message names the checkpoint's URI and the cause."""


def _with_retries(storage: Storage, fn):
    """The whole upload again, with backoff, on a transient storage error (it restarts the
    object: a stream cannot resume halfway); StorageError naming the URI once retries are spent,
    or at once where no retry can help (credentials, permissions, no such bucket)."""
    delay = 0.5
    for attempt in range(storage.retries + 1):
        try:
            return fn()
        except (OSError, pa.ArrowException) as e:
            if attempt == storage.retries or permanent(e):
                raise StorageError(f"uploading to {storage.uri}: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
            log.warning("checkpoint upload to %s failed (%s); retrying in %.1fs", storage.uri,
                        str(e).splitlines()[0] if str(e) else type(e).__name__, delay)
            time.sleep(delay)
            delay = min(delay * 2, 10.0)


def read_shard(strategy: Strategy, storage: Storage, manifest: dict) -> dict[str, torch.Tensor]:
    """This rank's main parameters and Adam moments from a checkpoint saved at any world size,
    strategy and tensor-parallel size, reading (and verifying) only the byte ranges that cover
    them. No collective runs here: a rank that fails leaves the others free to try another
    checkpoint."""
    index = SavedIndex(manifest)
    readers: dict[int, ShardReader] = {}

    def reader(f: int) -> ShardReader:
        if f not in readers:
            readers[f] = ShardReader(storage, manifest["shards"][f]["file"], manifest["shards"][f])
        return readers[f]

    opt = strategy.optimizer
    targets = {"main": torch.zeros(sum(m.numel() for m in strategy.main_params)),
               "exp_avg": torch.zeros_like(opt.exp_avg, device="cpu"),
               "exp_avg_sq": torch.zeros_like(opt.exp_avg_sq, device="cpu")}
    layout, names, tp = strategy.buffer.layout, strategy.buffer.names, strategy.tp
    copies = []  # (file, offset in the file's tensors, length, offset in this rank's shard)
    for own, local in strategy.pieces():
        for span in layout.params:
            cut = span.world.intersect(own)
            if cut is None:
                continue
            name = names[span.index]
            lo, dst = cut.start - span.world.start, local + (cut.start - own.start)
            split = tp.split.get(name) if tp is not None else None
            shape = tp.global_shape.get(name) if tp is not None else None
            size, place = tp.place(split) if split is not None else (1, 0)
            for g, n, d in global_runs(split, shape, size, place, lo, lo + cut.size):
                copies += index.locate(name, g, g + n, dst + d)
    # Parallel ranged reads of at most READ_CHUNK each: object stores serve several GETs at
    # once faster than one long one, and hashing (which releases the GIL) overlaps them.
    jobs = []
    for f, off, n, dsts in _coalesce(copies):
        for lo in range(0, n, READ_CHUNK):
            hi = min(lo + READ_CHUNK, n)
            part = [(max(s, lo) - lo, d + max(s, lo) - s, min(s + k, hi) - max(s, lo))
                    for s, d, k in dsts if s < hi and s + k > lo]
            jobs += [(f, name, off + lo, hi - lo, part) for name in NAMES]

    def run(job):
        f, name, start, length, part = job
        data = torch.frombuffer(bytearray(reader(f).read_bytes(name, start, start + length)), dtype=torch.float32)
        for src_rel, dst, k in part:
            targets[name][dst : dst + k] = data[src_rel : src_rel + k]

    for f in {j[0] for j in jobs}:
        reader(f)  # open (and verify the header of) each file once, before the threads
    with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
        list(pool.map(run, jobs))
    return targets


def _pick(flat: torch.Tensor, pieces: list[tuple[Range, int]]) -> torch.Tensor:
    """The elements of a rank's flat shard that `pieces` (range, offset) cover, in order."""
    if sum(r.size for r, _ in pieces) == flat.numel():
        return flat  # every piece: the shard as it is
    return torch.cat([flat[offset : offset + r.size] for r, offset in pieces]) if pieces else flat[:0]


def global_runs(split: Split | None, shape, tp: int, tp_rank: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """Local flat elements [lo, hi) of a parameter (a TP rank's slice when `split`) as runs of
    the whole tensor's flat elements: (global start, length, offset from lo)."""
    if split is None:
        return [(lo, hi - lo, 0)]
    out = []
    for local, glob, n in split.runs(tuple(shape), tp, tp_rank):
        a, b = max(lo, local), min(hi, local + n)
        if a < b:
            out.append((glob + a - local, b - a, a - lo))
    return out


class SavedIndex:
    """A checkpoint's saved elements in global terms: parameter `name`'s whole tensor, flat,
    sits at `offset[name]`; `locate` finds global elements in the shard files. Replicated
    parameters saved by several TP ranks are read from the first's files; a name saved by
    several pipeline stages (a tied embedding), from the lowest stage's. Each shard's pieces
    are in its stage's layout (`shard["pp_rank"]`, 0 in a checkpoint without stages)."""

    def __init__(self, manifest: dict):
        stages = stage_layouts(manifest["layout"])
        shapes = {p["name"]: p["shape"] for p in manifest["params"]}
        self.offset, off = {}, 0
        owner: dict[str, int] = {}  # name -> the stage whose copy is read
        for k, lay in enumerate(stages):
            for name, (start, end) in zip(lay["param_order"], lay["param_world"]):
                if name in owner:
                    continue
                owner[name], self.offset[name] = k, off
                off += _numel(shapes.get(name)) if name in shapes else end - start
        spans = [sorted((start, end, name) for name, (start, end) in zip(lay["param_order"], lay["param_world"]))
                 for lay in stages]
        pieces = []
        for f, shard in enumerate(manifest["shards"]):
            k = shard.get("pp_rank", 0)
            tp = stages[k].get("tp") or {"tp": 1, "split": {}}
            t, file_off = shard.get("tp_rank", 0), 0
            span_starts = [s[0] for s in spans[k]]
            for start, end in shard["pieces"]:
                i = max(bisect.bisect_right(span_starts, start) - 1, 0)
                while i < len(spans[k]) and spans[k][i][0] < end:
                    p_start, p_end, name = spans[k][i]
                    cut = Range(p_start, p_end).intersect(Range(start, end))
                    i += 1
                    if cut is None or not cut.size or owner[name] != k:
                        continue  # a lower stage's copy is read
                    placed = tp["split"].get(name)
                    split = Split.from_record(placed) if placed else None
                    if (split is None or split.axis != "tp") and t != 0:
                        continue  # replicated over TP: rank 0 of the group's copy
                    size, place = (tp.get("ep", 1), shard.get("ep_rank", 0)) if split is not None and \
                        split.axis == "ep" else (tp["tp"], t)
                    lo = cut.start - p_start
                    base = file_off + (cut.start - start)
                    for g, n, d in global_runs(split, shapes.get(name), size, place, lo, lo + cut.size):
                        pieces.append((self.offset[name] + g, self.offset[name] + g + n, f, base + d))
                file_off += end - start
        pieces.sort()
        self.pieces, self.starts = pieces, [p[0] for p in pieces]

    def locate(self, name: str, lo: int, hi: int, dst: int = 0) -> list[tuple[int, int, int, int]]:
        """Where global elements [lo, hi) of `name` are: (file, offset, length, dst + ...)."""
        base = self.offset[name]
        return locate_saved(base + lo, base + hi, dst, self.pieces, self.starts)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def apply_shard(strategy: Strategy, targets: dict[str, torch.Tensor], adam_steps: int) -> None:
    """Install what `read_shard` read; collective (parameters are made whole): every rank."""
    opt = strategy.optimizer
    with torch.no_grad():
        offset = 0
        for m in strategy.main_params:
            m.copy_(targets["main"][offset : offset + m.numel()].view_as(m))
            offset += m.numel()
        opt.exp_avg.copy_(targets["exp_avg"])
        opt.exp_avg_sq.copy_(targets["exp_avg_sq"])
    opt.step_count = adam_steps
    strategy.after_load()


def locate_saved(src: int, src_end: int, dst: int, pieces, starts) -> list[tuple[int, int, int, int]]:
    """Where saved world elements [src, src_end) are: (file, offset, length, destination)."""
    out = []
    i = bisect.bisect_right(starts, src) - 1
    while src < src_end:
        start, end, f, off = pieces[i] if i >= 0 else (0, 0, 0, 0)
        if not start <= src < end:
            raise ValueError(f"saved element {src} is in no shard: the manifest's pieces do not cover it")
        n = min(end, src_end) - src
        out.append((f, off + (src - start), n, dst))
        src, dst, i = src + n, dst + n, i + 1
    return out


def _coalesce(copies):
    """Join copies that read adjacent bytes of the same file into one read each: a rank at the
    same layout reads each of its pieces in one request."""
    runs = []
    for f, off, n, dst in sorted(copies):
        if runs and runs[-1][0] == f and runs[-1][1] + runs[-1][2] == off:
            run = runs[-1]
            run[3].append((run[2], dst, n))
            run[2] += n
        else:
            runs.append([f, off, n, [(0, dst, n)]])
    return runs
