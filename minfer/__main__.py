"""`python -m minfer ...` is the `minfer` command."""
from .cli import main

raise SystemExit(main())
