"""What `rayzero train` prints: a dry run's plan (`--dry-run`) and a finished run's summary,
one line per topic, from the dicts `plan` and `run_train` return (which `--summary-json`
writes as they are)."""

from __future__ import annotations

import math



def print_plan(p: dict) -> None:
    from rayzero.jobs.pipeline_plan import pipeline_lines

    elastic = f" (down to {p['world_sizes'][-1]} if the cluster shrinks)" if len(p["world_sizes"]) > 1 else ""
    bundle = ", ".join(f"{v:g} {k}" for k, v in p["bundle"].items())
    hybrid = f", {p['dp_outer']} replicas" if p["dp_outer"] > 1 else ""
    mem = p["memory"]
    ck = p["checkpoint"]
    print(
        f"plan (dry run: nothing started)\n"
        f"  {p['world_size']} ranks{elastic} of {bundle} each, on {p['cluster']}\n"
        f"  strategy {p['strategy']}{hybrid}; params {p['param_dtype']}, grads {p['grad_dtype']}\n"
        + ("".join(f"  {line}\n" for line in p["mesh"]) if p["tp"] > 1 or p.get("cp", 1) > 1 or p.get("ep", 1) > 1
           or p.get("pipeline") else "")
        + (f"  {_experts_line(p)}\n" if p.get("experts") else "")
        + (f"  context parallel {p['cp']} ({p['cp_mode']}): each rank holds 1/{p['cp']} of every sequence's tokens "
           f"(chunks i and {2 * p['cp'] - 1}-i of {2 * p['cp']}), attention across them; gradients reduced over "
           f"data-parallel x cp\n" if p.get("cp", 1) > 1 else "")
        + ("".join(f"  {line}\n" for line in pipeline_lines(p["pipeline"])) if p.get("pipeline") else "")
        + ("  sequence parallel: norms and residuals on 1/tp of the sequence\n" if p["sequence_parallel"] else "")
        + ("  vocabulary parallel: embedding, head and logits split over the tp ranks, the loss on the shards\n"
           if p["tp"] > 1 and p["vocab_parallel"] else "")
        + (f"  note: {p['vocab_note']}\n" if p.get("vocab_note") else "")
        + f"  model {_model_line(p)}\n"
        + (f"  {p['model']['lora']}\n" if p["model"].get("lora") else "")
        + (f"  {_params_line(p['num_params'], p['trainable_params'])}"
           + (f" ({p['params_per_rank']:,} on each rank: its tensor-parallel share)" if p["tp"] > 1 else "")
           + "; model state per rank "
           f"{mem['bytes_per_param']:.2f} bytes/parameter = {mem['bytes_per_rank'] / 2**20:,.1f} MiB (Megatron's "
           f"formula, before padding and activations)\n" if p["num_params"] else
           f"  model state per rank {mem['bytes_per_param']:.2f} bytes/parameter (Megatron's formula)\n")
        + (f"  {_activations_line(mem)}\n" if mem.get("activations_bytes") is not None else "")
        + (f"  {_compile_line(p)}\n" if p.get("compile") else "")
        + (f"  {p['objective']['line']}\n" if (p.get("objective") or {}).get("line") else "")
        + (f"  {p['rollouts']['line']}\n" if (p.get("rollouts") or {}).get("line") else "")
        + (f"  {_buckets_line(p['buckets'])}\n" if p["buckets"]["numel"] else "")
        + f"  {p['global_batch_size']} sequences per step = {p['dp_size']} "
        + ("data-parallel ranks" if p["dp_size"] < p["world_size"] else "ranks") + f" x {p['grad_accum']} "
        f"micro-batches x {p['micro_batch_size']}; {p['tokens_per_step']:,} tokens per step, {p['steps']} steps\n"
        f"  {p['schedule']}\n"
        + (f"  {p['defaults']}\n" if p.get("defaults") else "")
        + (f"  length: {p['length']}\n" if p.get("length") else "")
        + f"  data {p['data']}" + (f" ({p['data_note']})" if p.get("data_note") else "") + "\n"
        + (f"  note: {p['cut']}\n" if p.get("cut") else "")
        + (f"  checkpoints every {ck['every_steps']} steps to {ck['dir']} (resume {ck['resume']})\n" if ck
           else "  checkpoints off\n")
        + (f"  {_start_line(ck['start'], ck['resume'])}\n" if ck and ck.get("start") else "")
        + f"  mlflow {p['tracking'] or 'off'}\n"
        f"  restarts up to {p['failure']['max_restarts']} (-1: unlimited), phase watchdog "
        f"{p['failure']['phase_timeout_s']:g} s"
        + (f", {_spares_words(p['failure'])}" if p["failure"].get("spares") else "")
    )


