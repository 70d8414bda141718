"""The Kubernetes client's connection machinery, without its generated API and model classes.

The driver talks to the API server in raw REST (plain dicts in and out: slices, claims,
the Node), so of the official client it needs only what turns a kubeconfig or the
in-cluster service account into authenticated requests: ``Configuration``, ``ApiClient``
and the config loaders, with their exec credential plugins, token refresh, proxies and
CA handling. Importing the package the usual way also imports every generated API and
model class, of the synchronous client and of the asyncio one: tens of MiB of memory and
a good part of start-up (docs/performance.md, "Figures behind the code's comments"), for
classes the driver never touches.

So this module imports just those modules of the installed package, behind placeholders
for the packages around them, whose ``__init__`` would import all the rest. Nothing is
copied or patched: the classes are the library's own, and a later ``import
kubernetes.client`` (or any other submodule) still works. Where the package was already
imported in full (a test process using the typed client), that is used as it is.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING

# The packages whose __init__ imports the generated code; the modules below need them only
# as the place their submodules are found.
_PLACEHOLDERS = (
    "kubernetes",
    "kubernetes.aio",
    "kubernetes.aio.client",
    "kubernetes.aio.client.models",
    "kubernetes.aio.config",
    "kubernetes.aio.utils",
)


def _import_light() -> types.SimpleNamespace:
    if "kubernetes" not in sys.modules:
        spec = importlib.util.find_spec("kubernetes")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("the kubernetes package is not installed")
        root = spec.submodule_search_locations[0]
        for name in _PLACEHOLDERS:
            placeholder = types.ModuleType(name, "placeholder: see dra_driver.apiserver.kube")
            placeholder.__path__ = [f"{root}/{name.removeprefix('kubernetes').strip('.').replace('.', '/')}"]
            sys.modules[name] = placeholder
    configuration = importlib.import_module("kubernetes.aio.client.configuration")
    api_client = importlib.import_module("kubernetes.aio.client.api_client")
    # The config loaders import these two names from the client package.
    client_package = sys.modules["kubernetes.aio.client"]
    for name, value in (("Configuration", configuration.Configuration), ("ApiClient", api_client.ApiClient)):
        if not hasattr(client_package, name):
            setattr(client_package, name, value)
    return types.SimpleNamespace(
        configuration=configuration,
        api_client=api_client,
        exceptions=importlib.import_module("kubernetes.aio.client.exceptions"),
        kube_config=importlib.import_module("kubernetes.aio.config.kube_config"),
        incluster_config=importlib.import_module("kubernetes.aio.config.incluster_config"),
        config_exception=importlib.import_module("kubernetes.aio.config.config_exception"),
    )


if TYPE_CHECKING:  # the same classes, as the type checker finds them
    from kubernetes.aio.client.api_client import ApiClient
    from kubernetes.aio.client.configuration import Configuration
    from kubernetes.aio.client.exceptions import ApiException
    from kubernetes.aio.config.config_exception import ConfigException
    from kubernetes.aio.config.incluster_config import load_incluster_config
    from kubernetes.aio.config.kube_config import load_kube_config
else:
    _client = _import_light()
    ApiClient = _client.api_client.ApiClient
    Configuration = _client.configuration.Configuration
    ApiException = _client.exceptions.ApiException
    ConfigException = _client.config_exception.ConfigException
    load_kube_config = _client.kube_config.load_kube_config
    load_incluster_config = _client.incluster_config.load_incluster_config


def resolve_environment_once(configuration: Configuration) -> None:
    """Look up the environment's proxy for the API server once, instead of twice per request.

    The client's aiohttp session trusts the environment (``trust_env``): for every request it
    reads ``~/.netrc`` and ``HTTPS_PROXY``/``NO_PROXY`` again, each in a worker thread, so every
    claim GET paid two thread hops. The API server is one host and the environment of a running
    process does not change, so the answer is found here once: the proxy it names for the
    server (``NO_PROXY`` honoured, with its credentials, from its URL or ``~/.netrc``) becomes
    the configuration's proxy, and the session stops asking. A proxy the kubeconfig sets
    (``proxy-url``) is already the configuration's and wins, as with kubectl. ``.netrc`` is no
    longer read for the API server's own credentials: neither kubectl nor client-go ever read it.
    """
    from aiohttp.helpers import get_env_proxy_for_url  # the client's own dependency
    from yarl import URL

    configuration.client_session_kwargs = {"trust_env": False}
    if configuration.proxy or not configuration.host:
        return
    try:
        proxy, auth = get_env_proxy_for_url(URL(configuration.host))
    except LookupError:  # no proxy for this host (none set, or NO_PROXY names it)
        return
    if auth is not None:  # in the URL, where aiohttp turns it into Proxy-Authorization (also for CONNECT)
        proxy = proxy.with_user(auth.login).with_password(auth.password)
    configuration.proxy = str(proxy)


__all__ = [
    "ApiClient",
    "ApiException",
    "ConfigException",
    "Configuration",
    "load_incluster_config",
    "load_kube_config",
    "resolve_environment_once",
]
