"""The ``placement`` section: which node runs each role, where other nodes' agents meet the
controller, Ray placement, and how the controller watches workers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from flowrl.messages import DataPlane, TrainerRendezvous
from flowrl.recipe.section import _PathText, _rule, _Section

CONTROLLER_NODE = "node0"
"""The controller's own node; `PlacementConfig.roles` may name it (its processes run there)."""

ROLES = ("rollout", "reward", "reference", "critic", "train")
"""Every worker role a recipe may run (which ones a recipe runs: `Recipe.roles`)."""

LEASED_ROLES = ("rollout", "reward", "reference", "critic")
"""The roles whose tasks node agents may dispatch (`node_dispatch`): rollout (not colocated) and
the roles of row-level stages."""


class _FrozenDict(dict[str, Any]):
    """A dict that cannot change and hashes by content, so a frozen recipe stays hashable."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def _frozen(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("recipe mappings are immutable")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _frozen
    __ior__ = _frozen

    def __copy__(self) -> _FrozenDict:
        return self  # immutable: a copy would be the same

    def __deepcopy__(self, memo: dict[int, Any]) -> _FrozenDict:
        return self


def _freeze(v: dict[str, Any]) -> dict[str, Any]:
    return _FrozenDict(v)


_NODE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


class ClusterSettings(_Section):
    """Where the controller meets the node agents of other nodes (the controller takes them as
    ``flowrl.node_hub.ClusterConfig``, which adds the run's keys); every tcp link is encrypted with
    the run's CurveZMQ keys (but see `data_plane`)."""

    host: str = Field(default="127.0.0.1", min_length=1)
    """Address the controller binds and agents connect to."""
    port: int = Field(default=0, ge=0, le=65535)
    """Port of the controller's endpoint; 0 picks a free one (logged at start)."""
    keys_file: _PathText | None = None
    """Where the controller writes the run's fresh keys (mode 0600) for agents started by hand;
    Ray-placed agents get them from the controller directly. The file is the run's while it
    runs (another live run naming it is refused), removed when it ends, and simply rewritten
    by the next run (also after a run that died)."""
    join_timeout_s: float = Field(default=120.0, gt=0.0, le=86400.0)
    """How long the start waits for every agent to join."""
    data_plane: DataPlane = "encrypted"
    """How sample bytes travel between nodes. ``encrypted``: over CurveZMQ, like every other
    link. ``plaintext``: the sample bytes of cross-node store reads travel unencrypted (anyone
    on the network path can read, or alter, them), for trusted fabrics (InfiniBand/RoCE inside a
    datacenter, where NCCL traffic is unencrypted too) on which encryption would bound the
    read rate. Those read requests remain authenticated with the run's keys (a peer without
    them gets nothing and can change nothing; a captured request cannot be replayed), and all
    other traffic (controller links, store bookkeeping, puts and frees) stays CurveZMQ. Nodes'
    clocks must agree within 30 s."""
    trainer_rendezvous: TrainerRendezvous = "node"
    """Where data-parallel trainer ranks (``trainer.ranks > 1``) meet. ``node``: a file in their
    node's run directory, so ``placement.roles.train`` names one node. ``cluster``: the ranks
    may run on several nodes and meet in a torch.distributed TCPStore the controller hosts on
    `host`. The rendezvous and the collectives between the ranks (gloo, NCCL) are then neither
    authenticated nor encrypted (torch.distributed): anyone who reaches the store's port or the
    ranks' links can read, disturb or join the training group. For trusted fabrics only; the
    ranks' interface is the environment's (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``)."""


class RayResources(_Section):
    """What a node agent's Ray actor requests; the node's workers run inside that reservation
    (with ``num_gpus``, Ray's ``CUDA_VISIBLE_DEVICES`` reaches them)."""

    num_cpus: float = Field(default=1.0, ge=0.0)
    """CPUs reserved for the node's agent and workers."""
    num_gpus: float = Field(default=0.0, ge=0.0)
    """GPUs reserved for the node's workers."""
    resources: Annotated[dict[str, float], AfterValidator(_freeze)] = Field(
        default_factory=dict)
    """Custom resources, e.g. ``{"NPU": 8}`` or a label that pins the agent to one Ray node."""

    @field_validator("resources")
    @classmethod
    def _non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        bad = sorted(k for k, n in v.items() if not k or not n >= 0.0)
        if bad:
            raise ValueError(f"resources need a name and an amount >= 0: {bad}")
        return v


class RayConfig(_Section):
    """Ray placement (``placement.kind="ray"``): one node agent per node as a Ray actor."""

    address: str | None = None
    """``ray.init`` address (``"auto"``, ``"ray://host:10001"``); None joins the cluster Ray
    finds (``RAY_ADDRESS``) or starts a local one. Unused when Ray is already initialized."""
    agent: RayResources = Field(default_factory=RayResources)
    """What every agent's actor requests, unless `nodes` says otherwise for its node."""
    nodes: Annotated[dict[str, RayResources], AfterValidator(_freeze)] = Field(
        default_factory=dict)
    """Per node name: what that node's actor requests instead of `agent`."""


class PlacementConfig(_Section):
    """Where processes run and how the controller watches them."""

    kind_fields: ClassVar[Mapping[str, frozenset[str]]] = {"ray": frozenset({"ray"})}

    mode: Literal["separated", "colocated"] = "separated"
    """``separated``: every role runs in processes of its own. ``colocated``: each trainer
    process also hosts the rollout engine, generating with the trainer's own weights (no copy,
    and a weight sync is a version bump); the two take turns (generate, then train), and the
    engine not in its phase releases what memory it can (README: "Placement modes"). Reward,
    reference and critic workers keep processes of their own. Needs ``rollout.engine = "hf"``,
    one rollout worker per trainer process (``rollout.workers = trainer.ranks``), and the rollout
    on the trainer's nodes; with ``trainer.sharding = "fsdp2"`` each engine keeps a whole copy
    of the weights, loaded bucket by bucket at every step's end."""
    keep_weight_copy: bool = True
    """``mode = "colocated"``: the trainer also writes each new version into its node's store,
    the copy a restarted process (after a death) joins the run from. False holds the weights
    once, in the trainer, and a colocated process that dies then cannot come back (the run
    stops with its error)."""
    kind: Literal["local", "ray"] = "local"
    """``local``: the controller starts its own node's processes, and the agents of other nodes
    `roles` names are started by hand (``python -m flowrl.node``); ``ray``: those agents are
    started as Ray actors (`ray`)."""
    nodes: int = Field(default=1, ge=1, le=4096)
    """Nodes (one node agent and one shared-memory store each); local placement has one. With
    `roles`, implied by it: leave it out."""
    roles: Annotated[dict[str, tuple[str, ...]], AfterValidator(_freeze)] = Field(
        default_factory=dict)
    """Role → the nodes its processes run on (process ``p`` on ``nodes[p % len(nodes)]``); a
    role not named runs on the controller's node (``"node0"``)."""
    cluster: ClusterSettings | None = None
    """Where agents of other nodes meet the controller; required when `roles` names another
    node and `kind` is ``local``."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """Ray placement settings; only with ``kind="ray"``."""
    store_capacity_mb: int = Field(default=1024, ge=1, le=1 << 24)
    """Shared-memory sample store per node, in MiB."""
    heartbeat_timeout_s: float = Field(default=10.0, ge=3.0, le=3600.0)
    """A worker silent this long is declared dead (heartbeats are sent every second)."""
    node_dispatch: bool = False
    """The agents of nodes other than the controller's dispatch their rollout, reward,
    reference and critic workers' tasks themselves: the controller leases each agent batches
    of tasks (as many as its workers have room for; rollout tasks as soon as they are formed,
    each with the policy version it needs, which the agent waits for) and takes their
    completions in batches, instead of a poll and a report per task per worker; train stays
    with the controller, which still decides what runs (docs/architecture.md, node-local
    dispatch). Needs `roles` to place such workers on a node other than the controller's;
    not with ``eval``; with ``mode = 'colocated'`` rollout stays central. A lost node agent
    still stops the run."""
    max_restarts: int = Field(default=3, ge=0, le=10_000)
    """Restarts of one worker process after it died (after 0.5 s, doubling per death, at most
    30 s); one more death stops the run. Data-parallel trainer ranks restart as one group,
    counted once per restart of the group."""

    @model_validator(mode="after")
    def _local_is_one_node(self) -> PlacementConfig:
        if self.kind == "local" and self.nodes != 1 and not self.roles:
            raise _rule("nodes", f"local placement runs on one node, got nodes={self.nodes}")
        return self

    @model_validator(mode="after")
    def _roles_and_nodes(self) -> PlacementConfig:
        for role, nodes in self.roles.items():
            if role not in ROLES:
                raise _rule(f"roles.{role}", f"unknown role; roles are {', '.join(ROLES)}")
            if not nodes:
                raise _rule(f"roles.{role}", "empty node list (leave the role out to run it on "
                            "the controller's node)")
            bad = [n for n in nodes if not n or not set(n) <= _NODE_CHARS or len(n) > 64]
            if bad:
                raise _rule(f"roles.{role}", f"bad node names {bad}: use 1-64 letters, digits, "
                            "'_', '.' or '-'")
        if self.roles and "nodes" in self.model_fields_set:
            raise _rule("nodes", "implied by roles; leave it out")
        if self.mode != "colocated" and "keep_weight_copy" in self.model_fields_set:
            raise _rule("keep_weight_copy", "only colocated placement (mode = 'colocated') "
                        "serves the trainer's weights in place")
        if self.kind != "ray" and "ray" in self.model_fields_set:
            raise _rule("ray", f"Ray settings given but kind is {self.kind!r}, not 'ray'")
        unknown = sorted(set(self.ray.nodes) - set(self.remote_nodes))
        if unknown:
            raise _rule(f"ray.nodes.{unknown[0]}", f"not a node roles places on (have "
                        f"{self.remote_nodes})")
        if self.node_dispatch:
            roles = [r for r in LEASED_ROLES if r != "rollout" or self.mode != "colocated"]
            leased = sorted({r for r, nodes in self.roles.items()
                             if r in roles and set(nodes) - {CONTROLLER_NODE}})
            if not leased:
                raise _rule("node_dispatch", f"needs roles to place {', '.join(roles)} workers "
                            "on a node other than the controller's (node0): only other nodes' "
                            "agents dispatch")
        if self.kind == "local" and self.remote_nodes:
            if self.cluster is None:
                raise _rule("cluster", f"required: roles places processes on "
                            f"{self.remote_nodes}, whose agents meet the controller there")
            if self.cluster.keys_file is None:
                raise _rule("cluster.keys_file", "required: agents started by hand read the "
                            "run's keys from it")
        return self

    @property
    def remote_nodes(self) -> list[str]:
        """The nodes `roles` names other than the controller's, sorted."""
        return sorted({n for nodes in self.roles.values() for n in nodes} - {CONTROLLER_NODE})
