"""A multi-turn job on two CPU cores: a tiny model learns to call a calculator for its sums.

    python -m flowrl.launch recipes/tool_cpu.py

Task: ``a+b=`` with ``a, b`` in ``0..99``. The tiny model (``flowrl.tiny_model``, ~0.9M
parameters, built here and cached) cannot add two-digit numbers. Each response is an episode
(`episode` below): the policy either answers at once, or calls the ``add`` tool
(`` CALL add 37 45``), which runs in a tool sandbox process; the episode inserts its result as
a ``tool`` message (``tool: 82``, masked out of the loss) and the policy gives its final answer.
The reward is 1 for the exact sum, 0 otherwise: a call with operands other than the prompt's
gives a wrong result, so the policy must copy the operands into its call and the tool's result
into its answer.

Warm start: the ``tool_calls`` corpus (`flowrl.tiny_model.tool_call_line`) teaches both
formats, half and half: the call, with its result and the answer copied from it, and the
direct answer, always a random number. It teaches the format, not the habit: the warm model
calls the tool about half the time and its direct answers are right by chance only. RL has to
learn that calling pays. README ("Multi-turn episodes") has the measured figures;
``bench/tool_learning.py`` measures them.
"""

from __future__ import annotations

import re
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

# The call as the warm start writes it (`flowrl.tiny_model.tool_call_line`).
_CALL = re.compile(r"CALL add (\d{1,3}) (\d{1,3})")


def add(a: int, b: int) -> int:
    """The calculator (run in a tool sandbox, never in the rollout worker)."""
    return a + b


async def episode(policy: Any, example: Any) -> float:
    """One attempt at ``example`` (``prompt``, ``answer``) against the policy handle
    (`flowrl.episode.Policy`): a direct answer, or a call, its result, then the answer."""
    policy.add(example.prompt)
    turn = await policy.generate()
    answer = turn.text
    if "CALL" in answer:
        call = _CALL.fullmatch(answer.strip())
        if call is None:  # a malformed call answers nothing
            return 0.0
        result = await policy.call_tool("add", a=int(call[1]), b=int(call[2]))
        policy.add(result.text, role="tool")
        answer = (await policy.generate(max_new_tokens=5)).text
    return 1.0 if answer.strip() == example.answer else 0.0


recipe = Recipe(
    steps=80,
    max_staleness=1,
    model=ModelConfig(tiny=TinyModelConfig(corpus="tool_calls", pretrain_steps=1000)),
    data=DataConfig(arithmetic=ArithmeticConfig(max_operand=99)),
    algorithm=AlgorithmConfig(group_size=8),
    rollout=RolloutConfig(temperature=1.0, max_new_tokens=12, groups_per_task=2, threads=1,
                          episode=episode, tools={"add": add}, max_turns=2),
    trainer=TrainerConfig(lr=1e-3, lr_schedule="cosine", min_lr_ratio=0.1, groups_per_step=16,
                          micro_batch_groups=8, threads=1),
)
