"""LoRA policies and gradient checkpointing on a real tiny Qwen2: the adapter-only weight payload
(small, and the rollout engine serves exactly the merged model from it), the stability guard's
copy of only what trains, checkpointed layers computing the same loss and gradients, the
recipe's rules, and one real launch whose final model is merged and loads with plain
transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch import Tensor

from flowrl.recipe import LoraConfig, ModelConfig, Recipe, TrainerConfig
from flowrl.tiny_model import build_tiny_model
from flowrl.worker_spec import LoraSpec, ResumeSpec
from workers.devices import set_threads
from workers.engines import HFRolloutEngine, SequenceBatch, TorchTrainerEngine
from workers.engines.lora import SCALE_KEY, is_adapter_payload, payload_from_dir, payload_nbytes
from workers.roles.factory import make_hf_role
from workers.roles.guard_orders import GuardOrders
from workers.roles.trainer import _load_into

set_threads(2)

pytest.importorskip("peft")

PAD = 1
ROWS = SequenceBatch.from_rows([[18, 19, 12, 24, 30], [21, 22, 11], [5, 6]],
                               [[40, 41, 42], [7, 8], [9, 10, 11, 12]], pad_token_id=PAD)
IDS = torch.tensor([[18, 19, 12, 24, 30, 40, 41, 42], [5, 6, 9, 10, 11, 12, 13, 14]])


def lora_spec(sync: str = "adapter", dropout: float = 0.0) -> LoraSpec:
    return LoraSpec(rank=4, alpha=8, dropout=dropout, target_modules="all-linear",
                    sync=sync)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("lora") / "tiny")


def nll(lps: Tensor, batch: SequenceBatch) -> Tensor:
    return -(lps * batch.response_mask).sum()


def trained(model_dir: Path, steps: int = 2, **kwargs: Any) -> TorchTrainerEngine:
    """A LoRA trainer moved off its initial adapters (B starts at zero)."""
    engine = TorchTrainerEngine(model_dir, lr=1e-2, device="cpu", **kwargs)
    for _ in range(steps):
        engine.train_micro_batch(ROWS, nll)
        engine.optimizer_step()
    return engine


def logits(engine: HFRolloutEngine) -> Tensor:
    with torch.no_grad():
        out: Tensor = engine.model(input_ids=IDS).logits
    return out


# ---- the adapter-only payload --------------------------------------------------------------------


def test_the_adapter_payload_is_small_and_rollout_serves_the_merged_model(model_dir: Path) -> None:
    """A version's payload is the adapters alone, a small share of the weights; the rollout
    engine rebuilds from it, on its own base copy, exactly the merged weights the trainer
    saves (equal logits), for each version in turn; a bad payload changes nothing."""
    trainer = trained(model_dir, lora=lora_spec())
    payload = trainer.export_weights()
    assert is_adapter_payload(payload)
    assert all(k == SCALE_KEY or k.endswith((".lora_A", ".lora_B")) for k in payload)
    whole = trainer.whole_state()
    full = payload_nbytes({k: v for k, v in whole.items() if k != "lm_head.weight"})
    assert payload_nbytes(payload) * 10 < full  # rank 4 on a hidden size of 128

    served, merged = (HFRolloutEngine(model_dir, device="cpu") for _ in range(2))
    base = logits(served)
    served.load_weights(payload, 2)
    merged.load_weights(whole, 2)
    assert served.version == 2
    assert not torch.equal(logits(served), base)  # the adapters do something
    assert torch.equal(logits(served), logits(merged))
    # The trainer computes the same function unmerged (up to float rounding).
    with torch.no_grad():
        own = trainer.model(input_ids=IDS).logits
    torch.testing.assert_close(own, logits(merged), rtol=0, atol=1e-4)

    # The next version merges into the base, not into the previous version.
    trainer.train_micro_batch(ROWS, nll)
    trainer.optimizer_step()
    served.load_weights(trainer.export_weights(), 3)
    merged.load_weights(trainer.whole_state(), 3)
    assert torch.equal(logits(served), logits(merged))

    before = logits(served)
    (name, a), *_ = ((k, v) for k, v in payload.items() if k.endswith(".lora_A"))
    with pytest.raises(ValueError, match="adapter makes"):
        served.load_weights({**payload, name: a[:, :-1]}, 4)
    with pytest.raises(KeyError, match="unknown weight"):
        served.load_weights({**payload, "nowhere.lora_A": a, "nowhere.lora_B": a.T}, 4)
    assert served.version == 3
    assert torch.equal(logits(served), before)


def test_merged_sync_publishes_whole_weights_with_the_adapters_beside(model_dir: Path) -> None:
    """For an engine that loads whole weights only (vLLM): merged weights named as the base
    model names them, plus the adapters, from which a restarted trainer takes its own."""
    trainer = trained(model_dir, lora=lora_spec("merged"))
    payload = trainer.export_weights()
    base = TorchTrainerEngine(model_dir, device="cpu").export_weights()
    assert set(base) < set(payload)
    assert is_adapter_payload(payload)
    joined = TorchTrainerEngine(model_dir, device="cpu", lora=lora_spec("merged"), seed=5)
    _load_into(joined, payload)
    again = joined.export_weights()
    assert all(torch.equal(v, again[k]) for k, v in payload.items())


def test_the_final_model_is_merged_and_the_adapter_saved(model_dir: Path, tmp_path: Path) -> None:
    """`save_pretrained` writes merged weights under the base model's names (plain
    transformers loads them and computes the trained policy) and peft's adapter files, which
    read back to the payload the trainer publishes."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    trainer = trained(model_dir, lora=lora_spec())
    out = trainer.save_pretrained(tmp_path / "final")
    assert load_file(out / "model.safetensors").keys() == load_file(
        model_dir / "model.safetensors").keys()
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=IDS).logits,
                                   trainer.model(input_ids=IDS).logits, rtol=0, atol=1e-4)
    saved, published = payload_from_dir(out / "adapter"), trainer.export_weights()
    assert saved.keys() == published.keys()
    assert all(torch.equal(saved[k], published[k]) for k in saved)


