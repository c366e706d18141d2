"""The schedule library: what the schedule passes and ``schedule auto``'s search share.

Each module holds the functions of one schedule decision, as pure functions of records
(:mod:`flowrl.compiler.sched`), so that a pass applies them to the flow's schedule and the
search (:mod:`flowrl.compiler.auto`) applies the very same ones to every candidate:

* :mod:`.placement` — pools carved from the cluster, engines placed on them;
* :mod:`.layouts` — parallel layouts checked against the pool, the model, the platform and memory;
* :mod:`.memory` — the memory phases of GPUs that engines share (which engine sleeps or
  offloads when, and each phase's peak);
* :mod:`.staleness` — the modulo schedule's depth and buffer;
* :mod:`.sync` — weight-sync protocols, their routes, buckets and resharding;
* :mod:`.estimate` — the cost model and the simulator run over a placed, laid-out schedule.

Nothing here imports a pass or the pass manager; the passes (``compiler/passes``) import
this library.
"""
