"""`tuneforge train --nproc-per-node N`: start the workers with PyTorch's elastic launcher (torchrun)."""

from __future__ import annotations

import sys

from torch.distributed.run import get_args_parser
from torch.distributed.run import run as elastic_run


def launch_workers(
    argv: list[str], nproc_per_node: int, nnodes: int, node_rank: int, master_addr: str, master_port: int
) -> int:
    """Run `python -m tuneforge <argv>` in N workers per node; returns non-zero if any worker failed."""
    launcher_args = [
        f"--nproc-per-node={nproc_per_node}",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--master-addr={master_addr}",
        f"--master-port={master_port}",
        "--module",
        "tuneforge",
        *argv,
    ]
    args = get_args_parser().parse_args(launcher_args)
    try:
        elastic_run(args)
    except Exception as exc:  # ChildFailedError: the workers already printed their errors
        print(f"tuneforge: a worker failed ({type(exc).__name__}); see the messages above", file=sys.stderr)
        return 1
    return 0
