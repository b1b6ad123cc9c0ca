"""Start real Python processes as a launcher does (torchrun's or srun's variables), for the
habits run_on_ranks cannot show: its workers leave through multiprocessing, which skips the
interpreter's shutdown (atexit, the final collection), and that is where some crashes live."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_environment(rank: int, world: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def launch(script: str, environments: list[dict[str, str]], timeout: float = 120) -> list[tuple[int, str, str]]:
    """Run `script` once per environment (added to this one's, minus any launcher variable),
    tests/ importable; (exit code, stdout, stderr) per process."""
    base = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    base["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), base.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**base, **env}) for env in environments]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]
