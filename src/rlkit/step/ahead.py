"""Generation ahead of training (``trainer.mode``: ``one_step_off`` / ``async``), driven from the driver.

A rollout worker group in a pool of its own generates while the actor trains. Versions: version ``v``
is the actor's weights after ``v`` updates (0 = initial); the trainer at step ``k`` trains a policy of
version ``k - 1``. A batch's *staleness* is ``actor version - version it was generated with``.

    pipe = RolloutPipeline(rollout_group, actor_group, depth=2, max_staleness=2)
    pipe.push_weights(version=0)                   # the rollout starts from the actor's own weights
    pipe.top_up(make_request)                      # keep depth + 1 generations submitted
    item, dropped = pipe.take(actor_version=k - 1) # the oldest fresh enough one (waits for it)
    ... train ...
    pipe.push_weights(version=k)                   # queued behind the generations already submitted

The step's generation phase in these modes is ``generated_ahead(more_prompts, ctx, pipe)``: the next batch the
pool made (``async/*`` metrics: its staleness, the generations dropped as too stale).

The rollout group's Ray actors run calls one at a time in submission order, so a generation submitted
after ``push_weights(v)`` runs on version ``v`` and one in flight when a push is submitted finishes on
its old weights (partial rollouts: *finish under the old version*; every row carries ``rollout_version``).
With ``depth`` generations ahead of the one being trained, each batch is ``depth`` versions stale once the
pipeline is full (one_step_off: depth 1). ``StalenessQueue`` (pure, no Ray) holds the submitted
generations in order and drops any whose staleness exceeds ``max_staleness`` when it is taken.

Checkpoints: ``state_dict()`` first waits for every generation in flight (they finish under the weights
they started with), so a checkpoint holds the generated batches themselves; a resumed run trains on
exactly them (``load_state_dict``), which makes resume exact (docs/async.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlkit.batch import Batch
from rlkit.rollout.base import rollout_inputs
from rlkit.step.generate import join_generation, repeat_prompts

__all__ = [
    "Generation",
    "StalenessQueue",
    "RolloutPipeline",
    "generated_ahead",
    "staleness_bound",
    "pipeline_depth",
    "MODES",
]

MODES = ("sync", "one_step_off", "async")
DEFAULT_STALENESS = {"one_step_off": 1, "async": 2}


def staleness_bound(mode: str, max_staleness: int | None) -> int:
    """``trainer.max_staleness`` as a run uses it (0 for sync: every batch is on-policy)."""
    if mode == "sync":
        return 0
    return DEFAULT_STALENESS[mode] if max_staleness is None else int(max_staleness)


def pipeline_depth(mode: str, max_staleness: int | None) -> int:
    """Generations kept submitted beyond the one the trainer waits for (one_step_off: 1; async: the bound)."""
    return 1 if mode == "one_step_off" else staleness_bound(mode, max_staleness)


@dataclass
class Generation:
    """One generation batch: the prompts as repeated for it, the rollout's answer (a pending call until
    resolved, then a ``Batch``), the weights version it runs on, and its serial number (uids)."""

    request: Any  # the repeated prompts (Batch)
    result: Any  # PendingCall while in flight, Batch once resolved
    version: int
    serial: int


class StalenessQueue:
    """Generations in submission order; ``take`` drops the ones more than ``max_staleness`` versions old."""

    def __init__(self, max_staleness: int):
        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1, got {max_staleness}")
        self.max_staleness = max_staleness
        self.items: deque[Generation] = deque()
        self.dropped = 0  # over the run (a resumed run continues the count)

    def __len__(self) -> int:
        return len(self.items)

    def put(self, item: Generation) -> None:
        if self.items and item.version < self.items[-1].version:
            raise ValueError(
                f"generation {item.serial} has version {item.version}, older than the one queued before "
                f"it ({self.items[-1].version}): versions only grow"
            )
        self.items.append(item)

    def staleness(self, item: Generation, actor_version: int) -> int:
        return actor_version - item.version

    def take(self, actor_version: int) -> tuple[Generation | None, list[Generation]]:
        """``(oldest fresh enough generation or None when none is left, the stale ones dropped before
        it)``."""
        dropped = []
        while self.items:
            item = self.items.popleft()
            if self.staleness(item, actor_version) <= self.max_staleness:
                self.dropped += len(dropped)
                return item, dropped
            dropped.append(item)
        self.dropped += len(dropped)
        return None, dropped


class RolloutPipeline:
    """Keeps ``depth`` generations submitted to the rollout group ahead of the one being trained.

    ``make_request(serial) -> (repeated prompts, rollout inputs)`` draws the next prompts (the trainer's
    data order); the rollout group's ``generate_sequences`` gets the inputs with ``n=1``.
    """

    def __init__(self, rollout: Any, actor: Any, *, depth: int, max_staleness: int):
        self.rollout = rollout
        self.actor = actor
        self.depth = depth
        self.queue = StalenessQueue(max_staleness)
        self.version = 0  # of the latest weights pushed to the rollout
        self.serial = 0  # generations submitted so far
        self.pushes: list[Any] = []  # PendingCalls of update_weights not yet checked

    # ----- generation -------------------------------------------------------------------------
    def top_up(self, make_request: Callable[[int], tuple[Any, Any]], ahead: int | None = None) -> None:
        """Submit generations until ``min(depth, ahead) + 1`` are queued (the next one to train and up to
        ``depth`` ahead; ``ahead``: how many more steps the run will make after the next one)."""
        ahead = self.depth if ahead is None else max(0, min(self.depth, ahead))
        while len(self.queue) < ahead + 1:
            request, inputs = make_request(self.serial)
            pending = self.rollout.submit("generate_sequences", inputs, balance=False, n=1)
            self.queue.put(Generation(request, pending, self.version, self.serial))
            self.serial += 1

    def take(
        self, actor_version: int, make_request: Callable[[int], tuple[Any, Any]], ahead: int | None = None
    ) -> tuple[Generation, int]:
        """The next batch to train on (waits for it) and how many stale generations were dropped first
        (``ahead``: see ``top_up``)."""
        dropped = 0
        while True:
            self.top_up(make_request, ahead)
            item, stale = self.queue.take(actor_version)
            dropped += len(stale)
            if item is not None:
                break
        self.check_pushes()
        item.result = self.resolve(item.result)
        return item, dropped

    @staticmethod
    def resolve(result: Any) -> Any:
        return result.get() if hasattr(result, "get") else result

    # ----- weights ----------------------------------------------------------------------------
    def push_weights(self, version: int) -> None:
        """Send the actor's current weights (version ``version``) to every rollout rank, behind the
        generations already submitted: its full state dict, or with ``actor.lora`` the adapter's tensors alone
        (``rollout_state_dict``). Waits only for the actor to produce them."""
        pending = self.actor.submit("rollout_state_dict", dispatch="all")  # collective: every rank takes part
        if len(pending.refs) > 1:
            from rlkit.workers.group import PendingCall

            # the other ranks: {}
            PendingCall(self.actor, "rollout_state_dict", "all", pending.refs[1:]).get()
        self.pushes.append(
            self.rollout.submit("update_weights", pending.refs[0], dispatch="all", version=version)
        )
        self.version = version

    def check_pushes(self, wait: bool = False) -> None:
        """Raise the error of a weight push that failed; ``wait``: also wait for the ones still queued."""
        import ray

        keep = []
        for call in self.pushes:
            ready, _ = ray.wait(call.refs, num_returns=len(call.refs), timeout=None if wait else 0)
            if len(ready) == len(call.refs):
                call.get()
            else:
                keep.append(call)
        self.pushes = keep

    # ----- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Waits for every generation in flight and every push; the queue holds batches afterwards."""
        for item in self.queue.items:
            item.result = self.resolve(item.result)
        self.check_pushes(wait=True)
        items = [(g.request, g.result, g.version, g.serial) for g in self.queue.items]
        return {"items": items, "version": self.version, "serial": self.serial, "dropped": self.queue.dropped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Queue the saved batches again (``push_weights`` of the checkpoint's version comes separately)."""
        self.queue.items.clear()
        for request, result, version, serial in state["items"]:
            self.queue.put(Generation(request, result, version, serial))
        self.serial = state["serial"]
        self.queue.dropped = state["dropped"]


def generated_ahead(more_prompts: Any, ctx: Any, pipe: RolloutPipeline) -> tuple[Any, dict[str, float]]:
    """The generation phase with a rollout pool: the next batch it generated ahead (waiting for it if needed);
    it draws new prompts from ``more_prompts`` to stay ``depth`` generations ahead. Metrics ``async/*``: the
    staleness of the batch's rows (actor version - ``rollout_version``) and the generations dropped as too
    stale."""

    def request(serial: int) -> tuple[Batch, Batch]:
        prompts = next(more_prompts)
        repeated = repeat_prompts(
            Batch(prompts.tensors, prompts.non_tensors, prompts.meta), f"g{serial}", ctx.recipe.rollout.n
        )
        return repeated, rollout_inputs(repeated)

    actor_version = ctx.global_step - 1  # updates the actor has made before this step's
    ahead = ctx.rt.total_steps - ctx.global_step  # nothing is generated for steps the run will not make
    item, dropped = pipe.take(actor_version, request, ahead=ahead)
    batch, metrics = join_generation(item.request, item.result)
    staleness = (actor_version - batch["rollout_version"]).float()  # [B]
    return batch, metrics | {
        "async/staleness_mean": float(staleness.mean()),
        "async/staleness_max": float(staleness.max()),
        "async/dropped_stale": float(dropped),
        "async/weights_version": float(actor_version),
        "async/queued": float(len(pipe.queue)),
    }
