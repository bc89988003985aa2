"""Names and shapes of the messages between the controller and its workers.

Pure definitions (no I/O, nothing heavy imported) so that `workers` may import them without
pulling in the controller. Every payload is a msgpack map; tensors never ride in these messages,
only store handles (msgpack ext type ``transport.codec.HANDLE_EXT``, or a row of a run,
``[run, i]`` with the run of ext type ``transport.codec.RUN_EXT``, so a field's values are told
apart from inline ones by type: `transport.handles.is_handle`) and small scalars.

Requests (worker -> controller, over the controller's ROUTER socket):

- ``register``   ``{name, role, node, pid, capacity}`` -> ``{worker_id, token, version, weights}``;
  every later call in the worker's name carries ``worker_id`` and that ``token`` (16 random
  bytes, never logged or shown): a call naming a registered worker without its token is
  refused (``PermissionError``), so no other process can act as that worker.
- ``heartbeat``  ``{worker_id, version, busy}`` -> ``{ok}``; an unknown worker gets ``{ok: False}``
  and must exit (the controller has already declared it dead and requeued its rows).
- ``get_task``   ``{worker_id, wait_s, done?}`` -> a `TaskMsg` map, or ``None`` when nothing came
  within ``wait_s`` (a long poll: the controller answers the moment a task is assigned).
  ``done``, a `DoneMsg`, reports the worker's previous task with its next poll (one round trip
  per task instead of two); it is handled before the poll waits, exactly like ``task_done``, and
  a report that cannot be taken fails its task instead of the poll. Reports are idempotent: a
  worker whose poll failed sends the same report again, and a repeat is ignored. A report may
  name rows whose values are fallbacks (``failed``, a `FailedRows` per kind: a reward function
  that raised, timed out or returned garbage on them).
- ``task_done``  ``{worker_id, task_id, fields, lengths, version, metrics}`` -> ``{ok}``
- ``task_failed`` ``{worker_id, task_id, error}`` -> ``{ok}``
- ``served``     ``{worker_id, version, interrupted?, continued?}`` -> ``{ok}``: the worker now
  serves that policy version. Interruptible generation (``rollout.partial``) loads it while
  tasks run: ``interrupted`` counts those tasks, ``continued`` their running sequences that
  continue under it.
- ``node_served`` ``{node, token, served: [[worker_id, token, version(, interrupted,
  continued)]], dropped: [{name, reason, connected}]}`` -> ``{ok, served}``: a node agent's
  gathering of its workers' ``served`` reports (each entry is checked as the worker's own
  request would be), and the workers its broadcast relay dropped (`flowrl.node_relay`);
  ``token`` is the node's. Workers on a node agent send ``served`` to it, not here.
- ``node_heartbeat`` ``{node, token, workers: [[worker_id, token]]}`` -> ``{ok, unknown}``: the
  heartbeats a node agent heard from its workers since its last (each entry checked as the
  worker's own heartbeat would be); ``unknown`` names those the controller no longer knows,
  whose next heartbeat the agent answers ``{ok: False}``. Workers on a node agent send
  ``heartbeat`` to it, not here.
- ``sync_failed`` ``{worker_id, version, error}`` -> ``{ok}``: the worker could not load that
  version within its deadline; it exits next (and is restarted, joining at the current version).
- ``bye``        ``{worker_id}`` -> ``{ok}``: clean exit.
- ``start_failed`` ``{process, token, error}`` -> ``{ok}``: worker process ``process`` could not
  start (its model, dataset or reward function failed to load) and exits next; sent before it
  registers, so it carries the process's start token (`flowrl.worker_spec.ProcessSpec`), not a
  worker's. A process that never came up stops the run with ``error``; a restarted one is
  restarted again within ``max_restarts``.

Broadcasts (controller -> node agents -> their workers, PUB/SUB topics):

- ``version``  ``{version, weights}``: a new policy version is published; ``weights`` maps
  parameter names to store handles (rollout workers load it at their next safe point).
- ``stop``     ``{reason}``: finish the current task and exit.
"""

from __future__ import annotations

from typing import Any, Final, Literal, NotRequired, TypedDict

OP_REGISTER: Final = "register"
OP_HEARTBEAT: Final = "heartbeat"
OP_GET_TASK: Final = "get_task"
OP_TASK_DONE: Final = "task_done"
OP_TASK_FAILED: Final = "task_failed"
OP_SERVED: Final = "served"
#: the ``served`` reports of the workers of one process, to their node's relay, as
#: ``{"reports": [served, ...]}`` (`workers.runtime.ServedReports`; at most `MAX_NODE_SERVED`)
OP_SERVED_MANY: Final = "served_many"
OP_NODE_SERVED: Final = "node_served"
OP_NODE_HEARTBEAT: Final = "node_heartbeat"
#: the most entries (served reports, drops, heartbeats) one ``node_served`` or
#: ``node_heartbeat`` carries
MAX_NODE_SERVED: Final = 4096
OP_BYE: Final = "bye"
OP_SYNC_FAILED: Final = "sync_failed"
OP_START_FAILED: Final = "start_failed"

LONG_POLLS: Final = frozenset({OP_GET_TASK})
"""Requests that wait for work: served on a budget of their own (`RpcServer`'s ``long_polls``),
so that however many are open, heartbeats are still read and answered."""

TOPIC_VERSION: Final = "version"
TOPIC_STOP: Final = "stop"
#: ``{"node": name}``: that node is out of the run, its store with it (`flowrl.control.lost_nodes`)
TOPIC_NODE_LOST: Final = "node_lost"
#: what workers and node relays subscribe to
WORKER_TOPICS: Final = (TOPIC_VERSION, TOPIC_STOP, TOPIC_NODE_LOST)

DataPlane = Literal["encrypted", "plaintext"]
"""How sample bytes of cross-node store reads travel (``ClusterSettings.data_plane``; node
agents learn it from the controller)."""

TrainerRendezvous = Literal["node", "cluster"]
"""Where data-parallel trainer ranks meet (``ClusterSettings.trainer_rendezvous``): a file in
their one node's run directory, or a store the controller hosts for ranks on several nodes."""


class TaskMsg(TypedDict):
    """One micro-batch of work handed to a worker."""

    task_id: int
    stage: str
    rows: list[int]
    groups: list[int]
    #: the group of each row, aligned with ``rows`` (group-level stages get whole groups).
    row_groups: list[int]
    #: field name -> one value per row: a store handle (a list) or an inline scalar.
    inputs: dict[str, list[Any]]
    #: stage-specific parameters, e.g. the train step and whether this micro-batch ends it.
    params: dict[str, Any]


class FailedRows(TypedDict):
    """Rows of a task whose values are fallbacks, for one kind of failure."""

    #: offsets into the task's ``rows``
    rows: list[int]
    #: what went wrong on one of them
    error: str


class DoneMsg(TypedDict):
    worker_id: str
    task_id: int
    #: produced field name -> one value per row (store handle or inline scalar), or a run of
    #: rows (`transport.handles.run_to_wire`) for a field's rows of one put.
    fields: dict[str, Any]
    #: per-row token counts of what was produced (used for load balancing), or empty.
    lengths: list[int]
    #: the policy version that produced these rows, when the stage generates samples.
    version: int | None
    metrics: dict[str, float]
    #: set by the task that ends a train step: parameter name -> store handle of version+1.
    weights: NotRequired[dict[str, Any]]
    #: failure kind -> the rows whose values are fallbacks (a reward function failed on them).
    failed: NotRequired[dict[str, FailedRows]]
