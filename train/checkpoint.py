"""Checkpoints with orbax: save every N steps, keep the latest few, resume exactly."""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp

__all__ = ["Checkpointer"]


class Checkpointer:
    """The whole train state (step, Forecast, optimizer state) as one orbax item. The data
    position is the step (the sampler is a pure function of it)."""

    def __init__(self, directory: str | Path, *, save_every: int, keep: int = 3):
        if save_every < 1 or keep < 1:
            raise ValueError(f"save_every and keep must be >= 1, got {save_every}, {keep}")
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=save_every, create=True),
        )

    def save(self, step: int, state, *, force: bool = False) -> bool:
        return self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)), force=force)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, template, step: int | None = None):
        """Restore into the structure (and shardings) of `template`; None if nothing saved."""
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(template)))
        return out["state"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
