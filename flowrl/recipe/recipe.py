"""The `Recipe` itself: its sections, the rules across them, and its compilation into the
controller's `PipelineSpec` and the workers' `EngineSpec`."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from flowrl.episode import MAX_RUNNING
from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages, ppo_stages
from flowrl.recipe.algorithm import (
    DEFAULT_TIS_CAP,
    LOSS_AGG_ALGORITHM_NAMES,
    TRUNCATING_CORRECTIONS,
    AlgorithmConfig,
)
from flowrl.recipe.colocated import check_colocated
from flowrl.recipe.critic import CriticConfig
from flowrl.recipe.data import DataConfig
from flowrl.recipe.evaluation import EvalConfig
from flowrl.recipe.model import TINY_MODEL, ModelConfig
from flowrl.recipe.monitor import MonitorConfig
from flowrl.recipe.placement import ROLES, PlacementConfig
from flowrl.recipe.reward import RewardConfig, check_fn_ref
from flowrl.recipe.rollout import RolloutConfig
from flowrl.recipe.section import _rule, _Section
from flowrl.recipe.sim import SimConfig
from flowrl.recipe.stability import StabilityConfig
from flowrl.recipe.tracking import Trackers
from flowrl.recipe.trainer import TrainerConfig
from flowrl.worker_spec import (
    AlgorithmSpec,
    ArithmeticDataSpec,
    CriticSpec,
    DataParallelSpec,
    EngineSpec,
    EvalDataSpec,
    FileDataSpec,
    LoraSpec,
    ModelSpec,
    RolloutSpec,
    SamplingSpec,
    TrainerSpec,
)


def _model_config(field: str, path: str) -> dict[str, Any]:
    """The ``config.json`` of the model directory ``path``, or a rule error naming ``field``."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise _rule(field, f"{path!r} is not a model directory (no config.json in it)")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _rule(field, f"{str(file)!r} cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise _rule(field, f"{str(file)!r} holds no JSON object")
    return config


def _num_labels(config: dict[str, Any]) -> int:
    """A classifier's outputs as transformers counts them (``id2label``, else ``num_labels``,
    else its default of 2)."""
    labels = config.get("id2label")
    if isinstance(labels, dict):
        return len(labels)
    n = config.get("num_labels", 2)
    return n if isinstance(n, int) else 2


