"""``python -m dra_driver`` and the ``dra-driver`` console script."""

import gc


def main() -> int:
    # Knob 1 of the start-up policy (dra_driver.gpu_plugin.tuning): no cyclic collection while the
    # commands' modules are imported. Here, before any import of ours: the policy's own module
    # imports asyncio, which would be collected already.
    gc.disable()
    from dra_driver.cli import main as run_command

    return run_command()


if __name__ == "__main__":
    raise SystemExit(main())
