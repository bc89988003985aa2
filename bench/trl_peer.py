"""TRL's ``GRPOTrainer`` on a flowrl recipe's job, for the benchmarks that compare with it.

`run_trl` trains the recipe's model (the directory `flowrl.run.prepare_model` gives: the same
build, loaded with transformers) on the recipe's task and reward with TRL, in this process on
the CPU with ``threads`` torch threads (default `DEFAULT_THREADS`, one, as each of flowrl's
compute processes has: on two cores that other work shares, two threads made TRL's steps 10-30
times slower, each thread waiting for the other, descheduled one at every operation), with
the same group size (``num_generations``), prompts per optimizer step, micro-batches per step
(``gradient_accumulation_steps``: one ``generate`` call per step, then the step's micro-batches),
response length, temperature and top-p, learning rate and its schedule (warm-up, constant or
cosine down to ``lr · min_lr_ratio``), gradient clipping, weight decay, clip range and KL weight,
computing in float32 without gradient checkpointing (flowrl's trainer; not TRL's defaults).
TRL's defaults give GRPO's advantages (group mean and std) and a loss averaged over all tokens
of the step, as flowrl's GRPO with ``loss_agg="token_mean"``. What cannot match: TRL is
synchronous, so a recipe's ``max_staleness`` has no counterpart, and it draws prompts in its own
order. TRL is optional: `unavailable` says why it cannot run; bench/README.md shows how to
install it beside flowrl in a separate venv.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.runner import library_versions
from flowrl.recipe import Recipe

#: the libraries a TRL figure depends on, reported beside it
LIBRARIES = ("trl", "transformers", "torch", "accelerate", "datasets")
DEFAULT_THREADS = 1


def unavailable() -> str | None:
    """Why TRL cannot run in this interpreter, or None when it can."""
    try:
        import trl  # type: ignore[import-not-found]  # noqa: F401
    except ImportError as e:
        return f"trl not importable ({e}); see bench/README.md"
    return None


def describe_error(e: BaseException) -> str:
    """A short line for a failure inside TRL (a peer's API drift must not hide our figures)."""
    return f"{type(e).__name__}: {e}"[:300]


def versions() -> dict[str, str]:
    return library_versions(LIBRARIES)


@dataclass(frozen=True)
class TrlRun:
    wall_s: float
    """Seconds of ``trainer.train()``: generation, scoring and optimizer steps (model load and
    the trainer's construction are not timed)."""
    samples: int
    rewards: list[float]
    """The mean reward of each logged step, in order (every step with ``log_every=1``)."""

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s


def check_matchable(recipe: Recipe) -> None:
    """ValueError naming what of ``recipe`` this setup of TRL would not reproduce."""
    a, t = recipe.algorithm, recipe.trainer
    differ = [f"algorithm.{k} = {v!r}" for k, v, same in (
        ("name", a.name, "grpo"), ("policy_loss", a.policy_loss, "ppo_clip"),
        ("loss_agg", a.loss_agg_resolved, "token_mean"),
        ("entropy_coef", a.entropy_coef, 0.0), ("dynamic_sampling", a.dynamic_sampling, False),
    ) if v != same]
    if a.kl_in_reward:
        differ.append("algorithm.kl_in_reward = True")
    if t.updates_per_step > 1:
        differ.append(f"trainer.ppo_epochs = {t.ppo_epochs}, {t.mini_batches} mini-batches "
                      "(one update per step)")
    if t.groups_per_step % t.micro_batch_groups:
        differ.append(f"trainer.groups_per_step = {t.groups_per_step}, no multiple of "
                      f"trainer.micro_batch_groups = {t.micro_batch_groups}")
    if differ:
        raise ValueError("TRL is set up for GRPO with PPO-clip, loss_agg 'token_mean', no entropy "
                         "bonus, no dynamic sampling and micro-batches of equal size; the recipe "
                         "has "
                         + "; ".join(differ))


def _schedule(recipe: Recipe) -> dict[str, Any]:
    """The recipe's learning-rate schedule in transformers' terms."""
    t = recipe.trainer
    if t.lr_schedule == "cosine":
        return {"lr_scheduler_type": "cosine_with_min_lr",
                "lr_scheduler_kwargs": {"min_lr_rate": t.min_lr_ratio}}
    return {"lr_scheduler_type": "constant_with_warmup" if t.warmup_steps else "constant"}


def run_trl(recipe: Recipe, model_dir: Path, steps: int, *, log_every: int | None = None,
            save_to: Path | None = None, threads: int = DEFAULT_THREADS) -> TrlRun:
    """Train ``steps`` optimizer steps of the recipe's job with TRL; ``log_every``: steps per
    logged reward (default a quarter of the run); ``save_to``: where the trained model goes
    (default nowhere; its tokenizer is ``model_dir``'s, which TRL does not change);
    ``threads``: torch threads meanwhile (this process's count is restored after)."""
    check_matchable(recipe)
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _train(recipe, model_dir, steps, log_every, save_to)
    finally:
        torch.set_num_threads(before)


def _train(recipe: Recipe, model_dir: Path, steps: int, log_every: int | None,
           save_to: Path | None) -> TrlRun:
    from datasets import Dataset  # type: ignore[import-not-found]
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer  # type: ignore[import-not-found]

    from workers.roles.factory import dataset_from_config
    from workers.roles.reward_runner import resolve_reward_fn

    t, a = recipe.trainer, recipe.algorithm
    data = dataset_from_config(recipe.engine_config())
    dataset = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer} for e in data.examples])
    score = resolve_reward_fn(recipe.reward.ref)

    def reward(prompts: list[str], completions: list[str], answer: list[str],
               **_: Any) -> list[float]:
        if recipe.reward.batched:
            return [float(r) for r in score(prompts, completions, [{"answer": x} for x in answer])]
        return [float(score(p, c, answer=x))
                for p, c, x in zip(prompts, completions, answer, strict=True)]

    group = a.group_size
    per_step = group * t.groups_per_step
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    with tempfile.TemporaryDirectory(prefix="flowrl-trl-bench-") as out:
        config = GRPOConfig(
            output_dir=out, use_cpu=True, report_to="none", save_strategy="no",
            logging_steps=log_every or max(1, steps // 4), max_steps=steps, seed=recipe.seed,
            learning_rate=t.lr, warmup_steps=t.warmup_steps, **_schedule(recipe),
            max_grad_norm=t.grad_clip or 0.0, weight_decay=t.weight_decay,
            adam_beta1=t.betas[0], adam_beta2=t.betas[1],
            per_device_train_batch_size=group * t.micro_batch_groups,
            gradient_accumulation_steps=t.groups_per_step // t.micro_batch_groups,
            num_generations=group, max_completion_length=recipe.rollout.max_new_tokens,
            temperature=recipe.rollout.temperature, top_p=recipe.rollout.top_p,
            beta=a.kl_coef, epsilon=a.clip_low, epsilon_high=a.clip_high_resolved,
            # TRL's own defaults are bfloat16 autocast and gradient checkpointing (recomputing
            # activations); flowrl's trainer computes in float32 and keeps them.
            bf16=False, gradient_checkpointing=False,
            dataloader_num_workers=0, disable_tqdm=True,
        )
        # Its log lines are printed on stdout, where a benchmark prints its one JSON line.
        with contextlib.redirect_stdout(sys.stderr):
            trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config,
                                  train_dataset=dataset, processing_class=tokenizer)
            t0 = time.perf_counter()
            trainer.train()
            wall = time.perf_counter() - t0
            if save_to is not None:
                trainer.model.save_pretrained(save_to)
        rewards = [float(e["reward"]) for e in trainer.state.log_history if "reward" in e]
    return TrlRun(wall_s=wall, samples=steps * per_step, rewards=rewards)
