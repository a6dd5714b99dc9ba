"""Worker: the repository's pretrain_gpt.py, also saving every parameter's gradient per iteration.

After each ``train_step`` the gradient buffers still hold that iteration's reduced gradients
(Megatron zeroes them at the start of the next step), so the wrapper copies ``main_grad`` of every
parameter of every model chunk into ``$ULTRAEP_GRAD_DUMP_DIR/rank<r>.pt`` as
``{iteration: {param name: grad}}``. Only meaningful without the distributed optimizer (which keeps
just a shard of the reduced gradient on each rank).

Run:  torchrun ... pretrain_grad_dump.py <pretrain_gpt.py arguments>
"""

import os
import runpy
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]


def main():
    dump_dir = Path(os.environ["ULTRAEP_GRAD_DUMP_DIR"])
    dump_dir.mkdir(parents=True, exist_ok=True)
    from ultraep_megatron.megatron import cpu_backend

    cpu_backend.activate()  # pretrain_gpt.py does it too (idempotent); before megatron imports
    import megatron.training.training as training

    original = training.train_step
    grads: dict[int, dict[str, torch.Tensor]] = {}

    def train_step(forward_step_func, data_iterator, model, *args, **kwargs):
        result = original(forward_step_func, data_iterator, model, *args, **kwargs)
        iteration = len(grads) + 1
        grads[iteration] = {
            f"chunk{i}.{name}": param.main_grad.detach().clone()
            for i, chunk in enumerate(model) for name, param in chunk.named_parameters()
            if getattr(param, "main_grad", None) is not None
        }
        torch.save(grads, dump_dir / f"rank{torch.distributed.get_rank()}.pt")
        return result

    training.train_step = train_step
    sys.argv = [str(REPO / "pretrain_gpt.py"), *sys.argv[1:]]
    runpy.run_path(str(REPO / "pretrain_gpt.py"), run_name="__main__")


if __name__ == "__main__":
    main()