def test_the_guard_keeps_only_the_adapters_and_rolls_back_to_them(model_dir: Path) -> None:
    trainer = trained(model_dir, lora=lora_spec())
    orders = GuardOrders()
    orders.at_step_start(trainer, {"keep_from": 2, "step": 2}, version=2, load=_load_into)
    kept = orders._copy
    assert kept is not None
    assert is_adapter_payload(kept.weights)
    assert payload_nbytes(kept.weights) * 10 < payload_nbytes(trainer.whole_state())
    good = trainer.export_weights()
    trainer.train_micro_batch(ROWS, nll)
    trainer.optimizer_step()
    moved, first = trainer.export_weights(), next(k for k in good if k.endswith("lora_B"))
    assert not torch.equal(moved[first], good[first])
    orders.at_step_start(trainer, {"rollback": {"id": 1, "version": 2}, "step": 3},
                         version=3, load=_load_into)
    restored = trainer.export_weights()
    assert all(torch.equal(restored[k], v) for k, v in good.items())
    assert trainer.step == 3  # the schedule keeps its place


def test_a_resumed_run_continues_the_adapter_on_the_initial_model(model_dir: Path,
                                                                   tmp_path: Path) -> None:
    """Resuming, the trainer and the HF rollout engine start from the initial model (not the
    checkpoint's merged weights, which the adapter must not be merged into twice) with the
    checkpoint's adapter: the trainer publishes what it published, and rollout serves it."""
    trainer = trained(model_dir, lora=lora_spec())
    checkpoint = tmp_path / "step_2"
    trainer.save_pretrained(checkpoint)
    trainer.state_dict().save(checkpoint)
    recipe = Recipe(steps=4, model=ModelConfig(path=str(model_dir), lora=LoraConfig(
        rank=4, alpha=8)))
    spec = recipe.engine_spec().model_copy(update={
        "model": recipe.engine_spec().model.model_copy(update={
            "path": str(checkpoint), "reference_path": str(model_dir)}),
        "resume": ResumeSpec(checkpoint=str(checkpoint), version=2)})
    train = make_hf_role("train", spec, seed=3)
    published, resumed = trainer.export_weights(), train.engine.export_weights()  # type: ignore[attr-defined]
    assert all(torch.equal(resumed[k], v) for k, v in published.items())
    rollout = make_hf_role("rollout", spec, seed=3).engine  # type: ignore[attr-defined]
    merged = HFRolloutEngine(model_dir, device="cpu")
    merged.load_weights(trainer.whole_state(), 2)
    assert rollout.version == 2
    assert torch.equal(logits(rollout), logits(merged))


# ---- gradient checkpointing ----------------------------------------------------------------------


