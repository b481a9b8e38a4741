"""``duet deploy render``: a placement plan as KubeRay manifests (docs/guides/kubernetes.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from duet.cluster.placement.cluster_spec import ClusterSpec, ClusterSpecError
from duet.cluster.placement.plan import Plan, PlanError
from duet.deploy.manifests import manifests, to_yaml
from duet.deploy.render import API_KEYS_ENV_KEY, API_KEYS_FILE_KEY, ClusterLaunch, RenderOptions, plan_launch
from duet.deploy.serve_config import DeployError

EXIT_BAD_INPUT = 2


def register_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``deploy render`` to duet's CLI."""
    deploy = subparsers.add_parser("deploy", help="deploy on Kubernetes with KubeRay")
    actions = deploy.add_subparsers(dest="deploy", required=True, metavar="ACTION")
    render = actions.add_parser("render", help="render KubeRay manifests (RayCluster or RayService) for a plan")
    render.add_argument("--plan", type=Path, required=True, help="placement plan from `duet plan`")
    render.add_argument(
        "--config", type=Path, help="base duet config: model, engine and router settings (default: configs/local.yaml)"
    )
    render.add_argument(
        "--cluster", type=Path, help="the plan's cluster.yaml: checks the plan and lets each group grow to its GPUs"
    )
    render.add_argument("--image", help="container image (default: duet:gpu, or duet:cpu for a CPU plan)")
    render.add_argument("--name", default="duet", help="name of the cluster and prefix of every object")
    render.add_argument("--namespace", default="default")
    render.add_argument("--kind", choices=["raycluster", "rayservice"], default="raycluster")
    render.add_argument("--gpu-label", default="duet/gpu-type", help="node label holding the GPU type")
    render.add_argument(
        "--front-doors", type=int, default=0, metavar="N",
        help="serve the APIs from a group of N front-door pods apart from the head (default 0: the head serves)",
    )
    render.add_argument(
        "--gcs-redis", metavar="HOST:PORT",
        help="external Redis for KubeRay's GCS fault tolerance: a restarted head keeps the workers (and front doors)",
    )
    render.add_argument("--out", type=Path, help="write the manifests here (default: standard output)")
    render.set_defaults(handler=_render)


def _render(args: argparse.Namespace) -> int:
    try:
        if not args.plan.is_file():
            raise PlanError(f"--plan {args.plan}: no such file (write one with `duet plan ... --out {args.plan}`)")
        plan = Plan.load(args.plan)
        cluster = ClusterSpec.load(args.cluster) if args.cluster else None
        options = RenderOptions(
            args.name, args.namespace, args.image, args.kind, args.gpu_label, args.front_doors, args.gcs_redis
        )
        launch = plan_launch(plan, options, args.config, cluster)
    except (PlanError, ClusterSpecError, DeployError) as error:
        print(f"duet deploy: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    text = to_yaml(manifests(launch), _header(args.plan, launch))
    if args.out is None:
        sys.stdout.write(text)
        return 0
    args.out.write_text(text)
    first, *groups = _describe(launch)
    print("\n".join([f"wrote {args.out}: {first}", *groups]), file=sys.stderr)
    return 0


def _describe(launch: ClusterLaunch) -> list[str]:
    """The cluster, then one line per worker group."""
    kind = "RayService" if launch.options.kind == "rayservice" else "RayCluster"
    lines = [f"{kind} {launch.options.name} ({launch.image}), worker groups:"]
    for g in launch.workers:
        each = f"{g.size.gpus} GPU(s)" if g.size.gpus else f"{g.size.cpus} CPUs"
        lines.append(f"  {g.name}: {g.min_replicas} pod(s), up to {g.max_replicas}, {each} each")
    return lines


def _header(path: Path, launch: ClusterLaunch) -> str:
    """What the file is, and the two Secrets it needs (created once, never rendered)."""
    options = launch.options
    namespace = f"-n {options.namespace} "
    return "\n".join(
        [
            f"Rendered by `duet deploy render` from {path.name}:",
            *(f"  {line}" for line in _describe(launch)),
            "Create the Secrets it reads first (docs/guides/kubernetes.md):",
            f"  kubectl {namespace}create secret generic {options.ray_token_secret} "
            "--from-literal=auth_token=$(openssl rand -hex 32)",
            f"  kubectl {namespace}create secret generic {options.api_keys_secret} "
            + (
                f"--from-file={API_KEYS_FILE_KEY}=KEYS_FILE"
                if launch.api_keys_file
                else f"--from-literal={API_KEYS_ENV_KEY}=NAME:KEY,..."
            ),
            *(
                [f"  kubectl {namespace}create secret generic {options.redis_secret} --from-literal=password=REDIS_PASSWORD"]
                if options.gcs_redis
                else []
            ),
        ]
    )
