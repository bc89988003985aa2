"""Build the real ("hf" engine) roles from the `EngineSpec` every worker receives.

`make_hf_role(role, config, seed)` reads a `flowrl.worker_spec.EngineSpec` (or its JSON form,
validated first) and returns a ready `workers.runtime.Role`: it loads the model, tokenizer and
dataset, and wires them into `RolloutRole`, `RewardRole`, `ReferenceRole`, `CriticRole` or
`TrainerRole`. The roles themselves take constructed objects (engine, tokenizer, dataset), so
tests and custom launchers can inject their own; this module is the one place that knows the
spec's layout.

Guarantees:
- Every worker built from the same spec maps a dataset position to the same example (the
  dataset is built deterministically from ``spec.data`` and ``spec.seed``).
- A spec the roles cannot serve (a malformed one, a model path that is not a directory, an
  unknown role) raises ValueError naming the field, before any model is loaded.

Imports torch and transformers lazily, inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from flowrl.data import Dataset, arithmetic, hold_out, jsonl, parquet
from flowrl.worker_spec import (
    ArithmeticDataSpec,
    Dtype,
    EngineSpec,
    JudgeSpec,
    RewardModelSpec,
    engine_spec,
)

if TYPE_CHECKING:
    import torch

    from workers.engines.batching import RequestBatcher
    from workers.engines.protocols import RolloutEngine, SamplingParams
    from workers.engines.torch_trainer import TorchTrainerEngine
    from workers.roles.trainer import TrainerRole
    from workers.runtime import Role

__all__ = [
    "HF_ROLES",
    "data_splits",
    "dataset_from_config",
    "load_tokenizer",
    "make_colocated_roles",
    "make_hf_role",
    "make_vllm_role",
    "model_dir",
    "rollout_dtype",
    "sampling_from_config",
    "torch_dtype",
]

#: a spec, or its JSON form
Config = EngineSpec | Mapping[str, Any]

HF_ROLES = ("rollout", "reward", "reference", "critic", "train")

log = structlog.get_logger("flowrl.factory")


def model_dir(config: Config) -> Path:
    """``model.path``, checked to be a local model directory."""
    path = Path(engine_spec(config).model.path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model.path: {str(path)!r} is not a local model directory (no "
                         "config.json); the launcher resolves 'tiny' before workers start")
    return path


def dataset_from_config(config: Config) -> Dataset:
    """The training prompts of ``data`` (the same on every worker): all of them, or, when the
    run evaluates, those not held out (`data_splits`)."""
    return data_splits(config)[0]


def data_splits(config: Config) -> tuple[Dataset, Dataset | None]:
    """``(train, evaluation)``: the prompt dataset of ``data`` and the held-out split of
    ``eval`` (`flowrl.data.hold_out`; None when the run does not evaluate), the same on every
    worker."""
    spec = engine_spec(config)
    data = spec.data
    if data.kind == "arithmetic":
        dataset = arithmetic(data.count, max_operand=data.max_operand, seed=data.seed)
    else:
        dataset = _read(data.kind, data.path, spec, "data.path")
    held = spec.eval
    if held is None:
        return dataset, None
    source = None if held.path is None else _read(data.kind, held.path, spec, "eval.path")
    return hold_out(dataset, held.prompts, source=source, seed=spec.seed)


def _read(kind: str, path: str, spec: EngineSpec, field: str) -> Dataset:
    data = spec.data
    assert not isinstance(data, ArithmeticDataSpec)
    read = jsonl if kind == "jsonl" else parquet
    dataset = read(path, prompt_key=data.prompt_key, answer_key=data.answer_key,
                   template=data.prompt_template, seed=spec.seed)
    if dataset.skipped:
        log.warning("malformed dataset rows skipped", field=field, path=path,
                    skipped=dataset.skipped, kept=len(dataset))
    return dataset


def rollout_dtype(config: Config, device: torch.device) -> torch.dtype:
    """``rollout.dtype`` as a torch dtype (`torch_dtype`)."""
    return torch_dtype(engine_spec(config).rollout.dtype, device)


def torch_dtype(name: Dtype, device: torch.device) -> torch.dtype:
    """A spec's dtype name as a torch dtype; ``auto`` is bfloat16 where ``device`` supports it
    (CUDA with bf16, NPU), else float32."""
    import torch

    if name == "auto":
        bf16 = device.type == "npu" or (device.type == "cuda" and torch.cuda.is_bf16_supported())
        return torch.bfloat16 if bf16 else torch.float32
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)  # the spec names floating-point dtypes only
    return dtype


def load_tokenizer(path: Path) -> Any:
    """The model directory's tokenizer, offline."""
    from transformers import AutoTokenizer

    from workers.engines.hf_rollout import quiet_transformers

    quiet_transformers()
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def sampling_from_config(config: Config) -> SamplingParams:
    """``sampling`` as `SamplingParams` (``n`` is set per task by the rollout role)."""
    from workers.engines.protocols import SamplingParams

    s = engine_spec(config).sampling
    return SamplingParams(temperature=s.temperature, top_p=s.top_p,
                          max_new_tokens=s.max_new_tokens, stop=s.stop)


