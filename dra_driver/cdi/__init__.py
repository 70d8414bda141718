"""The container runtime's view: one transient CDI spec per prepared claim.

:mod:`~dra_driver.cdi.spec` computes a claim's spec from the prepared devices,
:mod:`~dra_driver.cdi.validate` holds the rules a runtime applies when it loads
one, and :mod:`~dra_driver.cdi.store` is the only part that touches the disk.
"""
