"""What the controller reports: each step's metrics (to MLflow and the run's history) from the
ranks' results, and the run's summary at the end."""

from __future__ import annotations

from statistics import mean

from rayzero.cluster.throughput import throughput
from rayzero.sharding.memory import bytes_per_param


def step_metrics(results: list[dict], phase: dict[str, float], dt: float, tokens_per_step: int, world: int,
                 rate: dict, micro: int, objective=None) -> dict:
    """One iteration's metrics from every rank's results: `phase` the slowest rank's seconds in
    each phase, `dt` the iteration's wall time, `rate` its throughput (`throughput`), `micro`
    the micro-batches a step, `objective` the run's (its metrics, each merged as it declares)."""
    metrics = {
        "loss": sum(r["loss_sum"] for r in results) / sum(r["tokens"] for r in results),
        "skipped_step": float(results[0]["skipped"]),  # fp16 loss scaling found inf/NaN: no update
        "lr": results[0]["lr"],
        "grad_norm": results[0]["grad_norm"],
        "tokens_per_s": tokens_per_step / dt,
        "tokens_per_s_per_rank": tokens_per_step / dt / world,
        "step_ms": dt * 1e3,
        # Wall time outside the slowest rank's phases: dispatch, transfer, waiting.
        "dispatch_overhead_ms": max(0.0, dt - sum(phase.values())) * 1e3,
        # The ranks' reading of their rows (a step ahead, in a thread): part of gather.
        "data_ms": max(r["phase_s"].get("data", 0.0) for r in results) * 1e3,
        **{f"phase_{p}_ms": v * 1e3 for p, v in phase.items()},
    }
    if rate["mfu"] is not None:
        metrics["mfu"] = rate["mfu"]
    if results[0]["loss_scale"] is not None:
        metrics["loss_scale"] = results[0]["loss_scale"]
    if objective is not None and results[0].get("objective"):  # the objective's own (DPO's: by TRL's names)
        metrics.update(objective.step_metrics(results[0]["objective"], sum(r["tokens"] for r in results)))
    if results[0].get("aux_loss_sum") is not None:  # a mixture of experts: its router's loss, apart
        metrics["router_aux_loss"] = sum(r["aux_loss_sum"] for r in results) / micro
    if results[0].get("z_loss_sum") is not None:  # and its z-loss (`moe.router_z_loss`), apart too
        metrics["router_z_loss"] = sum(r["z_loss_sum"] for r in results) / micro
    if results[0].get("experts"):  # expert parallelism: the busiest expert against the mean, pairs dropped,
        metrics.update(results[0]["experts"])  # all-to-all bytes (merged over the ranks: `results.merge`)
    return metrics


def last_of(rows: list[dict], keys) -> dict | None:
    """`keys` of the last row that has them (None: none has)."""
    row = next((r for r in reversed(rows) if keys[0] in r), None)
    return {k: row[k] for k in keys if k in row} if row is not None else None


def objective_finals(objective, rows: list[dict]) -> dict:
    """An objective's last metrics in the summary: final_<summary> and final_val_<summary>."""
    names = objective.metric_names()
    if not objective.summary or not names:
        return {}
    return {f"final_{objective.summary}": last_of(rows, names),
            f"final_val_{objective.summary}": last_of(rows, objective.metric_names("val_"))}


