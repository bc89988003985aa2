"""Build the real ("hf" engine) roles from the JSON config every worker receives.

`make_hf_role(role, config, seed)` reads `flowrl.recipe.Recipe.engine_config` output and
returns a ready `workers.runtime.Role`: it loads the model, tokenizer and dataset, and wires them
into `RolloutRole`, `RewardRole`, `ReferenceRole`, `CriticRole` or `TrainerRole`. The roles
themselves take constructed objects (engine, tokenizer, dataset), so tests and custom launchers
can inject their own; this module is the one place that knows the config's layout.

Guarantees:
- Every worker built from the same config maps a dataset position to the same example (the
  dataset is built deterministically from ``config["data"]`` and ``config["seed"]``).
- A config the roles cannot serve (a model path that is not a directory, an unsupported data
  kind, an unknown role) raises ValueError naming the field, before any model is loaded.

Imports torch and transformers lazily, inside the functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from flowrl.data import Dataset, arithmetic, jsonl, parquet

if TYPE_CHECKING:
    import torch

    from workers.engines.protocols import SamplingParams
    from workers.runtime import Role

__all__ = [
    "HF_ROLES",
    "dataset_from_config",
    "load_tokenizer",
    "make_hf_role",
    "make_vllm_role",
    "model_dir",
    "rollout_dtype",
    "sampling_from_config",
    "start_version",
]

HF_ROLES = ("rollout", "reward", "reference", "critic", "train")

log = structlog.get_logger("flowrl.factory")


def model_dir(config: dict[str, Any]) -> Path:
    """``config["model"]["path"]``, checked to be a local model directory."""
    path = Path(str(config["model"]["path"]))
    if not (path / "config.json").is_file():
        raise ValueError(f"model.path: {str(path)!r} is not a local model directory (no "
                         "config.json); the launcher resolves 'tiny' before workers start")
    return path


def dataset_from_config(config: dict[str, Any]) -> Dataset:
    """The prompt dataset of ``config["data"]`` (the same on every worker)."""
    data = config["data"]
    kind = data["kind"]
    if kind == "arithmetic":
        a = data["arithmetic"]
        return arithmetic(int(a["count"]), max_operand=int(a["max_operand"]), seed=int(a["seed"]))
    if kind in ("jsonl", "parquet"):
        read = jsonl if kind == "jsonl" else parquet
        dataset = read(str(data["path"]), prompt_key=str(data["prompt_key"]),
                       answer_key=str(data["answer_key"]),
                       template=str(data.get("prompt_template", "{prompt}")),
                       seed=int(config.get("seed", 0)))
        if dataset.skipped:
            log.warning("malformed dataset rows skipped", path=str(data["path"]),
                        skipped=dataset.skipped, kept=len(dataset))
        return dataset
    raise ValueError(
        f"data.kind: {kind!r} is not supported by the hf roles (arithmetic, jsonl, parquet)")


def rollout_dtype(config: dict[str, Any], device: torch.device) -> torch.dtype:
    """``config["rollout"]["dtype"]`` as a torch dtype; ``auto`` is bfloat16 where ``device``
    supports it (CUDA with bf16, NPU), else float32."""
    import torch

    name = str(config.get("rollout", {}).get("dtype", "float32"))
    if name == "auto":
        bf16 = device.type == "npu" or (device.type == "cuda" and torch.cuda.is_bf16_supported())
        return torch.bfloat16 if bf16 else torch.float32
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"rollout.dtype: {name!r} is not a floating-point torch dtype")
    return dtype


def load_tokenizer(path: Path) -> Any:
    """The model directory's tokenizer, offline."""
    from transformers import AutoTokenizer

    from workers.engines.hf_rollout import quiet_transformers

    quiet_transformers()
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def sampling_from_config(config: dict[str, Any]) -> SamplingParams:
    """``config["sampling"]`` as `SamplingParams` (``n`` is set per task by the rollout role)."""
    from workers.engines.protocols import SamplingParams

    s = config["sampling"]
    return SamplingParams(temperature=float(s["temperature"]), top_p=float(s["top_p"]),
                          max_new_tokens=int(s["max_new_tokens"]),
                          stop=tuple(str(x) for x in s.get("stop", ())))


