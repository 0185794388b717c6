"""One rank of a two-process run that trains and shuts down ``relattn train``'s DDP path many times.

Usage: ``python ddp_shutdown_loop.py RANK PORT[,PORT...] OUT``, started once for rank 0 and once for rank 1 (the
environment torchrun would give is set here). For each port it calls :func:`relattn.training.train.train` (what
``relattn train`` calls) on a tiny model for one step under DistributedDataParallel over gloo, with that port as
``MASTER_PORT``, and returns from it: the recipe, its DDP wrapper and the process group are all released, as at
the end of a real run. Each round has its own deadline: a round that hangs (a rank stuck in a destructor of the
process group, say) dumps its stack and exits with status 1 instead of hanging the test.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import torch

from relattn.training.model import TransformerConfig
from relattn.training.train import TrainOptions, train

ROUND_DEADLINE_S = 60

CONFIG = TransformerConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16, max_relative_position=2, context=8)


def main(argv: list[str]) -> int:
    rank, ports, out = int(argv[0]), argv[1].split(","), Path(argv[2])
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1")
    for i, port in enumerate(ports):
        os.environ["MASTER_PORT"] = port
        faulthandler.dump_traceback_later(ROUND_DEADLINE_S, exit=True)
        options = TrainOptions(out=str(out / f"round{i}"), steps=1, batch_size=2, eval_tokens=16, eval_every=0,
                               sample_bytes=0, plots=False, progress=False, device="cpu")
        result = train(CONFIG, options)
        faulthandler.cancel_dump_traceback_later()
        assert result.metrics["world_size"] == 2, result.metrics["world_size"]
        print(f"rank {rank}: round {i} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
