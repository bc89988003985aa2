"""The default job (``make demo``): GRPO teaches a tiny model small sums, on two CPU cores.

    python -m flowrl.launch recipes/tiny_cpu.py                        # about 1 min (+1 to build)
    python -m flowrl.launch recipes/tiny_cpu.py --set max_staleness=0  # synchronous

Model: a ~0.9M-parameter Qwen2 built locally (``flowrl.tiny_model``, byte-level tokenizer) and
cached under ``~/.cache/flowrl/models``. Its warm start is language modelling on a corpus of
single-digit ``a+b=c``, ``a-b=c`` and ``a*b=c`` lines until the model answers half of the
corpus's distinct questions exactly (``pretrain_until=0.5``, checked every 100 steps; at most
4000 steps): 1400-1800 steps here, a minute or two on two cores, once. A fixed number of steps
(200 before) left models built on different CPUs knowing very different amounts, because the
model learns its facts suddenly, at a step that depends on the CPU's floating-point kernels:
at 200 steps one CPU's build answered 6 of this task's 36 prompts greedily and learnt, another
CPU's answered 2, and its runs ended at ~0.5, most answering 6 of 36 greedily: what answering 5,
the most common sum, to every prompt gets.

Task: ``a+b=`` with ``a, b`` in ``0..5`` (36 distinct prompts), the answer checked exactly. The
reward (``workers.roles.builtin_rewards.numeric_partial_credit``) is 1.0 for the exact sum, at most
0.5 for another number (less the farther it is), 0.0 for anything else. The warm start answers
12-28 of the 36 prompts greedily (28-63% of its samples at temperature 1), depending on the
build; RL lifts the mean reward from 0.62-0.80 over the first ten steps to 0.77-0.97 over the
last ten (three builds, ``model.tiny.seed`` 0-2, on an AVX-512 Xeon, 2026-12-02;
``bench/learning.py``), 73-103 s of training. The weakest build (seed 2) knew the fewest sums
when it stopped (the target counts all three operations, the task only small sums) and is
the one that ends lowest. bench/README.md has the figures and what was tried.

Asynchronous: rollout runs up to one policy version ahead of training (``max_staleness=1``),
and stale samples are corrected by truncated importance sampling. Each compute process (rollout,
trainer) gets one torch thread, so the two overlap on two cores instead of fighting over them.
A rollout task samples two groups (16 responses) in one engine call, and a step's 16 groups
are trained in two micro-batches of 8, so training starts on the first half of a step while
the second half is still generating (this matters at ``max_staleness=0``). Rollout then runs a
full version ahead, and the learning rate decays (cosine, to a tenth) so that late steps on
one-version-old samples do not undo what was learnt: with a constant rate, two groups per task
ended at 0.75-0.89 (one run in six collapsed to 0.52 in an earlier session), one group per
task at 0.86-0.90 and half the speed.
"""

from flowrl import (
    AlgorithmConfig,
    ArithmeticConfig,
    DataConfig,
    ModelConfig,
    Recipe,
    RewardConfig,
    RolloutConfig,
    TinyModelConfig,
    TrainerConfig,
)

recipe = Recipe(
    steps=400,
    max_staleness=1,
    model=ModelConfig(tiny=TinyModelConfig(corpus="arithmetic", pretrain_steps=4000,
                                         pretrain_until=0.5)),
    data=DataConfig(arithmetic=ArithmeticConfig(max_operand=5)),
    algorithm=AlgorithmConfig(group_size=8),
    # Two groups per generate call: ~1.4x the samples/s of one (bench/README.md).
    rollout=RolloutConfig(temperature=1.0, max_new_tokens=4, groups_per_task=2, threads=1),
    # Batched: one call per reward task (one thread) instead of one per response.
    # The reward's maximum tells the stability guard a solved task from a stuck one.
    reward=RewardConfig(fn="workers.roles.builtin_rewards:numeric_partial_credit_batch",
                        batched=True, max_score=1.0),
    trainer=TrainerConfig(lr=1e-3, lr_schedule="cosine", min_lr_ratio=0.1, groups_per_step=16,
                          micro_batch_groups=8, threads=1),
)
