"""The benchmarks page's sections: one function per stored result, which writes its section's
markdown (a table, a sentence of what it shows, the figures, and the line that says where, with
what, when and how it was measured) and draws its figures; and the at-a-glance table from all of
them. `benchmarks/figures.py` puts them on the page."""

from __future__ import annotations

import statistics

import matplotlib.pyplot as plt

ASSETS_LINK = "../assets/benchmarks"  # from the page
COLORS = ["#1f6fb4", "#e07b1a", "#2e9e44", "#c9352b", "#8a5cb8", "#7f7f7f", "#b5a22a", "#17a3b8", "#8c564b",
          "#e377c2", "#aec7e8", "#98df8a"]


def measured(r: dict) -> str:
    """Where, with what, when and how: the line under each section's table."""
    hw, v = r["hardware"], r["versions"]
    machine = ", ".join(hw["gpus"]) if hw["gpus"] else f"{hw['cores']} CPU cores ({hw['cpu']}), no GPU"
    names = {"python": "Python", "torch": "torch", "cuda": "CUDA", "ray": "Ray", "transformers": "transformers"}
    stack = ", ".join(f"{label} {v[k]}" for k, label in names.items() if v.get(k))
    note = " with uncommitted changes" if r.get("code_changed") else ""
    line = f"*{machine}; {stack}; {r['date']}, commit `{r['commit']}`{note}. Reproduce: `{r['command']}`*"
    return line + (f" *({r['source']})*" if r.get("source") else "")


def image(name: str, alt: str) -> str:
    return f"![{alt}]({ASSETS_LINK}/{name}.svg)"


def table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])



STRATEGY = {"no_shard": "DDP (`no_shard`)", "optim": "ZeRO-1 (`optim`)", "optim_grads": "ZeRO-2 (`optim_grads`)",
            "optim_grads_params": "ZeRO-3 (`optim_grads_params`)"}


def memory_block(r: dict):
    rows = r["results"]["rows"]
    by = {(x["strategy"], x["param_dtype"], x["d"]): x for x in rows}
    ds = sorted({x["d"] for x in rows})
    out = []
    for s in STRATEGY:
        for dtype in ("fp32", "bf16"):
            cells = [f"{by[s, dtype, d]['measured']:.2f} / {by[s, dtype, d]['formula']:g}" for d in ds]
            out.append([STRATEGY[s], dtype, *cells])
    n = rows[0]["num_params"]
    text = "\n\n".join([
        f"Model state in bytes per parameter, measured (every tensor the rank process holds) / the "
        f"formula, for the `{r['results']['preset']}` GPT ({n / 1e6:.1f}M parameters) at d data-parallel ranks:",
        table(["strategy", "dtype", *(f"d = {d}" for d in ds)], out), measured(r)])
    return text, {}


def gpu_block(r: dict):
    g = r["results"]
    z, c, cli = g["zero3"], g["compile"], g["cli"]
    runs = z["ratio_runs"]
    rows = [["ZeRO-3 bf16 step against plain torch (fused AdamW, autocast)", f"{z['model']}, {z['batch']}",
             f"median of runs {statistics.median(runs):.2f}× (runs {min(runs):.2f}–{max(runs):.2f}×; target "
             f"{z['target']}×)"],
            ["GPU busy a step", "the same", f"plain torch {z['gpu_busy_ms']['plain torch']} ms, rayzero "
             f"{z['gpu_busy_ms']['rayzero ZeRO-3']} ms of a {z['step_ms_range'][0]}–{z['step_ms_range'][1]} ms "
             "step: both bound by the host"],
            ["device memory per parameter", "the same, after 30 steps",
             f"{z['device_bytes_per_param']} bytes (ledger {z['ledger']:g}, formula {z['formula']:g})"],
            ["`train.compile` against eager", "the same", ", ".join(f"{x:.2f}×" for x in c["ratio_runs"])
             + f"; first compiled step {c['first_step_s'][0]}–{c['first_step_s'][1]} s, "
             f"{c['cached_first_step_s'][0]}–{c['cached_first_step_s'][1]} s from the caches"],
            ["`rayzero train` on one GPU", cli["model"], f"{cli['tokens_per_s']:,} tokens/s, {cli['step_ms']} ms a "
             f"step, first step {cli['first_step_s']} s after the launch"],
            ["`tests/gpu`", "", f"{g['tests']['passed']} passed in {g['tests']['seconds'][0]} s"]]
    return "\n\n".join([table(["what", "model and batch", "result"], rows), measured(r)]), {}


