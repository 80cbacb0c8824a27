"""``python -m harness`` runs the ppspec CLI."""
from harness.entry import main

main()
