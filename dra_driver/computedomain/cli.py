"""The commands ``compute-domain-controller`` and ``compute-domain-daemon`` of ``dra-driver``.

Their settings follow the daemon's convention: flag ``--daemon-image`` is environment variable
``DRA_DAEMON_IMAGE`` (flags win), and the chart sets the variables from its
``computeDomainController`` values.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dra_driver.apiserver.connect import load_configuration
from dra_driver.errors import EXIT_USAGE, StartupError
from dra_driver.log import configure
from dra_driver.settings import DEFAULT_DRIVER_NAME, ENV_PREFIX, LogFormat

if TYPE_CHECKING:  # `dra-driver` builds this parser for every command, the node daemon's too
    from dra_driver.apiserver import kube

_COMMON: list[tuple[str, Any, str]] = [
    ("driver_name", DEFAULT_DRIVER_NAME, "the GPU driver's name; every ComputeDomain name derives from it"),
    ("kubeconfig", "", "kubeconfig file; empty: the in-cluster service account"),
    ("log_format", LogFormat.AUTO.value, "auto, json or console"),
    ("log_level", "info", "debug, info, warning or error"),
]
# NVIDIA's IMEXDaemonsWithDNSNames: the controller hands it to the daemons (their DaemonSet's env).
_DNS_NAMES = (
    "imex_daemons_with_dns_names",
    True,
    "IMEX daemons find their peers by fixed DNS names in /etc/hosts, not by IP addresses",
)
_CONTROLLER: list[tuple[str, Any, str]] = [
    ("namespace", "", "namespace of the IMEX daemons' DaemonSets and claim templates (the controller's own)"),
    ("daemon_image", "", "image of the IMEX daemon pods (the driver's image)"),
    ("daemon_ready_timeout_seconds", 300.0, "a daemon not ready for this long gets a condition and an event"),
    ("resync_seconds", 600.0, "every object is reconciled at least this often"),
    ("lease_name", "compute-domain-controller", "the Lease (in --namespace) the replicas elect a leader on"),
    ("lease_duration_seconds", 15.0, "a leader not renewing its Lease for this long is replaced"),
    _DNS_NAMES,
    # NVIDIA's HostManagedIMEXDaemon: the node daemons' setting of the same name must match.
    (
        "host_managed_imex",
        False,
        "the hosts run nvidia-imex as a service: create no IMEX DaemonSets, only channel templates",
    ),
]
_DAEMON: list[tuple[str, Any, str]] = [
    ("imex_config_dir", "/imexd", "where prepare mounted the daemon's imexd.cfg and nodes_config.cfg"),
    ("imex_server_port", 0, "peer port instead of imexd.cfg's SERVER_PORT (0: the file's)"),
    _DNS_NAMES,
    ("hosts_file", "/etc/hosts", "the hosts file the daemon keeps the DNS names of its peers in"),
]


def add_commands(commands: Any) -> None:
    controller = commands.add_parser("compute-domain-controller", help="run the ComputeDomain controller")
    _add_flags(controller, _COMMON + _CONTROLLER)
    controller.set_defaults(run=_controller)
    daemon = commands.add_parser(
        "compute-domain-daemon", help="run a (simulated) IMEX daemon in a ComputeDomain's daemon pod"
    )
    _add_flags(daemon, _COMMON + _DAEMON)
    daemon.set_defaults(run=_daemon)


def _add_flags(parser: argparse.ArgumentParser, flags: list[tuple[str, Any, str]]) -> None:
    for name, default, help_text in flags:
        env = ENV_PREFIX + name.upper()
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=boolean if isinstance(default, bool) else type(default),
            # A string default goes through `type` too, so a bad variable fails like a bad flag.
            default=os.environ.get(env, str(default)),
            help=f"{help_text} [env {env}; default {default}]",
        )


def boolean(text: str) -> bool:
    """A boolean flag's or variable's text, as Go's strconv.ParseBool reads it (NVIDIA's gates)."""
    if text.lower() in ("1", "t", "true"):
        return True
    if text.lower() in ("0", "f", "false"):
        return False
    raise ValueError(f"{text!r} is not true or false")


async def _api(kubeconfig: str) -> kube.ApiClient:
    """The API client, as the node daemon makes it: the kubeconfig given, else the pod's account."""
    from dra_driver.apiserver import kube

    configuration = kube.Configuration()
    await load_configuration(Path(kubeconfig) if kubeconfig else None, configuration)
    return kube.ApiClient(configuration)