def _stacked(ax, bars: list[tuple[str, list[tuple[str, float]]]], unit: str = "s") -> None:
    """Horizontal bars, one per row, each split into its named segments in order; a legend of the
    segment names, each name one colour wherever it appears."""
    names = list(dict.fromkeys(n for _, segs in bars for n, _ in segs))
    color = {n: COLORS[i % len(COLORS)] for i, n in enumerate(names)}
    for i, (label, segs) in enumerate(bars):
        left = 0.0
        for n, v in segs:
            ax.barh(i, v, left=left, color=color[n], edgecolor="white", linewidth=0.5, label=n)
            left += v
        ax.text(left, i, f"  {left:.1f} {unit}", va="center", fontsize=8)
    ax.set_yticks(range(len(bars)), [label for label, _ in bars])
    ax.invert_yaxis()
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    ax.legend([seen[n] for n in names], names, fontsize=7, ncol=min(len(names), 6), loc="lower center",
              bbox_to_anchor=(0.5, 1.0), frameon=False)


STARTUP_SHOWN = {"local": "rayzero, starting a local Ray", "join": "rayzero, joining a running Ray",
                 "join_no_mlflow": "rayzero, joining, tracking.enabled=false"}


def _median_stages(rows: list[dict]) -> list[tuple[str, float]]:
    keys = list(dict.fromkeys(k for row in rows for k in row["stages"]))
    return [(k.removesuffix("_s").replace("_", " "), statistics.median(row["stages"].get(k, 0.0) for row in rows))
            for k in keys]


def startup_block(r: dict):
    res, med = r["results"], r["results"]["median"]
    torchrun, ray_train = med["torchrun_first_step_s"], med["ray_train_first_step_s"]
    rows = [[label, f"{med[f'{n}_first_step_s']:.2f}", f"{med[f'{n}_ratio']:.2f}×", f"{med[f'{n}_ray_train_ratio']:.2f}×"]
            for n, label in STARTUP_SHOWN.items()]
    rows += [["torchrun, DDP", f"{torchrun:.2f}", "1.00×", f"{torchrun / ray_train:.2f}×"],
             ["Ray Train `TorchTrainer`, starting a local Ray", f"{ray_train:.2f}", f"{ray_train / torchrun:.2f}×", "1.00×"]]
    first_line = max(med[f"{n}_first_line_s"] for n in STARTUP_SHOWN)
    rounds = len(res["torchrun"])
    text = "\n\n".join([
        table(["run", "launch to the first step's end (s)", "against torchrun", "against Ray Train"], rows),
        f"Medians of {rounds} rounds. rayzero's first status line comes {first_line:.2f} s after the launch; a "
        "mistake in the config, the data or the model is said before Ray starts.",
        image("startup", "The first minute, stage by stage"), measured(r)])
    bars = [(label, _median_stages(res["rayzero"][n])) for n, label in STARTUP_SHOWN.items() if n != "join_no_mlflow"]
    bars += [("torchrun, DDP", _median_stages(res["torchrun"])),
             ("Ray Train, starting a local Ray", _median_stages(res["ray_train"]))]
    fig, ax = plt.subplots(figsize=(9, 2.6))
    _stacked(ax, bars)
    ax.set_xlabel("seconds from the launch to the end of the first step")
    return text, {"startup": fig}


RECOVERY_STAGES = {"detection": "detection", "replacement": "replacement (restart or spare)",
                   "load": "checkpoint load", "first_step": "first step after"}


