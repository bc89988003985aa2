"""GRPO with a reward model instead of a reward function: the tiny task, all of it on a CPU.

    python -m flowrl.launch recipes/tiny_reward_model.py

Policy: the default job's tiny Qwen2 model (``flowrl.tiny_model``) without its warm start, so
the model builds in seconds. Task: ``a+b=`` with ``a, b`` in ``0..5``.

Reward: a reward model (``reward.model``), here a tiny Qwen2 sequence classifier with one label
(``Qwen2ForSequenceClassification``, ``num_labels=1``; ``path="tiny"``), built locally by
``flowrl.tiny_model`` like the policy and cached under ``~/.cache/flowrl/models``. A reward
worker process loads it and scores each response as the model's scalar output for prompt +
response (at most ``max_length`` tokens, the end kept), ``batch_size`` texts per forward pass,
one call per reward task, on the worker's device (CUDA, NPU, else CPU). Its weights are random:
the run shows the pipeline, not learning; the policy drifts towards whatever the random scorer
happens to prefer.

A real reward model is any local Hugging Face directory that
``AutoModelForSequenceClassification`` loads with one label::

    python -m flowrl.launch recipes/tiny_reward_model.py --set reward.model.path=/models/rm \\
        --set reward.timeout_s=60

A directory without ``config.json``, or with a classifier of more than one label, fails before
any process starts, naming ``reward.model.path``.

A generative judge instead (``reward.judge``: the policy's initial model prompted with a
template, its verdict parsed as a 0-10 score; this random model's verdicts are mostly
unparsable, so they score ``reward.judge.default`` and are counted as ``reward failed``)::

    python -m flowrl.launch recipes/tiny_reward_model.py --set reward.model=null \\
        --set 'reward.judge={"max_prompt_tokens": 96}'

The 20 steps train in about 5 s. The whole command, two model builds and the start of four
processes included, took 55 s on two cores shared with other work (load average 7), 35 s with
the models already cached (load average 9); on quiet cores start-up is most of it.
"""

from flowrl import (
    AlgorithmConfig,
    ArithmeticConfig,
    DataConfig,
    ModelConfig,
    Recipe,
    RewardConfig,
    RewardModelConfig,
    RolloutConfig,
    TinyModelConfig,
    TrainerConfig,
)

recipe = Recipe(
    steps=20,
    max_staleness=1,
    model=ModelConfig(tiny=TinyModelConfig(corpus="arithmetic")),
    data=DataConfig(arithmetic=ArithmeticConfig(max_operand=5)),
    algorithm=AlgorithmConfig(group_size=8),
    rollout=RolloutConfig(temperature=1.0, max_new_tokens=4, groups_per_task=2, threads=1),
    reward=RewardConfig(model=RewardModelConfig(path="tiny", max_length=64, batch_size=16)),
    trainer=TrainerConfig(lr=1e-3, groups_per_step=8, micro_batch_groups=4, threads=1),
)