def make_hf_role(role: str, config: Config, seed: int, *, process: str | None = None,
                 run_id: str | None = None) -> Role:
    """A real role for ``role`` (one of `HF_ROLES`) from the worker's ``config``.

    ``process`` (``train.<rank>``) places a data-parallel trainer rank in its group; ``run_id``
    lets a restarted critic find its own run's last save (and ranks their run directory).
    """
    if role not in HF_ROLES:
        raise ValueError(f"no hf role {role!r}; have {list(HF_ROLES)}")
    spec = engine_spec(config)
    if role == "reward":
        return _reward(spec, seed)
    path = model_dir(spec)
    if role == "rollout":
        return _rollout(spec, _policy_base(spec, path), seed)
    if role == "reference":
        # The initial policy, also when the run resumes from a later checkpoint.
        ref = spec.model.reference_path
        return _reference(spec, Path(ref) if ref else path, seed)
    if role == "critic":
        return _critic(spec, path, seed, run_id)
    return _trainer(spec, _policy_base(spec, path), seed, process, run_id)


def make_colocated_roles(config: Config, seed: int, *, keep_weight_copy: bool,
                         process: str | None = None, run_id: str | None = None,
                         rollout_engine: str = "hf") -> tuple[Role, Role]:
    """A colocated process's trainer and rollout roles (`workers.colocated`), both taking
    turns in one `Phases`. A trainer (or replicated rank) holds whole weights, which the
    rollout engine generates with in place; raises ValueError when the layouts differ (the
    rollout's dtype is not the trainer's): serving them would need a copy in another layout.
    An FSDP2 rank holds shards: its engine loads a whole model of its own (``rollout.dtype``),
    which every step's end fills bucket by bucket (`DataParallelTrainerRole.load_engine_with`).
    ``rollout_engine="vllm"`` (one trainer): vLLM loads each version from the trainer's tensors
    in the process instead, in its own layout and dtype (`_colocated_vllm`).
    """
    from workers.colocated import (
        ColocatedRollout,
        ColocatedTrainer,
        Phases,
        RolloutMemory,
        TrainerMemory,
    )
    from workers.engines.hf_rollout import HFRolloutEngine
    from workers.engines.torch_trainer import TorchTrainerEngine
    from workers.resharding import copy_into
    from workers.roles.dp_trainer import DataParallelTrainerRole
    from workers.roles.trainer import TrainerRole

    spec = engine_spec(config)
    path = _policy_base(spec, model_dir(spec))
    trainer = _trainer(spec, path, seed, process, run_id)
    assert isinstance(trainer, TrainerRole)
    engine = trainer.engine
    assert isinstance(engine, TorchTrainerEngine)  # what `_trainer` builds
    if rollout_engine == "vllm":
        return _colocated_vllm(spec, path, seed, trainer, engine,
                               keep_weight_copy=keep_weight_copy)
    if rollout_engine != "hf":
        raise ValueError(f"rollout.engine: colocated placement runs hf or vllm, not "
                         f"{rollout_engine!r}")
    ranked = trainer if isinstance(trainer, DataParallelTrainerRole) else None
    wanted = rollout_dtype(spec, engine.device)
    if ranked is not None and ranked.group.sharded:
        generator = HFRolloutEngine(path, device=engine.device, dtype=wanted, seed=seed,
                                    version=spec.start_version)
        ranked.load_engine_with(copy_into(generator.weight_targets))

        def engine_load(version: int, weights: dict[str, torch.Tensor]) -> None:
            if weights:  # a restarted process joining: the store's copy of the version
                generator.load_weights(weights, version)
    else:
        held = next(engine.model.parameters()).dtype
        if wanted != held:
            raise ValueError(f"rollout.dtype: resolves to {wanted} on {engine.device}, but the "
                             f"colocated trainer holds {held} weights; serving them in place "
                             f"needs the same dtype (set rollout.dtype = '{str(held)[6:]}')")
        generator = HFRolloutEngine(path, device=engine.device, seed=seed, model=engine.model,
                                    version=spec.start_version)
    phases = Phases({"train": TrainerMemory(engine), "generate": RolloutMemory(engine.device)})
    sharded = ranked is not None and ranked.group.sharded
    train = ColocatedTrainer(trainer, phases, keep_weight_copy=keep_weight_copy,
                             announces=ranked is None or ranked.group.rank == 0,
                             defers=sharded, engine_load=engine_load if sharded else None)
    rollout = ColocatedRollout(_rollout_role(spec, generator, path), generator, train, phases)
    return train, rollout