def recovery_block(r: dict):
    res = r["results"]
    med = {int(k): v for k, v in res["median_kill"].items()}
    kills = sum(1 for row in res["rows"] if row["how"] == "kill" and row["spares"] == 0)
    steady = statistics.median(row["steady_step"] for row in res["rows"])
    rows = [[label, f"{med[0][k]:.2f}", f"{med[1][k]:.2f}"] for k, label in RECOVERY_STAGES.items()]
    rows.append(["**kill to the next finished step**", f"**{med[0]['total']:.2f}**", f"**{med[1]['total']:.2f}**"])
    text = "\n\n".join([
        table(["stage (s)", "no spare", "one warm spare"], rows),
        f"Medians of {kills} kills each; a steady step takes {steady:.2f} s. Without a spare the replacement is a "
        "restart: the group's processes torn down, placed and started again, and their rendezvous. With one, the "
        "spare is already running and joins the survivors.",
        image("recovery", "A recovery from a killed rank, stage by stage"), measured(r)])
    fig, ax = plt.subplots(figsize=(9, 1.9))
    _stacked(ax, [(label, [(RECOVERY_STAGES[k], med[s][k]) for k in RECOVERY_STAGES])
                  for s, label in ((0, "no spare"), (1, "one warm spare"))])
    ax.set_xlabel("seconds from the kill")
    return text, {"recovery": fig}


def _cp_label(mode: str, cp: int) -> str:
    return "cp 1" if cp == 1 else f"{mode} cp {cp}"


def long_context_block(r: dict):
    res = r["results"]
    rows = res["rows"]
    by = {(x["mode"], x["cp"], x["length"]): x for x in rows}
    lengths = sorted({x["length"] for x in rows})
    runs = sorted({(x["mode"], x["cp"]) for x in rows}, key=lambda m: (m[1], m[0]))
    out = []
    for mode, cp in runs:
        cells = []
        for n in lengths:
            x, base = by.get((mode, cp, n)), by[("-", 1, n)]
            cells.append("" if x is None else f"{x['activations'] / 2**20:.1f} MiB, {x['step_s'] / base['step_s']:.2f}×")
        out.append([_cp_label(mode, cp), *cells])
    equal = all(x["sent"] == x["formula"] for x in rows)
    cap = res["cap_mib"]
    fits = []
    for key, fit in res["fits"].items():  # "ring cp 2", "- cp 1"
        mode, cp = key.rsplit(" cp ", 1)
        fits.append(f"{_cp_label(mode, int(cp))} about {fit['extrapolated']:,}")
    fits = ", ".join(fits)
    text = "\n\n".join([
        table(["run", *(f"{n:,} tokens" for n in lengths)], out),
        "Each cell: a rank's activations, and the step time against cp 1's at the same length. "
        + ("The bytes each rank sends equal the formula at every point. " if equal else "")
        + f"The longest sequence whose activations fit {cap:g} MiB a rank (activations grow linearly with a rank's "
        f"tokens): {fits} tokens.",
        image("long_context", "Activations a rank against the sequence length, by cp"), measured(r)])
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for i, (mode, cp) in enumerate(runs):
        xs = [n for n in lengths if (mode, cp, n) in by]
        ax.plot(xs, [by[mode, cp, n]["activations"] / 2**20 for n in xs], marker="o", color=COLORS[i % len(COLORS)],
                linestyle="-" if mode != "ulysses" else "--", label=_cp_label(mode, cp))
    ax.axhline(cap, color="#7f7f7f", linewidth=0.8, linestyle=":")
    ax.text(lengths[0], cap, f" cap {cap:g} MiB", va="bottom", fontsize=7, color="#555555")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
    ax.set_xlabel("tokens a sequence")
    ax.set_ylabel("activations a rank (MiB)")
    ax.legend(fontsize=7, frameon=False)
    return text, {"long_context": fig}


