"""``python -m dra_driver`` and the ``dra-driver`` console script."""


def main() -> int:
    # The first knob of the start-up policy (dra_driver.gpu_plugin.tuning): no cyclic collection
    # while the commands' modules are imported.
    from dra_driver.gpu_plugin.tuning import collector_off_for_imports

    collector_off_for_imports()
    from dra_driver.cli import main as run_command

    return run_command()


if __name__ == "__main__":
    raise SystemExit(main())
