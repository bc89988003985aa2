"""The controller's parts, each with one job; `flowrl.controller` wires them together.

Pure parts (no sockets, no clock of their own, testable without processes):

- `admission`: which dataset positions enter the run, for which train step (staleness gate and
  store backpressure);
- `ledger`: the policy version and the train steps: which micro-batches belong to which step,
  commit, abort, exactly-once accounting;
- `scheduler`: what to dispatch to whom, from the index, the registry, admission and the ledger;
- `assignments`: the tasks handed out and not yet reported;
- `weights`: the published weight versions and when their memory may go;
- `reports`: a worker's task report, validated before anything changes.

Parts with processes or sockets:

- `workforce`: worker processes: start, restart with backoff, kill hung ones, rank groups;
- `worker_api`: the RPC handlers workers call and their long-poll mailboxes;
- `store_feed`: frees retired memory, refreshes the store's accounting, finds a stuck store;
- `run_view`: the read-only snapshot the monitor and ``status()`` serve.
"""