def moe_block(r: dict):
    rows = r["results"]["rows"]
    base = {x["world"]: x for x in rows if x["ep"] == 1}
    out = []
    for x in rows:
        b = base[x["world"]]
        out.append([x["world"], x["ep"], x["experts"], f"{x['state'] / 2**20:.2f} ({x['state'] / x['formula']:.3f}×)",
                    f"{x['gathered'] / 2**20:.2f}", f"{x['sent'] / 2**20:.2f}", f"{x['step_s'] / b['step_s']:.2f}×"])
    text = "\n\n".join([
        table(["ranks", "ep", "local experts", "model state a rank, MiB (against the formula)",
               "parameters gathered a step (MiB)", "tokens sent a step (MiB)", "step time against ep 1"], out),
        "`loop`: the family's own loop over a rank's experts; `grouped`: one grouped matmul per projection "
        "(`moe.grouped_mm`). On CPU ranks that share 2 cores the all-to-alls cost more than a small model's expert "
        "arithmetic saves, so the step is slower at ep > 1; what expert parallelism buys is the bytes: the "
        "parameters gathered fall by the experts' share.", measured(r)])
    return text, {}


def grpo_block(r: dict):
    x = r["results"]
    split = ", ".join(f"{k} {v:.0f} ms" for k, v in x["split_ms"].items())
    text = "\n\n".join([
        table(["GRPO step, the guide's task", "rayzero (2 ranks + 1 rollout actor)", "TRL (one process)", "rayzero / TRL"],
              [["step time (median)", f"{x['rayzero_step_ms']:.0f} ms", f"{x['trl_step_ms']:.0f} ms", f"{x['ratio']:.2f}×"],
               ["completion tokens / s", f"{x['rayzero_completion_tokens_per_s']:,.0f}",
                f"{x['trl_completion_tokens_per_s']:,.0f}",
                f"{x['rayzero_completion_tokens_per_s'] / x['trl_completion_tokens_per_s']:.2f}×"]]),
        f"rayzero's step: {split}. The guide's model is tiny (2 layers of width 64, 4 tokens a completion): "
        "each step is fixed costs, the Ray calls of the weight sync and of the rollout actor and the ranks' "
        "gloo collectives, which TRL's single process does not pay. They do not grow with the model; "
        "generation and the update do.", measured(r)])
    return text, {}


def grpo_lag_block(r: dict):
    x = r["results"]
    k = x["lag"]
    rows = [[f"{e} engine", f"{v['generate_ms']:.0f} ms", f"{v['update_ms']:.0f} ms",
             f"{v['sync_ms'] + v['score_ms']:.0f} ms", f"{v['step_lag0_ms']:.0f} ms",
             f"{v['bound_ms']:.0f} ms ({v['step_over_bound']:.2f}×)",
             f"{v['overlap_bound_ms']:.0f} ms ({v['step_over_overlap_bound']:.2f}×)",
             f"{v[f'step_lag{k}_ms']:.0f} ms", f"{v['speedup']:.2f}×"] for e, v in x["engines"].items()]
    text = "\n\n".join([
        table(["engine", "generate", "update", "sync + score", "step at lag 0",
               f"max(generate, update) + sync + score (lag {k} over it)",
               f"max(generate, update + sync + score) (lag {k} over it)", f"step at lag {k}",
               "lag 0 / lag " + str(k)], rows),
        "The waiting engine's generation is a sleep, as a GPU engine's is to the host: the overlap hides "
        "the shorter of generation and update, and the sync too, which the actors stage while they generate. The CPU engine computes on the same 2 cores as the ranks, so "
        "overlapping them shares the cores rather than hiding one behind the other.", measured(r)])
    return text, {}


