"""RayExecutor: the tensor-parallel ranks as Ray actors, one per bundle of a placement group
(`--distributed-executor-backend ray`), so that ranks can sit on several machines.

The cluster: with $RAY_ADDRESS set (`ray start --head` on one machine, `ray start --address
HEAD:6379` on the others, then `RAY_ADDRESS=auto kvflow serve ...` on the head) kvflow joins
it and leaves it running; without, kvflow starts a private local one on 127.0.0.1 (no
dashboard, a small object store, its own temp dir) and stops it, every process of it, in
`shutdown`. The ranks meet over torch.distributed at rank 0's node address.

A step is a call of rank 0's `step`, which broadcasts it to the others (their `follow` loops,
as in tp_worker.py); a rank that dies or raises ends its call, and the step fails with
RankError (engine death); a hung rank hangs the step for the engine's watchdog.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvflow.core.messages import ModelRunnerOutput, SchedulerOutput
from kvflow.structured.wire import GrammarSender
from kvflow.worker.executor import _LIVE, STOP_GRACE_S, RankError
from kvflow.worker.tp_worker import RankLoaded, RankSpec, RankWorker, fault_at_start

logger = logging.getLogger("kvflow.engine")

OBJECT_STORE_BYTES = (
    80 << 20
)  # a private cluster carries steps, not tensors (Ray's minimum is 75 MiB)
START_TIMEOUT_S = 900.0


class RankActor:
    """One rank inside a Ray actor (wrapped with ray.remote by RayExecutor)."""

    def __init__(self) -> None:
        self.worker: RankWorker | None = None

    def address(self) -> tuple[str, int]:
        """(this node's IP, a free port on it): where rank 0 hosts the rendezvous."""
        import ray

        from kvflow.worker.executor import free_port

        return ray.util.get_node_ip_address(), free_port()

    def start(self, spec: RankSpec, rank: int) -> RankLoaded:
        fault_at_start(rank)
        self.worker = RankWorker(spec, rank)
        return self.worker.load()

    def follow(self) -> None:
        self.worker.follow()
        self.worker.group.destroy()

    def step(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.step(self.worker.group.broadcast_object(sched))

    def stop(self) -> None:
        self.worker.group.broadcast_object(None)
        self.worker.group.destroy()

    def take_timers(self) -> dict[str, float]:
        return self.worker.group.take_timers()


class RayExecutor:
    """A Runner over Ray actors; `loaded` and `num_blocks` as MultiprocExecutor's. Raises
    RankError when a rank fails to start."""

    def __init__(self, spec: RankSpec) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._temp_dir: str | None = None
        self._closed = False
        self.actors: list[Any] = []
        self._pg = None
        self._follow_refs: list[Any] = []
        self._grammars = GrammarSender()
        _LIVE.add(self)
        self._connect()
        try:
            gpu = spec.device.startswith("cuda")
            bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
            self._pg = placement_group([bundle] * spec.world_size, strategy="PACK")
            ready, _ = ray.wait([self._pg.ready()], timeout=START_TIMEOUT_S)
            if not ready:
                raise RankError(f"Ray cannot place {spec.world_size} ranks of {bundle}")
            actor_class = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(RankActor)
            for rank in range(spec.world_size):
                strategy = PlacementGroupSchedulingStrategy(self._pg, rank)
                self.actors.append(actor_class.options(scheduling_strategy=strategy).remote())
            host, port = ray.get(self.actors[0].address.remote())
            # each actor sees only its own GPU: every rank's device is cuda:0 there
            spec = replace(spec, init_method=f"tcp://{host}:{port}")
            starts = [a.start.remote(spec, r) for r, a in enumerate(self.actors)]
            self.loaded = self._get(starts, "at start-up")
            self.num_blocks = min(r.num_blocks for r in self.loaded)
            self._follow_refs = [a.follow.remote() for a in self.actors[1:]]
        except BaseException:
            self.shutdown()
            raise

    def _connect(self) -> None:
        ray = self._ray
        if ray.is_initialized():
            return
        address = os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=True)
            return
        self._temp_dir = tempfile.mkdtemp(prefix="kvflow-ray-")
        # Ray's processes die with the thread that started them (PR_SET_PDEATHSIG follows
        # the forking thread), and the server loads on a thread that exits: a thread that
        # lives as long as the process starts them.
        started: dict[str, BaseException | None] = {}
        ready = threading.Event()

        def keeper() -> None:
            try:
                ray.init(
                    address="local",
                    include_dashboard=False,
                    object_store_memory=OBJECT_STORE_BYTES,
                    _node_ip_address="127.0.0.1",
                    _temp_dir=self._temp_dir,
                    log_to_driver=True,
                    configure_logging=False,
                )
                started["error"] = None
            except BaseException as exc:
                started["error"] = exc
            ready.set()
            self._released.wait()

        self._released = threading.Event()
        threading.Thread(target=keeper, name="kvflow-ray-keeper", daemon=True).start()
        ready.wait()
        if started["error"] is not None:
            raise started["error"]

    def _get(self, refs: list[Any], when: str) -> list[Any]:
        """ray.get of the ranks' refs; a rank's error or death becomes RankError."""
        ray = self._ray
        try:
            return ray.get(refs)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            raise RankError(f"a tensor-parallel rank (Ray actor) failed {when}:\n{exc}") from None

    def launch(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        if self._closed:
            raise RankError("the tensor-parallel ranks are stopped")
        ref = self.actors[0].step.remote(self._grammars.encode(scheduler_output))
        return lambda: self._wait_output(ref)

    def _wait_output(self, ref: Any) -> ModelRunnerOutput:
        ready, _ = self._ray.wait([ref, *self._follow_refs], num_returns=1)
        if ready[0] is not ref:  # a follower's loop ended: it died or raised
            self._get(ready, "during a step")
            raise RankError("a tensor-parallel rank (Ray actor) left during a step")
        return self._get([ref], "during a step")[0]

    def timers(self) -> dict[str, float]:
        return self._ray.get(self.actors[0].take_timers.remote())

    def shutdown(self) -> None:
        """Stop the ranks (then kill the actors), remove the placement group and, for a
        private cluster, stop it and remove its temp dir. Idempotent."""
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        try:
            if self.actors and self._follow_refs:
                self.actors[0].stop.remote()
                refs = self._follow_refs
                ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S)
            for actor in self.actors:
                ray.kill(actor)
            if self._pg is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self._pg)
        except Exception:  # the cluster may be gone already
            logger.exception("stopping the Ray ranks failed")
        _LIVE.discard(self)
        if self._temp_dir is not None:
            ray.shutdown()  # stops (and waits for) every process of the private cluster
            self._released.set()
            shutil.rmtree(self._temp_dir, ignore_errors=True)
