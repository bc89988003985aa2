"""How well a policy answers its recipe's task: exact answers over the task's distinct prompts.

`exact_accuracy` loads a model directory (an untrained model, a run's final checkpoint, a model
another trainer saved) into flowrl's rollout engine (`HFRolloutEngine`) in this process and
answers every distinct prompt of the recipe's dataset (36 for the default recipe's ``a+b=``)
twice over: greedily once, and ``samples`` times at the recipe's temperature, top-p and
response length. A response counts when `exact_match` accepts it, the check under which the
recipe's rewards give 1.0. Prompts are tokenized (`flowrl.prompts.encode_prompt`, through
the chat template when the recipe says so) and responses decoded as the rollout and reward
roles do. The result does not depend on the machine's timing: greedy decoding has no
randomness and the samples are drawn from a seeded stream per prompt.

    python bench/task_accuracy.py [MODEL_DIR] [--samples N] [--set KEY=VALUE ...]

prints one JSON line for ``MODEL_DIR`` (default: the default recipe's untrained model) on the
default recipe's task.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowrl.data import Example, distinct_examples
from flowrl.prompts import encode_prompt
from flowrl.recipe import Recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny_cpu.py"
DEFAULT_SAMPLES = 32


def task_prompts(recipe: Recipe) -> list[Example]:
    """The distinct examples of the recipe's dataset, in the order they first appear."""
    from workers.roles.factory import dataset_from_config

    return distinct_examples(dataset_from_config(recipe.engine_config()).examples)


def exact_accuracy(model_dir: str | Path, recipe: Recipe, *, samples: int = DEFAULT_SAMPLES,
                   seed: int = 0, tokenizer_dir: str | Path | None = None) -> dict[str, Any]:
    """``greedy_exact``: prompts answered exactly by greedy decoding (0..``prompts``);
    ``sampled_exact``: the share of the ``prompts × samples`` sampled responses that are exact
    (0..1); ``prompts``, ``samples``. ``seed`` picks the sampled responses; ``tokenizer_dir``:
    where the tokenizer is, when not beside the weights."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    from workers.engines.hf_rollout import HFRolloutEngine
    from workers.engines.protocols import SamplingParams, mix_seed
    from workers.roles.builtin_rewards import exact_match
    from workers.roles.factory import load_tokenizer, sampling_from_config

    examples = task_prompts(recipe)
    path = Path(model_dir)
    tokenizer = load_tokenizer(Path(tokenizer_dir) if tokenizer_dir is not None else path)
    engine = HFRolloutEngine(path)
    keep = recipe.data.max_prompt_tokens  # the end of a prompt, as the rollout role keeps
    data = recipe.data  # prompts encoded as the rollout role encodes them
    prompts = [encode_prompt(tokenizer, e.prompt, chat_template=data.chat_template,
                             system_prompt=data.system_prompt)[-keep:] for e in examples]
    sampling = sampling_from_config(recipe.engine_config())

    def exact(params: SamplingParams) -> list[bool]:
        gens = engine.generate(prompts, params)
        texts = tokenizer.batch_decode([g.response_ids.tolist() for g in gens],
                                       skip_special_tokens=True)
        return [exact_match(examples[g.prompt_index].prompt, text,
                            answer=examples[g.prompt_index].answer) == 1.0
                for g, text in zip(gens, texts, strict=True)]

    greedy = exact(SamplingParams(temperature=0.0, max_new_tokens=sampling.max_new_tokens,
                                  stop=sampling.stop))
    seeds = tuple(mix_seed(seed, i) for i in range(len(prompts)))
    sampled = exact(SamplingParams(
        temperature=sampling.temperature, top_p=sampling.top_p,
        max_new_tokens=sampling.max_new_tokens, stop=sampling.stop, n=samples,
        prompt_seeds=seeds))
    return {"greedy_exact": sum(greedy), "sampled_exact": round(sum(sampled) / len(sampled), 4),
            "prompts": len(prompts), "samples": samples}


def main(argv: list[str] | None = None) -> None:
    from flowrl.logs import configure
    from flowrl.recipe_file import load_recipe
    from flowrl.run import prepare_model

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", nargs="?", type=Path,
                   help="a model directory (default: the recipe's untrained model)")
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES,
                   help=f"sampled responses per prompt (default {DEFAULT_SAMPLES})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the recipe, as the launcher's --set")
    args = p.parse_args(argv)
    if args.samples < 1:
        p.error("--samples must be >= 1")
    configure(level="warning")
    recipe = load_recipe(RECIPE, args.overrides)
    model_dir = args.model_dir or prepare_model(recipe)
    if model_dir is None:
        p.error("the recipe has no model to evaluate (a simulated engine)")
    print(json.dumps({**exact_accuracy(model_dir, recipe, samples=args.samples),
                      "model_dir": str(model_dir)}))


if __name__ == "__main__":
    main()
