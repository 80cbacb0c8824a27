"""``python -m harness`` runs the ppspec CLI."""
from harness.cli import main

main()