def _start_line(r: dict, mode: str) -> str:
    """Where the run starts, as the run itself will say it (`mode`: checkpoint.resume)."""
    if r.get("note"):
        return f"where it starts: {r['note']}"
    if r["from"] is None:
        return f"starts at step 0 of {r['of']}: " + ("checkpoint.resume=none" if mode == "none" else
                                                      "no checkpoint to resume yet")
    if r["nothing_to_train"]:
        return f"nothing to train: {r['from']} is at step {r['step']}, train.steps={r['of']}"
    return f"resuming from {r['from']} at step {r['step']} of {r['of']}"


def _spares_words(f: dict) -> str:
    """The warm spares asked for, and how many would be placed where that was measured."""
    n, room = f["spares"], f.get("spare_room") or {}
    asked = f"{n} warm spare{'s' if n > 1 else ''}"
    if room.get("fit") is None:
        return f"{asked}, room {room.get('on', 'not measured')}" if room else asked
    if room["fit"] >= n:
        return f"{asked}, room for {'them' if n > 1 else 'it'} on {room['on']}"
    fit = room["fit"]
    return (f"{asked} asked, but {'none' if not fit else f'only {fit}'} can be placed on {room['on']}: the run "
            f"would go on with{'out spares' if not fit else f' {fit}'}")


def _rewards_line(s: dict) -> str:
    """Preference tuning's last rewards, train and validation (nothing for other runs)."""
    out = ""
    for key, prefix, what in (("final_preferences", "", "rewards"), ("final_val_preferences", "val_", "validation")):
        r = s.get(key)
        if r:
            out += (f"; {what}: margin {r[prefix + 'rewards/margins']:.4f}, accuracy "
                    f"{r[prefix + 'rewards/accuracies']:.2f}")
    return out


def _activations_line(mem: dict) -> str:
    act = mem["activations_bytes"]
    total = (f"; model state + activations {(mem['bytes_per_rank'] + act) / 2**20:,.1f} MiB per rank"
             if mem["bytes_per_rank"] else "")
    return (f"activations {act / 2**20:,.1f} MiB a micro-batch (estimated from the model's shape; activation "
            f"checkpointing {mem['activation_checkpointing']}){total}")


def _compile_line(p: dict) -> str:
    """`train.compile`'s line: the backend, what stays eager, where inductor's caches go."""
    line = (f"each block compiled (torch.compile, {p['compile']}) at the first step; the embedding, head, loss "
            "and sharding hooks eager")
    if p["compile"] != "inductor":  # aot_eager generates no code to cache
        return line
    where = p.get("compile_cache") or "the run directory's compile_cache"
    return f"{line}; inductor's caches in {where}"


def _buckets_line(b: dict) -> str:
    n = b["numel"]
    if b["per_unit"]:
        rule = "one per FSDP unit"
    elif b["bucket_numel"] == "auto":
        rule = "bucket_numel auto"
    else:
        rule = f"bucket_numel {b['bucket_numel']:,}"
    return (f"{len(n)} communication bucket{'s' if len(n) > 1 else ''} ({rule}), {min(n):,} to {max(n):,} "
            f"elements, reduced in the order backward fills them")


def _model_line(p: dict) -> str:
    m = p["model"]
    if m["note"]:
        return f"{m['kind']} from {m['source']}: {m['note']}"
    from rayzero.models import spec_class

    return spec_class(m["kind"]).plan_line(m)


def _experts_line(p: dict) -> str:
    e = p["experts"]
    drop = (f"at most {e['capacity_factor']:g} x an even share of pairs an expert, the rest dropped"
            if e["capacity_factor"] else "dropless")
    return (f"expert parallel {p['ep']}: each rank holds {e['local']} of the {e['total']} experts of every MoE layer "
            f"({e['params_per_rank']:,} expert parameters, {e['bytes_per_param']:.2f} bytes each), their gradients "
            f"reduced over the {e['reduce_over']} rank(s) holding the same experts; tokens sent to their experts by "
            f"all-to-all, {drop}")


def _params_line(total: int, trainable: int) -> str:
    frozen = total - trainable
    return f"{total:,} parameters" + (f" ({frozen:,} frozen)" if frozen else "")


PARTS = ("torch_compile_s",)  # start-up timings inside a stage (the first step's), not stages of their own