def run_summary(cfg, rec, h, ckpt, early, tracker, run_dir: str, objective=None) -> dict:
    """The run's summary (what `--summary-json` writes and `Result.summary` holds), from the
    run record `rec` and history `h` at the end of `fit`, the checkpoints `ckpt` (None: off),
    the early-stopping policy, the tracker and the objective (its metrics' last values, under
    its `summary` name). `rec.build`: the whole model's (`whole_build`)."""
    info, mesh = rec.build, cfg.mesh(rec.world)
    trained = bool(h.losses)
    step_s = mean(h.timed(h.step_s)) if trained else None
    memory = h.memory or [info["memory"]]
    tokens_per_s = cfg.train.global_batch_size * cfg.train.seq_len / step_s if trained else None
    rate = throughput(tokens_per_s, rec.world, info["flops_per_token"], info["device_name"]) if trained else {}
    best = ckpt.best if ckpt is not None else None
    first_start = rec.first_start or (0, None)
    return {
        "first_loss": h.losses[0] if trained else None,
        "final_loss": h.losses[-1] if trained else None,
        "final_val_loss": h.val_losses[-1] if h.val_losses else None,
        # a mixture of experts: the router's load-balancing loss (its mean over the last step's
        # micro-batches), which joins the training loss weighted by router_aux_loss_coef
        "final_router_aux_loss": next((r["router_aux_loss"] for r in reversed(h.rows) if "router_aux_loss" in r),
                                      None),
        **({"final_router_z_loss": next((r["router_z_loss"] for r in reversed(h.rows) if "router_z_loss" in r), None)}
           if cfg.moe.router_z_loss else {}),
        # expert parallelism: the last step's busiest expert against the mean (1: even), pairs dropped
        **({"final_expert_load": last_of(h.rows, ["expert_load_max_over_mean", "dropped_pairs"])}
           if mesh.size("ep") > 1 else {}),
        # the objective's metrics, the last step's and the last validation's (DPO's: final_preferences)
        **(objective_finals(objective, h.rows) if objective is not None else {}),
        "val_losses": [[s, v] for s, v in zip(h.val_steps, h.val_losses)],
        "steps": len(h.losses),
        "start_step": first_start[0],
        "total_steps": cfg.train.steps,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_rank": rate.get("tokens_per_s_per_rank"),
        "mfu": rate.get("mfu"),  # None on a CPU or a device whose peak is not known
        "model_flops_per_token": info["flops_per_token"],
        "device": info["device_name"],
        "step_ms": step_s * 1e3 if trained else None,
        "phase_ms": {p: mean(h.timed(v)) * 1e3 for p, v in h.phase_s.items()} if trained else {},
        "data_ms": mean(h.timed(data_ms)) if (data_ms := [r["data_ms"] for r in h.rows if "data_ms" in r
                                                         and r["step"] >= first_start[0]]) else None,
        "world_size": rec.world,
        "num_workers": cfg.cluster.num_workers,
        "strategy": cfg.sharding.strategy,
        "tp": mesh.size("tp"),
        "pp": info.get("pp", 1),  # pipeline stages; each stage's own figures under "stages"
        "pp_schedule": cfg.parallel.pp_schedule if info.get("pp", 1) > 1 else None,
        "stages": info.get("stages"),  # None without stages (`checkpoint/stages.py`)
        "sequence_parallel": cfg.parallel.sequence_parallel,
        # the embedding, head and logits split over the TP ranks (what the ranks built, not only what was asked)
        "vocab_parallel": bool((info.get("tp") or {}).get("vocab_parallel")),
        "grad_accum": cfg.grad_accum_for(cfg.mesh(rec.world)),
        "num_params": info["num_params"],
        "trainable_params": info["trainable_params"],
        "backend": info["backend"],
        "dispatch": cfg.cluster.dispatch,
        "mlflow_run_id": tracker.run_id,
        "mlflow_tracking_uri": tracker.uri,
        "mlflow_unsent": tracker.spilled_to,
        "run_dir": run_dir,
        "final_weights": cfg.train.save_final or None,
        "skipped_steps": h.skipped,
        "resumed_from": first_start[1],
        "checkpoint": ckpt.last_committed if ckpt is not None else None,
        "checkpoints_committed": ckpt.commits if ckpt is not None else 0,
        "best_checkpoint": best.uri if best is not None else None,
        "best_val_loss": best.manifest["metrics"]["val_loss"] if best is not None else None,
        "stopped_early": ({"step": early.stopped_after, "reason": early.stopped}
                          if early.stopped else None),
        "schedule_steps": rec.schedule_steps,
        "restarts": len(rec.failures),
        "failures": [f.record() for f in rec.failures],
        "resizes": rec.resizes,
        "replacements": rec.replacements,
        "memory": {
            "bytes_per_param": bytes_per_param(memory, info["params_per_rank"]),
            "transient_bytes": max(r["transient_peak"] for r in memory),
            # what a micro-batch's forward leaves saved for its backward, at its peak (the most on any rank)
            "activations_peak_bytes": max(r.get("activations_peak", 0) for r in memory),
            # preference tuning: the frozen reference model beside the model state (0: none held)
            "reference_bytes": max(r.get("reference_params", 0) for r in memory),
            "per_rank": memory,
            "param_dtype": cfg.sharding.param_dtype,
            "grad_dtype": cfg.sharding.grad_dtype,
        },
    }
