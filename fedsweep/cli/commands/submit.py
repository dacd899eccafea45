"""``fedsweep submit FILE`` and ``fedsweep jobs status|logs|stop ID``: Ray jobs on a cluster."""

from __future__ import annotations

import argparse

from fedsweep.cli.views import console
import os


def add(sub) -> None:
    p = sub.add_parser("submit", help="run an experiment or a study as a Ray job on a cluster; streams the logs")
    p.add_argument("file", help="experiment or sweep YAML (validated here before it is sent)")
    p.add_argument("--address", default=None, help="Ray dashboard / Jobs API, e.g. http://HEAD:8265 "
                   "(default $RAY_API_SERVER_ADDRESS or http://127.0.0.1:8265)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    p.add_argument("--python", default="python", help="interpreter on the cluster that has fedsweep (default python)")
    p.add_argument("--working-dir", default=".", help="directory shipped with the job (default .; 'none' ships nothing)")
    p.add_argument("--requirements", help="pip requirements file installed for the job (pinned versions)")
    p.add_argument("--image", help="prebuilt container image for the job instead of pip")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment variable for the job")
    p.add_argument("--no-follow", action="store_true", help="return after submitting instead of streaming logs")
    p.set_defaults(handler=cmd_submit)
    p = sub.add_parser("jobs", help="status, logs or stop of a submitted job")
    p.add_argument("action", choices=["status", "logs", "stop"])
    p.add_argument("job_id")
    p.add_argument("--address", default=None, help="Ray Jobs API address (as for submit)")
    p.set_defaults(handler=cmd_jobs)


def _jobs_address(address: str | None) -> str:
    return address or os.environ.get("RAY_API_SERVER_ADDRESS") or "http://127.0.0.1:8265"


def cmd_submit(args: argparse.Namespace) -> int:
    from fedsweep.orchestrator import jobs as submit
    from fedsweep.errors import ConfigError

    env = {}
    for item in args.env:
        if "=" not in item:
            raise ConfigError(f"--env {item!r}: expected KEY=VALUE")
        key, _, value = item.partition("=")
        env[key] = value
    address = _jobs_address(args.address)
    working_dir = None if args.working_dir in ("none", "") else args.working_dir
    job_id = submit.submit(args.file, address, args.overrides, python=args.python, working_dir=working_dir,
                           requirements=args.requirements, image=args.image, env=env)
    console.print(f"submitted job [bold]{job_id}[/] to {address}")
    console.print(f"  fedsweep jobs status {job_id} --address {address}")
    if args.no_follow:
        return 0
    final = submit.follow(address, job_id, lambda text: print(text, end="", flush=True))
    console.print(f"job {job_id}: {final}")
    return 0 if final == "SUCCEEDED" else 1


def cmd_jobs(args: argparse.Namespace) -> int:
    import json

    from fedsweep.orchestrator import jobs as submit

    address = _jobs_address(args.address)
    if args.action == "status":
        console.print(json.dumps(submit.status(address, args.job_id), indent=1), highlight=False)
    elif args.action == "logs":
        print(submit.logs(address, args.job_id), end="")
    else:
        console.print(f"stop requested: {submit.stop(address, args.job_id)}")
    return 0