def long_tail_block(r: dict):
    x = r["results"]
    rows = [[name, f"{v['seconds']:.2f} s", f"{v['tokens_per_s']:,.0f}", f"{v['steps']:.0f}",
             f"{v['over_groups']:.2f}×"] for name, v in x["arms"].items()]
    text = "\n\n".join([
        table([f"one round: {x['prompts']} prompts × {x['group']} completions, up to {x['max_tokens']} tokens",
               "round (median)", "completion tokens / s", "decode steps", "over a group at a time"], rows),
        "A group's batch runs until its longest completion ends, and so does one padded batch of the whole "
        "round; a continuous batch gives a finished completion's row to the next one at once, so the long "
        "tail holds up one row each. Each arm draws from the same distribution; the group-at-a-time and "
        "continuous arms draw each completion from its own seed (here the same completions), `generate` others.", measured(r)])
    return text, {}


def partial_block(r: dict):
    x = r["results"]
    rows = []
    for name, v in x["arms"].items():
        over = v["over_finish"]
        rows.append([f"`{v['partial']}`, {v['slots']} rows", f"{v['seconds']:.2f} s ({over['seconds']:.2f}×)",
                     f"{v['steps']:,} ({over['steps']:.2f}×)", f"{v['occupancy']:.0%}",
                     f"{v['tokens']:,} of {v['sampled']:,}"])
    text = "\n\n".join([
        table([f"`rollout.partial`: {x['rounds']} rounds of {x['prompts']} prompts × {x['group']} on one actor",
               "time (over finish)", "decode steps (over finish)", "rows in use", "tokens kept of sampled"], rows),
        "`finish` runs each round's batch until its last completion ends, its free rows idle meanwhile; "
        "`continue` and `restart` hand what is still sampling on to the next round's batch, which fills the "
        "rows at once. `restart` samples the handed-on completions again from their start, so it spends "
        "tokens it throws away. On a GPU a decode step costs about the same with any number of rows, so "
        "the decode steps are the figure that carries over (not measured on a GPU here); on 2 CPU cores a "
        "step's time grows with its rows.",
        measured(r)])
    return text, {}


def grpo_mismatch_block(r: dict):
    x = r["results"]
    rows = [[name, f"{v['mean']:.3f} ({v['min']:.3f}–{v['max']:.3f})", f"{v['sampling_kl']:.4f}",
             f"{v['logp_difference_max']:.2f}"] for name, v in x["arms"].items()]
    text = "\n\n".join([
        table(["the guide's task, 60 steps", f"reward over the last 10 steps: mean (min–max over {x['seeds']} seeds)",
               "sampling/kl (mean)", "largest logp difference"], rows),
        "The hotter sampler draws at 1.6 times the run's temperature and reports its own log-probabilities "
        "(`benchmarks/engines.py:HotEngine`). On this task the truncated correction does not win back the "
        "reward a hotter sampler costs: it reweighs the tokens the sampler drew, but the samples themselves "
        "are worse, and at this size the spread between seeds is as large as the difference.", measured(r)])
    return text, {}


def checkpoint_block(r: dict):
    tp, st = r["results"]["throughput"], r["results"]["stall"]
    rounds = tp["rounds"]
    rows = [["save a rank's shard (safetensors, a SHA-256 per block)",
             f"{statistics.median(x['save_mb_s'] for x in rounds):.0f} MB/s",
             f"{statistics.median(x['raw_save_mb_s'] for x in rounds):.0f} MB/s", f"{tp['save_ratio']:.2f}×"],
            ["load it back (ranged, verified reads)", f"{statistics.median(x['load_mb_s'] for x in rounds):.0f} MB/s",
             f"{statistics.median(x['raw_load_mb_s'] for x in rounds):.0f} MB/s", f"{tp['load_ratio']:.2f}×"]]
    stall = statistics.median(st["stall_s"])
    text = "\n\n".join([
        table(["what", "rayzero", "raw `pyarrow.fs`", "rayzero / raw"], rows),
        f"A shard of {tp['bytes'] / 2**30:.2f} GiB (the `medium` GPT's fp32 parameters and Adam moments), "
        f"{len(rounds)} rounds. Training goes on while a checkpoint uploads: a step is held "
        f"{stall * 1e3:.0f} ms for the snapshot ({st['stall_over_copy']:.2f}× the copy alone, "
        f"{st['stall_over_step']:.1%} of a step of the `small` GPT).", measured(r)])
    return text, {}


