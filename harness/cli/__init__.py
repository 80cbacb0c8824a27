"""The ``ppspec`` Typer app and its commands."""
