"""GRPO with simulated workers: the full dataflow, real processes and transport, no model.

Rollout, reward, reference and train workers model their compute time (``workers.sim``), so this
recipe exercises the controller, scheduler, store, staleness gate and weight sync on any machine
in seconds. Try ``--set max_staleness=0`` against the default 1 to see what asynchrony buys.

    python -m flowrl.launch recipes/sim_grpo.py --set steps=50
"""

from flowrl import (
    AlgorithmConfig,
    PlacementConfig,
    Recipe,
    RolloutConfig,
    SimConfig,
    TrainerConfig,
)

recipe = Recipe(
    steps=20,
    max_staleness=1,
    algorithm=AlgorithmConfig(group_size=8, kl_coef=0.001),
    rollout=RolloutConfig(engine="sim", workers=8, max_new_tokens=512),
    trainer=TrainerConfig(groups_per_step=8, micro_batch_groups=2),
    sim=SimConfig(prompt_len=32, rollout_token_s=0.00005, train_token_s=0.000005),
    placement=PlacementConfig(store_capacity_mb=256),
)