def _colocated_vllm(spec: EngineSpec, path: Path, seed: int, trainer: TrainerRole,
                    engine: TorchTrainerEngine, *, keep_weight_copy: bool) -> tuple[Role, Role]:
    """`make_colocated_roles` on vLLM (`workers.colocated_vllm`): vLLM loads each version from
    the trainer's module in the process and sleeps between its phases where it can."""
    from workers.colocated import ColocatedRollout, ColocatedTrainer, Phases, TrainerMemory
    from workers.colocated_vllm import VLLMInPlace, colocated_llm_kwargs, module_buckets
    from workers.engines.vllm_rollout import VLLMRolloutEngine

    _check_partial(spec)
    generator = VLLMRolloutEngine(path, dtype=spec.rollout.dtype, seed=seed,
                                  version=spec.start_version, llm_kwargs=colocated_llm_kwargs())
    served = VLLMInPlace(generator, lambda: module_buckets(engine.model),
                         lambda: trainer.version)
    phases = Phases({"train": TrainerMemory(engine), "generate": served})
    train = ColocatedTrainer(trainer, phases, keep_weight_copy=keep_weight_copy)
    rollout = ColocatedRollout(_rollout_role(spec, generator, path), served, train, phases)
    return train, rollout


def _policy_base(spec: EngineSpec, path: Path) -> Path:
    """Where a policy engine loads its weights from: ``model.path``, except when adapters
    train and the run resumes: then the initial model (the base the checkpoint's adapter
    applies to; `_resume_adapter` loads the adapter)."""
    ref = spec.model.reference_path
    return Path(ref) if spec.model.lora is not None and ref else path


def _resume_adapter(spec: EngineSpec) -> dict[str, torch.Tensor] | None:
    """The adapter payload of the checkpoint a run with adapters resumes from (None: not
    resuming, or no adapters)."""
    if spec.model.lora is None or spec.resume is None:
        return None
    from workers.engines.lora import ADAPTER_DIR, payload_from_dir

    return payload_from_dir(Path(spec.resume.checkpoint) / ADAPTER_DIR)


def make_vllm_role(role: str, config: Config, seed: int, *, process: str | None = None,
                   run_id: str | None = None) -> Role:
    """The ``vllm`` engine's roles: rollout on `workers.engines.vllm_rollout` (episodes on its
    `workers.engines.vllm_continuous.VLLMBatcher`), every other role as `make_hf_role` builds
    it (scoring and training stay on torch)."""
    if role != "rollout":
        return make_hf_role(role, config, seed, process=process, run_id=run_id)
    from workers.engines.vllm_rollout import VLLMRolloutEngine

    spec = engine_spec(config)
    _check_partial(spec)
    path = model_dir(spec)
    # rollout.dtype names are vLLM's too ("auto": the checkpoint's dtype). A resumed run's
    # model.path is its checkpoint (merged weights, adapters included): that version's weights.
    engine = VLLMRolloutEngine(path, dtype=spec.rollout.dtype, seed=seed,
                               version=spec.start_version)
    if spec.rollout.episode is not None:
        from workers.engines.vllm_continuous import VLLMBatcher

        return _episode_role(spec, VLLMBatcher(engine), path)
    return _rollout_role(spec, engine, path)


def _reward(spec: EngineSpec, seed: int) -> Role:
    from workers.roles.reward_role import RewardRole
    from workers.roles.reward_runner import RewardRunner, resolve_reward_fn

    r = spec.reward
    policy = model_dir(spec)  # checked before any model loads
    fn: Callable[..., Any]
    if r.model is not None:
        fn, batched = _reward_model(r.model), True
    elif r.judge is not None:
        fn, batched = _judge(spec, r.judge, seed), True
    else:
        assert r.fn is not None  # RewardSpec: exactly one source
        fn, batched = resolve_reward_fn(r.fn), r.batched
    runner = RewardRunner(fn, batched=batched, timeout_s=r.timeout_s,
                          max_concurrency=r.concurrency)
    train, held_out = data_splits(spec)
    return RewardRole(runner, load_tokenizer(policy), train, eval_dataset=held_out)


