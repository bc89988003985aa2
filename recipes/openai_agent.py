"""An agent written against the ``openai`` client, trained as it is: ``rollout.endpoint``.

    python -m flowrl.launch recipes/openai_agent.py

The episode below knows nothing of flowrl but ``policy.openai_client()``: it is the loop one
would write against any OpenAI-compatible server. Each rollout worker serves the episode an
endpoint on loopback with a key of its own, and every completion it asks for is recorded into
its trajectory token in, token out (README, "OpenAI-compatible endpoint"), so the run trains the
very tokens the agent saw.

Task: the tiny arithmetic model of ``recipes/tiny_cpu.py`` answers ``a+b=``, then, in a second
turn that continues the same text, ``b+a=``; the reward is the share of the two answers that are
exact. The model is a base model without a chat template, so the agent uses the completions API;
with a chat model it would call ``client.chat.completions.create(messages=...)`` the same way.
"""

from __future__ import annotations

from typing import Any

from flowrl import (
    AlgorithmConfig,
    ArithmeticConfig,
    DataConfig,
    ModelConfig,
    Recipe,
    RolloutConfig,
    TinyModelConfig,
    TrainerConfig,
)


async def episode(policy: Any, example: Any) -> float:
    client = policy.openai_client()
    first = await client.completions.create(model="policy", prompt=example.prompt, max_tokens=4)
    answer = first.choices[0].text
    a, b = example.prompt.rstrip("=").split("+")
    # The second prompt continues the text served so far, as any completions client sends it.
    prompt = f"{example.prompt}{answer}\n{b}+{a}="
    second = await client.completions.create(model="policy", prompt=prompt, max_tokens=4)
    right = [text.strip() == example.answer for text in (answer, second.choices[0].text)]
    return sum(right) / 2


recipe = Recipe(
    steps=200,
    max_staleness=1,
    model=ModelConfig(tiny=TinyModelConfig(corpus="arithmetic", pretrain_steps=200)),
    data=DataConfig(arithmetic=ArithmeticConfig(max_operand=5)),
    algorithm=AlgorithmConfig(group_size=8),
    rollout=RolloutConfig(temperature=1.0, max_new_tokens=4, groups_per_task=2, episode=episode,
                          endpoint=True),
    trainer=TrainerConfig(lr=1e-3, lr_schedule="cosine", min_lr_ratio=0.1, groups_per_step=16,
                          micro_batch_groups=8, threads=1),
)
