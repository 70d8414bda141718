"""The attack suite: the chart's own accounts, with real tokens, try every write their roles allow.

``make security`` (``python -m e2e.security``) starts the real control plane, installs the chart
(ComputeDomains, node labels and the webhook on), and, as a token stolen from node A would be used,
tries each write beyond the account's own node or objects; positive controls show that what the
driver itself writes still passes. It writes ``_output/security.json``. ``e2e/test_security.py``
runs the same suite in ``make test``, against every supported release (marked ``kube_versions``).

See :mod:`e2e.security.suite` for the attempts and docs/security.md for the table of what is refused.
"""