def _reward_model(rm: RewardModelSpec) -> Callable[..., Any]:
    from workers.devices import pick_device
    from workers.engines.reward_model import RewardModelEngine

    path = Path(rm.path)
    if not (path / "config.json").is_file():
        raise ValueError(f"reward.model.path: {rm.path!r} is not a local model directory (no "
                         "config.json); the launcher resolves 'tiny' before workers start")
    device = pick_device()
    return RewardModelEngine(path, max_length=rm.max_length, batch_size=rm.batch_size,
                             device=device, dtype=torch_dtype(rm.dtype, device))


def _judge(spec: EngineSpec, j: JudgeSpec, seed: int) -> Callable[..., Any]:
    """A judge served here with the rollout engine code: a fixed model, so this role never
    loads policy versions (the policy's own directory holds its initial weights)."""
    from workers.roles.judge import Judge

    if j.path is not None:
        path = Path(j.path)
        if not (path / "config.json").is_file():
            raise ValueError(f"reward.judge.path: {j.path!r} is not a local model directory "
                             "(no config.json)")
    else:  # the policy as the run started (when resuming, not the checkpoint)
        ref = spec.model.reference_path
        path = Path(ref) if ref else model_dir(spec)
    engine: RolloutEngine
    if j.engine == "vllm":
        from workers.engines.vllm_rollout import VLLMRolloutEngine

        engine = VLLMRolloutEngine(path, dtype=j.dtype, seed=seed)
    else:
        from workers.devices import pick_device
        from workers.engines.hf_rollout import HFRolloutEngine

        device = pick_device()
        engine = HFRolloutEngine(path, device=device, dtype=torch_dtype(j.dtype, device),
                                 seed=seed)
    return Judge(engine, load_tokenizer(path), template=j.template, parse=j.parse,
                 min_score=j.min_score, max_score=j.max_score, default=j.default,
                 max_new_tokens=j.max_new_tokens, max_prompt_tokens=j.max_prompt_tokens,
                 stop=j.stop)


def _rollout(spec: EngineSpec, path: Path, seed: int) -> Role:
    from workers.devices import pick_device
    from workers.engines.hf_rollout import HFRolloutEngine

    _check_partial(spec)
    device = pick_device()
    engine = HFRolloutEngine(path, device=device, dtype=rollout_dtype(spec, device), seed=seed,
                             version=spec.start_version)
    adapter = _resume_adapter(spec)
    if adapter is not None:
        engine.load_weights(adapter, spec.start_version)
    if spec.rollout.episode is not None:
        from workers.engines.hf_continuous import ContinuousBatcher

        return _episode_role(spec, ContinuousBatcher(engine), path)
    return _rollout_role(spec, engine, path)


def _check_partial(spec: EngineSpec) -> None:
    if spec.rollout.partial and spec.rollout.episode is None:
        raise ValueError("rollout.partial: interruptible generation continues running episodes "
                         "under new weights; it needs rollout.episode")


def _episode_role(spec: EngineSpec, batcher: RequestBatcher, path: Path) -> Role:
    """The episode rollout role over ``batcher``, either engine's."""
    # The recipe refuses episodes with eval or a chat template: an episode renders its own
    # chat messages and the held-out split is served by the single-completion role only.
    from flowrl.episode import resolve_episode_fn
    from workers.roles.episode_rollout import EpisodeRolloutRole
    from workers.tool_pool import ToolPool

    r = spec.rollout
    assert r.episode is not None
    return EpisodeRolloutRole(
        batcher, load_tokenizer(path), dataset_from_config(spec),
        sampling_from_config(spec), resolve_episode_fn(r.episode),
        episode_name=r.episode, sample_seed=spec.seed,
        endpoint=r.endpoint,
        tools=ToolPool(r.tools, workers=r.tool_workers, timeout_s=r.tool_timeout_s,
                       memory_mb=r.tool_memory_mb) if r.tools else None,
        max_turns=r.max_turns, max_tokens=r.max_episode_tokens, interruptible=r.partial)


def _rollout_role(spec: EngineSpec, engine: RolloutEngine, path: Path) -> Role:
    """The rollout role over ``engine``: the policy's tokenizer, the data's splits, the run's
    sampling and prompt encoding."""
    from workers.roles.rollout import RolloutRole

    train, held_out = data_splits(spec)
    return RolloutRole(engine, load_tokenizer(path), train, sampling_from_config(spec),
                       max_prompt_tokens=spec.data.max_prompt_tokens, sample_seed=spec.seed,
                       chat_template=spec.data.chat_template,
                       system_prompt=spec.data.system_prompt, eval_dataset=held_out)


