"""The default job (``make demo``): GRPO teaches a tiny model small sums, on two CPU cores.

    python -m flowrl.launch recipes/tiny_cpu.py                        # 1-2 min
    python -m flowrl.launch recipes/tiny_cpu.py --set max_staleness=0  # synchronous

Model: a ~0.9M-parameter Qwen2 built locally (``workers.tiny_model``, byte-level tokenizer) and
cached under ``~/.cache/flowrl/models``. Its warm start is 200 language-modelling steps (~10 s
on two free cores) on a corpus of single-digit ``a+b=c``, ``a-b=c`` and ``a*b=c`` lines: enough
to answer in the right format (digits, then end of text), not enough to know the sums: it
answers 12% of this task's prompts exactly at temperature 1 (6 of 36 greedily).

Task: ``a+b=`` with ``a, b`` in ``0..5`` (36 distinct prompts), the answer checked exactly. The
reward (``workers.roles.rewards.numeric_partial_credit``) is 1.0 for the exact sum, at most 0.5
for another number (less the farther it is), 0.0 for anything else. RL alone lifts the mean
reward from about 0.45 over the first ten steps to 0.77-0.94 over the last ten (seven runs,
about 1.5 minutes each on two quiet cores). bench/README.md has the measured figures.

Asynchronous: rollout runs up to one policy version ahead of training (``max_staleness=1``),
and stale samples are corrected by truncated importance sampling. Each compute process (rollout,
trainer) gets one torch thread, so the two overlap on two cores instead of fighting over them.
A rollout task samples one group (8 responses) in one engine call, and a step's 16 groups are
trained in two micro-batches of 8, so training starts on the first half of a step while the
second half is still generating (this matters at ``max_staleness=0``).
"""

from flowrl.recipe import (
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
    steps=300,
    max_staleness=1,
    model=ModelConfig(tiny=TinyModelConfig(corpus="arithmetic", pretrain_steps=200)),
    data=DataConfig(arithmetic=ArithmeticConfig(max_operand=5)),
    algorithm=AlgorithmConfig(group_size=8),
    # One group per generate call. `--set rollout.groups_per_task=2` doubles throughput here, but
    # then every sample is one version old and 1 run in 6 collapsed late (0.52 at step 300);
    # with one group rollout paces training and most samples are fresh (bench/README.md).
    rollout=RolloutConfig(temperature=1.0, max_new_tokens=4, groups_per_task=1, threads=1),
    # Batched: one call per reward task (one thread) instead of one per response.
    reward=RewardConfig(fn="workers.roles.rewards:numeric_partial_credit_batch", batched=True),
    trainer=TrainerConfig(lr=1e-3, groups_per_step=16, micro_batch_groups=8, threads=1),
)
