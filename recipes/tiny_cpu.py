"""The default job (``make demo``): GRPO teaches a tiny model small sums, on two CPU cores.

    python -m flowrl.launch recipes/tiny_cpu.py                        # about 1 min
    python -m flowrl.launch recipes/tiny_cpu.py --set max_staleness=0  # synchronous

Model: a ~0.9M-parameter Qwen2 built locally (``flowrl.tiny_model``, byte-level tokenizer) and
cached under ``~/.cache/flowrl/models``. Its warm start is 200 language-modelling steps (~10 s
on two free cores) on a corpus of single-digit ``a+b=c``, ``a-b=c`` and ``a*b=c`` lines: enough
to answer in the right format (digits, then end of text), not enough to know the sums: it
answers 12% of this task's prompts exactly at temperature 1 (6 of 36 greedily).

Task: ``a+b=`` with ``a, b`` in ``0..5`` (36 distinct prompts), the answer checked exactly. The
reward (``workers.roles.builtin_rewards.numeric_partial_credit``) is 1.0 for the exact sum, at most
0.5 for another number (less the farther it is), 0.0 for anything else. RL alone lifts the mean
reward from about 0.45 over the first ten steps to 0.90-0.96 over the last ten: ten runs of ten
learned (five seeds, each alone and beside two CPU-bound processes; ``bench/learning.py``,
2026-12-01), 72-157 s of training on shared cores. 400 steps, not 300: at 300 the slowest runs
were still climbing (0.81-0.82 at the end of two loaded runs). Those figures are of one CPU's
build: on an AVX-512 Xeon (2026-12-02) the build answers 2 of 36 greedily and two runs ended at
0.67 and 0.50 (README.md, "On another CPU"). Another build of the same model
(``model.tiny.seed=1``) warm-starts worse and collapses at ~0.55; bench/README.md has the
figures.

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
    model=ModelConfig(tiny=TinyModelConfig(corpus="arithmetic", pretrain_steps=200)),
    data=DataConfig(arithmetic=ArithmeticConfig(max_operand=5)),
    algorithm=AlgorithmConfig(group_size=8),
    # Two groups per generate call: ~1.4x the samples/s of one (bench/README.md).
    rollout=RolloutConfig(temperature=1.0, max_new_tokens=4, groups_per_task=2, threads=1),
    # Batched: one call per reward task (one thread) instead of one per response.
    reward=RewardConfig(fn="workers.roles.builtin_rewards:numeric_partial_credit_batch",
                        batched=True),
    trainer=TrainerConfig(lr=1e-3, lr_schedule="cosine", min_lr_ratio=0.1, groups_per_step=16,
                          micro_batch_groups=8, threads=1),
)
