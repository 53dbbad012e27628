def main() -> None:
    """The `gpusched` entry point; an install made before the CLI moved to gpusched.cli.main
    has a script that imports it from here."""
    from gpusched.cli.main import main as run

    run()