def activations_block(r: dict):
    res = r["results"]
    first = res["rounds"][0]
    rows = [[f"`{m}`", f"{statistics.median(x[m]['activations_mib'] for x in res['rounds']):.0f} MiB "
             f"(estimate {res['estimate_mib'][m]:.0f})", f"{v['activations_mib']:.2f}×", f"{v['step_s']:.2f}×",
             f"{v['peak_rss_mib']:.2f}×"] for m, v in res["ratios"].items() if m in first]
    text = "\n\n".join([
        table(["`model.activation_checkpointing`", "activations a rank", "against `none`", "step time against `none`",
               "peak memory against `none`"], rows),
        f"An HF Llama of {res['num_params'] / 1e6:.0f}M parameters at 1,024 tokens a sequence, 2 ranks, ZeRO-3, "
        f"fp32, medians of {len(res['rounds'])} rounds; the estimate is the one `--dry-run` prints.", measured(r)])
    return text, {}


PEER = {"rayzero no_shard": "DDP", "rayzero optim": "DDP", "rayzero optim_grads": "DDP",
        "rayzero optim_grads_params": "FSDP2", "Ray Train DDP": "DDP", "Ray Train FSDP2": "FSDP2"}
RAY_TRAIN = {"DDP": "Ray Train DDP", "FSDP2": "Ray Train FSDP2"}


def _run_label(run: str) -> str:
    return STRATEGY.get(run.removeprefix("rayzero "), run) if run.startswith("rayzero ") else run


class StepTimes:
    """`step_time.py`'s grid: its points, the runs it holds, and each run's step-time ratio to its
    peer at a point (the median over rounds)."""

    def __init__(self, res: dict):
        self.cells = {tuple(k.split("|")): c for k, c in res["cells"].items()}
        self.points = [p["name"] for p in res["points"]]
        self.runs = [run for run in PEER if any((p, run) in self.cells for p in self.points)]

    def ratio(self, point: str, run: str) -> float | None:
        c = self.cells.get((point, run))
        key = "ratio_fsdp2" if PEER[run] == "FSDP2" else "ratio_ddp"
        return statistics.median(c[key]) if c and c[key] else None

    def median(self, run: str) -> float:
        """The run's median ratio over the grid."""
        return statistics.median(x for x in (self.ratio(p, run) for p in self.points) if x is not None)


