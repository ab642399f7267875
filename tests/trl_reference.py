"""The references for `train.objective=dpo` and for instruction fine-tuning: TRL's own
`DPOTrainer` and `SFTTrainer` (trl 1.16), run on CPU in fp32 on a model directory and a list of
records, with everything that could differ from a plain step pinned down (`pinned`). `trl_dpo`
and `trl_sft` return what TRL logged at every step and the weights it ended with, for a test to
set beside a rayzero run of the same settings.

What is pinned, and why (each is a TRL or `transformers.Trainer` default that differs from a
plain DPO step, or from rayzero's defaults):

- fp32 throughout: `bf16=False` (TRL's `DPOConfig` defaults it to True), `fp16=False`,
  `use_cpu=True`; the model loaded in float32 (`model_init_kwargs={"dtype": "float32"}`).
- `gradient_checkpointing=False` (TRL defaults it to True); dropout off (`disable_dropout=True`,
  TRL's default, sets every `nn.Dropout`'s p to 0: the model's and LoRA's own).
- The optimizer is `torch.optim.AdamW` (`optim="adamw_torch"`, or `"adamw_torch_fused"`, the
  Trainer's default on torch >= 2.8, which is the same update by the fused kernel rayzero
  runs), betas `adam_betas`, eps `adam_eps`, weight decay on every parameter but biases and
  norm gains (the Trainer's rule by name: for Llama exactly the 1-D parameters, rayzero's
  `dim() >= 2` rule). `lr_scheduler_type="constant"`, no warmup. The gradient is clipped
  to `max_grad_norm` by `torch.nn.utils.clip_grad_norm_` (0 = no clipping).
- One optimizer step per batch of `pairs_per_step` pairs: `per_device_train_batch_size =
  pairs_per_step`, no gradient accumulation, `max_steps = steps`, and the batches taken in
  order (`train_sampling_strategy="sequential"`): step k trains on records [k P, (k+1) P)
  modulo len(records). `len(records) == pairs_per_step` trains every step on the same pairs.
- `max_length` is TRL's: prompt + completion, each of chosen and rejected cut to it keeping
  the start (rayzero's `train.seq_len + 1`).
"""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# TRL's metrics that `trl_dpo` returns for every step (besides the Trainer's own `loss`,
# `grad_norm` and `learning_rate`)
DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected")
LOSSES = ("sigmoid", "ipo", "hinge", "robust")


def lora_config(lora: Any):
    """A `peft.LoraConfig` from one, or from rayzero's `model.lora` keys as a dict
    (`r`, `alpha`, `dropout`, `target_modules`, `modules_to_save`)."""
    from peft import LoraConfig

    if isinstance(lora, LoraConfig):
        return lora
    lora = dict(lora)
    targets = lora.pop("target_modules", None) or None
    saved = lora.pop("modules_to_save", None) or None
    return LoraConfig(r=lora.pop("r", 8), lora_alpha=lora.pop("alpha", 16.0), lora_dropout=lora.pop("dropout", 0.0),
                      target_modules=list(targets) if targets else None,
                      modules_to_save=list(saved) if saved else None, task_type="CAUSAL_LM", **lora)


def pinned(out: str, *, lr: float, optim: str, adam_betas: tuple[float, float], adam_eps: float, weight_decay: float,
           max_grad_norm: float, batch: int, steps: int, seed: int) -> dict:
    """The `TrainingArguments` both references pin (see the module doc): fp32 on the CPU, no
    gradient checkpointing, a constant learning rate without warmup, the optimizer's settings,
    one optimizer step per `batch` records taken in order, every step logged, nothing saved."""
    return dict(
        output_dir=out, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        model_init_kwargs={"dtype": "float32"},
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
        optim=optim, adam_beta1=adam_betas[0], adam_beta2=adam_betas[1], adam_epsilon=adam_eps,
        weight_decay=weight_decay, max_grad_norm=max_grad_norm,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, max_steps=steps,
        train_sampling_strategy="sequential", dataloader_drop_last=False, dataloader_num_workers=0,
        seed=seed, data_seed=seed,
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True,
    )


