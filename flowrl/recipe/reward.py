"""The ``reward`` section, and references to reward functions that worker processes resolve.

A reward comes from exactly one source: a Python function (`RewardConfig.fn`, the default), a
reward model (`RewardModelConfig`: a sequence-classification model's scalar score of prompt +
response) or a generative judge (`JudgeConfig`: a causal LM prompted with a template, its score
parsed from the text it writes). The last two are served by the reward workers themselves.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_serializer, field_validator, model_validator

from flowrl.recipe.model import TINY_MODEL, TinyModelConfig
from flowrl.recipe.section import _PathText, _rule, _Section, _StopStrings
from flowrl.worker_spec import Dtype, JudgeSpec, RewardModelSpec, RewardSpec

DEFAULT_JUDGE_TEMPLATE = (
    "Rate how well the response answers the question, from 0 (wrong) to 10 (right).\n"
    "Question: {prompt}\n"
    "Response: {response}\n"
    "Score:"
)

def _lookup(obj: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _is_dotted_name(s: str) -> bool:
    return bool(s) and all(p.isidentifier() for p in s.split("."))


def callable_ref(fn: Callable[..., Any]) -> str:
    """A reference worker processes can resolve: ``module:qualname`` or ``/abs/file.py:name``.

    An importable module is preferred. A function defined in a file run as a script or as a
    recipe (``runpy``: no importable module) is referred to by its file, which the worker
    executes as a module. Lambdas, nested functions and callable objects cannot be located and
    raise ValueError.
    """
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if not isinstance(qualname, str) or not isinstance(module, str):
        raise ValueError(f"cannot locate {fn!r} from another process; give a module-level "
                         "function or a 'module:function' string")
    if "<" in qualname:
        raise ValueError(f"{qualname!r} is a lambda or a nested function; worker processes "
                         "can only load module-level functions")
    mod = sys.modules.get(module)
    spec = getattr(mod, "__spec__", None)
    if mod is not None and spec is not None and _lookup(mod, qualname) is fn:
        return f"{spec.name if module == '__main__' else module}:{qualname}"
    code = getattr(fn, "__code__", None)
    filename = getattr(code, "co_filename", "")
    globals_ = getattr(fn, "__globals__", {})
    if (filename.endswith(".py") and Path(filename).is_file() and "." not in qualname
            and globals_.get(qualname) is fn):
        return f"{Path(filename).resolve()}:{qualname}"
    raise ValueError(f"cannot locate {module}.{qualname} from another process: its module is "
                     "not importable and it is not defined at the top of a .py file")


def check_fn_ref(ref: str) -> tuple[str, str]:
    """Split ``"module:function"`` or ``"path/file.py:function"`` into (target, name).

    Checks the syntax only (no import); ValueError says what is wrong.
    """
    target, sep, name = ref.rpartition(":")
    if not sep or not target or not _is_dotted_name(name):
        raise ValueError(f"{ref!r} is not 'module:function' or 'path/to/file.py:function'")
    if not target.endswith(".py") and not _is_dotted_name(target):
        raise ValueError(f"{target!r} is neither a dotted module name nor a .py file")
    return target, name


def locatable(v: str | Callable[..., Any] | None) -> str | Callable[..., Any] | None:
    """``v`` unchanged if a worker process can find it (a ``"module:fn"`` or file reference, or
    a module-level function); ValueError saying why not."""
    try:
        if isinstance(v, str):
            check_fn_ref(v)
        elif v is not None:
            callable_ref(v)
    except ValueError as e:
        raise ValueError(str(e)) from None
    return v


class RewardModelConfig(_Section):
    """A reward model: a sequence-classification model (``num_labels=1``) whose score of the
    text prompt + response is the response's reward, batched per reward task."""

    path: _PathText = Field(min_length=1)
    """A local Hugging Face model directory that ``AutoModelForSequenceClassification`` loads
    (with its tokenizer), or ``"tiny"`` to build a tiny Qwen2 reward model (random weights)."""
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    """Settings of the tiny reward model; only used when `path` is ``"tiny"``."""
    max_length: int = Field(default=512, ge=2, le=1 << 20)
    """Tokens of prompt + response scored; a longer text keeps its end (the response)."""
    batch_size: int = Field(default=16, ge=1, le=4096)
    """Texts per forward pass."""
    dtype: Dtype = "float32"
    """Weights and compute; ``auto`` is bfloat16 where the worker's device supports it."""

    @model_validator(mode="after")
    def _tiny_rules(self) -> RewardModelConfig:
        if self.path != TINY_MODEL:
            if "tiny" in self.model_fields_set:
                raise _rule("tiny", f"tiny-model settings given but path is {self.path!r}, "
                            "not 'tiny'")
            return self
        if self.tiny.pretrain_steps:
            raise _rule("tiny.pretrain_steps", "a tiny reward model keeps random weights; "
                        "it has no language-modelling warm-up")
        if self.max_length > self.tiny.max_positions:
            raise _rule("max_length", f"{self.max_length} exceeds tiny.max_positions = "
                        f"{self.tiny.max_positions}")
        return self