def step_time_block(r: dict):
    res = r["results"]
    grid = StepTimes(res)
    cells, points, runs, ratio = grid.cells, grid.points, grid.runs, grid.ratio
    rows = []
    for run in runs:
        got = [x for x in (ratio(p, run) for p in points) if x is not None]
        line = [_run_label(run), PEER[run], f"{grid.median(run):.2f}×", f"{min(got):.2f}–{max(got):.2f}×"]
        ray = RAY_TRAIN[PEER[run]]
        if run.startswith("rayzero ") and ray in runs:
            versus = [a / b for a, b in ((ratio(p, run), ratio(p, ray)) for p in points) if a and b]
            line.append(f"{statistics.median(versus):.2f}×")
        else:
            line.append("")
        rows.append(line)
    rss = [cells[p, run]["peak_rss_mib"] / cells[p, PEER[run]]["peak_rss_mib"] for p in points for run in runs
           if run.startswith("rayzero ") and (p, run) in cells and (p, PEER[run]) in cells]
    rounds = res["rounds"]
    text = "\n\n".join([
        table(["run", "against", "median over the grid", "range over the grid", "against Ray Train's"], rows),
        f"Step time at each of {len(points)} points, {rounds} round{'s' if rounds > 1 else ''} each, the ratio to "
        f"the peer in the same round. Peak memory per rank against the peer's: {min(rss):.2f}–{max(rss):.2f}×.",
        image("step_time", "Step-time ratio to the peer at each point of the grid"), measured(r)])

    fig, ax = plt.subplots(figsize=(10, 0.45 * len(runs) + 1.6))
    values = [[ratio(p, run) for p in points] for run in runs]
    shown = [[float("nan") if x is None else x for x in row] for row in values]
    im = ax.imshow(shown, cmap="RdYlGn_r", vmin=0.6, vmax=1.4, aspect="auto")
    for i, row in enumerate(values):
        for j, x in enumerate(row):
            if x is not None:
                ax.text(j, i, f"{x:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(points)), [p.replace("/", "\n") for p in points], fontsize=7)
    ax.set_yticks(range(len(runs)), [f"{_run_label(run).replace('`', '')} / {PEER[run]}" for run in runs])
    ax.set_title("step time against the peer, at each point (model / tokens a micro-batch / accumulation)")
    fig.colorbar(im, ax=ax, fraction=0.02, pad=0.01, label="ratio (under 1: faster)")
    return text, {"step_time": fig}


def dispatch_block(r: dict):
    res = r["results"]
    rows = res["results"]
    by = {(x["ranks"], x["nodes"], x["dispatch"]): x for x in rows}
    out = []
    for ranks, nodes in sorted({(x["ranks"], x["nodes"]) for x in rows}):
        flat, merged = by.get((ranks, nodes, "flat")), by.get((ranks, nodes, "merged"))
        out.append([ranks, nodes, f"{flat['median_ms']:.2f}" if flat else "", f"{merged['median_ms']:.2f}" if merged else ""])
    m = res["model"]
    text = "\n\n".join([
        table(["ranks", "nodes", "every rank's result read (ms)", "merged per node (ms)"], out),
        f"The driver's own work: {m['a_ms']:.3f} ms an iteration + {m['b_ms_per_output']:.3f} ms per result it "
        f"reads; a node's merge {m['m_ms_per_merged_result']:.4f} ms per rank. Modelled at 1,024 ranks on 128 "
        f"nodes: **{m['merged_ms']:.1f} ms** an iteration merged per node, against {m['flat_ms']:.1f} ms reading "
        f"every rank ({m['flat_ms'] / m['merged_ms']:.0f}×). The table is end to end on one machine, where every "
        "simulated node's merger and every rank share its cores: there merging costs more than it saves; what it "
        "saves on a cluster is the driver's own work, which grows with the results it reads.", measured(r)])
    return text, {}


def glance_block(results: dict[str, dict]):
    """One line per section: its headline figure, from the same stored results."""
    rows = []
    if "step_time" in results:
        grid = StepTimes(results["step_time"]["results"])
        rows.append(["[steady step](#steady-step-against-torchrun-fsdp2-and-ray-train)",
                     f"DDP (`no_shard`) {grid.median('rayzero no_shard'):.2f}× torchrun DDP's step; ZeRO-3 "
                     f"{grid.median('rayzero optim_grads_params'):.2f}× FSDP2's (medians over the grid)",
                     "2 ranks, CPU"])
    su = results["startup"]["results"]["median"]
    rows.append(["[first minute](#the-first-minute)",
                 f"first step {su['join_first_step_s']:.1f} s after the launch joining a running Ray "
                 f"({su['join_ratio']:.2f}× torchrun), {su['local_first_step_s']:.1f} s starting one "
                 f"({su['local_ray_train_ratio']:.2f}× Ray Train's)", "2 ranks, CPU"])
    rc = {int(k): v for k, v in results["recovery"]["results"]["median_kill"].items()}
    rows.append(["[recovery](#recovery-from-a-lost-rank)", f"kill to the next step {rc[1]['total']:.1f} s with a warm "
                 f"spare, {rc[0]['total']:.1f} s without", "4 ranks, CPU"])
    mem = results["memory"]["results"]["rows"]
    worst = max(abs(x["measured"] / x["formula"] - 1) for x in mem)
    rows.append(["[memory](#memory-per-parameter-against-the-formula)",
                 f"every strategy's model state within {worst:.2%} of the published formula", "2 and 4 ranks"])
    if "activations" in results:
        full = results["activations"]["results"]["ratios"]["full"]
        rows.append(["[activation checkpointing](#activation-checkpointing)", f"`full`: {full['activations_mib']:.2f}× "
                     f"the activations for {full['step_s']:.2f}× the step time",
                     f"{results['activations']['results']['num_params'] / 1e6:.0f}M Llama, 2 ranks, CPU"])
    if "checkpoint" in results:
        tp, st = results["checkpoint"]["results"]["throughput"], results["checkpoint"]["results"]["stall"]
        rows.append(["[checkpoints](#checkpoints)", f"save {tp['save_ratio']:.2f}×, load {tp['load_ratio']:.2f}× raw "
                     f"`pyarrow.fs` on S3; an async checkpoint holds a step {st['stall_over_step']:.1%} of its time",
                     "one rank, CPU"])
    if "dispatch" in results:
        m = results["dispatch"]["results"]["model"]
        rows.append(["[dispatch](#dispatch-cost-at-scale)", f"{m['merged_ms']:.1f} ms of driver time an iteration "
                     "modelled at 1,024 ranks on 128 nodes", "measured to 32 ranks"])
    moe = results["moe"]["results"]["rows"]
    ep = max((x for x in moe if x["ep"] > 1), key=lambda x: x["world"])
    one = next(x for x in moe if x["world"] == ep["world"] and x["ep"] == 1)
    rows.append(["[mixtures of experts](#mixtures-of-experts)", f"ep {ep['ep']}: {ep['gathered'] / one['gathered']:.2f}× "
                 "the parameters gathered a step of ep 1", f"{ep['world']} ranks, CPU"])
    if "grpo" in results:
        g = results["grpo"]["results"]
        line = f"GRPO step {g['ratio']:.2f}× TRL's `GRPOTrainer`'s on a tiny task (fixed Ray and gloo costs)"
        if "grpo_lag" in results:
            lag = results["grpo_lag"]["results"]
            waiting = next(v for e, v in lag["engines"].items() if e.startswith("waiting"))
            line += f"; generating {lag['lag']} round ahead {waiting['speedup']:.2f}× faster with an engine that waits"
        if "long_tail" in results:
            best = min(results["long_tail"]["results"]["arms"].values(), key=lambda v: v["over_groups"])
            line += f"; a continuous batch {best['over_groups']:.2f}× a group at a time's round"
        rows.append(["[online RL](#online-rl-grpo)", line, "CPU"])
    lc = results["long_context"]["results"]
    top = max(x["length"] for x in lc["rows"])
    act = {(x["mode"], x["cp"]): x["activations"] for x in lc["rows"] if x["length"] == top}
    cps = sorted({cp for _, cp in act if cp > 1})
    rows.append(["[long context](#long-context)", f"activations a rank at {top:,} tokens: " + ", ".join(
        f"{act['ring', cp] / act['-', 1]:.2f}× cp 1's at cp {cp}" for cp in cps), "ring attention, CPU"])
    z = results["gpu_checks"]["results"]["zero3"]
    rows.append(["[on a GPU](#on-a-gpu)", f"ZeRO-3 bf16 {statistics.median(z['ratio_runs']):.2f}× plain torch's step "
                 "(host-bound at 85M)", "one H200"])
    return table(["question", "answer", "where"], rows), {}


BLOCKS = {"step_time": step_time_block, "startup": startup_block, "recovery": recovery_block,
          "dispatch": dispatch_block, "moe": moe_block, "grpo": grpo_block,
          "grpo_lag": grpo_lag_block, "grpo_mismatch": grpo_mismatch_block,
          "long_tail": long_tail_block, "partial": partial_block, "long_context": long_context_block,
          "checkpoint": checkpoint_block, "activations": activations_block, "memory": memory_block, "gpu_checks": gpu_block}
