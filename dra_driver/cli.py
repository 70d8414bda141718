"""``dra-driver``: the daemon and the commands an operator runs next to it.

* ``kubelet-plugin``: the node daemon (what the DaemonSet runs);
* ``inventory``: the node's GPUs and the exact ResourceSlices the daemon would publish, offline;
* ``simulate``: change the simulated GPUs (faults, busy GPUs, MIG made by an administrator);
* ``compute-domain-controller`` and ``compute-domain-daemon``: ComputeDomains (multi-node NVLink).

Whatever the user got wrong (a flag, an env var, a kubeconfig, a directory, a GPU that is not
there) ends the command in :func:`main` with one line on stderr and a non-zero exit; see
:mod:`dra_driver.errors`.

Each command imports what it needs when it runs: the daemon opens its kubelet sockets before it
imports the API client, aiohttp or the GPU backends (:mod:`dra_driver.gpu_plugin.launch`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import structlog
import yaml
from pydantic import ValidationError

from dra_driver import __version__
from dra_driver.computedomain.cli import add_commands as add_compute_domain_commands
from dra_driver.devices.backend import DeviceError
from dra_driver.devices.types import Gpu
from dra_driver.errors import EXIT_FAILURE, EXIT_USAGE, StartupError
from dra_driver.gpu_plugin.startup import check_mig_partitions
from dra_driver.kubelet.sockets import KubeletSocketError
from dra_driver.log import configure, crash_line, error_line, wants_json
from dra_driver.node.records import BootIdUnavailable, StoreFromNewerDriver
from dra_driver.settings import ENV_PREFIX, LogFormat, Settings, xid_numbers
from dra_driver.simulated.nodes import NODE_PROFILES

if TYPE_CHECKING:
    from kubernetes.aio.client import ApiClient

    from dra_driver.simulated.gpus import SimulatedBackend

log = structlog.get_logger("dra_driver.cli")
_SETTINGS_DOC = "dra-driver kubelet-plugin --help, or docs/configuration.md"

# The settings the offline commands honour; the daemon takes them all.
_INVENTORY_SETTINGS = [
    "driver_name",
    "node_name",
    "simulate",
    "data_dir",
    "mig_partitions",
    "consumable_capacity",
    "passthrough",
    "sysfs_root",
    "binding_conditions",
    "share_binding_conditions",
    "log_format",
    "log_level",
]
_SIMULATE_SETTINGS = ["driver_name", "node_name", "simulate", "data_dir", "plugins_dir"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the one place where its errors become the line the user reads.

    A :class:`StartupError`, a device's refusal or a socket that cannot be made ends it with
    ``error: ...`` (or one JSON log event, see :func:`~dra_driver.log.error_line`). A bug still
    shows its traceback; in JSON mode inside one log event, so the log stays one event a line.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run(argv)
    except StartupError as err:
        return _exit(str(err), err.exit_code, argv)
    except (DeviceError, KubeletSocketError, BootIdUnavailable, StoreFromNewerDriver) as err:
        return _exit(str(err), EXIT_FAILURE, argv)
    except KeyboardInterrupt:
        return 130  # Ctrl-C before the daemon's own signal handling took over
    except Exception:
        if not wants_json(requested_log_format(argv)):
            raise
        print(crash_line(traceback.format_exc()), file=sys.stderr, flush=True)
        return EXIT_FAILURE


def _exit(message: str, code: int, argv: list[str]) -> int:
    print(error_line(message, requested_log_format(argv), exit_code=code), file=sys.stderr, flush=True)
    return code


def _run(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command != "kubelet-plugin":
        # Off for the imports (dra_driver.__main__); the daemon turns it on once it serves. Knob 1 of
        # the start-up policy, dra_driver.gpu_plugin.tuning.
        gc.enable()
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    result: int = args.run(args)
    return result


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is a :class:`StartupError` (one line) instead of usage text."""

    def error(self, message: str) -> NoReturn:
        raise StartupError(f"{message}; see `{self.prog} --help`", exit_code=EXIT_USAGE)