class Recipe(_Section):
    """One RL run. Only `steps` is required; `to_pipeline` compiles it for the controller."""

    steps: int = Field(ge=1, le=10**9)
    """Optimizer steps to run."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy (and reference) model."""
    data: DataConfig = Field(default_factory=DataConfig)
    """The prompt dataset."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """The RL objective."""
    critic: CriticConfig = Field(default_factory=CriticConfig)
    """PPO's value model; only with ``algorithm.name="ppo"``."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Generation engine and sampling."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """The reward function."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Optimizer and batch sizes."""
    max_staleness: int = Field(default=0, ge=0, le=64)
    """Policy versions a sample may lag behind the trainer; 0 is synchronous on-policy."""
    seed: int = Field(default=0, ge=0)
    """Seed of sampling, data order and simulated costs."""
    output: Path | None = None
    """Run directory: the final model (``final``), checkpoints, the step log, the summary and
    the recipe (`flowrl.run_output`); None writes nothing (``python -m flowrl.launch`` then
    makes one under ``runs/``)."""
    checkpoint_every: int = Field(default=0, ge=0)
    """Save a checkpoint every this many steps (and at the end); 0 never. Needs `output`."""
    keep_last: int | None = Field(default=None, ge=1)
    """Keep only the newest this many checkpoints: an older ``step_N`` is deleted once a newer
    one is complete (the final model is not a checkpoint); None keeps all. Needs
    `checkpoint_every`."""
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    """The HTTP monitor."""
    sim: SimConfig = Field(default_factory=SimConfig)
    """Simulated costs; only with ``rollout.engine="sim"``."""
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    """Process placement."""
    stability: StabilityConfig = Field(default_factory=StabilityConfig)
    """The guard that watches each step's training signals and acts on them."""
    eval: EvalConfig | None = None
    """Periodic validation on held-out prompts; None evaluates nothing."""
    tracking: Trackers = ()
    """Experiment trackers that get each step's metrics, the recipe and the summary
    (`flowrl.tracking`): ``"tensorboard"`` (event files in ``<output>/tensorboard``),
    ``"wandb"``, ``"mlflow"``; each needs its extra (``pip install 'flowrl[wandb]'``). Needs
    `output`."""

    @model_validator(mode="after")
    def _cross_section(self) -> Recipe:
        sim = self.rollout.engine == "sim"
        if "sim" in self.model_fields_set and not sim:
            raise _rule("sim", f"simulated costs given but rollout.engine is "
                        f"{self.rollout.engine!r}, not 'sim'")
        if "critic" in self.model_fields_set and self.algorithm.name != "ppo":
            raise _rule("critic", f"critic settings given but algorithm.name is "
                        f"{self.algorithm.name!r}, not 'ppo'")
        if self.checkpoint_every and self.output is None:
            raise _rule("checkpoint_every", "needs output (a directory to write checkpoints to)")
        if self.tracking and self.output is None:
            raise _rule("tracking", "needs output (a run directory: the trackers' files go "
                        "there)")
        if self.keep_last is not None and not self.checkpoint_every:
            raise _rule("keep_last", "needs checkpoint_every > 0 (it says how many of the "
                        "checkpoints to keep)")
        served = "model" if self.reward.model is not None else (
            "judge" if self.reward.judge is not None else None)
        if sim and served is not None:
            raise _rule(f"reward.{served}", "simulated reward workers score no text; a reward "
                        f"{served} needs rollout.engine 'hf' or 'vllm'")
        if sim and self.trainer.ranks > 1:
            raise _rule("trainer.ranks", "simulated trainers do not all-reduce; data-parallel "
                        "ranks need rollout.engine 'hf' or 'vllm'")
        if self.model.lora is not None and self.trainer.sharding != "replicate":
            raise _rule("model.lora", "adapters train on replicated ranks only: set "
                        f"trainer.sharding='replicate' (got {self.trainer.sharding!r})")
        cluster = self.placement.cluster
        if (self.trainer.ranks > 1 and len(set(self.placement.roles.get("train", ()))) > 1
                and (cluster is None or cluster.trainer_rendezvous != "cluster")):
            raise _rule("placement.roles.train", "data-parallel trainer ranks meet through a "
                        "file in their node's run directory: place them on one node, or set "
                        "placement.cluster.trainer_rendezvous = 'cluster' to let them meet "
                        "across nodes (unauthenticated, unencrypted: trusted fabrics only)")
        if not sim and self.model.path == TINY_MODEL:
            longest = self.data.max_prompt_tokens + self.rollout.max_new_tokens
            if longest > self.model.tiny.max_positions:
                raise _rule("rollout.max_new_tokens", f"data.max_prompt_tokens + "
                            f"rollout.max_new_tokens = {longest} exceeds "
                            f"model.tiny.max_positions = {self.model.tiny.max_positions}")
        judge = self.reward.judge
        if not sim and judge is not None and judge.path is None and self.model.path == TINY_MODEL:
            longest = judge.max_prompt_tokens + judge.max_new_tokens
            if longest > self.model.tiny.max_positions:
                raise _rule("reward.judge.max_prompt_tokens", f"with max_new_tokens = "
                            f"{judge.max_new_tokens}, {longest} tokens exceed the judge's (the "
                            f"policy's) model.tiny.max_positions = "
                            f"{self.model.tiny.max_positions}")
        self._check_eval()
        if self.rollout.partial and self.rollout.episode is None and not self.sim_episodes:
            raise _rule("rollout.partial", "interruptible generation continues running "
                        "episodes under new weights: it needs rollout.episode, or with "
                        "rollout.engine 'sim' sim.episode_turns > 0")
        if self.rollout.episode is not None:
            if self.rollout.engine == "sim":
                raise _rule("rollout.episode", "episodes run on a real engine (rollout.engine "
                            "'hf' or 'vllm'); the sim engine models episodes of its own "
                            "(sim.episode_turns)")
            if "reward" in self.model_fields_set:
                raise _rule("reward", "an episode scores itself (policy.finish(reward) or its "
                            "return value): a run with rollout.episode has no reward section")
            self._check_episode_prompts()
        else:
            if self.rollout.endpoint:
                raise _rule("rollout.endpoint", "the endpoint serves episodes: name the agent "
                            "loop that uses it in rollout.episode")
            tasks = self.rollout.tasks_per_worker
            if not self.sim_episodes and isinstance(tasks, int) and tasks > 1:
                raise _rule("rollout.tasks_per_worker", "a single-completion rollout worker "
                            "runs one task at a time (its engine generates a task's groups in "
                            "one call): more than 1 needs episodes (rollout.episode, or with "
                            "rollout.engine 'sim' sim.episode_turns > 0)")
            for name in ("tools", "max_turns", "max_episode_tokens"):
                if name in self.rollout.model_fields_set and getattr(self.rollout, name):
                    raise _rule(f"rollout.{name}", "only episodes call tools and take turns: "
                                "name the episode function in rollout.episode")
        if self.placement.node_dispatch and self.eval is not None:
            raise _rule("placement.node_dispatch", "not with eval: evaluation rounds' scoring "
                        "jobs are dispatched by the controller, to workers node agents dispatch "
                        "instead")
        check_colocated(self.placement, model=self.model, rollout=self.rollout,
                        trainer=self.trainer)
        unrun = sorted(set(self.placement.roles) - set(self.roles))
        if unrun:
            raise _rule(f"placement.roles.{unrun[0]}", f"this run has no {unrun[0]} workers "
                        f"(its roles: {', '.join(self.roles)})")
        if self.inputs_are_local:
            self._check_local_paths()
        return self

    def _check_eval(self) -> None:
        ev, d = self.eval, self.data
        if ev is None:
            return
        if ev.path is not None and d.kind == "arithmetic":
            raise _rule("eval.path", "not used with data.kind 'arithmetic' (its held-out "
                        "prompts are drawn from the task's own)")
        if d.kind == "arithmetic" and ev.path is None:
            pairs = (d.arithmetic.max_operand + 1) ** 2
            if ev.prompts >= min(pairs, d.arithmetic.count):
                raise _rule("eval.prompts", f"{ev.prompts} would hold out every prompt of the "
                            f"arithmetic task (at most {min(pairs, d.arithmetic.count)} "
                            "distinct)")

    def _check_episode_prompts(self) -> None:
        # An episode renders its own chat messages from each example and scores itself, so
        # neither the prompt encoding nor the held-out rounds (single completions) apply.
        episode = self.rollout.episode_ref
        # (data.system_prompt needs data.chat_template: refusing the template refuses both)
        for field, is_set in (("eval", self.eval is not None),
                              ("data.chat_template", self.data.chat_template)):
            if is_set:
                raise _rule(field, f"not used with rollout.episode {episode!r}: an episode "
                            "renders its own chat messages (policy.generate(messages)), and "
                            "evaluation rounds are single completions scored by reward")

    @property
    def inputs_are_local(self) -> bool:
        """Whether its workers load their model, data and reward function on this machine
        (a real engine, every role on the controller's node)."""
        return (self.rollout.engine != "sim" and self.placement.kind == "local"
                and not self.placement.remote_nodes)

    def _check_local_paths(self) -> None:
        if self.model.path != TINY_MODEL and not (Path(self.model.path) / "config.json").is_file():
            raise _rule("model.path", f"{self.model.path!r} is not a model directory "
                        "(no config.json in it)")
        if self.data.path is not None and not Path(self.data.path).is_file():
            raise _rule("data.path", f"no such file: {self.data.path!r}")
        if (self.eval is not None and self.eval.path is not None
                and not Path(self.eval.path).is_file()):
            raise _rule("eval.path", f"no such file: {self.eval.path!r}")
        tools = [(f"rollout.tools.{n}", ref) for n, ref in self.rollout.tools.items()]
        for name, ref in (("reward.fn", self.reward.fn), ("rollout.episode",
                                                          self.rollout.episode), *tools):
            if isinstance(ref, str):
                target, _ = check_fn_ref(ref)
                if target.endswith(".py") and not Path(target).is_file():
                    raise _rule(name, f"no such file: {target!r}")
        rm, judge = self.reward.model, self.reward.judge
        if rm is not None and rm.path != TINY_MODEL:
            labels = _num_labels(_model_config("reward.model.path", rm.path))
            if labels != 1:
                raise _rule("reward.model.path", f"{rm.path!r} is a model with {labels} "
                            "labels; a reward model has one (num_labels=1)")
        if judge is not None and judge.path is not None:
            _model_config("reward.judge.path", judge.path)

    @property
    def tis_cap(self) -> float | None:
        """The TIS cap at the start of the run: `AlgorithmConfig.tis_cap`, with ``"auto"`` →
        2.0 when ``max_staleness > 0``, else None (off); None as well under a masking
        correction, which has no cap. Trainers resolve ``"auto"`` per task from the staleness
        in force, which the monitor may change mid-run."""
        if self.algorithm.correction not in TRUNCATING_CORRECTIONS:
            return None
        cap = self.algorithm.tis_cap
        if cap == "auto":
            return DEFAULT_TIS_CAP if self.max_staleness > 0 else None
        assert not isinstance(cap, str)
        return cap

    @property
    def roles(self) -> tuple[str, ...]:
        """The worker roles this run has (the pools of `to_pipeline`)."""
        return tuple(r for r in ROLES if (r != "reference" or self.uses_reference)
                     and (r != "critic" or self.uses_critic)
                     and (r != "reward" or (self.rollout.episode is None
                                            and not self.sim_episodes)))

    @property
    def sim_episodes(self) -> bool:
        """Whether simulated rollout workers run episodes (``sim.episode_turns > 0``)."""
        return self.rollout.engine == "sim" and self.sim.episode_turns > 0

    @property
    def rollout_tasks_per_worker(self) -> int:
        """`RolloutConfig.tasks_per_worker` resolved: tasks one rollout worker runs at once."""
        r = self.rollout
        if not (r.episode is not None or self.sim_episodes):
            return 1
        if isinstance(r.tasks_per_worker, int):
            return r.tasks_per_worker
        rows = self.algorithm.group_size * r.groups_per_task
        running = self.sim.max_running if self.sim_episodes else MAX_RUNNING
        in_flight = (self.max_staleness + 1) * self.trainer.groups_per_step
        per_worker = math.ceil(in_flight / (r.groups_per_task * r.workers))
        return max(1, min(running // rows, per_worker))

    @property
    def uses_critic(self) -> bool:
        """Whether the run has a critic stage (PPO)."""
        return self.algorithm.name == "ppo"

    @property
    def uses_reference(self) -> bool:
        """Whether the run has a reference stage (the KL term is on)."""
        return self.algorithm.kl_coef > 0.0

    # ---- compilation --------------------------------------------------------------------------

    def to_pipeline(self) -> PipelineSpec:
        """The controller's view: stages, worker pools, bounds and the engines' configuration."""
        sim = self.rollout.engine == "sim"
        group = self.algorithm.group_size
        reference = self.uses_reference
        # Simulated workers are coroutines that only sleep: many share one process.
        rollout_per_process = self.rollout.workers if sim else 1
        reward_per_process = self.reward.workers if sim else 1
        # A reward task is one rollout task's rows; enough tasks per worker to keep
        # `concurrency` calls busy.
        reward_rows = group * self.rollout.groups_per_task
        reward_capacity = max(1, math.ceil(self.reward.concurrency / reward_rows))
        episode = self.rollout.episode is not None or self.sim_episodes
        pools = [
            PoolSpec("rollout", count=self.rollout.workers, per_process=rollout_per_process,
                     capacity=self.rollout_tasks_per_worker, threads=self.rollout.threads),
        ]
        if not episode:  # an episode scores itself
            pools.append(PoolSpec("reward", count=self.reward.workers,
                                  per_process=reward_per_process, capacity=reward_capacity,
                                  threads=self.reward.threads))
        if reference:
            pools.append(PoolSpec("reference", count=1, threads=self.rollout.threads))
        if self.uses_critic:
            pools.append(PoolSpec("critic", count=1, threads=self.critic.threads))
        # A colocated process runs one phase at a time: each gets the threads it would have.
        train_threads = (max(self.trainer.threads, self.rollout.threads)
                         if self.placement.mode == "colocated" else self.trainer.threads)
        pools.append(PoolSpec("train", count=self.trainer.ranks, threads=train_threads))
        pools = [dataclasses.replace(p, nodes=self.placement.roles.get(p.role, ()))
                 for p in pools]
        shape: dict[str, Any] = dict(
            group_size=group, train_micro_groups=self.trainer.micro_batch_groups,
            rollout_micro_groups=self.rollout.groups_per_task, reward_micro_batch=reward_rows,
            reference=reference, episode=episode)
        return PipelineSpec(
            stages=(ppo_stages(**shape, kl_in_reward=self.algorithm.kl_in_reward)
                    if self.uses_critic else grpo_stages(**shape)),
            pools=tuple(pools),
            group_size=group,
            groups_per_step=self.trainer.groups_per_step,
            max_staleness=self.max_staleness,
            engine=self.rollout.engine,
            engine_config=self.sim_cost() if sim else self.engine_config(),
            store_capacity_bytes=self.placement.store_capacity_mb << 20,
            heartbeat_timeout_s=self.placement.heartbeat_timeout_s,
            max_restarts=self.placement.max_restarts,
            max_failure_share=self.reward.max_failure_share,
            max_failure_steps=self.reward.max_failure_steps,
            output=(str(self.output) if self.output is not None and self.checkpoint_every
                    and not sim else None),
            seed=self.seed,
            stability=self.stability.model_dump(mode="json"),
            eval=None if self.eval is None else self.eval.model_dump(mode="json"),
            colocated=self.placement.mode == "colocated",
            keep_weight_copy=self.placement.keep_weight_copy,
            node_dispatch=self.placement.node_dispatch,
        )

    def sim_cost(self) -> dict[str, Any]:
        """The ``workers.sim.SimCost`` field values of this recipe."""
        return {**self.sim.model_dump(mode="json"), "max_new_tokens": self.rollout.max_new_tokens,
                "partial": self.rollout.partial}

    def _rollout_spec(self) -> RolloutSpec:
        r = self.rollout
        return RolloutSpec(dtype=r.dtype, episode=r.episode_ref, tools=r.tool_refs,
                           tool_workers=r.tool_workers, tool_timeout_s=r.tool_timeout_s,
                           tool_memory_mb=r.tool_memory_mb, max_turns=r.max_turns,
                           max_episode_tokens=r.max_episode_tokens, endpoint=r.endpoint,
                           partial=r.partial)

    def engine_spec(self) -> EngineSpec:
        """What real-engine workers are configured with (no monitor secrets, resolved values;
        the model path as the recipe gives it: `flowrl.run.compile_recipe` resolves it)."""
        a, d = self.algorithm, self.data
        data: ArithmeticDataSpec | FileDataSpec
        if d.kind == "arithmetic":
            data = ArithmeticDataSpec(kind=d.kind, max_prompt_tokens=d.max_prompt_tokens,
                                      chat_template=d.chat_template,
                                      system_prompt=d.system_prompt, **d.arithmetic.model_dump())
        else:
            assert d.path is not None  # DataConfig: a file kind has a path
            data = FileDataSpec(kind=d.kind, path=d.path, prompt_key=d.prompt_key,
                                answer_key=d.answer_key, prompt_template=d.prompt_template,
                                max_prompt_tokens=d.max_prompt_tokens,
                                chat_template=d.chat_template, system_prompt=d.system_prompt)
        t = self.trainer
        lora = self.model.lora
        return EngineSpec(
            model=ModelSpec(path=self.model.path, lora=None if lora is None else LoraSpec(
                **lora.model_dump(),
                # vLLM's engine loads whole weights; ours merges the adapters itself.
                sync="adapter" if self.rollout.engine == "hf" else "merged")),
            data=data,
            algorithm=AlgorithmSpec(
                name=a.name, kl_coef=a.kl_coef, kl_estimator=a.kl_estimator,
                kl_in_reward=a.kl_in_reward,
                entropy_coef=a.entropy_coef, policy_loss=a.policy_loss,
                clip_low=a.clip_low_resolved, clip_high=a.clip_high_resolved,
                loss_agg=LOSS_AGG_ALGORITHM_NAMES[a.loss_agg_resolved],
                correction=a.correction, tis_cap=a.tis_cap, mask_bounds=a.mask_bounds),
            sampling=SamplingSpec(temperature=self.rollout.temperature, top_p=self.rollout.top_p,
                                  max_new_tokens=self.rollout.max_new_tokens,
                                  stop=self.rollout.stop),
            rollout=self._rollout_spec(),
            reward=self.reward.spec(),
            eval=None if self.eval is None else EvalDataSpec(prompts=self.eval.prompts,
                                                             path=self.eval.path),
            trainer=TrainerSpec(lr=t.lr, weight_decay=t.weight_decay, betas=t.betas,
                                grad_clip=t.grad_clip, warmup_steps=t.warmup_steps,
                                lr_schedule=t.lr_schedule, min_lr_ratio=t.min_lr_ratio,
                                ppo_epochs=t.ppo_epochs, mini_batches=t.mini_batches,
                                gradient_checkpointing=t.gradient_checkpointing),
            critic=CriticSpec(
                **self.critic.model_dump(exclude={"threads"}),
                rows_per_step=t.groups_per_step * a.group_size) if self.uses_critic else None,
            data_parallel=DataParallelSpec(
                world=t.ranks, sharding=t.sharding, compute_dtype=t.compute_dtype,
                export_bucket_bytes=max(1, round(t.export_bucket_mb * (1 << 20))))
            if t.ranks > 1 else None,
            steps=self.steps,
            seed=self.seed,
            output=None if self.output is None else str(self.output),
            checkpoint_every=self.checkpoint_every,
        )

    def engine_config(self) -> dict[str, Any]:
        """`engine_spec` in its JSON form (what `PipelineSpec.engine_config` holds)."""
        return self.engine_spec().model_dump(mode="json")
