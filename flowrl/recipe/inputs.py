"""What a recipe's workers load, checked before any process starts.

`check_inputs` does in the launcher what the workers would do first, and fails the way they
would, but at once and naming the recipe field: it resolves the reward function
(`flowrl.reward_fn`, running the user's module as a reward worker does) and checks that it can
be called as the reward role calls it (or the episode function: an async
``fn(policy, example)``); it reads the data file (and a held-out ``eval.path``) up to its first
usable row; and it loads the config and tokenizer of each model directory (offline), checking
the policy's chat template when ``data.chat_template`` asks for it. A failure raises
`InputError` (the launcher exits with code 2) instead of a worker process dying over and over a
minute later.

Only inputs on this machine are checked (`Recipe.inputs_are_local`): a simulated run loads
none, and a run placed on other nodes reads its files there. transformers is imported only
when there is a model directory to check.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any

from flowrl.data import first_example
from flowrl.episode import resolve_episode_fn
from flowrl.prompts import NoChatTemplate, check_chat_template
from flowrl.recipe.data import DataConfig
from flowrl.recipe.model import TINY_MODEL
from flowrl.recipe.recipe import Recipe
from flowrl.recipe.reward import RewardConfig
from flowrl.reward_fn import RewardFnError, describe_error, resolve_reward_fn

__all__ = ["InputError", "check_data", "check_episode_fn", "check_inputs", "check_model_dir",
           "check_reward_fn", "check_tools"]


class InputError(ValueError):
    """An input named by the recipe (``field``) that its workers could not use."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


def check_inputs(recipe: Recipe) -> None:
    """Raise `InputError` for the first input of ``recipe`` its workers could not use."""
    if not recipe.inputs_are_local:
        return
    if recipe.rollout.episode is not None:
        check_episode_fn(recipe.rollout.episode_ref)
        check_tools(recipe.rollout.tool_refs)
    else:
        check_reward_fn(recipe.reward)
    check_data(recipe.data)
    if recipe.eval is not None and recipe.eval.path is not None:
        check_data(recipe.data, path=recipe.eval.path, field="eval.path")
    if recipe.model.lora is not None and importlib.util.find_spec("peft") is None:
        raise InputError("model.lora", "adapters need the peft package: pip install "
                         "'flowrl[lora]'")
    if recipe.model.path != TINY_MODEL:
        tokenizer = check_model_dir("model.path", recipe.model.path)
        if recipe.data.chat_template:
            try:
                check_chat_template(tokenizer)
            except NoChatTemplate as exc:
                raise InputError(exc.field, exc.detail) from None
    rm, judge = recipe.reward.model, recipe.reward.judge
    if rm is not None and rm.path != TINY_MODEL:
        check_model_dir("reward.model.path", rm.path)
    if judge is not None and judge.path is not None:
        check_model_dir("reward.judge.path", judge.path)


def check_reward_fn(reward: RewardConfig) -> None:
    """The reward function resolves (its module imports, the name is a callable in it) and
    takes the arguments the reward role passes."""
    ref = reward.ref
    if ref is None:
        return
    try:
        fn = resolve_reward_fn(ref)
    except RewardFnError as exc:
        raise InputError("reward.fn", str(exc)) from None
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or an extension's callable: nothing to bind
        return
    meta = {"answer": "1"}  # what `workers.roles.reward_role` passes of a dataset row
    args: tuple[Any, ...] = (["p"], ["r"], [meta]) if reward.batched else ("p", "r")
    try:
        signature.bind(*args, **({} if reward.batched else meta))
    except TypeError as exc:
        call = ("fn(prompts, responses, metas) (reward.batched)" if reward.batched
                else "fn(prompt, response, answer=...)")
        raise InputError("reward.fn", f"{ref!r} cannot be called as {call}: {exc} (it is "
                         f"{getattr(fn, '__name__', 'fn')}{signature})") from None


def check_episode_fn(ref: str | None) -> None:
    """The episode function resolves to an async function taking ``(policy, example)``."""
    if ref is None:
        return
    try:
        resolve_episode_fn(ref)
    except RewardFnError as exc:
        raise InputError("rollout.episode", str(exc)) from None


def check_tools(refs: dict[str, str]) -> None:
    """Every tool resolves to a callable (as its sandbox processes will resolve it)."""
    for name, ref in refs.items():
        try:
            resolve_reward_fn(ref, what=f"tool {name!r}")
        except RewardFnError as exc:
            raise InputError(f"rollout.tools.{name}", str(exc)) from None


def check_data(data: DataConfig, *, path: str | None = None, field: str = "data.path") -> None:
    """A data file (``data.path``, or ``path`` read as the data's kind) opens and has a usable
    row (read up to the first one)."""
    path = path if path is not None else data.path
    if data.kind == "arithmetic" or path is None:
        return
    try:
        first_example(path, kind=data.kind, prompt_key=data.prompt_key,
                      answer_key=data.answer_key, template=data.prompt_template)
    except (OSError, ValueError, ImportError) as exc:
        raise InputError(field, str(exc)) from None


def check_model_dir(field: str, path: str) -> Any:
    """A model directory's config and tokenizer load, offline (as the workers load them); its
    tokenizer."""
    import importlib

    from transformers import AutoConfig, AutoTokenizer

    hf_logging: Any = importlib.import_module("transformers.utils.logging")
    hf_logging.disable_progress_bar()  # the launcher's output is line-oriented
    loaded = []
    for what, auto in (("config", AutoConfig), ("tokenizer", AutoTokenizer)):
        try:
            loaded.append(auto.from_pretrained(path, local_files_only=True))
        except Exception as exc:  # whatever a broken directory makes transformers raise
            raise InputError(field, f"{path!r}: its {what} does not load: "
                                    f"{describe_error(exc)}") from None
    tokenizer = loaded[1]
    # Without tokenizer files transformers makes one of its special tokens alone: every text
    # would encode to unknown tokens.
    if len(tokenizer) <= len(set(tokenizer.all_special_tokens)):
        raise InputError(field, f"{path!r}: its tokenizer has no vocabulary ({len(tokenizer)} "
                                "tokens, all special): are its tokenizer files missing?")
    return tokenizer
