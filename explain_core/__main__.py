"""``python -m explain_core`` runs the CLI."""

from explain_core.cli import main

raise SystemExit(main())