class JudgeConfig(_Section):
    """A generative judge: a causal LM, served by the reward workers with the rollout engine
    code, reads `template` filled with the prompt and response and writes its verdict; the
    reward is the score parsed from that text. Greedy decoding, so a verdict is reproducible."""

    path: _PathText | None = None
    """A local causal LM directory; None: the policy model as the run starts (its initial
    weights, frozen: the judge does not follow training)."""
    template: str = DEFAULT_JUDGE_TEMPLATE
    """The judge's prompt; ``{response}`` (required), ``{prompt}`` and ``{answer}`` (the
    dataset row's reference answer) are replaced literally, other braces stay as written."""
    parse: Literal["number", "yes_no"] = "number"
    """``number``: the first number of the verdict, in ``[min_score, max_score]``, scaled to
    0..1. ``yes_no``: a verdict whose first word is yes scores 1, no scores 0."""
    min_score: float = 0.0
    """The lowest number the judge is asked for (``parse="number"``); it scores 0."""
    max_score: float = 10.0
    """The highest number the judge is asked for (``parse="number"``); it scores 1."""
    default: float = Field(default=0.0, allow_inf_nan=False)
    """The reward of a verdict nothing can be parsed from (counted as failed, kind
    ``unparsable``)."""
    max_new_tokens: int = Field(default=8, ge=1, le=1 << 16)
    """Longest verdict."""
    max_prompt_tokens: int = Field(default=1024, ge=1, le=1 << 20)
    """Longest judge prompt; a longer one keeps its end (where the response and the cue are)."""
    stop: _StopStrings = ("\n",)
    """Strings that end a verdict (besides the model's end-of-sequence token)."""
    engine: Literal["hf", "vllm"] = "hf"
    """The generation engine: ``hf`` (transformers, runs on a CPU) or ``vllm``."""
    dtype: Dtype = "float32"
    """Weights and compute of the judge's engine (as ``rollout.dtype``)."""

    @field_validator("template")
    @classmethod
    def _placeholders(cls, v: str) -> str:
        if "{response}" not in v:
            raise ValueError("the judge template must contain {response}")
        return v

    @model_validator(mode="after")
    def _score_range(self) -> JudgeConfig:
        if not (math.isfinite(self.min_score) and math.isfinite(self.max_score)
                and self.max_score > self.min_score):
            raise _rule("max_score", f"{self.max_score} must be finite and above min_score = "
                        f"{self.min_score}")
        return self


_SOURCES = ("fn", "model", "judge")


