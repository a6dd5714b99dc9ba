"""Per-layer expert-load imbalance (``megatron/run/telemetry.py``): the per-EP-rank load and its
imbalance, by hand. (Logged on real runs: test_balanced_training.py, tests/product.)"""

import pytest
import torch

from ultraep_megatron.megatron.run.telemetry import per_rank_load
from ultraep_megatron.planner import load_imbalance


def test_per_rank_load_and_imbalance_by_hand():
    # 2 layers, 4 experts, EP=2: rank 0 holds experts 0-1, rank 1 experts 2-3.
    tokens = torch.tensor([[3.0, 1.0, 0.0, 4.0], [2.0, 2.0, 2.0, 2.0]])
    load = per_rank_load(tokens, ep_size=2)
    assert load.tolist() == [[4.0, 4.0], [4.0, 4.0]]
    tokens[0, 0] = 8.0  # rank 0 now gets 9 of 13 tokens
    assert load_imbalance(per_rank_load(tokens, 2)).tolist() == pytest.approx([9 / 6.5, 1.0])
    assert load_imbalance(torch.zeros(1, 4)).tolist() == [1.0]
    with pytest.raises(ValueError):
        per_rank_load(tokens, ep_size=3)


def test_after_iteration_writes_to_the_callers_writers_without_megatron_training_globals(
    tmp_path, monkeypatch
):
    """The training-log hook's work after Megatron's log line gets Megatron's arguments from
    ``install`` and the writers from its caller (its ``__call__``, where megatron's
    ``training_log`` runs): with none of megatron.training's globals set, the router's imbalance
    reaches the writers given and the JSONL record. One rank (torch.distributed stood in)."""
    import json
    from types import SimpleNamespace

    from megatron.training import global_vars

    from ultraep_megatron.megatron.run.telemetry import ExpertLoadTracker, _TrainingLogHook

    assert global_vars._GLOBAL_ARGS is None
    for name, value in {"get_world_size": 1, "get_rank": 0, "get_backend": "gloo"}.items():
        monkeypatch.setattr(torch.distributed, name, lambda *a, _v=value, **k: _v)
    monkeypatch.setattr(torch.distributed, "reduce", lambda *a, **k: None)
    args = SimpleNamespace(
        num_layers=2, mtp_num_layers=None, log_interval=1, world_size=1, num_experts=4
    )
    tracker = ExpertLoadTracker(num_layers=2, num_experts=4, ep_size=2)
    tracker.record(2, torch.tensor([6.0, 2.0, 0.0, 0.0]))  # layer 2: rank 0 gets all 8 tokens
    metrics = tmp_path / "metrics.jsonl"
    hook = _TrainingLogHook(lambda *a, **k: None, tracker, str(metrics), None, args)

    class Writer:
        def __init__(self):
            self.scalars, self.logged = {}, []

        def add_scalar(self, tag, value, step):
            self.scalars[(tag, step)] = value

        def log(self, data, step=None, commit=None):
            self.logged.append((dict(data), step))

    writer, wandb = Writer(), Writer()
    hook.after_iteration(7, {"lm loss": 2.5}, 1.25, 0, 1e-3, writer=writer, wandb_writer=wandb)
    assert writer.scalars[("moe/load_imbalance/layer_02", 7)] == pytest.approx(2.0)
    assert wandb.logged[0] == ({"moe/load_imbalance/layer_02": pytest.approx(2.0)}, 7)
    # Megatron writes its own figures with a tensorboard writer; the hook adds none of them.
    assert not any(tag == "lm loss" for tag, _ in writer.scalars)
    record = json.loads(metrics.read_text())
    assert record["iteration"] == 7 and record["load_imbalance"] == {"2": pytest.approx(2.0)}
    assert record["losses"] == {"lm loss": 2.5}