def trl_dpo(model_dir, tokenizer_dir, records: list[dict], *, steps: int, pairs_per_step: int, lr: float,
            beta: float = 0.1, loss: str = "sigmoid", label_smoothing: float = 0.0, max_length: int | None,
            lora: Any = None, precompute: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 1.0,
            adam_betas: tuple[float, float] = (0.9, 0.999), adam_eps: float = 1e-8, optim: str = "adamw_torch",
            seed: int = 0, lora_init_dir: str | None = None) -> dict:
    """Train with TRL's `DPOTrainer` for `steps` steps of `pairs_per_step` pairs from `records`
    (dicts of `prompt`, `chosen`, `rejected`: strings, or conversations as TRL takes them).

    `lora`: a `peft.LoraConfig` or a dict of rayzero's `model.lora` keys; TRL's reference is
    then the base with the adapters off. `lora_init_dir`: where to save the adapters as PEFT
    initialized them (TRL seeds PEFT with `seed`), for the other side to start from.

    Returns a dict:
      `metrics`: one dict per step of `loss`, `grad_norm` (before clipping), `learning_rate`
        and `DPO_METRICS`, as TRL logged them;
      `state_dict`: the final weights by the model's `state_dict()` names (with LoRA: the
        adapters merged into the base);
      `tokenized`: the records as TRL tokenized them (`prompt_ids`, `chosen_ids`,
        `rejected_ids`, before `max_length` cuts them);
      `sequences`: what TRL's collator trains on per record: `chosen` and `rejected`, the token
        ids of prompt + completion cut to `max_length`, and `prompt_len` (the completion's
        tokens are those from it on; padding and the model's shift are TRL's own);
      with LoRA also `adapter` (the final adapters by the names PEFT saves,
      `base_model.model.<module>.lora_A.weight`), `adapter_init` (the initial ones),
      `peft_state_dict` (the PEFT model's own names, `…lora_A.default.weight`).
    """
    import datasets
    import transformers
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    if loss not in LOSSES:
        raise ValueError(f"loss: TRL's DPOTrainer has no {loss!r} here; one of {LOSSES} (ORPO is trl.experimental)")
    if len(records) % pairs_per_step:
        raise ValueError(f"{len(records)} records are not whole batches of {pairs_per_step} pairs")
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()

    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(
            **pinned(out, lr=lr, optim=optim, adam_betas=adam_betas, adam_eps=adam_eps, weight_decay=weight_decay,
                     max_grad_norm=max_grad_norm, batch=pairs_per_step, steps=steps, seed=seed),
            beta=beta, loss_type=[loss], label_smoothing=label_smoothing, max_length=max_length,
            truncation_mode="keep_start", precompute_ref_log_probs=precompute, disable_dropout=True,
        )
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        trainer = DPOTrainer(model=str(model_dir), args=args, train_dataset=datasets.Dataset.from_list(records),
                             processing_class=tokenizer,
                             peft_config=lora_config(lora) if lora is not None else None)
        if len(trainer.train_dataset) != len(records):
            # TRL drops a pair whose prompt alone fills max_length: the batches would shift
            raise ValueError(f"TRL kept {len(trainer.train_dataset)} of {len(records)} records "
                             f"(a prompt of max_length={max_length} tokens or more is dropped)")
        tokenized = [{k: list(r[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
                     for r in trainer.train_dataset]
        cut = slice(None, max_length)
        sequences = [{"chosen": (t["prompt_ids"] + t["chosen_ids"])[cut],
                      "rejected": (t["prompt_ids"] + t["rejected_ids"])[cut], "prompt_len": len(t["prompt_ids"])}
                     for t in tokenized]
        result: dict[str, Any] = {"tokenized": tokenized, "sequences": sequences}
        peft = lora is not None
        if peft:
            from peft import get_peft_model_state_dict

            result["adapter_init"] = {k: v.detach().clone() for k, v in get_peft_model_state_dict(trainer.model).items()}
            if lora_init_dir:
                trainer.model.save_pretrained(lora_init_dir)
        trainer.train()

    logged = [e for e in trainer.state.log_history if "loss" in e and "step" in e]
    if [e["step"] for e in logged] != list(range(1, steps + 1)):
        raise AssertionError(f"TRL logged steps {[e['step'] for e in logged]}, not 1..{steps}")
    result["metrics"] = [{k: e[k] for k in ("loss", "grad_norm", "learning_rate", *DPO_METRICS)} for e in logged]
    model = trainer.model
    if peft:
        from peft import get_peft_model_state_dict

        result["adapter"] = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
        result["peft_state_dict"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model = copy.deepcopy(model).merge_and_unload()
    result["state_dict"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return result


def trl_sft(model_dir, records: list[dict], *, steps: int, lr: float, max_length: int = 1024, lora: Any = None,
            weight_decay: float = 0.0, max_grad_norm: float = 1.0, adam_betas: tuple[float, float] = (0.9, 0.999),
            adam_eps: float = 1e-8, optim: str = "adamw_torch", seed: int = 0,
            lora_init_dir: str | None = None) -> dict:
    """Train with TRL's `SFTTrainer` for `steps` steps, every one on all of `records` (TRL's
    conversational prompt-completion records: `prompt` the turns before the assistant's,
    `completion` its turn), each example padded on its own (TRL's default: no packing), the loss
    on the completion only, summed over the step's completion tokens and divided by their count.
    Pinned as `trl_dpo` pins DPO: fp32 on the CPU, no gradient checkpointing, `constant` schedule
    without warmup, `optim`, `adam_betas`, `adam_eps`, `weight_decay` (not on biases and norms),
    `max_grad_norm`. `lora`, `lora_init_dir`: as for `trl_dpo`.

    Returns {"metrics": per step `loss`, `grad_norm` as TRL logged them; "state_dict": the final
    weights (with LoRA the adapters merged in); "tokenized": each record's `input_ids` and
    `labels` (-100 off the completion) as TRL made them}."""
    import datasets
    import transformers
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(
            **pinned(out, lr=lr, optim=optim, adam_betas=adam_betas, adam_eps=adam_eps, weight_decay=weight_decay,
                     max_grad_norm=max_grad_norm, batch=len(records), steps=steps, seed=seed),
            max_length=max_length, packing=False, completion_only_loss=True,
        )
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        trainer = SFTTrainer(model=str(model_dir), args=args, train_dataset=datasets.Dataset.from_list(records),
                             processing_class=tokenizer,
                             peft_config=lora_config(lora) if lora is not None else None)
        result: dict[str, Any] = {"tokenized": [{k: list(r[k]) for k in ("input_ids", "labels") if k in r}
                                                for r in trainer.train_dataset]}
        if lora is not None and lora_init_dir:
            trainer.model.save_pretrained(lora_init_dir)
        trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e and "step" in e]
    if [e["step"] for e in logged] != list(range(1, steps + 1)):
        raise AssertionError(f"TRL logged steps {[e['step'] for e in logged]}, not 1..{steps}")
    result["metrics"] = [{k: e[k] for k in ("loss", "grad_norm")} for e in logged]
    model = trainer.model
    if lora is not None:
        model = copy.deepcopy(model).merge_and_unload()
    result["state_dict"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return result


GRPO_METRICS = ("loss", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy",
                "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length")


def trl_grpo(model_dir, prompts: list[dict], reward_funcs: list, *, steps: int, prompts_per_step: int,
             num_generations: int, max_completion_length: int, replay_path, lr: float, loss_type: str = "dapo",
             beta: float = 0.0, num_iterations: int = 1, epsilon: float = 0.2, epsilon_high: float | None = None,
             scale_rewards: str = "group", temperature: float = 1.0, mask_truncated_completions: bool = False,
             reward_weights: list[float] | None = None, lora: Any = None, lora_init_dir: str | None = None,
             weight_decay: float = 0.0, max_grad_norm: float = 1.0, seed: int = 0) -> dict:
    """Train with TRL's `GRPOTrainer` for `steps` optimizer steps on `prompts` (TRL's prompt-only
    records), each step's generation batch in one micro-batch (`prompts_per_step` x
    `num_generations` completions). The completions are TRL's own hook for supplied ones
    (`rollout_func`): token ids drawn from a generator seeded per round (some ending in EOS, some
    cut at `max_completion_length`), each round written to `replay_path` as rayzero's replay
    engine reads it ({round, prompt, prompt_ids, index, completion_ids}), in TRL's order.

    Returns {"metrics": per step `GRPO_METRICS` as TRL logged them, "state_dict": the final
    weights (LoRA merged in)}."""
    import json

    import datasets
    import torch
    import transformers
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    special = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(len(tokenizer)) if i not in special]
    lines: list[str] = []
    rounds = [0]

    def rollout(batch_prompts, trainer):
        """Each row's completion: random ordinary tokens, EOS last for about half of them."""
        r = rounds[0]
        rounds[0] += 1
        gen = torch.Generator().manual_seed(1000 + r)
        seen: dict[str, int] = {}
        prompt_ids, completion_ids, logprobs = [], [], []
        for p in batch_prompts:
            ids = tokenizer(p, add_special_tokens=False)["input_ids"]
            index = seen.get(p, 0)
            seen[p] = index + 1
            n = int(torch.randint(1, max_completion_length + 1, (1,), generator=gen))
            comp = [ordinary[int(k)] for k in torch.randint(len(ordinary), (n,), generator=gen)]
            if n < max_completion_length or bool(torch.rand((), generator=gen) < 0.5):
                comp[-1] = tokenizer.eos_token_id
            prompt_ids.append(ids)
            completion_ids.append(comp)
            logprobs.append([0.0] * len(comp))
            lines.append(json.dumps({"round": r, "prompt": p, "prompt_ids": ids, "index": index,
                                     "completion_ids": comp}))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    with tempfile.TemporaryDirectory() as out:
        base = pinned(out, lr=lr, optim="adamw_torch", adam_betas=(0.9, 0.999), adam_eps=1e-8,
                      weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                      batch=prompts_per_step * num_generations, steps=steps, seed=seed)
        base.pop("train_sampling_strategy")
        args = GRPOConfig(**base, num_generations=num_generations, max_completion_length=max_completion_length,
                          steps_per_generation=1, loss_type=loss_type, beta=beta, num_iterations=num_iterations,
                          epsilon=epsilon, epsilon_high=epsilon_high, scale_rewards=scale_rewards,
                          temperature=temperature, mask_truncated_completions=mask_truncated_completions,
                          reward_weights=reward_weights, disable_dropout=True, log_completions=False)
        import os

        os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
        trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward_funcs, args=args,
                              train_dataset=datasets.Dataset.from_list(prompts), processing_class=tokenizer,
                              peft_config=lora_config(lora) if lora is not None else None, rollout_func=rollout)
        if lora is not None and lora_init_dir:
            trainer.model.save_pretrained(lora_init_dir)
        trainer.train()
    Path(replay_path).write_text("".join(line + "\n" for line in lines))
    logged = [e for e in trainer.state.log_history if "loss" in e and "step" in e]
    if [e["step"] for e in logged] != list(range(1, steps + 1)):
        raise AssertionError(f"TRL logged steps {[e['step'] for e in logged]}, not 1..{steps}")
    model = trainer.model
    if lora is not None:
        model = copy.deepcopy(model).merge_and_unload()
    return {"metrics": [{k: e.get(k) for k in GRPO_METRICS} for e in logged],
            "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()}}