class RewardConfig(_Section):
    """Where rewards come from (a function, a reward model or a judge; exactly one) and the
    workers that compute them."""

    fn: str | Callable[..., Any] | None = "workers.roles.builtin_rewards:exact_match"
    """``"module:function"``, ``"path/to/file.py:function"``, or a module-level function.
    Per sample: ``fn(prompt, response, **row_meta) -> float`` (row_meta holds ``answer``);
    batched: ``fn(prompts, responses, metas) -> list[float]``. Sync or async. The default
    applies only when neither `model` nor `judge` is given."""
    model: RewardModelConfig | None = None
    """A reward model instead of `fn`."""
    judge: JudgeConfig | None = None
    """A generative judge instead of `fn`."""
    batched: bool = False
    """Call `fn` once per micro-batch with lists instead of once per sample (a reward model
    and a judge always score a whole reward task at once)."""
    timeout_s: float = Field(default=10.0, gt=0.0, le=3600.0)
    """Per call (with a reward model or a judge: per reward task); a call that takes longer
    scores 0 and is counted as failed."""
    workers: int = Field(default=1, ge=1, le=1024)
    """Reward worker processes."""
    concurrency: int = Field(default=8, ge=1, le=1024)
    """Calls in flight per worker (also the size of its thread pool for sync functions)."""
    threads: int = Field(default=1, ge=1, le=1024)
    """torch threads per reward worker process (what a reward model or judge computes with)."""
    max_failure_share: float = Field(default=0.5, ge=0.0, le=1.0)
    """The run stops when the reward fails (raises, times out, returns garbage) on more than
    this share of a step's samples for `max_failure_steps` steps in a row; 1.0 never stops it.
    A judge's verdict without a score is counted but never stops the run."""
    max_failure_steps: int = Field(default=3, ge=1, le=1_000_000)
    """Consecutive steps over `max_failure_share` that stop the run."""
    max_score: float | None = Field(default=None, allow_inf_nan=False)
    """The highest score the reward gives (1.0 for the built-in rewards), if it has one. The
    stability guard then tells a solved run from a stuck one: a group whose responses all
    scored it is solved, so the guard's ``flat_groups`` and ``entropy`` signals do not count
    it (the step log's ``train_solved_groups``). None: the guard judges from the reward's
    history alone, and may warn about a run that solved its task early."""

    @model_validator(mode="before")
    @classmethod
    def _no_default_fn_beside_a_model(cls, data: Any) -> Any:
        # The default function is the reward only when no model or judge is given.
        if isinstance(data, dict) and "fn" not in data and any(
                data.get(k) is not None for k in ("model", "judge")):
            return {**data, "fn": None}
        return data

    @field_validator("fn")
    @classmethod
    def _locatable(cls, v: str | Callable[..., Any] | None) -> str | Callable[..., Any] | None:
        return locatable(v)

    @model_validator(mode="after")
    def _one_source(self) -> RewardConfig:
        given = [k for k in _SOURCES if getattr(self, k) is not None]
        if not given:
            raise _rule("fn", "no reward: give a function (fn), a reward model (model) or a "
                        "judge (judge)")
        if len(given) > 1:
            raise _rule(given[-1], f"give one reward source, not {' and '.join(given)}")
        if self.fn is None and "batched" in self.model_fields_set:
            raise _rule("batched", f"applies to fn only; a reward {given[0]} scores whole "
                        "reward tasks")
        return self

    @field_serializer("fn", when_used="json")
    def _fn_as_ref(self, v: str | Callable[..., Any] | None) -> str | None:
        return self.ref

    @property
    def ref(self) -> str | None:
        """`fn` as a reference string that worker processes resolve; None without `fn`."""
        if self.fn is None:
            return None
        return self.fn if isinstance(self.fn, str) else callable_ref(self.fn)

    def spec(self) -> RewardSpec:
        """What reward workers are told (a tiny reward model's path as given: the launcher
        resolves it)."""
        return RewardSpec(
            fn=self.ref, batched=self.batched, timeout_s=self.timeout_s,
            concurrency=self.concurrency, max_score=self.max_score,
            model=None if self.model is None else RewardModelSpec(
                **self.model.model_dump(exclude={"tiny"})),
            judge=None if self.judge is None else JudgeSpec(**self.judge.model_dump()))
