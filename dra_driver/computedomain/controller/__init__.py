"""The compute-domain controller, a program of its own (``dra-driver compute-domain-controller``).

- :mod:`.reconciler`: the watches, the work queue's workers and what reconciling a domain does;
- :mod:`.objects`: the objects a domain owns (DaemonSet, templates, clique entries), built pure;
- :mod:`.workqueue`: the rate-limited queue of domain keys; :mod:`.leader`: leader election.
"""