def make_hf_role(role: str, config: dict[str, Any], seed: int) -> Role:
    """A real role for ``role`` (one of `HF_ROLES`) from the worker's JSON ``config``."""
    if role not in HF_ROLES:
        raise ValueError(f"no hf role {role!r}; have {list(HF_ROLES)}")
    if role == "reward":
        return _reward(config)
    path = model_dir(config)
    if role == "rollout":
        return _rollout(config, path, seed)
    if role == "reference":
        # The initial policy, also when the run resumes from a later checkpoint.
        ref = config["model"].get("reference_path")
        return _reference(config, Path(ref) if ref else path, seed)
    if role == "critic":
        return _critic(config, path, seed)
    return _trainer(config, path, seed)


def make_vllm_role(role: str, config: dict[str, Any], seed: int) -> Role:
    """The ``vllm`` engine's roles: rollout on `workers.engines.vllm_rollout`, every other role
    as `make_hf_role` builds it (scoring and training stay on torch)."""
    if role != "rollout":
        return make_hf_role(role, config, seed)
    from workers.engines.vllm_rollout import VLLMRolloutEngine
    from workers.roles.rollout import RolloutRole

    path = model_dir(config)
    dataset = dataset_from_config(config)
    sampling = sampling_from_config(config)
    # rollout.dtype names are vLLM's too ("auto": the checkpoint's dtype).
    dtype = str(config.get("rollout", {}).get("dtype", "float32"))
    engine = VLLMRolloutEngine(path, dtype=dtype, seed=seed)
    return RolloutRole(engine, load_tokenizer(path), dataset, sampling,
                       max_prompt_tokens=int(config["data"]["max_prompt_tokens"]),
                       sample_seed=int(config.get("seed", 0)))


def _reward(config: dict[str, Any]) -> Role:
    from workers.roles.reward_role import RewardRole
    from workers.roles.reward_runner import RewardRunner, resolve_reward_fn

    r = config["reward"]
    runner = RewardRunner(resolve_reward_fn(str(r["fn"])), batched=bool(r["batched"]),
                          timeout_s=float(r["timeout_s"]),
                          max_concurrency=int(r["concurrency"]))
    return RewardRole(runner, load_tokenizer(model_dir(config)), dataset_from_config(config))


def _rollout(config: dict[str, Any], path: Path, seed: int) -> Role:
    from workers.devices import pick_device
    from workers.engines.hf_rollout import HFRolloutEngine
    from workers.roles.rollout import RolloutRole

    dataset = dataset_from_config(config)
    sampling = sampling_from_config(config)
    device = pick_device()
    engine = HFRolloutEngine(path, device=device, dtype=rollout_dtype(config, device), seed=seed,
                             version=start_version(config))
    return RolloutRole(engine, load_tokenizer(path), dataset, sampling,
                       max_prompt_tokens=int(config["data"]["max_prompt_tokens"]),
                       sample_seed=int(config.get("seed", 0)))


def _reference(config: dict[str, Any], path: Path, seed: int) -> Role:
    from workers.engines.torch_trainer import TorchTrainerEngine
    from workers.roles.reference import ReferenceRole

    # The trainer's engine class, never stepped: its logprobs are the trainer's at version 0.
    engine = TorchTrainerEngine(path, seed=seed)
    engine.model.requires_grad_(False)
    return ReferenceRole(engine, temperature=sampling_from_config(config).temperature,
                         pad_token_id=_pad_id(engine.model))