def startup_line(t: dict) -> str:
    """Where the wait for the first step went, stage by stage (the status lines' stages)."""
    stages = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1f}" for k, v in t.items() if k not in ("total_s", *PARTS))
    parts = "".join(f", of which {k[:-2].replace('_', ' ')} {t[k]:.1f} s" for k in PARTS if k in t)
    return f"first step done {t['total_s']:.1f} s after the start ({stages} s{parts})"


def print_summary(s: dict) -> None:
    if s["steps"] == 0:
        why = (f"the run stopped early after step {s['stopped_early']['step']}: {s['stopped_early']['reason']}; "
               "train.early_stopping_patience=0 trains on" if s.get("stopped_early") else
               f"it is at step {s['start_step']} of train.steps={s['total_steps']}")
        print(f"\nnothing to train: {s['checkpoint']}: {why}")
        return
    phases = "  ".join(f"{k} {v:.1f}" for k, v in s["phase_ms"].items())
    mem = s["memory"]
    per_param = "  ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in mem["bytes_per_param"].items()
                          if k != "frozen_params" or v)
    resumed = f" (resumed at step {s['start_step']})" if s["resumed_from"] else ""
    ranks = f"{s['world_size']} ranks" + ("" if s["world_size"] == s["num_workers"] else f" (of {s['num_workers']})")
    print(
        f"\ntrained {s['steps']} steps{resumed}: loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}"
        + (f", validation loss {s['final_val_loss']:.4f}" if s.get("final_val_loss") is not None else "")
        + (f" (perplexity {math.exp(min(s['final_val_loss'], 700)):.2f})"
           if s.get("final_val_loss") is not None and "final_preferences" not in s else "")
        + _rewards_line(s)
        + (f"; router load-balancing loss {s['final_router_aux_loss']:.4f}"
           if s.get("final_router_aux_loss") is not None else "")
        + (f", z-loss {s['final_router_z_loss']:.4f}" if s.get("final_router_z_loss") is not None else "") + "\n"
        f"  {ranks}, strategy {s['strategy']}" + (f", tensor parallel {s['tp']}" if s.get("tp", 1) > 1 else "")
        + (f", pipeline {s['pp']} stages ({s.get('pp_schedule')})" if s.get("pp", 1) > 1 else "")
        + f", {_params_line(s['num_params'], s['trainable_params'])}, "
        f"{s['grad_accum']} micro-batches/step\n"
        f"  {s['tokens_per_s']:,.0f} tokens/s ({s['tokens_per_s_per_rank']:,.0f} per rank"
        + (f", MFU {s['mfu']:.1%} of the {s['device']}'s dense bf16 peak" if s.get("mfu") is not None else "")
        + f"), {s['step_ms']:.1f} ms/step ({phases} ms)\n"
        f"  memory per rank, bytes/parameter: {per_param}; transient peak "
        f"{mem['transient_bytes'] / 2**20:.1f} MiB; activations {mem['activations_peak_bytes'] / 2**20:.1f} MiB "
        f"a micro-batch at their peak"
        + (f"; reference model {mem['reference_bytes'] / 2**20:.1f} MiB" if mem.get("reference_bytes") else "") + "\n"
        + (f"  {s['skipped_steps']} steps skipped by loss scaling\n" if s["skipped_steps"] else "")
        + "".join(f"  {'replacement' if f['decision'] == 'replace' else 'restart'} {i}: {f['message']}; "
                  f"{f['decision']} at {f['world_size']} ranks, "
                  f"training again {f['timings'].get('total_s', 0):.1f}s later\n"
                  for i, f in enumerate(s["failures"], 1))
        + "".join(f"  grew from {r['from']} to {r['to']} ranks at step {r['step']}\n" for r in s["resizes"])
        + (f"  stopped early after step {s['stopped_early']['step']}: {s['stopped_early']['reason']}\n"
           if s.get("stopped_early") else "")
        + (f"  {startup_line(s['startup'])}\n" if s.get("startup") else "")
        + (f"  checkpoint {s['checkpoint']}\n" if s["checkpoint"] else "")
        + (f"  best checkpoint {s['best_checkpoint']} (validation loss {s['best_val_loss']:.4f})\n"
           if s.get("best_checkpoint") else "")
        + f"  run dir {s['run_dir']}\n"
        + (f"  mlflow run {s['mlflow_run_id']} at {s['mlflow_tracking_uri']}" if s["mlflow_run_id"]
           else f"  mlflow at {s['mlflow_tracking_uri']} did not answer" if s["mlflow_tracking_uri"] else "  mlflow off")
        + (f"; unsent metrics in {s['mlflow_unsent']}" if s["mlflow_unsent"] else "")
        + (f"\n  weights {s['final_weights']}" if s["final_weights"] else "")
    )
