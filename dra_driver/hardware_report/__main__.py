"""``python -m dra_driver.hardware_report``: what a node's NVML reports, read-only (:mod:`.report`)."""

import sys

from dra_driver.hardware_report.report import main

sys.exit(main())