def saved_bytes_and_grads(engine: TorchTrainerEngine) -> tuple[int, float, dict[str, Tensor]]:
    """The bytes autograd keeps for the backward outside checkpointed layers, the loss, and
    the gradients of one micro-batch (dropout drawn from the same seed)."""
    kept = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal kept
        kept += t.numel() * t.element_size()
        return t

    torch.manual_seed(7)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine.train_micro_batch(ROWS, nll)["loss"]
    grads = {n: p.grad.clone() for n, p in engine.model.named_parameters()
             if p.grad is not None}
    return kept, loss, grads


@pytest.mark.parametrize("lora", [None, lora_spec(dropout=0.2)], ids=["full", "lora"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(
    model_dir: Path, lora: LoraSpec | None,
) -> None:
    """Checkpointed decoder layers keep far less for the backward and recompute the same
    loss and gradients (a dropped-out adapter input replays its mask)."""
    plain = TorchTrainerEngine(model_dir, device="cpu", lora=lora)
    ckpt = TorchTrainerEngine(model_dir, device="cpu", lora=lora, gradient_checkpointing=True)
    kept, loss, grads = saved_bytes_and_grads(plain)
    kept_ckpt, loss_ckpt, grads_ckpt = saved_bytes_and_grads(ckpt)
    assert kept_ckpt * 2 < kept
    assert loss_ckpt == pytest.approx(loss, rel=1e-6)
    assert grads.keys() == grads_ckpt.keys()
    assert grads
    for name, g in grads.items():
        torch.testing.assert_close(grads_ckpt[name], g, rtol=1e-5, atol=1e-7, msg=name)
    with torch.no_grad():  # scoring is not checkpointed and drops nothing out
        torch.testing.assert_close(ckpt.logprobs(ROWS), plain.logprobs(ROWS), rtol=0, atol=0)


# ---- the recipe ----------------------------------------------------------------------------------


def test_the_recipe_carries_lora_and_checkpointing_to_the_workers() -> None:
    recipe = Recipe(steps=1, model=ModelConfig(lora=LoraConfig(rank=8, target_modules=("q_proj",
                    "v_proj"))), trainer=TrainerConfig(gradient_checkpointing=True))
    spec = recipe.engine_spec()
    assert spec.model.lora == LoraSpec(rank=8, alpha=32, dropout=0.0,
                                       target_modules=("q_proj", "v_proj"), sync="adapter")
    assert spec.trainer.gradient_checkpointing
    vllm = recipe.model_copy(update={"rollout": recipe.rollout.model_copy(
        update={"engine": "vllm"})})
    assert vllm.engine_spec().model.lora is not None
    assert vllm.engine_spec().model.lora.sync == "merged"  # type: ignore[union-attr]
    assert Recipe(steps=1).engine_spec().model.lora is None
    with pytest.raises(ValidationError, match="target_modules"):
        LoraConfig(target_modules=())
    with pytest.raises(ValidationError, match="replicated ranks only"):
        Recipe(steps=1, model=ModelConfig(lora=LoraConfig()),
               trainer=TrainerConfig(ranks=2, groups_per_step=2, sharding="fsdp2"))


# ---- a real run ----------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_lora_run_ends_with_a_merged_final_model(tmp_path: Path) -> None:
    """The tiny recipe with adapters and checkpointed layers: the final model holds the base
    model's weight names, loads with plain transformers and is the trained policy (not the
    initial one); its adapter is saved beside it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out, cache = tmp_path / "run", tmp_path / "cache"
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    done = subprocess.run(
        [sys.executable, "-m", "flowrl.launch", str(ROOT / "recipes" / "tiny_cpu.py"),
         "--steps", "3", "--output", str(out), "--no-monitor",
         "--set", "model.tiny.pretrain_steps=0", "--set", "trainer.groups_per_step=2",
         "--set", "trainer.micro_batch_groups=1", "--set", "algorithm.group_size=4",
         "--set", "trainer.lr=1e-3", "--set", "model.lora.rank=4",
         "--set", "trainer.gradient_checkpointing=true"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    final = out / "final"
    assert done.stdout.splitlines()[-1] == f"model saved to {final}"
    assert json.loads(done.stdout.splitlines()[-2])["version"] == 3
    (start,) = (cache / "flowrl" / "models").glob("tiny-*/model.safetensors")
    before, after = load_file(start), load_file(final / "model.safetensors")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert (final / "adapter" / "adapter_model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(final)
    assert torch.equal(model.state_dict()["model.norm.weight"], after["model.norm.weight"])