def _reference(spec: EngineSpec, path: Path, seed: int) -> Role:
    from workers.engines.torch_trainer import TorchTrainerEngine
    from workers.roles.reference import ReferenceRole

    # The trainer's engine class, never stepped: its logprobs are the trainer's at version 0.
    engine = TorchTrainerEngine(path, seed=seed)
    engine.model.requires_grad_(False)
    return ReferenceRole(engine, temperature=spec.sampling.temperature,
                         pad_token_id=_pad_id(engine.model))


def _critic(spec: EngineSpec, path: Path, seed: int, run_id: str | None) -> Role:
    from workers.engines.value_model import ValueModelEngine
    from workers.roles.critic import CriticRole, CriticSettings, critic_checkpoint

    c = spec.critic
    if c is None:
        raise ValueError("critic: the config has no critic section (algorithm.name is not 'ppo')")
    settings = CriticSettings.from_spec(spec, run_id=run_id)
    initial = spec.model.reference_path
    if initial:  # resuming: the critic was built from the initial model, not the checkpoint
        path = Path(initial)
    engine = ValueModelEngine(path, lr=c.lr, weight_decay=c.weight_decay,
                              grad_clip=c.grad_clip, seed=seed)
    saved = None
    if spec.resume is not None:
        saved = critic_checkpoint(Path(spec.resume.checkpoint).parent)
        if saved is None:
            log.warning("resuming without a critic checkpoint: the critic starts afresh",
                        output=str(Path(spec.resume.checkpoint).parent))
    elif settings.output is not None and settings.run_id is not None:
        # A restarted critic process: its run's newest save, if it made one.
        saved = critic_checkpoint(settings.output, run_id=settings.run_id)
    if saved is not None:
        engine.load(saved)
        log.info("critic resumed" if spec.resume else "critic restarted from its last save",
                 path=str(saved), critic_step=engine.step)
    return CriticRole(engine, settings, pad_token_id=_pad_id(engine.model.backbone))


def _trainer(spec: EngineSpec, path: Path, seed: int, process: str | None,
             run_id: str | None) -> Role:
    from workers.devices import pick_device
    from workers.distributed import DataParallel
    from workers.engines.torch_trainer import TorchTrainerEngine
    from workers.roles.trainer import TrainerRole, TrainSettings

    settings = TrainSettings.from_spec(spec)
    t = spec.trainer
    group = None
    if spec.data_parallel is not None:  # trainer.ranks > 1: this process is one rank
        if process is None or run_id is None:
            raise ValueError("a data-parallel trainer rank needs its process name and run id")
        from transport.endpoints import run_dir

        group = DataParallel.of_process(spec.data_parallel, process=process,
                                        run_dir=run_dir(run_id))
    engine = TorchTrainerEngine(
        path, lr=t.lr, weight_decay=t.weight_decay, betas=t.betas, grad_clip=t.grad_clip,
        warmup_steps=t.warmup_steps, schedule=t.lr_schedule, min_lr_ratio=t.min_lr_ratio,
        total_steps=spec.steps, seed=seed,
        device=None if group is None else group.device(pick_device()),
        lora=spec.model.lora, gradient_checkpointing=t.gradient_checkpointing,
    )
    adapter = _resume_adapter(spec)
    if adapter is not None:
        engine.load_adapter(adapter)
    role: TrainerRole
    if group is not None:
        from workers.roles.dp_trainer import DataParallelTrainerRole

        group.join(engine.device)  # waits for every rank (at most the group's timeout)
        role = DataParallelTrainerRole(engine, settings, pad_token_id=_pad_id(engine.model),
                                       group=group, version=spec.start_version)
    else:
        role = TrainerRole(engine, settings, pad_token_id=_pad_id(engine.model),
                           version=spec.start_version)
    if spec.resume is not None:  # the checkpoint's optimizer state (its weights are the model
        # path already), loaded once the role has sharded the model if it shards it
        from workers.engines.protocols import TrainerState

        engine.load_state_dict(TrainerState.load(spec.resume.checkpoint))
    return role


def _pad_id(model: Any) -> int:
    """The model's pad token (its EOS when it has none): right padding is masked anyway."""
    cfg = model.config
    for value in (getattr(cfg, "pad_token_id", None), getattr(cfg, "eos_token_id", None)):
        if isinstance(value, int):
            return value
        if isinstance(value, list | tuple) and value:
            return int(value[0])
    return 0