def _xid(text: str) -> int:
    """``--xid``: one positive Xid number."""
    try:
        xids = xid_numbers(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if len(xids) != 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not one Xid number, e.g. 79")
    return xids[0]


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dra-driver",
        description="A Kubernetes DRA driver for NVIDIA GPUs. Every flag can also be set by the "
        "environment variable named in its help.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    plugin = commands.add_parser("kubelet-plugin", help="run the node daemon")
    add_settings_flags(plugin)
    plugin.set_defaults(run=_kubelet_plugin)

    inventory = commands.add_parser(
        "inventory", help="print the node's GPUs and the ResourceSlices that would be published"
    )
    add_settings_flags(inventory, _INVENTORY_SETTINGS)
    inventory.add_argument(
        "--list-profiles", action="store_true", help="list the simulated node profiles and exit"
    )
    inventory.add_argument(
        "--kubernetes-version",
        metavar="RELEASE",
        default="",
        help="lay the slices out as this release's API server takes them, as the daemon does after "
        "reading /version (e.g. v1.34: counter sets beside their devices); default: the newest layout",
    )
    inventory.set_defaults(run=_inventory)

    state = commands.add_parser(
        "state",
        help="print what the node's store holds: prepared claims and their devices, MIG devices the "
        "driver made, MPS daemons, compute modes to restore (read-only; the plugin may be running)",
    )
    add_settings_flags(state, ["driver_name", "data_dir", "plugins_dir"])
    state.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")
    state.set_defaults(run=_state)

    webhook = commands.add_parser(
        "webhook",
        help="serve the validating admission webhook for opaque configs and capacity requests "
        "(docs/configuration.md)",
    )
    # --kubeconfig (else the pod's account): the driver's slices, to judge capacity requests.
    add_settings_flags(webhook, ["driver_name", "kubeconfig", "log_format", "log_level"])
    webhook.add_argument("--webhook-address", default="0.0.0.0:8443", help="host:port to serve HTTPS on")
    webhook.add_argument("--tls-cert-file", type=Path, required=True, help="serving certificate (PEM)")
    webhook.add_argument("--tls-key-file", type=Path, required=True, help="its private key (PEM)")
    webhook.set_defaults(run=_webhook)

    simulate = commands.add_parser(
        "simulate", help="act on the simulated GPUs of a node (the state the daemon reads)"
    )
    actions = simulate.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, help_text in (
        ("xid", "inject an Xid error on a GPU"),
        ("recover", "clear a GPU's injected faults"),
        ("busy", "mark a GPU or MIG device in use (or free it with --free)"),
        ("create-mig", "create a MIG device as an administrator would (static MIG)"),
        ("mig-mode", "switch MIG mode as an administrator would"),
        ("mig-creation", "make the driver's MIG device creation on a GPU wait or fail (a fault for tests)"),
    ):
        action = actions.add_parser(name, help=help_text)
        add_settings_flags(action, _SIMULATE_SETTINGS)
        action.add_argument("--gpu", required=True, help="GPU index or UUID (or a MIG UUID for busy)")
        if name == "xid":
            action.add_argument("--xid", type=_xid, required=True, help="the Xid number, e.g. 79")
        if name == "busy":
            action.add_argument("--free", action="store_true", help="mark it free again")
        if name == "create-mig":
            action.add_argument("--profile", required=True, help="MIG profile, e.g. 1g.10gb")
            action.add_argument("--start", type=int, required=True, help="placement start (memory slice)")
        if name == "mig-mode":
            action.add_argument("--off", action="store_true", help="disable instead of enable")
        if name == "mig-creation":
            action.add_argument(
                "--mode",
                choices=("ok", "held", "failing"),
                required=True,
                help="held: creations wait until ok (or failing); failing: they fail; ok: they work",
            )
        action.set_defaults(run=_simulate)
    host_imex = actions.add_parser(
        "host-imex", help="start or stop the node's host nvidia-imex service (host-managed IMEX mode)"
    )
    add_settings_flags(host_imex, _SIMULATE_SETTINGS)
    host_imex.add_argument("--state", choices=("ready", "stopped"), required=True, help="the service's state")
    host_imex.set_defaults(run=_simulate, gpu="")

    add_compute_domain_commands(commands)
    return parser


def _kubelet_plugin(args: argparse.Namespace) -> int:
    from dra_driver.gpu_plugin.launch import run_plugin

    settings = settings_from(args)
    configure(settings.log_format, settings.log_level)
    if not settings.node_name:
        raise StartupError(
            "--node-name / DRA_NODE_NAME is required (the downward API's spec.nodeName)",
            exit_code=EXIT_USAGE,
        )
    for name in unknown_env_settings():
        log.warning("environment variable names no setting; ignored", variable=name, settings=_SETTINGS_DOC)
    asyncio.run(run_plugin(settings))
    return 0


def _state(args: argparse.Namespace) -> int:
    from dra_driver.gpu_plugin import state_command

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `dra-driver state | head` ends quietly
    settings = settings_from(args)
    print(state_command.render(state_command.read(settings.state_dir), args.output))
    return 0


def _webhook(args: argparse.Namespace) -> int:
    from dra_driver.apiserver.rest import JsonApi
    from dra_driver.webhook.server import serve_webhook

    settings = settings_from(args)
    configure(settings.log_format, settings.log_level)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with contextlib.AsyncExitStack() as held:
            client = await _webhook_api_client(settings)
            if client is not None:
                held.push_async_callback(client.close)
            await serve_webhook(
                settings.driver_name,
                args.webhook_address,
                args.tls_cert_file,
                args.tls_key_file,
                stop,
                api=JsonApi(client) if client is not None else None,
            )

    try:
        asyncio.run(serve())
    except (OSError, ValueError) as err:  # a missing certificate, a bad address, a port in use
        print(f"error: webhook: {err}", file=sys.stderr)
        return 1
    return 0


async def _webhook_api_client(settings: Settings) -> ApiClient | None:
    """The API client that reads the driver's slices; None outside a pod with no --kubeconfig.

    Without one the webhook still checks opaque configs and lets every capacity request through.
    A --kubeconfig that does not work is an error; so is a pod whose account cannot be used.
    """
    if settings.kubeconfig is None and "KUBERNETES_SERVICE_HOST" not in os.environ:
        log.warning("no --kubeconfig and not in a pod: capacity requests are not checked")
        return None
    from dra_driver.apiserver.connect import api_client

    return await api_client(settings.kubeconfig)


def _inventory(args: argparse.Namespace) -> int:
    from dra_driver.devices.backends import open_backend
    from dra_driver.gpu_plugin.policies import desired_slices
    from dra_driver.resources.pool import PoolOwner, plan_pool
    from dra_driver.resources.server_rules import NEWEST, rules_of_release

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `dra-driver inventory | head` ends quietly
    if args.list_profiles:
        for name, profile in sorted(NODE_PROFILES.items()):
            print(f"{name:16} {profile.description}")
        return 0
    settings = settings_from(args)
    configure(settings.log_format, settings.log_level)
    try:
        rules = rules_of_release(args.kubernetes_version) if args.kubernetes_version else NEWEST
    except ValueError as error:
        raise StartupError(f"invalid --kubernetes-version: {error}", exit_code=EXIT_USAGE) from None
    node = settings.node_name or "node-1"
    with tempfile.TemporaryDirectory(prefix="dra-driver-inventory-") as scratch:
        # Offline, a simulated node starts fresh unless --data-dir points at a daemon's state.
        data_dir = settings.data_dir or Path(scratch)
        backend = open_backend(
            settings.simulate or None,
            data_dir,
            node,
            driver_root=settings.driver_root_mount or settings.driver_root,  # NVML from there, as the daemon
            sysfs_root=settings.sysfs_root or Path("/sys"),
            procfs_root=settings.procfs_root,
        )
        try:
            inventory = backend.inventory()
            passthrough = backend.pci().passthrough_gpus() if settings.passthrough else None
        finally:
            backend.close()
    check_mig_partitions(settings, inventory)
    owner = PoolOwner(driver=settings.driver_name, node_name=node)
    slices = desired_slices(settings, inventory, rules=rules, passthrough=passthrough)
    plan = plan_pool(slices, [], owner=owner)
    source = f"simulated {settings.simulate}" if settings.simulate else "NVML"
    cuda = ".".join(map(str, inventory.cuda_driver_version))
    versions = f"driver {inventory.driver_version}, CUDA {cuda}"
    print(f"# node {node}: {len(inventory.gpus)} GPUs ({source}), {versions}")
    for gpu in sorted(inventory.gpus, key=lambda g: g.minor):
        print(f"#   {_gpu_line(gpu)}")
    layout = f"Kubernetes {args.kubernetes_version}" if args.kubernetes_version else "the newest Kubernetes"
    print(f"# {len(plan.apply)} ResourceSlices follow, laid out for {layout} (kubectl apply -f accepts them)")
    yaml.dump_all(list(plan.apply), sys.stdout, Dumper=_PlainDumper, sort_keys=False)
    return 0


class _PlainDumper(yaml.SafeDumper):
    """Writes shared values out in full: the slices share attribute and counter objects, and
    YAML anchors (``&id001`` ... ``*id001``) would make the output unreadable to a person
    and to tools that do not resolve them."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def _gpu_line(gpu: Gpu) -> str:
    mig = "MIG on" if gpu.mig_enabled else "MIG capable" if gpu.mig_capable else "no MIG"
    parts = [
        f"gpu-{gpu.minor}",
        gpu.product_name,
        f"{gpu.memory_bytes / 2**30:.0f}GiB",
        gpu.uuid,
        gpu.pci_bus_id,
        mig,
    ]
    if gpu.mig_devices:
        parts.append("MIG devices: " + ", ".join(f"{m.profile}@{m.placement.start}" for m in gpu.mig_devices))
    return "  ".join(parts)


def _simulate(args: argparse.Namespace) -> int:
    from dra_driver.simulated.gpus import SimulatedBackend

    settings = settings_from(args)
    if not settings.simulate:
        raise StartupError(
            "--simulate / DRA_SIMULATE names the node profile of the simulated GPUs", exit_code=EXIT_USAGE
        )
    if not settings.node_name:
        raise StartupError(
            "--node-name / DRA_NODE_NAME is required: GPU identities derive from it", exit_code=EXIT_USAGE
        )
    gpu: str | int = int(args.gpu) if args.gpu.isascii() and args.gpu.isdigit() else args.gpu
    backend = SimulatedBackend(settings.simulate, settings.node_name, settings.state_dir)
    _apply_simulation(backend, args, gpu)
    return 0


def _apply_simulation(backend: SimulatedBackend, args: argparse.Namespace, gpu: str | int) -> None:
    if args.action == "xid":
        backend.inject_xid(gpu, args.xid)
    elif args.action == "recover":
        backend.recover(gpu)
    elif args.action == "busy":
        backend.set_busy(gpu, not args.free)
    elif args.action == "create-mig":
        created = backend.admin_create_mig(gpu, args.profile, args.start)
        print(created.uuid)
    elif args.action == "mig-mode":
        backend.admin_set_mig_mode(gpu, not args.off)
    elif args.action == "mig-creation":
        backend.set_mig_creation(gpu, args.mode)
    elif args.action == "host-imex":
        backend.set_host_imex(args.state)


# --- Settings as flags: a flag and its env var never drift apart ---------------------------------


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def add_settings_flags(parser: argparse.ArgumentParser, fields: list[str] | None = None) -> None:
    """Add one flag per setting; unset flags stay absent so the environment can supply them."""
    for name, info in Settings.model_fields.items():
        if fields is not None and name not in fields:
            continue
        annotation: Any = info.annotation
        choices = (
            [member.value for member in annotation]
            if isinstance(annotation, type) and issubclass(annotation, Enum)
            else None
        )
        default = info.default.value if isinstance(info.default, Enum) else info.default
        # A switch may stand alone: `--consumable-capacity` is `--consumable-capacity true`.
        switch: dict[str, Any] = {"nargs": "?", "const": "true"} if annotation is bool else {}
        parser.add_argument(
            flag_name(name),
            dest=name,
            default=argparse.SUPPRESS,
            choices=choices,
            **switch,
            metavar=None if choices else name.split("_")[-1].upper(),
            help=f"{info.description} [env {env_name(name)}; default {default!s:.60}]",
        )


def settings_from(args: argparse.Namespace) -> Settings:
    """Build settings from parsed flags (over env vars, over defaults).

    Raises :class:`StartupError` (exit 2) naming every bad setting by flag and env var, in one line.
    """
    given = {name: value for name, value in vars(args).items() if name in Settings.model_fields}
    try:
        return Settings(**given)
    except ValidationError as err:
        raise StartupError("; ".join(map(_describe, err.errors())), exit_code=EXIT_USAGE) from None


def _describe(problem: Any) -> str:
    field = str(problem["loc"][0]) if problem["loc"] else "?"
    message = str(problem["msg"]).removeprefix("Value error, ")  # pydantic's prefix for a ValueError
    return f"invalid setting {flag_name(field)} / {env_name(field)} = {problem.get('input')!r}: {message}"


def unknown_env_settings(environ: Mapping[str, str] = os.environ) -> list[str]:
    """``DRA_*`` variables that name no setting: a typo such as DRA_MIG_PARTITION is otherwise ignored."""
    known = {env_name(name) for name in Settings.model_fields}
    return sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in known)


def requested_log_format(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> LogFormat:
    """The log format asked for, read leniently: errors must be reported before settings are valid.

    ``--log-format X`` or ``--log-format=X`` wins over ``DRA_LOG_FORMAT``; anything unknown is auto.
    """
    flag, value = flag_name("log_format"), environ.get(env_name("log_format"), "")
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.partition("=")[2]
    try:
        return LogFormat(value)
    except ValueError:
        return LogFormat.AUTO


if __name__ == "__main__":
    raise SystemExit(main())