def _setup(args: argparse.Namespace) -> None:
    try:
        configure(LogFormat(args.log_format), args.log_level)
    except ValueError as error:
        raise StartupError(f"--log-format / DRA_LOG_FORMAT: {error}", exit_code=EXIT_USAGE) from None


def _controller(args: argparse.Namespace) -> int:
    from dra_driver.apiserver.rest import JsonApi
    from dra_driver.computedomain.controller.leader import LeaderElector, LeaseConfig
    from dra_driver.computedomain.controller.reconciler import ComputeDomainController

    _setup(args)
    if not args.namespace:
        raise StartupError(
            "--namespace / DRA_NAMESPACE is required (the controller pod's namespace)", exit_code=EXIT_USAGE
        )
    if not args.daemon_image:
        raise StartupError(
            "--daemon-image / DRA_DAEMON_IMAGE is required (the driver's image)", exit_code=EXIT_USAGE
        )

    try:
        lease = LeaseConfig(
            namespace=args.namespace,
            name=args.lease_name,
            identity=f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}",
            lease_duration=args.lease_duration_seconds,
            renew_deadline=args.lease_duration_seconds * 2 / 3,
            retry_period=args.lease_duration_seconds * 2 / 15,
        )
    except ValueError as error:
        raise StartupError(
            f"--lease-duration-seconds / DRA_LEASE_DURATION_SECONDS: {error}", exit_code=EXIT_USAGE
        ) from None

    async def run() -> None:
        # SIGTERM (a rolling update, a drain) ends the run in order, so the Lease is released and a
        # standby replica takes over at once instead of after the lease duration.
        main = asyncio.current_task()
        assert main is not None
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, main.cancel)
        api = await _api(args.kubeconfig)
        try:
            controller = ComputeDomainController(
                api,
                gpu_driver=args.driver_name,
                namespace=args.namespace,
                daemon_image=args.daemon_image,
                daemon_ready_timeout=args.daemon_ready_timeout_seconds,
                resync_seconds=args.resync_seconds,
                dns_names=args.imex_daemons_with_dns_names,
                host_managed_imex=args.host_managed_imex,
            )
            # Only the Lease's holder reconciles; a replica that loses it exits (and is restarted).
            await LeaderElector(JsonApi(api), lease).run(controller.run)
        finally:
            await api.close()  # type: ignore[no-untyped-call]

    return _run(run())


def _daemon(args: argparse.Namespace) -> int:
    from dra_driver.computedomain.api import Names
    from dra_driver.simulated.imex_daemon import DaemonIdentity, run_daemon

    _setup(args)
    try:
        DaemonIdentity.from_environment()  # before anything else: say at once what is missing
    except ValueError as error:
        raise StartupError(str(error), exit_code=EXIT_USAGE) from None

    async def run() -> None:
        api = await _api(args.kubeconfig)
        try:
            await run_daemon(
                api,
                Names(args.driver_name),
                Path(args.imex_config_dir),
                args.imex_server_port or None,
                dns_names=args.imex_daemons_with_dns_names,
                hosts_file=Path(args.hosts_file),
            )
        finally:
            await api.close()  # type: ignore[no-untyped-call]

    return _run(run())


def _run(main: Any) -> int:
    from dra_driver.computedomain.controller.leader import LostLease

    try:
        asyncio.run(main)
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C, or SIGTERM's orderly stop
        return 0
    except (ValueError, OSError, LostLease) as error:  # e.g. the port is taken, the Lease lost
        raise StartupError(str(error)) from None
    return 0
