"""``python -m dra_driver``: the same as the ``dra-driver`` console script."""

from dra_driver.cli import main

raise SystemExit(main())
