"""The fault suite: the node daemon killed, starved of disk, cut off from the API server, run twice,
and fed hostile input -- with figures that count what was tried and what went wrong.

``make reliability`` (``python -m e2e.reliability``) runs every scenario at full size and writes
``_output/reliability.json`` and a table; ``e2e/test_reliability.py`` runs a CI-sized subset of the
same code inside ``make test`` and asserts that every "went wrong" figure is 0.
"""