def _critic(config: dict[str, Any], path: Path, seed: int) -> Role:
    from workers.engines.value_model import ValueModelEngine
    from workers.roles.critic import CriticRole, CriticSettings

    if "critic" not in config:
        raise ValueError("critic: the config has no critic section (algorithm.name is not 'ppo')")
    settings = CriticSettings.from_config(config)
    c = config["critic"]
    resume = config.get("resume")
    initial = config["model"].get("reference_path")
    if initial:  # resuming: the critic was built from the initial model, not the checkpoint
        path = Path(initial)
    engine = ValueModelEngine(
        path, lr=float(c["lr"]), weight_decay=float(c["weight_decay"]),
        grad_clip=None if c.get("grad_clip") is None else float(c["grad_clip"]), seed=seed,
    )
    from workers.roles.critic import critic_checkpoint

    saved = None
    if resume:
        saved = critic_checkpoint(Path(resume["checkpoint"]).parent)
        if saved is None:
            log.warning("resuming without a critic checkpoint: the critic starts afresh",
                        output=str(Path(resume["checkpoint"]).parent))
    elif settings.output is not None and settings.run_id is not None:
        # A restarted critic process: its run's newest save, if it made one.
        saved = critic_checkpoint(settings.output, run_id=settings.run_id)
    if saved is not None:
        engine.load(saved)
        log.info("critic resumed" if resume else "critic restarted from its last save",
                 path=str(saved), critic_step=engine.step)
    return CriticRole(engine, settings, pad_token_id=_pad_id(engine.model.backbone))


def _trainer(config: dict[str, Any], path: Path, seed: int) -> Role:
    from workers.devices import pick_device
    from workers.distributed import DataParallel
    from workers.engines.torch_trainer import TorchTrainerEngine
    from workers.roles.trainer import TrainerRole, TrainSettings

    settings = TrainSettings.from_config(config)
    t = config["trainer"]
    betas = t.get("betas", (0.9, 0.999))
    group = DataParallel.from_config(config)  # trainer.ranks > 1: this process is one rank
    engine = TorchTrainerEngine(
        path, lr=float(t["lr"]), weight_decay=float(t["weight_decay"]),
        betas=(float(betas[0]), float(betas[1])),
        grad_clip=None if t.get("grad_clip") is None else float(t["grad_clip"]),
        warmup_steps=int(t["warmup_steps"]), schedule=str(t.get("lr_schedule", "constant")),
        min_lr_ratio=float(t.get("min_lr_ratio", 0.0)),
        total_steps=None if config.get("steps") is None else int(config["steps"]), seed=seed,
        device=None if group is None else group.device(pick_device()),
    )
    role: TrainerRole
    if group is not None:
        from workers.roles.dp_trainer import DataParallelTrainerRole

        group.join(engine.device)  # waits for every rank (at most the group's timeout)
        role = DataParallelTrainerRole(engine, settings, pad_token_id=_pad_id(engine.model),
                                       group=group, version=start_version(config))
    else:
        role = TrainerRole(engine, settings, pad_token_id=_pad_id(engine.model),
                           version=start_version(config))
    resume = config.get("resume")
    if resume:  # the checkpoint's optimizer state (its weights are the model path already),
        # loaded once the role has sharded the model if it shards it
        from workers.engines.protocols import TrainerState

        engine.load_state_dict(TrainerState.load(resume["checkpoint"]))
    return role


def start_version(config: dict[str, Any]) -> int:
    """The policy version the model path holds: 0, or the checkpoint's when resuming."""
    resume = config.get("resume")
    return int(resume["version"]) if resume else 0


def _pad_id(model: Any) -> int:
    """The model's pad token (its EOS when it has none): right padding is masked anyway."""
    cfg = model.config
    for value in (getattr(cfg, "pad_token_id", None), getattr(cfg, "eos_token_id", None)):
        if isinstance(value, int):
            return value
        if isinstance(value, list | tuple) and value:
            return int(value[0])
    return 0
