"""``python -m dra_driver`` and the ``dra-driver`` console script."""

import gc


def main() -> int:
    # Start-up imports some 700 modules and frees almost nothing of them; the cyclic collector
    # walking those objects while they are made cost 15-20 % of the start's CPU. It stays off
    # until the daemon serves (dra_driver.gpu_plugin.app), and is turned on again at once for every other
    # command (dra_driver.cli).
    gc.disable()
    from dra_driver.cli import main as run_command

    return run_command()


if __name__ == "__main__":
    raise SystemExit(main())
