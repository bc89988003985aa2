"""GRPO on GSM8K with a real model: a local Hugging Face model directory and a local JSONL file.

    python -m flowrl.launch recipes/gsm8k.py \\
        --set model.path=/models/Qwen2.5-0.5B-Instruct --set data.path=data/gsm8k_train.jsonl

or give the two paths as environment variables, ``FLOWRL_MODEL=... FLOWRL_DATA=...``; ``--set``
wins over the environment. A missing one fails at once naming the field and both ways to give
it; a path that is not a model directory (no ``config.json``) or not a file fails before any
process starts, naming the field and the path.

Data: one JSON object per line, GSM8K's own layout::

    {"question": "Natalia sold clips to 48 of her friends ...", "answer": "... #### 72"}

Malformed lines (not JSON, a missing key, a question that is not a string) are skipped and
counted in a warning, not fatal. Each question is wrapped in `TEMPLATE`. A Parquet file with
the same columns (GSM8K as the Hugging Face Hub ships it) works too: ``--set data.kind=parquet``
(needs pyarrow: ``pip install 'flowrl[parquet]'``). An instruct model gets each templated question
through its chat template with ``--set data.chat_template=true``; ``--set eval.every=20 --set
eval.path=data/gsm8k_test.jsonl`` validates on the test split (greedy and sampled accuracy).

Reward: ``workers.roles.builtin_rewards.gsm8k_numeric_batch``: 1.0 when the response's final number
(``#### N``, ``\\boxed{N}``, ``the answer is N``, else its last number) equals the number after
``####`` in the answer, compared as decimals (``1,234`` = ``1234``, ``3.50`` = ``3.5``), else 0.

GPU defaults (one device shared by rollout and trainer): the rollout engine in bfloat16 where the
device supports it (the trainer keeps float32 weights), responses up to 1024 tokens, groups of 8
responses, 16 prompts per optimizer step in micro-batches of 2 groups, no KL term (no reference
model), rollout up to one policy version ahead of training (``max_staleness=1``, stale samples
corrected by truncated importance sampling).

CPU variant (a 0.5B model on a few cores; minutes per step)::

    python -m flowrl.launch recipes/gsm8k.py --set model.path=... --set data.path=... \\
        --set rollout.max_new_tokens=256 --set trainer.groups_per_step=4 \\
        --set trainer.micro_batch_groups=1 --set rollout.threads=2 --set trainer.threads=2

(``rollout.dtype="auto"`` is float32 on a CPU.)
"""

from flowrl import (
    AlgorithmConfig,
    DataConfig,
    ModelConfig,
    Recipe,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
    given,
)

TEMPLATE = (
    "Question: {prompt}\n"
    "Solve the problem step by step. Write the final answer as a number on the last line, "
    "after \"####\".\n"
    "Answer:"
)

recipe = Recipe(
    steps=200,
    max_staleness=1,
    model=ModelConfig(path=given("model.path", env="FLOWRL_MODEL",
                                 what="a local Hugging Face model directory")),
    data=DataConfig(
        kind="jsonl",
        path=given("data.path", env="FLOWRL_DATA", what="a GSM8K-style JSONL file"),
        prompt_key="question",
        answer_key="answer",
        prompt_template=TEMPLATE,
        max_prompt_tokens=512,
    ),
    algorithm=AlgorithmConfig(group_size=8, kl_coef=0.0),
    rollout=RolloutConfig(dtype="auto", temperature=1.0, max_new_tokens=1024,
                          stop=("\nQuestion:",)),
    # Batched: one call (one reward thread) per reward task instead of one per response.
    reward=RewardConfig(fn="workers.roles.builtin_rewards:gsm8k_numeric_batch", batched=True,
                        max_score=1.0),
    trainer=TrainerConfig(lr=1e-6, groups_per_step=16, micro_batch_groups=2, warmup_steps=10),
)
