"""What trimming the heap after an idle engine costs and saves (issue 17): RSS of a CPU
worker after one large `embed`, the same RSS once the engine has been idle past the trim
(5 s), and how long the next large call takes on the trimmed heap against the one right
after it (warm heap). Starts its own dev server and worker; prints one line per figure.

    .venv/bin/python benches/idle_trim.py [--texts 200] [--rounds 3] [--pause 7]

With --pause 3 (under the 5 s idle time) nothing is trimmed: the control. The first call
of each round follows the pause; the round's second call follows the first at once.
"""

import argparse
import asyncio
import os
import pathlib
import subprocess
import sys
import time
import uuid

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "benches"))

from temporalio.worker import Worker  # noqa: E402

import workflows  # noqa: E402
from devserver import dev_server, model_dir, rss_mib  # noqa: E402


async def main(args):
    model = model_dir()
    async with dev_server() as (client, address, tmp):
        log = open(f"{tmp}/gpulane.log", "w")
        env = {**os.environ, "TEMPORAL_ADDRESS": address, "GPULANE_HOST": "trim",
               "GPULANE_METRICS_ADDRESS": "off", "GPULANE_ADMIN_ADDRESS": "off"}
        worker = subprocess.Popen([str(ROOT / "target/release/gpulane"), "run", "--model", model],
                                  stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while "gpulane ready" not in open(f"{tmp}/gpulane.log").read():
                await asyncio.sleep(0.1)
            text = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)
            queue = f"wf-{uuid.uuid4().hex[:8]}"
            async with Worker(client, task_queue=queue, workflows=[workflows.EmbedOn]):
                async def call():
                    t = time.monotonic()
                    await client.execute_workflow(
                        "EmbedOn", args=["cpu-tools", {"texts": [text] * args.texts}],
                        id=f"trim-{uuid.uuid4()}", task_queue=queue)
                    return time.monotonic() - t

                print(f"idle RSS after start: {rss_mib(worker.pid):.0f} MiB")
                await call()  # the first call ever pays for warm-up, whatever the pause
                await asyncio.sleep(args.pause)
                for r in range(args.rounds):
                    trimmed = await call()
                    warm = await call()
                    peak = rss_mib(worker.pid)
                    await asyncio.sleep(args.pause)
                    idle = rss_mib(worker.pid)
                    print(f"round {r}: {args.texts} texts after a {args.pause} s pause "
                          f"{trimmed:.2f} s, right after {warm:.2f} s; RSS after the calls "
                          f"{peak:.0f} MiB, {args.pause} s idle later {idle:.0f} MiB")
        finally:
            worker.terminate()
            worker.wait(60)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--texts", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    # The engine trims after 5 s idle: 7 s pauses trim between rounds, 3 s pauses do not
    # (the control).
    p.add_argument("--pause", type=float, default=7)
    asyncio.run(main(p.parse_args()))
