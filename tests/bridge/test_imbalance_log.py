"""``UltraEPImbalanceLog`` (ultraep_megatron.megatron.bridge.enable) writes each balanced layer's
imbalance to Bridge's own loggers as Bridge holds them: ``state.tensorboard_logger`` (a
``SummaryWriter``: ``add_scalar(tag, value, step)``) and ``state.wandb_logger`` (the ``wandb``
module, ``training/state.py``: ``log(data, step=None, commit=None)``, which Bridge's
``training_log`` calls as ``log(dict, iteration)``), every ``cfg.logger.log_interval`` steps. In one
process, no ranks (the ranks' average on the last rank is ``tests/bridge/test_bridge_pipeline.py``'s).

Skipped (one reason line) where megatron-bridge is not installed: run with ``ULTRAEP_BRIDGE=1``.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
from bridge_helpers import needs_bridge

pytestmark = needs_bridge

STATS = {
    1: {"imbalance_before": 1.75, "imbalance_after": 1.0, "replicas": 1.5},
    3: {"imbalance_before": 1.25, "imbalance_after": 1.0625, "replicas": 0.5},
}


class Wandb:
    """The ``wandb`` module's ``log`` as Bridge calls it, recorded."""

    def __init__(self):
        self.logged = []

    def log(self, data, step=None, commit=None):
        self.logged.append((dict(data), step))


class SummaryWriter:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, scalar_value, global_step=None):
        self.scalars.append((tag, scalar_value, global_step))


class Balancing:
    """The balancing context as the log reads it: figures popped since the last log."""

    def __init__(self):
        self.pops = 0

    def pop_stats(self):
        self.pops += 1
        return {layer: dict(figures) for layer, figures in STATS.items()}


def _context(step: int, interval: int, tensorboard, wandb):
    cfg = SimpleNamespace(logger=SimpleNamespace(log_interval=interval), model=None)
    state = SimpleNamespace(
        train_state=SimpleNamespace(step=step),
        cfg=cfg,
        tensorboard_logger=tensorboard,
        wandb_logger=wandb,
    )
    return SimpleNamespace(state=state)


def _parameters(function) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


def test_the_wandb_stand_in_takes_what_wandb_log_takes():
    wandb = pytest.importorskip("wandb")
    assert _parameters(Wandb.log) == _parameters(wandb.log)[:3] == ["data", "step", "commit"]


def test_imbalance_reaches_wandb_and_tensorboard_at_the_log_interval(capsys):
    from ultraep_megatron.megatron.bridge.enable import UltraEPImbalanceLog

    balancing, wandb, tensorboard = Balancing(), Wandb(), SummaryWriter()
    log = UltraEPImbalanceLog(balancing)
    log.on_train_step_end(_context(2, 5, tensorboard, wandb))  # iteration 3: not a log step
    assert balancing.pops == 0 and wandb.logged == [] and tensorboard.scalars == []
    log.on_train_step_end(_context(4, 5, tensorboard, wandb))  # iteration 5 ends
    expected = {
        f"ultraep/layer_{layer}/{key}": STATS[layer][key]
        for layer in STATS
        for key in ("imbalance_before", "imbalance_after")
    }
    assert wandb.logged == [(expected, 5)]  # one wandb step, numbered by the iteration
    assert sorted(tensorboard.scalars) == sorted((k, v, 5) for k, v in expected.items())
    assert log.last_stats == STATS and log.last_logged == STATS
    assert "[ultraep] iteration 5: imbalance before -> after layer 1 1.750 -> 1.000" in (
        capsys.readouterr().out
    )
    # Without Bridge's loggers (cfg.logger names none): the console line alone.
    log.on_train_step_end(_context(9, 5, None, None))
    assert balancing.pops == 2 and len(wandb.logged) == 1
    assert "[ultraep] iteration 10:" in capsys.readouterr().out
